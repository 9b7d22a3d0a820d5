"""Rollout engines side by side: transformers (lmppo's decode loop) vs vLLM, same process, same prompts.

Run in the vLLM environment (``make test-vllm`` builds it): ``.venv-vllm/bin/python
benchmarks/bench_engines.py``. For each model — a tiny random Llama (hidden 256, 4 layers, head size 64,
the toy world's tokenizer) and SmolLM2-135M-Instruct with LoRA — it reports generation tokens/s (all
sampled tokens over the generation seconds, median of ``--repeats``), the seconds to push the policy's
weights into the engine, and the whole PPO step (median ``perf/step_s`` after a warm-up step) with each
engine. With LoRA, ``vllm-lora`` is the vLLM engine synced by adapter only (``rollout.vllm_weight_sync:
lora``). The engines alternate; every figure comes from this one process.

    .venv-vllm/bin/python benchmarks/bench_engines.py --models tiny --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.modeling.distributed import seed_everything
from lmppo.runs.build import build_generator, build_trainer, load_models

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPTS = ROOT / "examples" / "smollm2" / "data" / "prompts_train.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="generation and sync repetitions per engine")
    p.add_argument("--steps", type=int, default=3, help="PPO steps per engine (the first is a warm-up)")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "bench_engines")
    return p.parse_args(argv)


def tiny_model(work_dir: Path) -> Path:
    """A random Llama on the toy world's tokenizer, with vLLM-friendly head size 64 (no EOS learned: every
    response runs to the length limit, so both engines do the same work)."""
    from transformers import LlamaForCausalLM

    from lmppo.modeling.loading import load_tokenizer
    from lmppo.toy.models import build_toy_world, tiny_llama_config

    out = work_dir / "tiny"
    if not (out / "config.json").is_file():
        world = build_toy_world(work_dir / "world", seed=0)
        tokenizer = load_tokenizer(world.policy_dir)
        torch.manual_seed(0)
        LlamaForCausalLM(
            tiny_llama_config(tokenizer, hidden_size=256, num_layers=4, num_heads=4)
        ).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def smollm2_model() -> Path:
    from lmppo.modeling.loading import cache_gguf_as_transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    return cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)


def config_for(name: str, model_dir: Path, args, engine: str, out: Path):
    lora = (
        {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"} if name == "smollm2" else {}
    )
    return load_config(
        base={
            "models": {
                "policy": {"path": str(model_dir)},
                "policy_lora": lora or {"enabled": False},
                "value": {"mode": "shared"},
            },
            "reward": {
                "function": f"{ROOT / 'examples/smollm2/judge.py'}:reward",
                "missing_eos_penalty": 1.0,
            },
            "data": {"prompts": str(PROMPTS)},
            "rollout": {
                "engine": engine.removesuffix("-lora"),
                "vllm_weight_sync": "lora" if engine.endswith("-lora") else "merged",
                "batch_size": args.batch,
                "max_new_tokens": args.new_tokens,
                "temperature": 0.7,
            },
            "ppo": {"minibatch_size": args.batch // 2, "ppo_epochs": 2, "lr": 1e-4},
            "run": {"output_dir": str(out), "steps": args.steps, "seed": 0},
        }
    )


def measure(name: str, model_dir: Path, args) -> dict:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.open()][::7][: args.batch]
    results = {}
    for engine in ("hf", "vllm", "vllm-lora") if name == "smollm2" else ("hf", "vllm"):
        cfg = config_for(name, model_dir, args, engine, args.work_dir / f"run-{name}-{engine}")
        seed_everything(0)
        spec = resolve(cfg, device="cpu")
        models = load_models(cfg, spec)
        generator = build_generator(cfg, spec, models)
        sync_s = []  # first, so that a LoRA-synced engine generates with its adapter applied
        if engine != "hf":
            for _ in range(args.repeats):
                started = time.perf_counter()
                generator.sync_weights(models.policy, 0)
                sync_s.append(time.perf_counter() - started)
        gen_s, tokens = [], 0
        for _ in range(args.repeats):
            started = time.perf_counter()
            rollout = generator.generate(prompts, policy_version=0)
            gen_s.append(time.perf_counter() - started)
            tokens = rollout.response_ids.numel()
        trainer = build_trainer(cfg, spec, models, prompts * 4, generator=generator)
        steps = [trainer.step() for _ in range(args.steps)][1:]
        results[engine] = {
            "generation_tokens_per_s": round(tokens / statistics.median(gen_s), 1),
            "generation_s": round(statistics.median(gen_s), 3),
            "weight_sync_s": round(statistics.median(sync_s), 3) if sync_s else None,
            "step_s": round(statistics.median(m["perf/step_s"] for m in steps), 3),
            "rollout_s": round(statistics.median(m["perf/rollout_s"] for m in steps), 3),
            "engine_logp_gap": max(m["engine/logp_gap"] for m in steps),
        }
        del trainer, generator, models
        gc.collect()
        print(f"  {name} {engine}: {results[engine]}", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    models = {"tiny": lambda: tiny_model(args.work_dir), "smollm2": smollm2_model}
    report = {}
    for name in args.models.split(","):
        report[name] = measure(name, models[name](), args)
    print(
        f"{'model':8} {'engine':9} {'gen tok/s':>10} {'gen s':>7} {'sync s':>7} {'step s':>7} {'rollout s':>9} "
        f"{'logp gap':>9}"
    )
    for name, engines in report.items():
        for engine, r in engines.items():
            sync = f"{r['weight_sync_s']:.3f}" if r["weight_sync_s"] is not None else "-"
            print(
                f"{name:8} {engine:9} {r['generation_tokens_per_s']:>10.0f} {r['generation_s']:>7.3f} {sync:>7} "
                f"{r['step_s']:>7.3f} {r['rollout_s']:>9.3f} {r['engine_logp_gap']:>9.1e}"
            )
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads(),
                "results": report,
            }
        )
    )


if __name__ == "__main__":
    main()
