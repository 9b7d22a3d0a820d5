"""The CUDA path: a bf16 SmolLM2 LoRA PPO step, generation on a static cache, exact resume, and the memory
plan against ``max_memory_allocated``. Skipped without a CUDA device; ``benchmarks/gpu_check.sh`` runs them."""

import json

import pytest
import torch
from helpers import comparable, run_cli, write_config
from test_smollm2 import CACHE_DIR, smollm2_gguf

from lmppo.build import load_models
from lmppo.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.config import load_config
from lmppo.metrics import read_metrics
from lmppo.models import cache_gguf_as_transformers
from lmppo.trainer import PPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = CACHE_DIR.parents[2]
PROMPTS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three."]


@pytest.fixture(scope="module")
def smollm2_config(tmp_path_factory):
    """examples/smollm2/ppo_judge.yaml on the GPU in bf16, small enough for seconds per step."""
    cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)
    here = tmp_path_factory.mktemp("gpu")
    (here / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    return load_config(
        ROOT / "examples/smollm2/ppo_judge.yaml",
        [
            f"models.policy.path={CACHE_DIR}",
            f"data.prompts={here / 'prompts.jsonl'}",
            "data.eval_prompts=null",
            "rollout.batch_size=8",
            "rollout.max_new_tokens=32",
            "ppo.minibatch_size=4",
            "run.device=cuda",
            "run.precision=bf16",
            f"run.output_dir={here / 'run'}",
        ],
    )


def test_a_bf16_smollm2_lora_step_on_cuda(smollm2_config):
    models = load_models(smollm2_config, torch.device("cuda"))
    trainer = PPOTrainer(smollm2_config, models, PROMPTS * 2)
    assert trainer.precision == "bf16"
    metrics = trainer.step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # The first ratio is 1 up to the bf16 difference between the decode loop and the update's forward.
    assert metrics["engine/logp_gap"] < 0.05 and abs(metrics["policy/ratio_mean"] - 1) < 0.05
    assert {p.dtype for p in models.policy.parameters() if p.requires_grad} == {torch.float32}
    print(
        f"\nbf16 engine/logp_gap {metrics['engine/logp_gap']:.4f}, peak {metrics['perf/peak_gpu_mb']:.0f} MiB"
    )


def test_generation_on_a_static_cache_on_cuda(smollm2_config):
    models = load_models(smollm2_config, torch.device("cuda"))
    trainer = PPOTrainer(smollm2_config, models, PROMPTS * 2)
    torch.manual_seed(0)
    with trainer.autocast():
        rollout = trainer.collect_rollout()
    assert rollout.response_ids.is_cuda and rollout.logp_old.dtype == torch.float32
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


def test_the_plan_bounds_max_memory_allocated(smollm2_config):
    from lmppo.plan import CUDA_CONTEXT_BYTES, memory_plan

    plan = memory_plan(smollm2_config)
    torch.cuda.reset_peak_memory_stats()
    models = load_models(smollm2_config, torch.device("cuda"))
    PPOTrainer(smollm2_config, models, PROMPTS * 2).step()
    measured = torch.cuda.max_memory_allocated()
    planned = plan.peak - CUDA_CONTEXT_BYTES  # the context is outside torch's allocator
    print(f"\nplan {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert abs(planned / measured - 1) < 0.25


def test_exact_resume_on_cuda(run_files, monkeypatch):
    """Bit-exact resume on the GPU needs deterministic kernels (embedding backward uses atomics)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        straight = write_config(
            run_files,
            run={
                "steps": 4,
                "output_dir": str(run_files.parent / "straight"),
                "device": "cuda",
                "precision": "bf16",
            },
        )
        assert run_cli("ppo", str(straight)) == 0
        split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
        assert run_cli("ppo", str(split)) == 0
        assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0
    finally:
        torch.use_deterministic_algorithms(False)
    a, b = run_files.parent / "straight", run_files.parent / "split"
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    ta, tb = (load_checkpoint(latest_checkpoint(d)).tensors["policy"] for d in (a, b))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
