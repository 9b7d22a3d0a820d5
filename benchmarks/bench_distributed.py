"""PPO on 1 process vs ``torchrun`` with N processes under DDP and FSDP2: seconds per step, tokens/s, each
rank's peak memory and trained-state bytes, bytes communicated.

Runs the quickstart's PPO stage (its config, its SFT policy and reward model) through the CLI: once as
``python -m lmppo ppo`` and once per setup as ``torchrun --standalone --nproc-per-node N -m lmppo ppo
distributed.strategy=S``, alternating, and reads each run's ``metrics.jsonl``. The SFT policy and reward
model come from ``--quickstart-dir`` (a finished ``lmppo quickstart --out DIR``); without one, a ``--fast``
quickstart is built first (about 3 minutes). ``--config`` runs any other PPO config instead (``--set`` adds
overrides, e.g. a smaller batch).

On a machine with as many cores as one process already uses, N processes share the same cores: the
figures then show the cost of data parallelism (collectives, global statistics, a smaller batch per
process), not a speed-up. Per rank and step: ``perf/allreduce_mb`` is what DDP's gradient buckets sent
(expected: trainable parameters x 4 bytes x optimiser steps); under FSDP2 ``perf/allgather_mb`` is what
the rank received of gathered weights and ``perf/reduce_scatter_mb`` what it sent of gradients.
``perf/trained_state_mb`` is the trained weights, gradients and Adam moments the rank holds.

    python benchmarks/bench_distributed.py                      # 1 process, ddp x 2, fsdp2 x 2
    python benchmarks/bench_distributed.py --quickstart-dir runs/quickstart --setups 1,fsdp2:2 --steps 12
    python benchmarks/bench_distributed.py --config examples/smollm2/ppo_judge.yaml --set rollout.batch_size=8
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
    p.add_argument(
        "--setups",
        default="1,ddp:2,fsdp2:2",
        help="comma-separated setups: 1 (one process, no launcher) or STRATEGY:PROCESSES",
    )
    p.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE (repeatable)")
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


def parse_setup(setup: str) -> tuple[str, int]:
    """``1`` -> ("single", 1); ``fsdp2:2`` -> ("fsdp2", 2)."""
    if setup == "1":
        return "single", 1
    strategy, procs = setup.split(":")
    return strategy, int(procs)


def run_ppo(args, config: Path, setup: str, out: Path) -> dict:
    """One PPO run of ``args.steps`` steps in ``setup``; figures from its metrics after warm-up."""
    strategy, procs = parse_setup(setup)
    shutil.rmtree(out, ignore_errors=True)
    ppo = [
        "-m",
        "lmppo",
        "ppo",
        str(config),
        f"run.output_dir={out}",
        f"run.steps={args.steps}",
        "run.eval_every=0",
        "diagnosis.preflight_batches=0",  # training steps only
        "run.checkpoint_every=0",
        *args.set,
        *([f"distributed.strategy={strategy}"] if procs > 1 else []),
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
        sys.exit(f"{setup} run failed:\n{done.stderr[-4000:]}")
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    tokens = [r["response/length"] * batch_size(config, args.set) for r in records]
    return {
        "seconds_per_step": statistics.median(r["perf/step_s"] for r in records),
        "tokens_per_second": sum(tokens) / sum(r["perf/step_s"] for r in records),
        "rollout_seconds": statistics.mean(r["perf/rollout_s"] for r in records),
        "score_seconds": statistics.mean(r["perf/score_s"] for r in records),
        "update_seconds": statistics.mean(r["perf/update_s"] for r in records),
        "allreduce_mb_per_step": statistics.mean(r.get("perf/allreduce_mb", 0.0) for r in records),
        "allgather_mb_per_step": statistics.mean(r.get("perf/allgather_mb", 0.0) for r in records),
        "reduce_scatter_mb_per_step": statistics.mean(r.get("perf/reduce_scatter_mb", 0.0) for r in records),
        "peak_rss_mb_per_rank": max(r["perf/peak_rss_mb"] for r in records),
        "trained_state_mb_per_rank": records[-1]["perf/trained_state_mb"],
        "updates_per_step": statistics.mean(r["policy/updates"] for r in records),
        "wall_s": round(wall_s, 1),
        "load_avg_1min": round(load, 2),
        "threads_per_process": int(env.get("OMP_NUM_THREADS", torch.get_num_threads())),
    }


def batch_size(config: Path, overrides: list[str]) -> int:
    from lmppo.inputs.config import load_config

    return load_config(config, overrides).rollout.batch_size


def trainable_parameters(config: Path, overrides: list[str]) -> int:
    """Policy + separate critic parameters the run trains (what DDP all-reduces)."""
    from lmppo.inputs.config import load_config
    from lmppo.inputs.resolve import resolve
    from lmppo.runs.build import load_models

    cfg = load_config(config, overrides)
    models = load_models(cfg, resolve(cfg, device="cpu"))
    params = {id(p): p for m in (models.policy, models.value) for p in m.parameters() if p.requires_grad}
    return sum(p.numel() for p in params.values())


def main(argv=None) -> None:
    args = parse_args(argv)
    config = ppo_config(args)
    setups = args.setups.split(",")
    runs: dict[str, list[dict]] = {setup: [] for setup in setups}
    for repeat in range(args.repeats):
        for setup in setups if repeat % 2 == 0 else setups[::-1]:
            out = args.work_dir / f"ppo-{setup.replace(':', 'x')}"
            runs[setup].append(run_ppo(args, config, setup, out))
            print(
                f"  {setup} #{repeat + 1}: {runs[setup][-1]['seconds_per_step']:.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    params = trainable_parameters(config, args.set)
    results = {}
    for setup, reps in runs.items():
        results[setup] = {key: round(statistics.median(r[key] for r in reps), 4) for key in reps[0]}
        ddp = parse_setup(setup)[0] == "ddp"
        results[setup]["expected_allreduce_mb_per_step"] = (
            round(params * 4 * results[setup]["updates_per_step"] / 2**20, 2) if ddp else 0.0
        )

    base = results[setups[0]]["seconds_per_step"]
    print(
        f"{config} {' '.join(args.set)}: {batch_size(config, args.set)} prompts per step, "
        f"{params / 1e6:.2f} M trainable parameters"
    )
    print(
        f"{'setup':>8} {'s/step':>7} {'x first':>7} {'tok/s':>6} {'rollout s':>9} {'score s':>7} "
        f"{'update s':>8} {'peak RSS MB':>11} {'trained MB':>10} {'all-reduce MB':>13} {'all-gather MB':>13} "
        f"{'red.-scatter MB':>15} {'threads':>7}"
    )
    for setup, r in results.items():
        print(
            f"{setup:>8} {r['seconds_per_step']:>7.3f} {r['seconds_per_step'] / base:>7.2f} "
            f"{r['tokens_per_second']:>6.0f} {r['rollout_seconds']:>9.3f} {r['score_seconds']:>7.3f} "
            f"{r['update_seconds']:>8.3f} {r['peak_rss_mb_per_rank']:>11.0f} "
            f"{r['trained_state_mb_per_rank']:>10.2f} {r['allreduce_mb_per_step']:>13.2f} "
            f"{r['allgather_mb_per_step']:>13.2f} {r['reduce_scatter_mb_per_step']:>15.2f} "
            f"{r['threads_per_process']:>7}"
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
                    "overrides": args.set,
                },
                "trainable_parameters": params,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
