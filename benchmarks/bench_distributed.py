"""PPO on 1 process vs ``torchrun`` with N processes: seconds per step, tokens/s, bytes all-reduced.

Runs the quickstart's PPO stage (its config, its SFT policy and reward model) through the CLI: once as
``python -m lmppo ppo`` and once per process count as ``torchrun --standalone --nproc-per-node N -m lmppo
ppo``, alternating, and reads each run's ``metrics.jsonl``. The SFT policy and reward model come from
``--quickstart-dir`` (a finished ``lmppo quickstart --out DIR``); without one, a ``--fast`` quickstart is
built first (about 3 minutes). ``--config`` runs any other PPO config instead.

On a machine with as many cores as one process already uses, N processes share the same cores: the
figures then show the cost of data parallelism (gradient all-reduce, global statistics, a smaller batch
per process), not a speed-up. ``perf/allreduce_mb`` is what DDP's gradient buckets sent per step and per
rank; the expected value is (trainable parameters x 4 bytes) x optimiser steps per PPO step.

    python benchmarks/bench_distributed.py                      # 1 vs 2 processes, 8 steps, 2 repeats
    python benchmarks/bench_distributed.py --quickstart-dir runs/quickstart --procs 1,2 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quickstart-dir", type=Path, default=None, help="a finished `lmppo quickstart --out DIR`"
    )
    p.add_argument("--config", type=Path, default=None, help="any PPO config instead of the quickstart's")
    p.add_argument("--procs", default="1,2", help="comma-separated process counts (1 = no launcher)")
    p.add_argument("--steps", type=int, default=8, help="PPO steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--repeats", type=int, default=2, help="runs per process count, alternating")
    p.add_argument("--work-dir", type=Path, default=HERE.parent / ".cache" / "bench_distributed")
    return p.parse_args(argv)


def ppo_config(args) -> Path:
    """``--config``, else the quickstart's PPO config (SFT policy, reward model), building a fast quickstart."""
    if args.config is not None:
        return args.config
    root = args.quickstart_dir or args.work_dir / "quickstart"
    config = root / "ppo" / "config.yaml"
    if not config.is_file():
        print(f"building a fast quickstart in {root} (SFT policy and reward model) ...", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "lmppo", "quickstart", "--fast", "--out", str(root)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return config


def run_ppo(args, config: Path, procs: int, out: Path) -> dict:
    """One PPO run of ``args.steps`` steps on ``procs`` processes; figures from its metrics after warm-up."""
    shutil.rmtree(out, ignore_errors=True)
    ppo = [
        "-m",
        "lmppo",
        "ppo",
        str(config),
        f"run.output_dir={out}",
        f"run.steps={args.steps}",
        "run.eval_every=0",
        "run.checkpoint_every=0",
        "--quiet",
    ]
    launcher = (
        [] if procs == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    )
    # One process uses torch's default threads (one per core); torchrun gives each rank one (OMP_NUM_THREADS=1).
    env = dict(os.environ)
    if procs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *launcher, *ppo], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{procs}-process run failed:\n{done.stderr[-4000:]}")
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    tokens = [r["response/length"] * batch_size(config) for r in records]
    return {
        "seconds_per_step": statistics.median(r["perf/step_s"] for r in records),
        "tokens_per_second": sum(tokens) / sum(r["perf/step_s"] for r in records),
        "rollout_seconds": statistics.mean(r["perf/rollout_s"] for r in records),
        "score_seconds": statistics.mean(r["perf/score_s"] for r in records),
        "update_seconds": statistics.mean(r["perf/update_s"] for r in records),
        "allreduce_mb_per_step": statistics.mean(r.get("perf/allreduce_mb", 0.0) for r in records),
        "updates_per_step": statistics.mean(r["policy/updates"] for r in records),
        "wall_s": round(wall_s, 1),
        "load_avg_1min": round(load, 2),
        "threads_per_process": int(env.get("OMP_NUM_THREADS", torch.get_num_threads())),
    }


def batch_size(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["rollout"]["batch_size"])


def trainable_parameters(config: Path) -> int:
    """Policy + separate critic parameters the quickstart trains (what DDP all-reduces)."""
    from lmppo.build import load_models
    from lmppo.config import load_config

    models = load_models(load_config(config), torch.device("cpu"))
    params = {id(p): p for m in (models.policy, models.value) for p in m.parameters() if p.requires_grad}
    return sum(p.numel() for p in params.values())


def main(argv=None) -> None:
    args = parse_args(argv)
    config = ppo_config(args)
    counts = [int(n) for n in args.procs.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for repeat in range(args.repeats):
        for procs in counts if repeat % 2 == 0 else counts[::-1]:
            runs[procs].append(run_ppo(args, config, procs, args.work_dir / f"ppo-{procs}"))
            print(
                f"  {procs} process(es) #{repeat + 1}: {runs[procs][-1]['seconds_per_step']:.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    params = trainable_parameters(config)
    results = {}
    for procs, reps in runs.items():
        results[procs] = {key: round(statistics.median(r[key] for r in reps), 4) for key in reps[0]}
        results[procs]["expected_allreduce_mb_per_step"] = (
            0.0 if procs == 1 else round(params * 4 * results[procs]["updates_per_step"] / 2**20, 2)
        )

    base = results[counts[0]]["seconds_per_step"]
    print(f"{config}: {batch_size(config)} prompts per step, {params / 1e6:.2f} M trainable parameters")
    print(
        f"{'procs':>5} {'s/step':>8} {'x 1 proc':>8} {'tok/s':>8} {'rollout s':>9} {'score s':>8} "
        f"{'update s':>8} {'all-reduce MB/step':>18} {'expected MB':>11} {'threads/proc':>12}"
    )
    for procs, r in results.items():
        print(
            f"{procs:>5} {r['seconds_per_step']:>8.3f} {r['seconds_per_step'] / base:>8.2f} "
            f"{r['tokens_per_second']:>8.0f} {r['rollout_seconds']:>9.3f} {r['score_seconds']:>8.3f} "
            f"{r['update_seconds']:>8.3f} {r['allreduce_mb_per_step']:>18.2f} "
            f"{r['expected_allreduce_mb_per_step']:>11.2f} {r['threads_per_process']:>12}"
        )
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": {
                    "cpu_count": os.cpu_count(),
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                },
                "settings": {
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "repeats": args.repeats,
                    "config": str(config),
                },
                "trainable_parameters": params,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
