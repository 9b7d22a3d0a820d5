#!/usr/bin/env python
"""HF-engine generation on SmolLM2-135M-Instruct against the machine's bounds, in one process.

The policy is set up as in the benchmark's real-model row: LoRA r16 on every linear layer (the adapter
given random weights, so that folding it matters), fp32, temperature 0.7, up to 48 new tokens, prompts
from ``examples/smollm2/data``. For each batch size it prints sampled tokens per second (every decode
position of every row, finished rows included: the work done) and two bounds measured in the same
process: the compute bound (the best 2048^2 fp32 GEMM rate over 2 x the policy's parameters per token)
and the memory bound (every weight read once per decode step at the measured read bandwidth).

    python benchmarks/bench_decode.py                  # batch 16 and 64
    python benchmarks/bench_decode.py --profile        # and the ops a batch-16 rollout spends its time in
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_ppo import matmul_peak_gflops  # noqa: E402  (beside this file)
from real_world import PROMPTS, smollm2_dir  # noqa: E402


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best rate of summing a large float32 tensor: what streaming every weight once can reach."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_generator(max_new_tokens: int):
    from lmppo.inputs.data import load_prompts
    from lmppo.modeling.loading import load_causal_lm, load_tokenizer
    from lmppo.modeling.lora import apply_lora
    from lmppo.sampling.hf_engine import hf_generator

    model_dir = smollm2_dir()
    torch.manual_seed(0)
    policy = apply_lora(load_causal_lm(model_dir), r=16, alpha=32, target_modules="all-linear")
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    generator = hf_generator(
        policy, load_tokenizer(model_dir), max_new_tokens=max_new_tokens, temperature=0.7
    )
    return generator, policy, load_prompts(str(PROMPTS))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,64")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="rollouts per batch size (the best counts)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    generator, policy, prompts = build_generator(args.new_tokens)
    base = policy.get_base_model()
    params = sum(p.numel() for p in base.parameters())  # tied embeddings once: the head reads them
    peak, bandwidth = matmul_peak_gflops(), read_bandwidth_gbs()
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        batch_prompts = prompts[:batch]
        timings = []
        for repeat in range(args.repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            rollout = generator.generate(batch_prompts, policy_version=0)
            timings.append((time.perf_counter() - start, rollout.response_ids.shape[1]))
        seconds, steps = min(timings)
        tokens_per_s = batch * steps / seconds
        compute_bound = peak * 1e9 / (2 * params)
        memory_bound = batch * bandwidth * 1e9 / (4 * params)
        results[batch] = {
            "tokens_per_s": round(tokens_per_s, 1),
            "ms_per_decode_step": round(1000 * seconds / steps, 1),
            "rollout_s": [round(s, 2) for s, _ in timings],
            "compute_bound_tokens_per_s": round(compute_bound, 1),
            "memory_bound_tokens_per_s": round(memory_bound, 1),
            "of_compute_bound": round(tokens_per_s / compute_bound, 3),
            "of_bound": round(tokens_per_s / min(compute_bound, memory_bound), 3),
        }
        print(f"batch {batch}: {results[batch]}", file=sys.stderr, flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            generator.generate(prompts[:16], policy_version=0)
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "threads": torch.get_num_threads(),
                "matmul_peak_gflops": round(peak, 1),
                "read_bandwidth_gbs": round(bandwidth, 1),
                "policy_params": params,
                "median_rollout_s": {b: statistics.median(r["rollout_s"]) for b, r in results.items()},
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
