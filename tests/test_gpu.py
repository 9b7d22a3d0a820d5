"""The paths only a GPU exercises: bf16 autocast with fp32 master weights on CUDA, generation on a static
cache, the memory plan against ``max_memory_allocated``, bit-exact resume with deterministic kernels, and
``lmppo eval`` on the device. Skipped without a CUDA device; ``benchmarks/gpu_check.sh`` runs them.

SmolLM2-135M-Instruct here has its real tokenizer, chat template and shapes but random weights, made on the
device (benchmarks/random_models.py): an offline GPU machine cannot take the 93 MB GGUF along. Set
``LMPPO_GPU_TESTS_DEVICE=cpu`` to run the same checks on the CPU (slowly) before a GPU session.
"""

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import comparable, run_cli, write_config

from lmppo.inputs.config import load_config
from lmppo.inputs.data import load_prompts
from lmppo.inputs.resolve import resolve
from lmppo.runs.build import build_trainer, load_models
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.training.metrics import read_metrics
from lmppo.training.trainer import PPOTrainer

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("LMPPO_GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def smollm2_config(tmp_path_factory):
    """examples/smollm2/ppo_judge.yaml (LoRA, critic head on the trunk) in bf16, seconds per step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from random_models import make

    here = tmp_path_factory.mktemp("gpu")
    model_dir = make("smollm2-135m", here / "smollm2", device=DEVICE, dtype="bfloat16")
    return load_config(
        ROOT / "examples/smollm2/ppo_judge.yaml",
        [
            f"models.policy.path={model_dir}",
            "data.eval_prompts=null",
            "rollout.batch_size=8",
            "rollout.max_new_tokens=32",
            "ppo.minibatch_size=4",
            f"run.device={DEVICE}",
            "run.precision=bf16",
            f"run.output_dir={here / 'run'}",
        ],
    )


def trainer_for(cfg) -> PPOTrainer:
    """The example's own training prompts: its judge scores only those."""
    spec = resolve(cfg, device=DEVICE)
    return build_trainer(cfg, spec, load_models(cfg, spec), load_prompts(cfg.data.prompts))


def test_a_bf16_step_computes_in_bf16_and_keeps_fp32_masters(smollm2_config):
    trainer = trainer_for(smollm2_config)
    models = trainer.models
    assert trainer.precision == "bf16"
    with trainer.autocast():
        logits = models.policy(torch.tensor([[1, 2, 3]], device=DEVICE)).logits
    assert logits.dtype == torch.bfloat16  # the matrix products ran in bf16
    metrics = trainer.step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # The first ratio is 1 up to the bf16 difference between the decode loop and the update's forward.
    assert metrics["engine/logp_gap"] < 0.05 and abs(metrics["policy/ratio_mean"] - 1) < 0.05
    trained = {p.dtype for p in models.policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in models.policy.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}  # LoRA adapters fp32 on a 16-bit base
    print(f"\nbf16 engine/logp_gap {metrics['engine/logp_gap']:.4f}, step {metrics['perf/step_s']:.2f} s")


def test_generation_on_a_static_cache_ends_each_mask_at_the_first_eos(smollm2_config):
    trainer = trainer_for(smollm2_config)
    models = trainer.models
    torch.manual_seed(0)
    with trainer.autocast():
        rollout = trainer.sampler.collect(trainer.policy_version)
    assert rollout.response_ids.device.type == DEVICE and rollout.logp_old.dtype == torch.float32
    mask = rollout.response_mask.bool()
    assert (
        mask[:, 0].all()
        and torch.isfinite(rollout.logp_old[mask]).all()
        and (rollout.logp_old[mask] <= 0).all()
    )
    # the mask ends at the first EOS (pad == EOS for SmolLM2): nothing after it counts
    eos = models.tokenizer.eos_token_id
    for ids, row_mask, ended in zip(rollout.response_ids, mask, rollout.terminated):
        n = int(row_mask.sum())
        assert (ids[n - 1] == eos) == bool(ended) and not row_mask[n:].any()
        assert ended or n == smollm2_config.rollout.max_new_tokens


@pytest.mark.skipif(DEVICE != "cuda", reason="max_memory_allocated is CUDA's")
def test_the_plan_is_within_25_percent_of_max_memory_allocated(smollm2_config):
    from lmppo.runs.plan import CUDA_CONTEXT_BYTES, memory_plan

    plan = memory_plan(smollm2_config)
    gc.collect()  # the earlier tests' models, so that the peak is this step's alone
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer_for(smollm2_config).step()
    measured = torch.cuda.max_memory_allocated()
    planned = plan.peak - CUDA_CONTEXT_BYTES  # the context is outside torch's allocator
    print(f"\nplan {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert abs(planned / measured - 1) < 0.25


@pytest.fixture
def deterministic(monkeypatch):
    """Bit-exact runs on a GPU need deterministic kernels (atomic adds make some backward passes differ
    from run to run). An op without a deterministic kernel warns (its name) instead of failing the run."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_exact_resume_in_bf16(run_files, deterministic):
    straight = write_config(
        run_files,
        run={
            "steps": 4,
            "output_dir": str(run_files.parent / "straight"),
            "device": DEVICE,
            "precision": "bf16",
        },
    )
    assert run_cli("ppo", str(straight)) == 0
    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    assert run_cli("ppo", str(split)) == 0
    assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0
    a, b = run_files.parent / "straight", run_files.parent / "split"
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    ta, tb = (load_checkpoint(latest_checkpoint(d)).tensors["policy"] for d in (a, b))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_lmppo_eval_runs_on_the_device(run_files):
    config = yaml.safe_load(run_files.read_text())
    config["data"]["eval_prompts"] = config["data"]["prompts"]
    config["run"].update(device=DEVICE, precision="bf16")
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    assert run_cli("eval", str(run_files.parent / "run")) == 0
    if DEVICE == "cuda":
        assert torch.cuda.max_memory_allocated() > 0  # the policies and their samples lived on the GPU
    record = json.loads((run_files.parent / "run" / "eval.json").read_text())
    assert all(
        torch.isfinite(torch.tensor(value))
        for policy in record["policies"].values()
        for value in policy["metrics"].values()
    )


# --------------------------------------------------------------------------------------------------
# The memory ladder on the device: quantized frozen models, QLoRA, offloaded frozen models
# --------------------------------------------------------------------------------------------------


def ladder_step(smollm2_config, *overrides: str) -> tuple[dict, int]:
    """One step of the example with ``overrides``: its metrics and the peak bytes torch allocated."""
    cfg = load_config(base=smollm2_config.model_dump(mode="json"), overrides=list(overrides))
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    metrics = trainer_for(cfg).step()
    return metrics, torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_qlora_steps_on_a_quantized_base_and_the_reference_is_that_base(smollm2_config, scheme):
    pytest.importorskip("torchao")
    metrics, peak = ladder_step(smollm2_config, f"models.policy.quantize={scheme}")
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # the policy starts as the quantized base it is compared with: no quantization error in the KL
    assert abs(metrics["kl/ref"]) < 0.05 and metrics["engine/logp_gap"] < 0.05
    print(f"\nQLoRA {scheme}: step {metrics['perf/step_s']:.2f} s, peak {peak / 2**20:.0f} MiB")


@pytest.mark.parametrize("how", ["model", "layers"])
def test_an_offloaded_reference_gives_the_resident_ones_log_probs(smollm2_config, how):
    """The reference as its own model (the policy's weights), resident or offloaded: the same KL, and
    its weights off the device between passes."""
    if DEVICE != "cuda":
        pytest.skip("offloading is for a CUDA device")
    own = [f"models.reference.path={smollm2_config.models.policy.path}", "models.reference.dtype=bfloat16"]
    resident, resident_peak = ladder_step(smollm2_config, *own)
    offloaded, offloaded_peak = ladder_step(smollm2_config, *own, f"models.reference.offload={how}")
    assert offloaded["kl/ref"] == pytest.approx(resident["kl/ref"], abs=1e-3)
    assert offloaded_peak <= resident_peak
    print(
        f"\noffload={how}: peak {offloaded_peak / 2**20:.0f} MiB against {resident_peak / 2**20:.0f} MiB "
        f"resident; reference pass {offloaded['perf/reference_s']:.3f} s against {resident['perf/reference_s']:.3f} s"
    )
