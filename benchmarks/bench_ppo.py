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

Prints a table, then one JSON line (the last line of stdout) with every figure. Phases per step:
generation, logprobs (reference pass; TRL also its log-softmax over the sampling logits), values,
scoring (reward model), update_forward, backward, optimizer, gc (TRL's gc.collect calls), other.
``flop_floor_s`` is the step's FLOPs (training 3 x forward per trained model per epoch, the stored
forward passes and generation, counted on real tokens) divided by the matmul peak measured in the
same process; ``train_peak_fraction`` is the update phase's achieved FLOP/s over that peak.

    python benchmarks/bench_ppo.py                      # the three sizes, both implementations
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
from tiny_world import SIZES, WorldSpec, build_world  # noqa: E402  (beside this file)

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
VARIANTS = {  # lmppo set-ups that change the models: their own rows, never in the matched comparison
    "lmppo-shared": {"models": {"value": {"mode": "shared"}}},  # value head on the policy's trunk
    "lmppo-lora": {
        "models": {
            "policy_lora": {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"},
            "value": {"lora": {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}},
        }
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    p.add_argument("--batch", type=int, default=16, help="prompts per PPO step")
    p.add_argument("--response-length", type=int, default=32, help="new tokens per response")
    p.add_argument("--epochs", type=int, default=4, help="PPO epochs per step (one minibatch each)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first in each repetition")
    p.add_argument("--repeats", type=int, default=2, help="repetitions per implementation, alternating")
    p.add_argument("--impls", default="lmppo,trl", help="lmppo and/or trl (trl is skipped if not installed)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="extra lmppo rows; '' for none")
    p.add_argument("--sweep", action="store_true", help="instead: generation scaling at the first size")
    p.add_argument(
        "--quickstart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time `lmppo quickstart` (the whole toy pipeline) end to end",
    )
    p.add_argument("--work-dir", default=".cache/bench", help="built models and run outputs")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one repetition of this impl
    p.add_argument("--size", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# FLOPs of one step (real tokens only; padding is waste, not work)
# --------------------------------------------------------------------------------------------------


def forward_flops(hidden: int, layers: int, vocab: int, seq_lengths: list[int], projected: int) -> float:
    """Forward FLOPs of a Llama (MLP 4 x hidden) over sequences, ``projected`` positions onto the vocabulary."""
    body = layers * (4 * hidden**2 + 3 * hidden * 4 * hidden)
    causal_attention = 2 * layers * hidden * sum(t * t for t in seq_lengths)  # QK^T and AV, lower triangle
    return 2.0 * body * sum(seq_lengths) + causal_attention + 2.0 * hidden * vocab * projected


def step_flops(
    spec: WorldSpec, prompt_lengths: list[int], response_length: int, epochs: int, impl: str = "lmppo"
) -> dict[str, float]:
    """FLOPs of a PPO step: generation, stored passes (reference, value, reward), training.

    Training is forward + backward (2 x forward) per trained network and epoch: the policy and the
    critic, or the policy alone with a shared trunk. LoRA's backward skips the frozen weights' gradients.
    """
    seqs = [q + response_length for q in prompt_lengths]
    responses = len(seqs) * response_length
    policy = forward_flops(spec.hidden, spec.layers, spec.vocab, seqs, responses)
    critic = forward_flops(spec.hidden, spec.layers, 0, seqs, 0)  # value and reward: same shape, scalar head
    trained = policy if impl == "lmppo-shared" else policy + critic
    per_epoch = (2 if impl == "lmppo-lora" else 3) * trained
    return {"generation": policy, "stored": policy + 2 * critic, "train": epochs * per_epoch}


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
        choose = phase if callable(phase) else (lambda *a, **k: phase)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = choose(*args, **kwargs)
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


def lmppo_worker(args, world: Path, clock: PhaseClock) -> tuple[list[float], list[dict], list[int], int]:
    import torch

    from lmppo import trainer as trainer_module
    from lmppo.build import load_models
    from lmppo.config import load_config
    from lmppo.data import load_prompts
    from lmppo.distributed import seed_everything

    cfg = load_config(
        base=merged(
            {
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
                    "minibatch_size": args.batch,
                    "vf_coef": MATCHED["vf_coef"],
                    "lr": MATCHED["lr"],
                },
                "kl": {"beta": MATCHED["kl_coef"], "estimator": "k1"},
                "run": {"seed": MATCHED["seed"], "device": "cpu", "steps": args.warmup + args.steps},
            },
            VARIANTS.get(args.worker, {}),
        )
    )
    seed_everything(cfg.run.seed)
    models = load_models(cfg, torch.device("cpu"))
    trainer = trainer_module.PPOTrainer(cfg, models, load_prompts(cfg.data.prompts))

    prompt_lengths: list[int] = []
    generate = trainer.generator.generate

    def generate_and_count(prompts, policy_version):
        rollout = generate(prompts, policy_version)
        prompt_lengths.extend(rollout.query_mask.sum(1).tolist())
        return rollout

    trainer.generator.generate = clock.wrap("generation", generate_and_count)
    trainer_module.sequence_logprobs = clock.wrap("logprobs", trainer_module.sequence_logprobs)
    trainer_module.value_predictions = clock.wrap("values", trainer_module.value_predictions)
    # the variant rows (LoRA reference, shared trunk) go through these same functions
    trainer.models.reward = clock.wrap("scoring", trainer.models.reward)
    trainer.micro_batch_loss = clock.wrap("update_forward", trainer.micro_batch_loss)
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)
    trainer.optimizer.step = clock.wrap("optimizer", trainer.optimizer.step)

    step_seconds, phases = [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        trainer.step()
        step_seconds.append(time.perf_counter() - start)
        phases.append(clock.take())
    return step_seconds, phases, prompt_lengths, sum(p.numel() for p in models.policy.parameters())


def trl_worker(args, world: Path, clock: PhaseClock) -> tuple[list[float], list[dict], list[int], int]:
    import gc

    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    policy = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(
        world / "reward", num_labels=1, dtype=torch.float32
    )
    value = AutoModelForSequenceClassification.from_pretrained(
        world / "reward", num_labels=1, dtype=torch.float32
    )
    prompts = Dataset.from_dict({"input_ids": json.loads((world / "prompt_ids.json").read_text())})

    prompt_lengths: list[int] = []
    generate = ppo_module.batch_generation

    def generate_and_count(model, queries, *a, **k):
        prompt_lengths.extend((queries != tokenizer.pad_token_id).sum(1).tolist())
        return generate(model, queries, *a, **k)

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
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=args.epochs,
        total_episodes=args.batch * steps,
        local_rollout_forward_batch_size=args.batch,
        response_length=args.response_length,
        stop_token=None,
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
        train_dataset=prompts,
        eval_dataset=prompts.select(range(8)),
        callbacks=[StepClock()],
    )
    trainer.accelerator.backward = clock.wrap("backward", trainer.accelerator.backward)
    trainer.optimizer.step = clock.wrap("optimizer", trainer.optimizer.step)
    trainer.train()
    return step_seconds, phases, prompt_lengths, sum(p.numel() for p in policy.parameters())


def run_worker(args) -> None:
    import resource

    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = WorldSpec(*SIZES[args.size])
    world = build_world(spec, Path(args.work_dir) / "models" / spec.name)
    peak = matmul_peak_gflops()
    load_before = os.getloadavg()[0]
    worker = trl_worker if args.worker == "trl" else lmppo_worker
    step_seconds, phases, prompt_lengths, params = worker(args, world, PhaseClock())
    peak = max(peak, matmul_peak_gflops())  # best of before and after: other processes only lower it
    timed = slice(args.warmup, None)
    per_step = {p: statistics.fmean(s.get(p, 0.0) for s in phases[timed]) for p in PHASES if p != "other"}
    per_step["other"] = statistics.fmean(step_seconds[timed]) - sum(per_step.values())
    timed_prompts = prompt_lengths[args.warmup * args.batch :]
    flops = step_flops(spec, timed_prompts, args.response_length, args.epochs, args.worker)
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
                "matmul_peak_gflops": peak,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "load": [load_before, os.getloadavg()[0]],
                "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            }
        )
    )


# --------------------------------------------------------------------------------------------------
# Orchestration: alternate implementations, aggregate, print
# --------------------------------------------------------------------------------------------------


def spawn(args, impl: str, size: str, batch: int, length: int) -> dict:
    command = [
        sys.executable,
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
        str(args.epochs),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--work-dir",
        args.work_dir,
    ]
    # PASSIVE: idle OpenMP threads sleep instead of spinning. On a machine shared with other jobs a
    # spinning team waits for a descheduled thread at every op (20x slower measured here); both
    # implementations get the same setting. Set OMP_WAIT_POLICY yourself to override it.
    env = {
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
    if done.returncode != 0:
        sys.exit(f"{impl} worker failed ({size}, batch {batch}, length {length}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], batch: int, length: int) -> dict:
    """One implementation at one size: medians over every timed step of every repetition."""
    steps = [s for r in runs for s in r["step_seconds"]]
    phases = {p: statistics.fmean(r["phase_seconds"][p] for r in runs) for p in PHASES}
    update_s = phases["update_forward"] + phases["backward"] + phases["optimizer"]
    flops = runs[0]["flops"]
    peak = statistics.median(r["matmul_peak_gflops"] for r in runs)
    train_gflops = flops["train"] / update_s / 1e9
    step_s = statistics.median(steps)
    return {
        "seconds_per_step": round(step_s, 4),
        "seconds_per_step_min_max": [round(min(steps), 4), round(max(steps), 4)],
        "tokens_per_second": round(batch * length / step_s, 1),
        "generation_tokens_per_second": round(batch * length / phases["generation"], 1),
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
    }


def compare(args, impls: list[str], size: str, batch: int, length: int) -> dict:
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for repeat in range(args.repeats):
        order = impls if repeat % 2 == 0 else impls[::-1]  # alternate who goes first
        for impl in order:
            runs[impl].append(spawn(args, impl, size, batch, length))
            print(
                f"  {size} b{batch} r{length} {impl} #{repeat + 1}: "
                f"{statistics.median(runs[impl][-1]['step_seconds']):.3f} s/step",
                file=sys.stderr,
                flush=True,
            )
    result = {impl: summarise(r, batch, length) for impl, r in runs.items()}
    if "trl" in result and "lmppo" in result:
        result["speedup"] = round(result["trl"]["seconds_per_step"] / result["lmppo"]["seconds_per_step"], 2)
        result["generation_speedup"] = round(
            result["lmppo"]["generation_tokens_per_second"] / result["trl"]["generation_tokens_per_second"], 2
        )
    return result


def print_table(results: dict[str, dict]) -> None:
    """One row per size and implementation; variants (changed model set-ups) have no ratio to TRL."""
    head = (
        f"{'size':<8} {'impl':<12} {'s/step':>7} {'x TRL':>6} {'floor s':>7} {'/floor':>6} {'1st step':>8} "
        f"{'tok/s':>6} {'gen tok/s':>9} {'train GF/s':>10} {'%peak':>5} {'RSS MB':>7} | "
        + " ".join(f"{p[:7]:>7}" for p in PHASES)
    )
    print(head)
    print("-" * len(head))
    for size, result in results.items():
        for impl, r in result.items():
            if not isinstance(r, dict):
                continue
            speedup = f"{result['speedup']:.2f}" if impl == "lmppo" and "speedup" in result else ""
            print(
                f"{size:<8} {impl:<12} {r['seconds_per_step']:>7.3f} {speedup:>6} {r['flop_floor_s']:>7.2f} "
                f"{r['step_over_floor']:>6.2f} {r['first_step_seconds']:>8.2f} {r['tokens_per_second']:>6.0f} "
                f"{r['generation_tokens_per_second']:>9.0f} {r['train_gflops']:>10.1f} "
                f"{100 * r['train_peak_fraction']:>5.0f} {r['peak_rss_mb']:>7.0f} | "
                + " ".join(f"{r['phase_seconds'][p]:>7.3f}" for p in PHASES)
            )


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


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    impls = [i for i in args.impls.split(",") if i == "lmppo" or importlib.util.find_spec("trl") is not None]
    variants = [v for v in args.variants.split(",") if v]
    for size in args.sizes.split(","):  # build before timing anything
        build_world(WorldSpec(*SIZES[size]), Path(args.work_dir) / "models" / WorldSpec(*SIZES[size]).name)
    started = time.time()
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "settings": {
            "batch": args.batch,
            "response_length": args.response_length,
            "epochs": args.epochs,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            **MATCHED,
        },
        "impls": impls,
        "variants": variants,
    }
    if args.sweep:
        report["sweep"] = sweep(args, impls)  # the matched set-up only
    else:
        report["results"] = {
            size: compare(args, impls + variants, size, args.batch, args.response_length)
            for size in args.sizes.split(",")
        }
        print_table(report["results"])
    if args.quickstart and not args.sweep:
        report["quickstart"] = time_quickstart(args)
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
