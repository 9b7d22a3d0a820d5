"""PPO steps on a device, fp32 against bf16, for SmolLM2-135M (LoRA, shared critic) and a randomly
initialised ~1B Llama (full policy, separate critic, gradient checkpointing): step time, generation and
update tokens/s, peak memory, and the memory plan against it. Each run is its own ``lmppo ppo`` process.

    python benchmarks/bench_gpu.py                      # on a CUDA machine (benchmarks/gpu_check.sh)
    python benchmarks/bench_gpu.py --device cpu --models smollm2 --steps 1 --rows 2 --tokens 4   # smoke

Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_MB = 512  # the plan's CUDA context, outside max_memory_allocated


def model_overrides(name: str, llama_dir: Path) -> tuple[Path, list[str]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    from lmppo.models import cache_gguf_as_transformers

    cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)
    if name == "smollm2":
        return ROOT / "examples/smollm2/ppo_judge.yaml", [f"models.policy.path={CACHE_DIR}"]
    if not (llama_dir / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks/make_llama_1b.py"), str(llama_dir)], check=True
        )
    return ROOT / "examples/llama_1b/ppo.yaml", [f"models.policy.path={llama_dir}"]


def run_once(config: Path, overrides: list[str], out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "lmppo",
        "ppo",
        str(config),
        *overrides,
        "run.eval_every=0",  # training steps only: no held-out evaluation, no reward pre-flight
        "diagnosis.preflight_batches=0",
        f"run.output_dir={out}",
        "--quiet",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return {
            "error": done.stderr.strip().splitlines()[-1]
            if done.stderr.strip()
            else f"exit {done.returncode}"
        }
    from lmppo.checkpoint import latest_checkpoint
    from lmppo.metrics import read_metrics

    records = read_metrics(out)
    timed = records[1:] or records  # the first step carries warm-up (kernels, allocator, caches)
    plan = json.loads((latest_checkpoint(out) / "manifest.json").read_text())["memory_plan"]
    gpu = "perf/peak_gpu_mb" in records[-1]
    measured = max(r["perf/peak_gpu_mb" if gpu else "perf/peak_rss_mb"] for r in records)
    planned = plan["peak_bytes"] / 2**20 - (CONTEXT_MB if gpu else 0)
    return {
        "step_s": round(statistics.median(r["perf/step_s"] for r in timed), 2),
        "rollout_tokens_per_s": round(statistics.median(r["perf/rollout_tokens_per_s"] for r in timed)),
        "train_tokens_per_s": round(statistics.median(r["perf/train_tokens_per_s"] for r in timed)),
        "engine_logp_gap": round(records[0]["engine/logp_gap"], 5),
        "peak_mb": round(measured),
        "plan_mb": round(planned),
        "plan_error": round(planned / measured - 1, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--models", nargs="+", default=["smollm2", "llama-1b"], choices=["smollm2", "llama-1b"]
    )
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32, help="prompts per step")
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lmppo-bench-gpu"))
    parser.add_argument("--llama-dir", type=Path, default=ROOT / ".cache/lmppo/llama-1b")
    args = parser.parse_args()

    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {}
    for name in args.models:
        config, overrides = model_overrides(name, args.llama_dir)
        for precision in args.precisions:
            settings = [
                *overrides,
                f"run.device={args.device}",
                f"run.precision={precision}",
                f"run.steps={args.steps}",
                "run.checkpoint_every=0",
                f"rollout.batch_size={args.rows}",
                f"rollout.max_new_tokens={args.tokens}",
                f"ppo.minibatch_size={max(args.rows // 2, 1)}",
                "data.eval_prompts=null",
                "reward.missing_eos_penalty=null",
            ]
            results[f"{name} {precision}"] = run_once(config, settings, args.out / f"{name}-{precision}")
    print(
        f"| {device_name} | step s | gen tok/s | update tok/s | peak MiB | plan MiB | plan error | logp gap |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        if "error" in r:
            print(f"| {key} | failed: {r['error']} |")
            continue
        print(
            f"| {key} | {r['step_s']} | {r['rollout_tokens_per_s']} | {r['train_tokens_per_s']} | {r['peak_mb']} "
            f"| {r['plan_mb']} | {r['plan_error']:+.0%} | {r['engine_logp_gap']} |"
        )
    print(
        json.dumps({"device": device_name, "rows": args.rows, "new_tokens": args.tokens, "results": results})
    )


if __name__ == "__main__":
    main()
