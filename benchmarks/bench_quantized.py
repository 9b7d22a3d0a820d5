"""What quantizing the frozen models costs and saves on SmolLM2-135M-Instruct (docs/memory.md).

1. ``--part logprobs`` and ``--part scores``: the reference's log-probs and the reward model's scores of each
   scheme (bf16, int8, nf4; lmppo.modeling.quantize) against the fp32 model: per response token mean and max
   |delta logp|, the bias a quantized reference puts into ``kl/ref`` at step 1 (mean over responses of the
   summed delta, the KL a
   policy equal to the fp32 model shows against it), and for the reward model the scores' mean |delta|, their
   rank correlation with fp32's and the share of held-out pairs ordered as fp32 orders them (and as the
   labels do). Responses are SmolLM2's own samples for held-out prompts (fixed seed).
2. ``--part speed``: one forward per scheme, torchao's and bitsandbytes' (when installed): the library choice.
3. ``--part steps``: a SmolLM2 LoRA PPO step (examples/smollm2/ppo_rm.yaml) with its frozen pair in each
   scheme, each run its own ``lmppo ppo`` process for --steps steps: peak RSS against the plan's peak,
   seconds per step.

Run from the repository root after ``python examples/smollm2/prepare.py --pairs`` and ``lmppo train-rm
examples/smollm2/rm.yaml`` (the reward model in runs/smollm2/rm, the pairs in runs/smollm2/prefs_test.jsonl):

    .venv/bin/python benchmarks/bench_quantized.py --part logprobs --out runs/bench_quantized
    .venv/bin/python benchmarks/bench_quantized.py --part scores --out runs/bench_quantized
    .venv/bin/python benchmarks/bench_quantized.py --part steps --out runs/bench_quantized
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / ".cache" / "lmppo" / "smollm2"
RM = ROOT / "runs" / "smollm2" / "rm"
PAIRS = ROOT / "runs" / "smollm2" / "prefs_test.jsonl"
PROMPTS = ROOT / "examples" / "smollm2" / "data" / "prompts_test.jsonl"
SCHEMES = {  # name -> (dtype of the unquantized weights, quantize)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "nf4": ("float32", "nf4"),
}


def cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags\t\t: ")[1].split("\n")[0].split()
    return " ".join(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))


def responses(n_prompts: int, seed: int):
    """SmolLM2's sampled responses (fp32, temperature 1) to the first held-out prompts."""
    import torch

    from lmppo.inputs.config import ModelSource
    from lmppo.inputs.data import load_prompts
    from lmppo.modeling.loading import load_causal_lm, load_tokenizer
    from lmppo.sampling.hf_engine import hf_generator

    tokenizer = load_tokenizer(POLICY)
    torch.manual_seed(seed)
    model = load_causal_lm(ModelSource(path=str(POLICY)))
    generator = hf_generator(model, tokenizer, max_new_tokens=48, temperature=1.0)
    return generator.generate(load_prompts(str(PROMPTS))[:n_prompts], policy_version=0)


def logprob_errors(n_prompts: int, seed: int) -> dict:
    import torch

    from lmppo.inputs.config import ModelSource
    from lmppo.modeling.loading import load_causal_lm
    from lmppo.modeling.quantize import quantized_weight_bytes
    from lmppo.sampling.passes import sequence_logprobs

    rollout = responses(n_prompts, seed)
    mask = rollout.response_mask.bool()
    logps, rows = {}, {}
    for name, (dtype, quantize) in SCHEMES.items():
        model = load_causal_lm(ModelSource(path=str(POLICY), dtype=dtype, quantize=quantize))
        with torch.no_grad():
            logps[name] = sequence_logprobs(model, rollout).float()
        size = sum(p.numel() * p.element_size() for p in model.parameters() if not _quantized(p))
        rows[name] = {"weights_mb": round((size + quantized_weight_bytes(model)) / 2**20, 1)}
    for name, logp in logps.items():
        delta = (logp - logps["fp32"])[mask]
        per_response = ((logps["fp32"] - logp) * mask).sum(-1)
        rows[name] |= {
            "mean_abs_dlogp": float(delta.abs().mean()),
            "max_abs_dlogp": float(delta.abs().max()),
            "kl_ref_bias": float(per_response.mean()),
            "kl_ref_bias_sd": float(per_response.std()),
        }
    return {"responses": int(mask.shape[0]), "tokens": int(mask.sum()), "reference": rows}


def _quantized(param) -> bool:
    from lmppo.modeling.quantize import is_quantized

    return is_quantized(param)


def score_errors() -> dict:
    import torch

    from lmppo.inputs.config import ModelSource
    from lmppo.modeling.loading import load_reward_model, load_tokenizer
    from lmppo.rewards.scoring import RewardModelScorer

    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    prompts = [p["prompt"] for p in pairs] * 2
    answers = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    tokenizer = load_tokenizer(RM)
    scores = {}
    for name, (dtype, quantize) in SCHEMES.items():
        model = load_reward_model(ModelSource(path=str(RM), dtype=dtype, quantize=quantize))
        with torch.no_grad():
            scores[name] = RewardModelScorer(model, tokenizer, batch_size=32)(prompts, answers).float()
    n = len(pairs)
    reference = scores["fp32"][:n] > scores["fp32"][n:]
    rows = {}
    for name, s in scores.items():
        chosen_wins = s[:n] > s[n:]
        rows[name] = {
            "mean_abs_dscore": float((s - scores["fp32"]).abs().mean()),
            "score_sd": float(scores["fp32"].std()),
            "spearman": spearman(s, scores["fp32"]),
            "pairs_ordered_as_fp32": float((chosen_wins == reference).float().mean()),
            "accuracy": float(chosen_wins.float().mean()),
        }
    return {"pairs": n, "reward_model": rows}


def spearman(a, b) -> float:
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    return float(((ra - ra.mean()) * (rb - rb.mean())).sum() / (ra.std() * rb.std() * (len(ra) - 1)))


def speed(repeats: int = 3) -> dict:
    """Seconds of one no-grad forward of 16 x 128 tokens through SmolLM2 per scheme (median of
    ``repeats``), torchao's and, when it is installed, bitsandbytes' (transformers' own loader)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from lmppo.inputs.config import ModelSource
    from lmppo.modeling.loading import load_causal_lm

    ids = torch.randint(0, 49152, (16, 128), generator=torch.Generator().manual_seed(0))
    models = {
        f"torchao {name}": lambda d=d, q=q: load_causal_lm(ModelSource(path=str(POLICY), dtype=d, quantize=q))
        for name, (d, q) in SCHEMES.items()
    }
    for name, kwargs in (
        ("int8", {"load_in_8bit": True}),
        ("nf4", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    ):

        def load(kwargs=kwargs):
            from transformers import BitsAndBytesConfig

            config = BitsAndBytesConfig(**kwargs)
            return AutoModelForCausalLM.from_pretrained(POLICY, quantization_config=config, device_map="cpu")

        models[f"bitsandbytes {name}"] = load
    rows = {}
    for name, load in models.items():
        try:
            model = load()
        except Exception as err:  # noqa: BLE001 (a library that cannot run here is a row of the table)
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
            continue
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - start)
        rows[name] = {"forward_s": round(statistics.median(times), 3)}
        del model
    return {"forward": "16 x 128 tokens, no grad", "speed": rows}


STEP_ROWS = {  # name -> overrides of examples/smollm2/ppo_rm.yaml (LoRA: the reference is the base)
    "fp32 frozen pair": [],
    "int8 frozen pair": ["models.policy.quantize=int8", "reward.model.quantize=int8"],
    "nf4 frozen pair (QLoRA)": ["models.policy.quantize=nf4", "reward.model.quantize=nf4"],
    # QLoRA against the 16-bit model as reference: kl/ref at step 1 is the quantization's own divergence
    "nf4 QLoRA, fp32 reference": ["models.policy.quantize=nf4", f"models.reference.path={POLICY}"],
}


def step_rows(out: Path, steps: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from lmppo.inputs.config import load_config
    from lmppo.runs.plan import memory_plan
    from lmppo.training.metrics import read_metrics

    results = {}
    for name, overrides in STEP_ROWS.items():
        run_dir = out / name.split(" (")[0].replace(" ", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [
            *overrides,
            f"run.output_dir={run_dir}",
            f"run.steps={steps}",
            "run.checkpoint_every=0",
            "run.eval_every=0",
            "data.eval_prompts=null",
            "diagnosis.preflight_batches=0",
        ]
        config = ROOT / "examples/smollm2/ppo_rm.yaml"
        plan = memory_plan(load_config(config, overrides))
        subprocess.run(
            [sys.executable, "-m", "lmppo", "ppo", str(config), *overrides, "--quiet"], check=True, cwd=ROOT
        )
        records = [r for r in read_metrics(run_dir) if "perf/step_s" in r]
        peak = max(r["perf/peak_rss_mb"] for r in records)
        results[name] = {
            "plan_mb": round(plan.peak / 2**20),
            "models_mb": round(plan.static / 2**20),
            "peak_rss_mb": round(peak),
            "plan_error": round(plan.peak / 2**20 / peak - 1, 3),
            "step_s": round(statistics.median(r["perf/step_s"] for r in records[1:] or records), 2),
            "kl_ref_step1": records[0]["kl/ref"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["logprobs", "scores", "speed", "steps"], required=True)
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts sampled (part logprobs)")
    parser.add_argument("--steps", type=int, default=3, help="PPO steps per row (part steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_quantized")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "logprobs":
        result = logprob_errors(args.prompts, args.seed)
    elif args.part == "scores":
        result = score_errors()
    elif args.part == "speed":
        result = speed()
    else:
        result = step_rows(args.out, args.steps)
    result = {
        "part": args.part,
        "cpu": platform.processor() or platform.machine(),
        "flags": cpu_flags(),
        **result,
    }
    print(json.dumps(result, indent=1))
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
