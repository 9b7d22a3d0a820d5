"""Peak memory of one PPO update on SmolLM2-135M-Instruct (LoRA r16, shared critic): as one micro-batch,
with ``ppo.gradient_checkpointing``, with it plus ``ppo.micro_batch_tokens``, and all that in bf16; each in
its own process (peak RSS cannot be reset inside one).

The update runs on a fixed rollout of ``--rows`` rows of ``--response`` tokens that never stop early (so
every position counts): the activations the backward keeps are what differs. Prints one JSON line: per
mode, peak RSS of the process, the seconds of the update, and what ``lmppo plan`` predicted (its error).

    .venv/bin/python benchmarks/bench_memory.py --rows 8 --response 256
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"


def worker(args) -> dict:
    import torch

    from lmppo.inputs.config import load_config
    from lmppo.inputs.resolve import resolve
    from lmppo.modeling.distributed import seed_everything
    from lmppo.modeling.loading import cache_gguf_as_transformers
    from lmppo.runs.build import build_trainer, load_models
    from lmppo.runs.plan import memory_plan
    from lmppo.sampling.rollout import EstimatedRollout, Rollout

    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)
    prompts = Path(args.out) / "prompt.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    cfg = load_config(
        ROOT / "examples/smollm2/ppo_judge.yaml",
        [
            f"models.policy.path={CACHE_DIR}",
            f"rollout.batch_size={args.rows}",
            f"ppo.minibatch_size={args.rows}",
            f"rollout.max_new_tokens={args.response}",
            f"ppo.gradient_checkpointing={args.checkpointing}",
            f"ppo.micro_batch_tokens={args.micro_batch_tokens or 'null'}",
            f"run.precision={args.precision}",
            f"data.prompts={prompts}",
            "reward.missing_eos_penalty=null",
        ],
    )
    plan = memory_plan(cfg)  # as `lmppo ppo` does: before any model is loaded
    seed_everything(0)
    spec = resolve(cfg, device="cpu")
    trainer = build_trainer(cfg, spec, load_models(cfg, spec), [PROMPT] * args.rows)
    query = torch.tensor([trainer.generator.renderer.render(PROMPT)] * args.rows)
    response = torch.randint(100, 1000, (args.rows, args.response))  # ordinary tokens: no stop, all counted
    rollout = Rollout(
        query_ids=query,
        query_mask=torch.ones_like(query),
        response_ids=response,
        response_mask=torch.ones(args.rows, args.response),
        terminated=torch.zeros(args.rows, dtype=torch.bool),
        logp_old=torch.zeros(args.rows, args.response),
        policy_version=0,
        created_at=time.time(),
        prompts=["q"] * args.rows,
        response_texts=[""] * args.rows,
        temperature=0.7,
    )
    zeros = torch.zeros(args.rows, args.response)
    rollout = EstimatedRollout.after(
        rollout,
        values=zeros,
        rm_score=torch.zeros(args.rows),
        logp_ref=zeros,
        kl_ref=zeros,
        advantages=torch.randn(args.rows, args.response),
        returns=zeros,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    with trainer.autocast():
        trainer.minibatch_update(rollout)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "update_s": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(peak),
        "peak_rss_before_update_mb": round(before),
        "plan_peak_mb": round(plan.peak / 2**20),  # the update is the largest phase planned here
        "plan_error": round(plan.peak / 2**20 / peak - 1, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="the budget of the third mode")
    parser.add_argument("--out", default="/tmp", help="a scratch directory")
    parser.add_argument("--bf16", action="store_true", help="add the third mode in run.precision=bf16")
    parser.add_argument("--checkpointing", choices=["true", "false"], help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checkpointing:
        print(json.dumps(worker(args)))
        return
    results = {}
    budget = f"micro_batch_tokens={args.micro_batch_tokens}"
    modes = {
        "one micro-batch": ("false", 0, "fp32"),
        "gradient_checkpointing": ("true", 0, "fp32"),
        f"gradient_checkpointing + {budget}": ("true", args.micro_batch_tokens, "fp32"),
    }
    if args.bf16:  # slow where the CPU has no bf16 matmul instructions (25x on an AVX2-only EPYC)
        modes[f"bf16 + gradient_checkpointing + {budget}"] = ("true", args.micro_batch_tokens, "bf16")
    for name, (checkpointing, budget, precision) in modes.items():
        command = [sys.executable, __file__, "--rows", str(args.rows), "--response", str(args.response),
                   "--checkpointing", checkpointing, "--micro-batch-tokens", str(budget),
                   "--precision", precision, "--out", args.out]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "rows": args.rows,
                "response_tokens": args.response,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
