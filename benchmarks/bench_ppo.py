#!/usr/bin/env python
"""lmppo vs TRL 1.12.0's PPOTrainer: seconds per PPO step on the same models, prompts and settings.

Every repetition runs in its own process (clean peak RSS, its own matmul peak), and the two
implementations alternate within a size so machine load hits both alike. TRL runs only when the
``bench`` extra (``trl==1.12.0``) is installed; otherwise lmppo is reported alone.

Matched settings (TRL's PPO defaults where it has one): fp32 on the CPU, a separate value model
initialised from the (random) reward model, full fine-tuning, one minibatch of the whole batch,
``--epochs`` PPO epochs, temperature 0.7, k1 KL with beta 0.05, vf_coef 0.1, lr 3e-6. Every response is
exactly ``--response-length`` tokens on both sides: TRL runs with ``stop_token=None``, and the
benchmark's policy cannot emit EOS (see ``tiny_world.py``).

The real-model row (``smollm2``, ``real_world.py``) has its own fixed settings: SmolLM2-135M-Instruct
with LoRA r16 on every linear layer (reference = adapter disabled), a critic trained in full from the
frozen reward model (SmolLM2 with a fresh score head), one batch of 16 prompts, up to 48 new tokens
stopping at ``<|im_end|>``, 2 epochs x 2 minibatches. Responses differ in length there, so it is
normalised per prompt (``x TRL``) and per generated token (``x/tok``).

Prints a table, then one JSON line (the last line of stdout) with every figure. Phases per step:
generation, logprobs (reference pass; TRL also its log-softmax over the sampling logits), values,
scoring (reward model), update_forward, backward, optimizer, gc (TRL's gc.collect calls), other.
``flop_floor_s`` is the step's FLOPs (training 3 x forward per trained model per epoch, the stored
forward passes and generation, counted on real tokens) divided by the matmul peak measured in the
same process; ``train_peak_fraction`` is the update phase's achieved FLOP/s over that peak.

    python benchmarks/bench_ppo.py                      # SmolLM2 and the three tiny sizes, both implementations
    python benchmarks/bench_ppo.py --sizes h128_l4 --steps 2 --repeats 1 --impls lmppo   # smoke test
    python benchmarks/bench_ppo.py --sweep              # generation scaling: length 32-128, batch 16-64
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_world import build_real_world  # noqa: E402  (beside this file)
from tiny_world import SIZES, WorldSpec, build_world  # noqa: E402

PHASES = (
    "generation",
    "logprobs",
    "values",
    "scoring",
    "update_forward",
    "backward",
    "optimizer",
    "gc",
    "other",
)
MATCHED = {"temperature": 0.7, "kl_coef": 0.05, "vf_coef": 0.1, "lr": 3e-6, "seed": 42}
LORA = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}
LORA_PEFT = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}  # the same adapter, for TRL
# The real model's row: SmolLM2-135M-Instruct, a LoRA policy (reference = adapter disabled), a separate
# critic trained in full; responses stop at <|im_end|>. Its settings are fixed, not --epochs/--response-length.
# The real row: 1 warm-up + 3 timed steps in each of 2 processes per implementation, alternating (one
# timed step per process, as before, let a single slow step decide TRL's figure)
REAL = {"smollm2": {"response_length": 48, "epochs": 2, "minibatches": 2, "steps": 3, "repeats": 2}}
TINY = {"steps": 4, "repeats": 2}  # the tiny rows' defaults; --steps / --repeats override both
VARIANTS = {  # lmppo set-ups that change the models: their own rows, never in the matched comparison
    "lmppo-shared": {"models": {"value": {"mode": "shared"}}},  # value head on the policy's trunk
    "lmppo-lora": {"models": {"policy_lora": LORA, "value": {"lora": LORA}}},
}
REAL_VARIANTS = {  # the real model's variant rows; lmppo-vllm runs in the vLLM environment (.venv-vllm)
    "lmppo-shared": {"models": {"value": {"mode": "shared"}}},
    "lmppo-vllm": {"rollout": {"engine": "vllm"}},
    # bf16 autocast with fp32 masters, and fp32 whose matmuls round their inputs to bf16 (oneDNN)
    "lmppo-bf16": {"run": {"precision": "bf16"}},
    "lmppo-fast-fp32": {"run": {"fp32_matmul_precision": "medium"}},
    # run.compile: the first step of each process carries the compile (first_step_seconds), cold or from
    # the inductor cache the repetition before left
    "lmppo-compiled": {"run": {"compile": True}},
    "lmppo-bf16-compiled": {"run": {"precision": "bf16", "compile": True}},
}
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes", default=",".join([*REAL, *SIZES]), help=f"comma-separated, from {[*REAL, *SIZES]}"
    )
    p.add_argument("--batch", type=int, default=16, help="prompts per PPO step")
    p.add_argument("--response-length", type=int, default=32, help="new tokens per response")
    p.add_argument("--epochs", type=int, default=4, help="PPO epochs per step (one minibatch each)")
    p.add_argument("--steps", type=int, help="timed steps per repetition (default: 4 tiny, 3 real)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first in each repetition")
    p.add_argument("--repeats", type=int, help="repetitions per implementation, alternating (2 tiny, 1 real)")
    p.add_argument("--impls", default="lmppo,trl", help="lmppo and/or trl (trl is skipped if not installed)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS | REAL_VARIANTS),
        help="extra lmppo rows where they apply; '' for none",
    )
    p.add_argument("--sweep", action="store_true", help="instead: generation scaling at the first size")
    p.add_argument(
        "--quickstart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time `lmppo quickstart` (the whole toy pipeline) end to end",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="lmppo rows: profile one more step after the timed ones (untimed): self time in matrix products, "
        "attention, other ops, and outside ops (Python and dispatch)",
    )
    p.add_argument("--work-dir", default=".cache/bench", help="built models and run outputs")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one repetition of this impl
    p.add_argument("--size", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# FLOPs of one step (real tokens only; padding is waste, not work)
# --------------------------------------------------------------------------------------------------


def model_shape(model_dir: Path):
    """The decoder's widths (``lmppo.runs.plan.Shape``) from a model directory's config.json."""
    from transformers import AutoConfig

    from lmppo.runs.plan import Shape

    return Shape.of(AutoConfig.from_pretrained(model_dir))


def forward_flops(shape, seq_lengths: list[int], projected: int) -> float:
    """Forward FLOPs of a decoder over sequences, ``projected`` positions onto its vocabulary."""
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    body = shape.layers * (2 * h * h + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down
    causal_attention = 2 * shape.layers * h * sum(t * t for t in seq_lengths)  # QK^T and AV, lower triangle
    return 2.0 * body * sum(seq_lengths) + causal_attention + 2.0 * h * shape.vocab * projected


def step_flops(
    world: Path, prompt_lengths: list[int], response_lengths: list[int], epochs: int, setup: dict
) -> dict[str, float]:
    """FLOPs of a PPO step: generation, stored passes (reference, value, reward), training.

    Training is forward + backward (2 x forward) per trained network and epoch, where the backward of a
    LoRA network computes input gradients only (1 x forward): the policy and a separate critic, or the
    policy alone with a shared trunk. Counted on real tokens: padding is waste, not work.
    """
    policy_shape, critic_shape = model_shape(world / "policy"), model_shape(world / "reward")
    seqs = [q + r for q, r in zip(prompt_lengths, response_lengths)]
    policy = forward_flops(policy_shape, seqs, sum(response_lengths))
    critic = forward_flops(critic_shape, seqs, 0)  # value and reward: scalar heads
    train = (2 if setup["policy_lora"] else 3) * policy
    if not setup["shared_critic"]:
        train += (2 if setup["critic_lora"] else 3) * critic
    return {"generation": policy, "stored": policy + 2 * critic, "train": epochs * train}


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GEMM rate of this process (torch's threads), in GFLOP/s."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up the BLAS
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


# --------------------------------------------------------------------------------------------------
# Workers: one repetition of one implementation, in its own process
# --------------------------------------------------------------------------------------------------


class PhaseClock:
    """Accumulates seconds per phase; ``wrap`` times a callable into a phase chosen at call time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, phase, fn):
        import torch

        choose = phase if callable(phase) else (lambda *a, **k: phase)

        def timed(*args, **kwargs):
            name, start = choose(*args, **kwargs), time.perf_counter()
            try:  # the marker lets a profiled step attribute each op to its phase (near free otherwise)
                with torch.profiler.record_function(PHASE_MARK + name):
                    return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s keys set; nested sections are merged."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


PHASE_MARK = "phase:"  # PhaseClock's profiler markers
PROFILE_SPLIT = ("matmul", "attention", "other_ops", "outside_ops")
MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_weight_int8pack_mm",
    "aten::_int_mm",
}


def op_category(name: str) -> str:
    """Where an op's self time goes: matrix products, attention (SDPA's fused kernels), or the rest."""
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    return "other_ops"


def profiled_step(step) -> dict:
    """One ``step()`` under torch's profiler: its wall seconds split into self time of matrix products,
    attention and other ops, and the time outside any op (Python, dispatch), in all and per phase (the
    :class:`PhaseClock` markers), with the 12 costliest other ops."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall = time.perf_counter() - start
    per_phase: dict[str, dict[str, float]] = {}
    others: dict[str, list] = {}
    for event in prof.events():
        phase, parent = "other", event
        while parent is not None and not parent.name.startswith(PHASE_MARK):
            parent = parent.cpu_parent
        if parent is not None:
            phase = parent.name.removeprefix(PHASE_MARK)
        category = "outside_ops" if event.name.startswith(PHASE_MARK) else op_category(event.name)
        split = per_phase.setdefault(phase, dict.fromkeys(PROFILE_SPLIT, 0.0))
        split[category] += event.self_cpu_time_total / 1e6
        if category == "other_ops":
            seen = others.setdefault(event.name, [0.0, 0])
            seen[0], seen[1] = seen[0] + event.self_cpu_time_total / 1e6, seen[1] + 1
    # time outside every phase marker and every op: Python outside the instrumented phases
    unmarked = wall - sum(sum(split.values()) for split in per_phase.values())
    per_phase.setdefault("other", dict.fromkeys(PROFILE_SPLIT, 0.0))["outside_ops"] += unmarked
    total = {k: sum(split[k] for split in per_phase.values()) for k in PROFILE_SPLIT}
    top = sorted(others.items(), key=lambda item: -item[1][0])[:12]
    return {
        "wall_s": round(wall, 3),
        **{k: round(v, 3) for k, v in total.items()},
        "phases": {p: {k: round(v, 3) for k, v in split.items()} for p, split in per_phase.items()},
        "top_other_ops": [{"op": k, "seconds": round(s, 3), "calls": n} for k, (s, n) in top],
    }


def setup_of(size: str, impl: str) -> dict:
    """What the networks are for one row: which are LoRA, whether the critic is a head on the policy."""
    real = size in REAL
    return {
        "real": real,
        "policy_lora": real or impl == "lmppo-lora",
        "critic_lora": impl == "lmppo-lora",
        "shared_critic": impl == "lmppo-shared",
        "minibatches": REAL[size]["minibatches"] if real else 1,
    }


def world_dir(args, size: str) -> Path:
    models = Path(args.work_dir) / "models"
    if size in REAL:
        return build_real_world(models / f"{size}_p{args.batch}", num_prompts=args.batch)
    spec = WorldSpec(*SIZES[size])
    return build_world(spec, models / spec.name)


def lmppo_trainer(args, world: Path):
    """The lmppo trainer of one row (``args.worker`` names the variant), set up as ``lmppo ppo`` would."""
    from lmppo.inputs.config import load_config
    from lmppo.inputs.data import load_prompts
    from lmppo.inputs.resolve import resolve
    from lmppo.modeling.distributed import seed_everything
    from lmppo.modeling.models import keep_freed_heap_memory
    from lmppo.runs.build import build_trainer, load_models

    setup = setup_of(args.size, args.worker)
    base = {
        "models": {"policy": {"path": str(world / "policy")}, "value": {"init_from": "reward"}},
        "reward": {"model": {"path": str(world / "reward")}},
        "data": {"prompts": str(world / "prompts.jsonl")},
        "rollout": {
            "batch_size": args.batch,
            "max_new_tokens": args.response_length,
            "temperature": MATCHED["temperature"],
        },
        "ppo": {
            "ppo_epochs": args.epochs,
            "minibatch_size": args.batch // setup["minibatches"],
            "vf_coef": MATCHED["vf_coef"],
            "lr": MATCHED["lr"],
        },
        "kl": {"beta": MATCHED["kl_coef"], "estimator": "k1"},
        "run": {
            "seed": MATCHED["seed"],
            "device": "cpu",
            "precision": "fp32",
            "steps": args.warmup + args.steps,
        },
    }
    if setup["real"]:
        base["models"]["policy_lora"] = LORA
    variant = (REAL_VARIANTS if setup["real"] else VARIANTS).get(args.worker, {})
    cfg = load_config(base=merged(base, variant))
    keep_freed_heap_memory()  # as `lmppo ppo` does on CPU
    seed_everything(cfg.run.seed)
    spec = resolve(cfg, device="cpu")
    return build_trainer(cfg, spec, load_models(cfg, spec), load_prompts(cfg.data.prompts))


def lmppo_worker(args, world: Path, clock: PhaseClock) -> tuple[list[float], list[dict], list, int, dict]:
    import torch

    from lmppo.training import scorer as scorer_module

    trainer = lmppo_trainer(args, world)

    lengths: list[tuple[int, int]] = []  # (prompt, response) tokens of every row generated
    generate = trainer.generator.generate

    def generate_and_count(prompts, policy_version, sample_ids=None, rows=None):
        rollout = generate(prompts, policy_version, sample_ids, rows)
        lengths.extend(zip(rollout.query_mask.sum(1).tolist(), rollout.response_mask.sum(1).tolist()))
        return rollout

    trainer.generator.generate = clock.wrap("generation", generate_and_count)
    scorer_module.sequence_logprobs = clock.wrap("logprobs", scorer_module.sequence_logprobs)
    scorer_module.value_predictions = clock.wrap("values", scorer_module.value_predictions)
    # the variant rows (LoRA reference, shared trunk) go through these same functions
    trainer.scorer.reward.raw_scores = clock.wrap("scoring", trainer.scorer.reward.raw_scores)
    trainer.micro_batch_loss = clock.wrap("update_forward", trainer.micro_batch_loss)
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)
    trainer.optimizer.step = clock.wrap("optimizer", trainer.optimizer.step)

    step_seconds, phases = [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        trainer.step()
        step_seconds.append(time.perf_counter() - start)
        phases.append(clock.take())
    extra = {}
    if args.profile:
        extra["profile"] = profiled_step(trainer.step)
        clock.take()
        del lengths[len(lengths) - args.batch :]  # the profiled step is not a timed one
    return step_seconds, phases, lengths, sum(p.numel() for p in trainer.policy.parameters()), extra


def trl_worker(args, world: Path, clock: PhaseClock) -> tuple[list[float], list[dict], list, int, dict]:
    import gc

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    setup = setup_of(args.size, "trl")
    tokenizer = AutoTokenizer.from_pretrained(world / "policy", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    # with LoRA, TRL's reference is the policy with its adapter disabled (ref_model=None), as in lmppo
    reference = (
        None
        if setup["policy_lora"]
        else AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    )
    reward = AutoModelForSequenceClassification.from_pretrained(
        world / "reward", num_labels=1, dtype=torch.float32
    )
    value = AutoModelForSequenceClassification.from_pretrained(
        world / "reward", num_labels=1, dtype=torch.float32
    )
    prompts = Dataset.from_dict({"input_ids": json.loads((world / "prompt_ids.json").read_text())})

    lengths: list[tuple[int, int]] = []  # (prompt, response) tokens of every row generated
    generate = ppo_module.batch_generation

    def generate_and_count(model, queries, *a, **k):
        query_responses, logits = generate(model, queries, *a, **k)
        responses = query_responses[:, queries.shape[1] :]
        if setup["real"]:  # up to and including the first <|im_end|> (TRL's own response mask drops it)
            stops = responses == tokenizer.eos_token_id
            ended = stops.any(1)
            response_lengths = torch.where(ended, stops.int().argmax(1) + 1, responses.shape[1])
        else:  # the tiny policy cannot stop: every response is full length
            response_lengths = torch.full((len(responses),), responses.shape[1])
        prompt_lengths = (queries != tokenizer.pad_token_id).sum(1)
        lengths.extend(zip(prompt_lengths.tolist(), response_lengths.tolist()))
        return query_responses, logits

    ppo_module.batch_generation = clock.wrap("generation", generate_and_count)
    ppo_module.forward = clock.wrap(
        lambda *a, **k: "update_forward" if torch.is_grad_enabled() else "logprobs", ppo_module.forward
    )
    ppo_module.selective_log_softmax = clock.wrap(
        lambda *a, **k: "update_forward" if torch.is_grad_enabled() else "logprobs",
        ppo_module.selective_log_softmax,
    )
    ppo_module.get_reward = clock.wrap(
        lambda model, *a, **k: "scoring" if model is reward else "values", ppo_module.get_reward
    )
    ppo_module.gc = type(gc)("gc")
    ppo_module.gc.collect = clock.wrap("gc", gc.collect)

    step_seconds, phases = [], []

    class StepClock(TrainerCallback):  # TRL has no on_step_begin: a step runs from one step end to the next
        def on_train_begin(self, *a, **k):
            clock.take()
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            step_seconds.append(now - self.last)
            phases.append(clock.take())
            self.last = now

    steps = args.warmup + args.steps
    config = PPOConfig(
        output_dir=str(Path(args.work_dir) / "trl_out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        # local batch = per-device x accumulation = 16; one optimizer step per minibatch, as in lmppo
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=setup["minibatches"],
        num_ppo_epochs=args.epochs,
        total_episodes=args.batch * steps,
        local_rollout_forward_batch_size=args.batch,
        response_length=args.response_length,
        stop_token="eos" if setup["real"] else None,
        temperature=MATCHED["temperature"],
        kl_coef=MATCHED["kl_coef"],
        vf_coef=MATCHED["vf_coef"],
        learning_rate=MATCHED["lr"],
        seed=MATCHED["seed"],
        num_sample_generations=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        value_model=value,
        peft_config=LoraConfig(**LORA_PEFT, task_type="CAUSAL_LM") if setup["policy_lora"] else None,
        train_dataset=prompts,
        eval_dataset=prompts.select(range(8)),
        callbacks=[StepClock()],
    )
    trainer.accelerator.backward = clock.wrap("backward", trainer.accelerator.backward)
    trainer.optimizer.step = clock.wrap("optimizer", trainer.optimizer.step)
    trainer.train()
    return step_seconds, phases, lengths, sum(p.numel() for p in policy.parameters()), {}


def run_worker(args) -> None:
    import resource

    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    world = world_dir(args, args.size)
    peak = matmul_peak_gflops()
    load_before = os.getloadavg()[0]
    worker = trl_worker if args.worker == "trl" else lmppo_worker
    step_seconds, phases, lengths, params, extra = worker(args, world, PhaseClock())
    peak = max(peak, matmul_peak_gflops())  # best of before and after: other processes only lower it
    timed = slice(args.warmup, None)
    per_step = {p: statistics.fmean(s.get(p, 0.0) for s in phases[timed]) for p in PHASES if p != "other"}
    per_step["other"] = statistics.fmean(step_seconds[timed]) - sum(per_step.values())
    prompt_lengths, response_lengths = zip(*lengths[args.warmup * args.batch :])  # the timed steps' rows
    setup = setup_of(args.size, args.worker)
    flops = step_flops(world, list(prompt_lengths), list(response_lengths), args.epochs, setup)
    flops = {k: v / args.steps for k, v in flops.items()}
    print(
        json.dumps(
            {
                "impl": args.worker,
                "size": args.size,
                "policy_params": params,
                "step_seconds": step_seconds[timed],
                "first_step_seconds": step_seconds[0],
                "phase_seconds": per_step,
                "flops": flops,
                "generated_tokens_per_step": sum(response_lengths) / args.steps,
                "matmul_peak_gflops": peak,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "load": [load_before, os.getloadavg()[0]],
                "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                **extra,
            }
        )
    )


# --------------------------------------------------------------------------------------------------
# Orchestration: alternate implementations, aggregate, print
# --------------------------------------------------------------------------------------------------


def size_settings(args, size: str) -> dict:
    """Response length, epochs, timed steps and repetitions of one size: the real model's are its own."""
    fixed = REAL.get(size, {"response_length": args.response_length, "epochs": args.epochs, **TINY})
    return {
        **fixed,
        "steps": args.steps or fixed["steps"],
        "repeats": args.repeats or fixed["repeats"],
    }


def spawn(args, impl: str, size: str, batch: int, length: int) -> dict:
    settings = size_settings(args, size)
    command = [
        str(VLLM_PYTHON) if impl == "lmppo-vllm" else sys.executable,
        __file__,
        "--worker",
        impl,
        "--size",
        size,
        "--batch",
        str(batch),
        "--response-length",
        str(length),
        "--epochs",
        str(settings["epochs"]),
        "--steps",
        str(settings["steps"]),
        "--warmup",
        str(args.warmup),
        "--work-dir",
        args.work_dir,
        *(["--profile"] if args.profile else []),
    ]
    # PASSIVE: idle OpenMP threads sleep instead of spinning. On a machine shared with other jobs a
    # spinning team waits for a descheduled thread at every op (20x slower measured here); both
    # implementations get the same setting. Set OMP_WAIT_POLICY yourself to override it.
    env = {
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the vLLM variant: the engine in the worker's process
        **os.environ,
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
    if done.returncode != 0:
        sys.exit(f"{impl} worker failed ({size}, batch {batch}, length {length}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], batch: int) -> dict:
    """One implementation at one size: medians over every timed step of every repetition, and the same
    per prompt and per generated token (response tokens up to and including the stop token)."""
    steps = [s for r in runs for s in r["step_seconds"]]
    generated = statistics.fmean(r["generated_tokens_per_step"] for r in runs)
    phases = {p: statistics.fmean(r["phase_seconds"][p] for r in runs) for p in PHASES}
    update_s = phases["update_forward"] + phases["backward"] + phases["optimizer"]
    flops = runs[0]["flops"]
    peak = statistics.median(r["matmul_peak_gflops"] for r in runs)
    train_gflops = flops["train"] / update_s / 1e9
    step_s = statistics.median(steps)
    return {
        "seconds_per_step": round(step_s, 4),
        "seconds_per_step_min_max": [round(min(steps), 4), round(max(steps), 4)],
        "seconds_per_prompt": round(step_s / batch, 4),
        "generated_tokens_per_step": round(generated, 1),
        "ms_per_generated_token": round(1000 * step_s / generated, 2),
        "tokens_per_second": round(generated / step_s, 1),
        "generation_tokens_per_second": round(generated / phases["generation"], 1),
        "phase_seconds": {p: round(v, 4) for p, v in phases.items()},
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
        "train_gflops": round(train_gflops, 1),
        "matmul_peak_gflops": round(peak, 1),
        "train_peak_fraction": round(train_gflops / peak, 3),
        "flop_floor_s": round(sum(flops.values()) / peak / 1e9, 3),
        "step_over_floor": round(step_s * peak * 1e9 / sum(flops.values()), 2),
        "first_step_seconds": round(statistics.median(r["first_step_seconds"] for r in runs), 3),
        "policy_params": runs[0]["policy_params"],
        "load_avg_1min": [round(x, 2) for r in runs for x in r["load"]],
        "omp_wait_policy": runs[0]["omp_wait_policy"],
        **({"profile": runs[-1]["profile"]} if "profile" in runs[-1] else {}),
    }


def compare(args, impls: list[str], size: str, batch: int, length: int) -> dict:
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for repeat in range(size_settings(args, size)["repeats"]):
        order = impls if repeat % 2 == 0 else impls[::-1]  # alternate who goes first
        for impl in order:
            runs[impl].append(spawn(args, impl, size, batch, length))
            print(
                f"  {size} b{batch} r{length} {impl} #{repeat + 1}: "
                f"{statistics.median(runs[impl][-1]['step_seconds']):.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    result = {impl: summarise(r, batch) for impl, r in runs.items()}
    if "trl" in result and "lmppo" in result:
        trl, ours = result["trl"], result["lmppo"]
        result["speedup"] = round(
            trl["seconds_per_step"] / ours["seconds_per_step"], 2
        )  # per prompt: 16 each
        result["speedup_per_token"] = round(trl["ms_per_generated_token"] / ours["ms_per_generated_token"], 2)
        result["generation_speedup"] = round(
            result["lmppo"]["generation_tokens_per_second"] / result["trl"]["generation_tokens_per_second"], 2
        )
    return result


def print_table(results: dict[str, dict]) -> None:
    """One row per size and implementation; variants (changed model set-ups) have no ratio to TRL.
    ``x TRL`` is per prompt (both run 16 a step), ``x/tok`` per generated token (lengths differ when
    responses stop at EOS)."""
    head = (
        f"{'size':<8} {'impl':<12} {'s/step':>7} {'min-max':>13} {'x TRL':>6} {'x/tok':>6} {'ms/tok':>7} {'floor s':>7} "
        f"{'/floor':>6} {'1st step':>8} {'gen tok/s':>9} {'train GF/s':>10} {'%peak':>5} {'RSS MB':>7} | "
        + " ".join(f"{p[:7]:>7}" for p in PHASES)
    )
    print(head)
    print("-" * len(head))
    for size, result in results.items():
        for impl, r in result.items():
            if not isinstance(r, dict):
                continue
            ours = impl == "lmppo" and "speedup" in result
            speedup = f"{result['speedup']:.2f}" if ours else ""
            per_token = f"{result['speedup_per_token']:.2f}" if ours else ""
            spread = "{:.2f}-{:.2f}".format(
                *r["seconds_per_step_min_max"]
            )  # every timed step's, all processes
            print(
                f"{size:<8} {impl:<12} {r['seconds_per_step']:>7.3f} {spread:>13} {speedup:>6} {per_token:>6} "
                f"{r['ms_per_generated_token']:>7.1f} {r['flop_floor_s']:>7.2f} {r['step_over_floor']:>6.2f} "
                f"{r['first_step_seconds']:>8.2f} {r['generation_tokens_per_second']:>9.0f} "
                f"{r['train_gflops']:>10.1f} {100 * r['train_peak_fraction']:>5.0f} {r['peak_rss_mb']:>7.0f} | "
                + " ".join(f"{r['phase_seconds'][p]:>7.3f}" for p in PHASES)
            )


def print_profiles(results: dict[str, dict]) -> None:
    """The profiled step of each lmppo row: where its wall time went, and the costliest other ops."""
    for size, result in results.items():
        for impl, r in result.items():
            profile = r.get("profile") if isinstance(r, dict) else None
            if profile is None:
                continue
            wall = profile["wall_s"]
            split = ", ".join(
                f"{k} {profile[k]:.2f} s ({100 * profile[k] / wall:.0f} %)" for k in PROFILE_SPLIT
            )
            print(f"profile {size} {impl}: {wall:.2f} s = {split}")
            for phase, seconds in profile["phases"].items():
                print(f"  {phase:<15} " + " ".join(f"{k} {seconds[k]:6.2f}" for k in PROFILE_SPLIT))
            print(
                "  "
                + "; ".join(f"{o['op']} {o['seconds']:.2f} s x{o['calls']}" for o in profile["top_other_ops"])
            )


def cpu_flags() -> str:
    """The CPU's name and the flags that decide matmul speed by dtype (AMX: fast bf16; AVX-512 BF16)."""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{fields.get('Model name', '?').strip()}; " + " ".join(f for f in wanted if f in flags)


def sweep(args, impls: list[str]) -> list[dict]:
    """Generation cost against new tokens and batch: with a KV cache it grows linearly in new tokens."""
    size, rows = args.sizes.split(",")[0], []
    for batch in (16, 64):
        for length in (32, 64, 128):
            result = compare(args, impls, size, batch, length)
            for impl in impls:
                generation_s = result[impl]["phase_seconds"]["generation"]
                rows.append(
                    {
                        "impl": impl,
                        "size": size,
                        "batch": batch,
                        "response_length": length,
                        "generation_s": generation_s,
                        "ms_per_decode_step": round(1000 * generation_s / length, 2),
                        "generation_tokens_per_second": result[impl]["generation_tokens_per_second"],
                        "seconds_per_step": result[impl]["seconds_per_step"],
                    }
                )
    print(
        f"{'impl':<12} {'batch':>5} {'length':>6} {'gen s':>7} {'x len 32':>8} {'ms/decode step':>14} "
        f"{'gen tok/s':>9} {'s/step':>7}"
    )
    for r in rows:
        base = next(
            b
            for b in rows
            if b["impl"] == r["impl"] and b["batch"] == r["batch"] and b["response_length"] == 32
        )
        print(
            f"{r['impl']:<12} {r['batch']:>5} {r['response_length']:>6} {r['generation_s']:>7.3f} "
            f"{r['generation_s'] / base['generation_s']:>8.2f} {r['ms_per_decode_step']:>14.2f} "
            f"{r['generation_tokens_per_second']:>9.0f} {r['seconds_per_step']:>7.3f}"
        )
    return rows


def time_quickstart(args) -> dict:
    """Wall time of ``lmppo quickstart`` (SFT, reward model, PPO, evaluation, report) in a fresh directory."""
    out = Path(args.work_dir) / "quickstart"
    shutil.rmtree(out, ignore_errors=True)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lmppo", "quickstart", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"lmppo quickstart failed:\n{done.stderr[-4000:]}")
    wall_s = time.perf_counter() - started
    print(f"lmppo quickstart: {wall_s / 60:.1f} min (load {load_before:.1f} -> {os.getloadavg()[0]:.1f})")
    return {
        "wall_s": round(wall_s, 1),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def applying(variants: list[str], size: str) -> list[str]:
    """The variant rows that exist for ``size``: the real model's, or the tiny worlds'."""
    return [v for v in variants if v in (REAL_VARIANTS if size in REAL else VARIANTS)]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    impls = [i for i in args.impls.split(",") if i == "lmppo" or importlib.util.find_spec("trl") is not None]
    variants = [v for v in args.variants.split(",") if v]
    if "lmppo-vllm" in variants and not VLLM_PYTHON.exists():
        print(
            f"lmppo-vllm skipped: no vLLM environment at {VLLM_PYTHON} (make test-vllm builds it)",
            file=sys.stderr,
        )
        variants.remove("lmppo-vllm")
    sizes = args.sizes.split(",")
    for size in sizes:  # build before timing anything
        world_dir(args, size)
    started = time.time()
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "cpu_flags": cpu_flags(),
        "settings": {
            "batch": args.batch,
            "warmup": args.warmup,
            "sizes": {size: size_settings(args, size) for size in sizes},
            **MATCHED,
        },
        "impls": impls,
        "variants": variants,
    }
    if args.sweep:
        report["sweep"] = sweep(args, impls)  # the matched set-up only
    else:
        report["results"] = {
            size: compare(
                args,
                impls + applying(variants, size),
                size,
                args.batch,
                size_settings(args, size)["response_length"],
            )
            for size in sizes
        }
        print(f"CPU: {report['cpu_flags']}")
        print_table(report["results"])
        print_profiles(report["results"])
    if args.quickstart and not args.sweep:
        report["quickstart"] = time_quickstart(args)
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
