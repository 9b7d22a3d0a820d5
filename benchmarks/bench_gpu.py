"""PPO steps on a GPU, per model and precision: step time, generation and update tokens/s, the model FLOP
rate they achieve against the GPU's bf16 matrix-product rate measured in this process, and peak
``max_memory_allocated`` against ``lmppo plan``. Models are random with real shapes (random_models.py):
SmolLM2-135M (LoRA, critic head on the trunk), a 1.07B and a 3B Llama (full policy, gradient
checkpointing; a separate critic where the plan fits one), the SmolLM2 and 1B rows with ``run.compile``
(``first_step_s`` holds the compile), then the memory ladder's rows: the 1B's reference in int8, in nf4
and offloaded, the 1B's 24 GB config, SmolLM2 as QLoRA on an nf4 base, and SmolLM2 under a 2 GiB cap
that runs it out of memory on purpose (the recovery's retries and the budgets it settles on). Each row is
its own ``lmppo ppo`` process, stopped once its steps are logged (no end-of-run checkpoint to write).

    python benchmarks/bench_gpu.py --deadline-s 180        # on the GPU (benchmarks/gpu_check.sh runs it)
    python benchmarks/bench_gpu.py --dry-run               # anywhere: every row's plan for a 139 GiB GPU

Rows run in order of value and a row that would overrun the deadline is skipped, so a cut-off run keeps
every row it finished: ``gpu_bench.md`` (the table) and ``gpu_bench.jsonl`` (one JSON line per row) in
--out are rewritten after each row. Models and runs go to --work (gigabytes; each row's log beside its run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from random_models import make  # noqa: E402


@dataclass(frozen=True)
class Row:
    shape: str
    precision: str
    config: str
    overrides: tuple[str, ...] = ()  # "{model}" stands for the row's model directory
    label: str = ""  # what the overrides change, in the row's name
    memory_gib: float | None = None  # the run's CUDA allocations capped here: out-of-memory on purpose

    @property
    def name(self) -> str:
        return " ".join(filter(None, [self.shape, self.precision, self.label]))


LLAMA = "examples/llama_1b/ppo.yaml"
SMOLLM2 = "examples/smollm2/ppo_judge.yaml"
# the 1B's reference as a model of its own, to quantize or offload
REFERENCE = "models.reference.path={model}"
# Most informative first: the bf16 rows our users run, then the memory ladder against the 1B bf16 row (the
# model exists by then: a row costs its steps), then the 3B, then fp32 for the ratio.
ROWS = [
    Row("smollm2-135m", "bf16", SMOLLM2),
    Row("llama-1b", "bf16", LLAMA),
    # run.compile against the two rows above: steady step and, in first_step_s, the compile
    Row("smollm2-135m", "bf16", SMOLLM2, ("run.compile=true",), "compiled"),
    Row("llama-1b", "bf16", LLAMA, ("run.compile=true",), "compiled"),
    Row("llama-1b", "bf16", LLAMA, (REFERENCE, "models.reference.quantize=int8"), "int8 ref"),
    Row("llama-1b", "bf16", LLAMA, (REFERENCE, "models.reference.quantize=nf4"), "nf4 ref"),
    Row("llama-1b", "bf16", LLAMA, (REFERENCE, "models.reference.offload=model"), "offload ref"),
    Row("llama-1b", "bf16", "examples/llama_1b/ppo_24gb.yaml", (REFERENCE,), "24 GB config"),
    Row("smollm2-135m", "bf16", SMOLLM2, ("models.policy.quantize=nf4",), "QLoRA nf4"),
    # planned at 4 GiB (stored passes 1.9, update 3.2): both run out under 2 GiB, halve and are redone
    Row("smollm2-135m", "bf16", SMOLLM2, (), "OOM recovery, 2 GiB cap", memory_gib=2.0),
    Row("llama-3b", "bf16", LLAMA),
    Row("smollm2-135m", "fp32", SMOLLM2),
    Row("llama-1b", "fp32", LLAMA),
]


def row_config(row: Row, model_dir: Path, args, output_dir: Path) -> list[str]:
    return [
        f"models.policy.path={model_dir}",
        *(override.format(model=model_dir) for override in row.overrides),
        f"run.device={args.device}",
        f"run.precision={row.precision}",
        f"run.steps={args.steps}",
        f"run.output_dir={output_dir}",
        "run.checkpoint_every=0",
        "run.eval_every=0",  # training steps only: no held-out evaluation, no reward pre-flight
        "diagnosis.preflight_batches=0",
        "guards.enabled=false",  # random weights: the rules would only stop a measurement
        f"rollout.batch_size={args.rows}",
        f"rollout.max_new_tokens={args.tokens}",
        f"ppo.minibatch_size={max(args.rows // 2, 1)}",
        "data.eval_prompts=null",
        "reward.missing_eos_penalty=null",
    ]


def flops_per_token(cfg, n_params: dict[str, int]) -> tuple[float, float]:
    """Model FLOPs per generated token (forward, 2N) and per response token of the update (forward 2N and
    backward 4N per fully trained network, 2N through a LoRA-adapted one; recompute under gradient
    checkpointing and prompt tokens not counted: a lower bound)."""
    policy = n_params["policy"]
    backward = 2 if cfg.models.policy_lora.enabled else 4
    update = (2 + backward) * policy
    if cfg.models.value.mode == "separate":
        update += 6 * n_params["value"]
    return 2.0 * policy, float(update)


def parameter_counts(cfg) -> dict[str, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def count(path: str) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        return sum(p.numel() for p in model.parameters())

    policy = count(cfg.models.policy.path)
    return {"policy": policy, "value": policy}  # the benchmark's critics start from the policy


def matmul_tflops(device: str) -> float | None:
    """The device's bf16 rate on an 8192-cube product (mean of 10 after 3 warm-ups), in this process."""
    import torch

    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def run_steps(command: list[str], metrics_file: Path, steps: int, timeout: float) -> str | None:
    """Run ``lmppo ppo`` until ``steps`` steps are logged, then stop it; the error's last line if it failed."""
    log = metrics_file.parent.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            if metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= steps:
                break
            time.sleep(0.5)
        finished = process.poll() is not None
        process.kill()
        process.wait()
    logged = len(metrics_file.read_text().splitlines()) if metrics_file.is_file() else 0
    if logged >= steps:
        return None
    lines = log.read_text().strip().splitlines() or ["no output"]
    return lines[-1][:300] if finished else f"timed out after {logged} of {steps} steps"


def summarise(records: list[dict], cfg, n_params, plan_bytes: int, peak_tflops) -> dict:
    from lmppo.runs.plan import CUDA_CONTEXT_BYTES

    timed = records[1:] or records  # the first step carries warm-up (kernels, allocator, caches)
    median = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    gen_flops, update_flops = flops_per_token(cfg, n_params)
    gen_tps, update_tps = median("perf/rollout_tokens_per_s"), median("perf/train_tokens_per_s")
    gpu = "perf/peak_gpu_mb" in records[-1]
    measured = max(r["perf/peak_gpu_mb" if gpu else "perf/peak_rss_mb"] for r in records)
    planned = (plan_bytes - (CUDA_CONTEXT_BYTES if gpu else 0)) / 2**20
    result = {
        "params_m": round(n_params["policy"] / 1e6),
        "step_s": round(median("perf/step_s"), 2),
        "first_step_s": round(records[0]["perf/step_s"], 2),  # warm-up: with run.compile, the compile
        "rollout_s": round(median("perf/rollout_s"), 2),
        "update_s": round(median("perf/update_s"), 2),
        "gen_tokens_per_s": round(gen_tps),
        "update_tokens_per_s": round(update_tps),
        "gen_tflops": float(f"{gen_flops * gen_tps / 1e12:.3g}"),
        "update_tflops": float(f"{update_flops * update_tps / 1e12:.3g}"),
        "engine_logp_gap": round(records[0]["engine/logp_gap"], 5),
        "peak_mb": round(measured),
        "plan_mb": round(planned),
        "plan_error": round(planned / measured - 1, 3),
    }
    retries = sum(r.get("perf/oom_retries", 0) for r in records)
    if retries:  # the budgets out-of-memory errors halved, as the last step ran
        budgets = {k.removeprefix("perf/"): v for k, v in records[-1].items() if k.endswith("_batch_tokens")}
        result |= {"oom_retries": int(retries), "budgets": budgets}
    if peak_tflops:
        result["update_mfu"] = float(f"{result['update_tflops'] / peak_tflops:.3g}")
    return result


def table(results: dict, device_name: str, peak_tflops) -> str:
    peak = f"{peak_tflops:.0f}" if peak_tflops else "n/a"
    lines = [
        f"{device_name}, bf16 matmul {peak} TFLOP/s measured in-process",
        "",
        "| row | step s | rollout s | update s | gen tok/s | gen TFLOP/s | update tok/s | update TFLOP/s "
        "| peak MiB | plan MiB | plan error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |")
            continue
        retried = f"; {r['oom_retries']} OOM retries → {r['budgets']}" if "oom_retries" in r else ""
        lines.append(
            f"| {name} ({r['params_m']}M{retried}) | {r['step_s']} | {r['rollout_s']} | {r['update_s']} "
            f"| {r['gen_tokens_per_s']} | {r['gen_tflops']} | {r['update_tokens_per_s']} | {r['update_tflops']} "
            f"| {r['peak_mb']} | {r['plan_mb']} | {r['plan_error']:+.0%} |"
        )
    return "\n".join(lines) + "\n"


def dry_run(args) -> None:
    """Each row's config and memory plan for a 139 GiB GPU, from config-only models: no GPU needed."""
    from lmppo.inputs.config import load_config
    from lmppo.runs.plan import memory_plan

    for row in ROWS:
        model_dir = make(row.shape, args.work / "models" / f"{row.shape}-config", config_only=True)
        cfg = load_config(ROOT / row.config, row_config(row, model_dir, args, args.work / "runs" / "dry"))
        plan = memory_plan(cfg, available=139 * 2**30, world_size=1, device="cuda")
        fits = "fits" if plan.fits else "does NOT fit"
        print(f"  {row.name:>20}: plan {plan.peak / 2**30:.1f} GiB of 139 GiB, {fits}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows-only", nargs="+", help="row names to run, e.g. 'llama-1b bf16'")
    parser.add_argument("--steps", type=int, default=3, help="per row; the first is warm-up")
    parser.add_argument("--rows", type=int, default=32, help="prompts per step")
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens")
    parser.add_argument("--deadline-s", type=float, default=180, help="stop starting rows after this")
    parser.add_argument("--out", type=Path, default=Path("gpu-out"))
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/lmppo-gpu"), help="random models and the rows' runs (large)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print each row's plan, run nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        return dry_run(args)
    started = time.monotonic()

    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak_tflops = matmul_tflops(args.device)
    print(f"[bench] {device_name}: bf16 matmul {peak_tflops or 0:.0f} TFLOP/s", flush=True)
    results: dict[str, dict] = {}
    seconds_per_shape: dict[str, float] = {}
    for row in ROWS:
        if args.rows_only and row.name not in args.rows_only:
            continue
        left = args.deadline_s - (time.monotonic() - started)
        # a shape measured before takes about as long again (its model exists by then); else the longest row
        if left < seconds_per_shape.get(row.shape, max(seconds_per_shape.values(), default=30)):
            results[row.name] = {"error": f"skipped: {left:.0f} s left before the deadline"}
            print(f"[bench] {row.name}: skipped ({left:.0f} s left)", flush=True)
            continue
        row_start = time.monotonic()
        results[row.name] = run_row(row, args, peak_tflops, timeout=left)
        seconds_per_shape[row.shape] = time.monotonic() - row_start
        print(
            f"[bench] {row.name}: {seconds_per_shape[row.shape]:.0f} s {json.dumps(results[row.name])}",
            flush=True,
        )
        write_results(args, results, device_name, peak_tflops)
    print(table(results, device_name, peak_tflops), flush=True)
    print(json.dumps(report(args, results, device_name, peak_tflops)))


# `lmppo` with this process's CUDA allocations capped at argv[1] GiB (torch raises OutOfMemoryError past it)
CAPPED = (
    "import sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv.pop(1)) * 2**30 / "
    "torch.cuda.get_device_properties(0).total_memory); sys.argv[0] = 'lmppo'; "
    "from lmppo.interface.cli import main; main()"
)


def run_row(row: Row, args, peak_tflops: float | None, timeout: float) -> dict:
    """One row: its random model (made once per shape), its plan, then `lmppo ppo` until its steps are
    logged; the figures, or the error."""
    import torch

    from lmppo.inputs.config import load_config
    from lmppo.runs.plan import memory_plan
    from lmppo.training.metrics import read_metrics

    if row.memory_gib is not None and args.device != "cuda":
        return {"error": "skipped: the memory cap is a CUDA allocator's"}
    model_dir = args.work / "models" / row.shape
    output_dir = args.work / "runs" / row.name.replace(" ", "-")
    overrides = row_config(row, model_dir, args, output_dir)
    if not list(model_dir.glob("*.safetensors")):
        make(row.shape, model_dir, config_only=True)
    cfg = load_config(ROOT / row.config, overrides)
    # Planned before any weights exist here: on CPU the plan counts this process's resident memory as
    # the run's baseline, as `lmppo ppo` does at its start.
    plan = memory_plan(cfg)
    if not list(model_dir.glob("*.safetensors")):
        # bf16 files halve the 3B's write on a GPU; fp32 on CPU, as real checkpoints are (the mapped
        # file counts in the peak RSS the plan is checked against there)
        make(
            row.shape, model_dir, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32"
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the child process needs the memory the model took here
    lmppo = (
        [sys.executable, "-m", "lmppo"]
        if row.memory_gib is None
        else [sys.executable, "-c", CAPPED, str(row.memory_gib)]
    )
    command = [*lmppo, "ppo", str(ROOT / row.config), *overrides, "--quiet", "--force"]
    error = run_steps(command, output_dir / "metrics.jsonl", args.steps, timeout=timeout)
    if error:
        return {"error": error}
    return summarise(read_metrics(output_dir), cfg, parameter_counts(cfg), plan.peak, peak_tflops)


def report(args, results: dict, device_name: str, peak_tflops) -> dict:
    return {
        "device": device_name,
        "matmul_tflops": peak_tflops,
        "rows": args.rows,
        "new_tokens": args.tokens,
        "steps": args.steps,
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }


def write_results(args, results: dict, device_name: str, peak_tflops) -> None:
    """The table and one JSON line per row so far, rewritten after each row: a cut-off run keeps them."""
    (args.out / "gpu_bench.md").write_text(table(results, device_name, peak_tflops))
    common = {k: v for k, v in report(args, results, device_name, peak_tflops).items() if k != "results"}
    lines = [json.dumps({**common, "row": name, **result}) for name, result in results.items()]
    (args.out / "gpu_bench.jsonl").write_text("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main()
