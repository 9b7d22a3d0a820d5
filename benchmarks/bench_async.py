"""Rollouts where the time goes (issue 41) on SmolLM2-135M-Instruct: the vLLM engine on 1 process and on 2
torchrun ranks, with synchronous and one-step-off (``rollout.asynchronous``) rollouts.

Each row is a run of ``examples/smollm2/ppo_judge.yaml`` through the CLI (torchrun for 2 ranks), with
``rollout.engine=vllm`` unless the row says otherwise, no held-out evaluation and no pre-flight. Figures
are medians over the steps after the first (its engine start-up and first sync): the step, the engine's
sampling (``perf/generation_s``: on its worker thread when asynchronous), what the step waited for it
(``perf/rollout_s``), the update and the weight sync; the lag and the largest engine/trainer log-prob gap;
the mean training reward over all steps. Run in the vLLM environment, with nothing else running:

    .venv-vllm/bin/python benchmarks/bench_async.py --steps 6
    .venv-vllm/bin/python benchmarks/bench_async.py --rows "hf,hf async" --steps 6   # the snapshot engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "examples" / "smollm2" / "ppo_judge.yaml"
sys.path.insert(0, str(ROOT / "tests"))
from helpers import TORCHRUN_LMPPO  # noqa: E402

ASYNC = ["rollout.asynchronous=true"]
ROWS: dict[str, tuple[int, list[str]]] = {  # name: (ranks, overrides)
    "vllm": (1, []),
    "vllm async": (1, ASYNC),
    "vllm 2 ranks": (2, []),
    "vllm 2 ranks async": (2, ASYNC),
    "hf": (1, ["rollout.engine=hf"]),
    "hf async": (1, ["rollout.engine=hf", *ASYNC]),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="vllm,vllm async,vllm 2 ranks,vllm 2 ranks async")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_async")
    return p.parse_args(argv)


def smollm2_dir() -> Path:
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    from lmppo.modeling.loading import cache_gguf_as_transformers

    return cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)


def run_row(name: str, args, model_dir: Path) -> list[dict]:
    ranks, overrides = ROWS[name]
    out = args.work_dir / name.replace(" ", "_")
    launcher = TORCHRUN_LMPPO if ranks > 1 else [sys.executable, "-m", "lmppo"]
    command = [
        *launcher,
        "ppo",
        str(CONFIG),
        f"models.policy.path={model_dir}",
        "rollout.engine=vllm",
        *overrides,
        f"run.steps={args.steps}",
        "run.eval_every=0",
        f"run.checkpoint_every={args.steps}",
        "diagnosis.preflight_batches=0",
        f"run.output_dir={out}",
        "--force",
        "--quiet",
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").open()][1:]


def summary(records: list[dict]) -> dict[str, float]:
    later = records[1:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in later)

    return {
        "step_s": median("perf/step_s"),
        "generation_s": median("perf/generation_s"),
        "waited_s": median("perf/rollout_s"),
        "update_s": median("perf/update_s"),
        "sync_s": median("perf/weight_sync_s"),
        "generation_share": median("perf/generation_s") / median("perf/step_s"),
        "lag": max(r["lag/policy_versions"] for r in records),
        "logp_gap": max(r["engine/logp_gap"] for r in records),
        "reward": statistics.mean(r["reward/rm_score"] for r in records),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir = smollm2_dir()
    cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("model name")), "").split(":")[-1]
    print(f"CPU:{cpu.strip()}; {os.cpu_count()} cores; {args.steps} steps per row")
    header = "| row | step s | generation s | waited s | update s | sync s | generation / step | lag | max logp gap | mean reward |"
    print(header + "\n" + "|---" * 10 + "|")
    for name in args.rows.split(","):
        s = summary(run_row(name.strip(), args, model_dir))
        print(
            f"| {name} | {s['step_s']:.1f} | {s['generation_s']:.1f} | {s['waited_s']:.2f} | {s['update_s']:.1f} "
            f"| {s['sync_s']:.2f} | {s['generation_share']:.0%} | {s['lag']:.0f} | {s['logp_gap']:.1e} "
            f"| {s['reward']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
