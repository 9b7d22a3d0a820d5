"""The memory plan against the measured peak, on the example configs (docs/memory.md): each row is its own
``lmppo ppo`` process for a few steps with held-out evaluation on, and its plan is the one the run made
at its start (the manifest's ``memory_plan``), against the largest ``perf/peak_rss_mb`` (or
``perf/peak_gpu_mb``) it logged.

    .venv/bin/python benchmarks/bench_plan.py --out runs/bench_plan            # every row
    .venv/bin/python benchmarks/bench_plan.py --rows toy "smollm2 fp32"        # some of them

The toy rows need a quickstart world (``lmppo quickstart``: runs/quickstart); the SmolLM2 rows the GGUF
converted by ``python examples/smollm2/prepare.py``, the calculator row its SFT policy
(examples/smollm2_calculator/README.md). Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ppo import cpu_flags  # noqa: E402  (beside this file)

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "examples/smollm2/ppo_judge.yaml"
TOY = "examples/toy_gold_reward.yaml"
CALCULATOR = "examples/smollm2_calculator/ppo.yaml"
ROWS = {  # name -> (config, overrides)
    "toy fp32": (TOY, []),
    "smollm2 fp32": (SMOLLM2, []),
    # small: bf16 matmuls are emulated, and slow, on a CPU without AVX512-BF16 or AMX
    "smollm2 bf16 (4 prompts x 8 tokens)": (
        SMOLLM2,
        ["run.precision=bf16", "rollout.batch_size=4", "rollout.max_new_tokens=8", "ppo.minibatch_size=4"],
    ),
    "smollm2 int8 base (QLoRA)": (SMOLLM2, ["models.policy.quantize=int8"]),
    "smollm2 nf4 base (QLoRA)": (SMOLLM2, ["models.policy.quantize=nf4"]),
    "smollm2 calculator (3-turn episodes with a tool)": (CALCULATOR, []),
    # the plan is a bound at the caps, which the example's episodes (57 of 128 tokens on average) leave
    # far below: a cap they fill tests the plan's arithmetic rather than the episodes' lengths
    "smollm2 calculator, episodes filling a 64-token cap": (CALCULATOR, ["rollout.max_total_tokens=64"]),
}


def world_overrides(config: str, world: Path, out: Path) -> list[str]:
    """The toy config on a quickstart world; a 32-prompt held-out file: one evaluation batch."""
    held_out = out / "eval_prompts.jsonl"
    if config == TOY:
        source = world / "world" / "data" / "prompts_test.jsonl"
        paths = [
            f"models.policy.path={world / 'sft'}",
            f"data.prompts={world / 'world/data/prompts_train.jsonl'}",
        ]
    else:  # the example's own held-out prompts
        source, paths = ROOT / Path(config).parent / "data" / "prompts_test.jsonl", []
    held_out.write_text("".join(source.read_text().splitlines(keepends=True)[:32]))
    return [*paths, f"data.eval_prompts={held_out}"]


def run_row(name: str, args) -> dict:
    config, overrides = ROWS[name]
    run_dir = args.out / re.sub(r"[^\w.-]+", "_", name).strip("_")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        *overrides,
        *world_overrides(config, args.world, args.out),
        f"run.output_dir={run_dir}",
        f"run.steps={args.steps}",
        "run.checkpoint_every=0",
        f"run.eval_every={args.steps}",  # evaluated at step 0 and at the end
        "diagnosis.preflight_batches=1",
        "guards.enabled=false",
    ]
    subprocess.run(
        [sys.executable, "-m", "lmppo", "ppo", str(ROOT / config), *overrides, "--quiet"],
        check=True,
        cwd=ROOT,
    )
    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    planned = json.loads((latest / "manifest.json").read_text())["memory_plan"]["peak_bytes"] / 2**20
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "perf/peak_gpu_mb" if any("perf/peak_gpu_mb" in r for r in records) else "perf/peak_rss_mb"
    peak = max(r[key] for r in records if key in r)
    return {"plan_mb": round(planned), "peak_mb": round(peak), "plan_error": round(planned / peak - 1, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--world", type=Path, default=ROOT / "runs" / "quickstart", help="a quickstart's runs"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_plan")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.rows:
        results[name] = run_row(name, args)
        print(f"[plan] {name}: {json.dumps(results[name])}", flush=True)
    print("| config | plan | measured peak | plan error |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['plan_mb']:,} MB | {r['peak_mb']:,} MB | {r['plan_error']:+.0%} |")
    date = datetime.date.today().isoformat()
    print(json.dumps({"date": date, "machine": cpu_flags(), "results": results}))


if __name__ == "__main__":
    main()
