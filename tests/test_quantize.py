"""Quantized frozen models and QLoRA (lmppo.modeling.quantize): what is quantized and what is not, the plan's
bytes against the loaded models, a run with an int8 reference and reward model that resumes exactly, QLoRA's
export, and the combinations refused (offloading's GPU paths: tests/test_gpu.py)."""

import pytest
import torch
import yaml
from helpers import comparable, llama_config, run_cli, toy_models, write_config
from safetensors.torch import load_file
from transformers import LlamaForSequenceClassification

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.modeling.quantize import is_quantized, quantizable_linears, quantize, quantized_weight_bytes
from lmppo.runs.build import load_models
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.runs.plan import memory_plan, remedies
from lmppo.training.metrics import read_metrics

pytest.importorskip("torchao")


@pytest.fixture
def quantized_files(run_files):
    """run_files with a reward model of its own (the policy's tokenizer) beside the policy."""
    tokenizer = toy_models().tokenizer
    torch.manual_seed(3)
    LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1)).save_pretrained(
        run_files.parent / "rm"
    )
    tokenizer.save_pretrained(run_files.parent / "rm")
    return run_files


def frozen_pair(run_files, scheme="int8") -> list[str]:
    """Overrides: the reference a quantized copy of the policy, the reward its quantized reward model."""
    policy = run_files.parent / "policy"
    return [
        f"models.reference.path={policy}",
        f"models.reference.quantize={scheme}",
        f"reward.model.path={run_files.parent / 'rm'}",
        "reward.function=null",
        f"reward.model.quantize={scheme}",
    ]


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_the_decoder_linears_are_quantized_and_the_embeddings_and_heads_are_not(scheme):
    policy = toy_models().policy
    ids = torch.randint(0, policy.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = policy(ids).logits.log_softmax(-1)
        linears = quantizable_linears(policy)
        quantize(policy, scheme)
        after = policy(ids).logits.log_softmax(-1)
    assert len(linears) == 7 * policy.config.num_hidden_layers  # q, k, v, o, gate, up, down
    assert all(is_quantized(linear.weight) for _, linear in linears)
    assert not is_quantized(policy.lm_head.weight) and not is_quantized(policy.model.embed_tokens.weight)
    # the error is the quantization's, not a broken layer: small against the log-probs' own spread
    assert 0 < (after - before).abs().mean() < 0.05 * before.std()


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_the_plan_counts_the_quantized_bytes_the_loaded_models_hold(quantized_files, scheme):
    cfg = load_config(quantized_files, frozen_pair(quantized_files, scheme))
    rows = {row.role: row for row in memory_plan(cfg).models}
    models = load_models(cfg, resolve(cfg, device="cpu"))
    for role, model in (("reference", models.reference), ("reward", models.reward_models[0])):
        row = rows[role]
        held = quantized_weight_bytes(model)
        planned = row.quantized * {"int8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / 64**2}[scheme]
        assert held == pytest.approx(planned, rel=0.25)  # int8's per-row scales on tiny rows: the slack
        plain = sum(p.numel() * p.element_size() for p in model.parameters() if not is_quantized(p))
        assert row.stored_weights == pytest.approx(plain + planned, rel=0.01)
    assert rows["reference"].dtype == f"{scheme} + float32"


@pytest.mark.slow
def test_a_run_with_an_int8_reference_and_reward_model_resumes_exactly(quantized_files):
    sections = yaml.safe_load(write_config(quantized_files).read_text())
    cfg = load_config(quantized_files, frozen_pair(quantized_files))
    straight = write_config(
        quantized_files,
        models=cfg.models.model_dump(mode="json"),
        reward=cfg.reward.model_dump(mode="json"),
        run={**sections["run"], "steps": 4, "output_dir": str(quantized_files.parent / "straight")},
    )
    assert run_cli("ppo", str(straight)) == 0
    split = write_config(straight, run={"steps": 2, "output_dir": str(quantized_files.parent / "split")})
    assert run_cli("ppo", str(split)) == 0
    assert run_cli("ppo", "--resume", str(quantized_files.parent / "split"), "run.steps=4") == 0
    a, b = quantized_files.parent / "straight", quantized_files.parent / "split"
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    saved_a, saved_b = (load_checkpoint(latest_checkpoint(d)) for d in (a, b))
    assert all(
        torch.equal(saved_a.tensors["policy"][k], saved_b.tensors["policy"][k])
        for k in saved_a.tensors["policy"]
    )
    identities = saved_a.manifest["identities"]
    assert identities["reference"]["quantized"] == identities["reward"]["quantized"] == "int8"
    assert identities["policy"]["quantized"] is None
    first_step = next(r for r in read_metrics(a) if "kl/ref" in r)
    assert first_step["kl/ref"] != 0  # the int8 reference is not the policy: its error shows


@pytest.mark.slow
def test_qlora_trains_adapters_on_an_nf4_base_and_saves_the_unquantized_base_plus_the_update(run_files):
    overrides = ["models.policy.quantize=nf4", "models.policy_lora.enabled=true", "models.value.mode=shared"]
    cfg = load_config(run_files, overrides)
    models = load_models(cfg, resolve(cfg, device="cpu"))
    base = models.policy.get_base_model()
    assert is_quantized(base.model.layers[0].self_attn.q_proj.base_layer.weight)
    assert all(p.requires_grad == ("lora_" in n) for n, p in models.policy.named_parameters())
    assert run_cli("ppo", str(run_files), *overrides) == 0
    final = load_file(run_files.parent / "run" / "final" / "model.safetensors")
    start = load_file(run_files.parent / "policy" / "model.safetensors")
    assert final.keys() == start.keys() and all(t.dtype == torch.float32 for t in final.values())
    moved = [k for k in start if not torch.equal(final[k], start[k])]
    # the adapters' update on the base's own fp32 weights: only the adapted projections moved, and by
    # less than nf4's rounding would have moved every one of them
    assert moved and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in moved
    )


def test_the_lora_fold_is_skipped_on_a_quantized_base(run_files):
    from lmppo.modeling.lora import mergeable_lora_layers

    overrides = ["models.policy.quantize=int8", "models.policy_lora.enabled=true", "models.value.mode=shared"]
    cfg = load_config(run_files, overrides)
    models = load_models(cfg, resolve(cfg, device="cpu"))
    assert mergeable_lora_layers(models.policy) == []


@pytest.mark.parametrize(
    "overrides, world_size, named",
    [
        (["models.policy.quantize=int8"], 1, "models.policy_lora.enabled=true"),
        (["models.reference.path={policy}", "models.reference.offload=model"], 1, "this run is on cpu"),
        (["models.policy.offload=model"], 1, "offload the frozen models instead"),
        (
            ["models.policy.quantize=nf4", "models.policy_lora.enabled=true", "distributed.strategy=fsdp2"],
            2,
            "distributed.strategy=ddp",
        ),
        (["models.policy.quantize=nf4", "models.policy_lora.enabled=true"], 1, "models.value.mode=shared"),
    ],
    ids=[
        "trained-weights",
        "offload-on-cpu",
        "policy-offload",
        "fsdp2",
        "critic-copy",
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_key_and_the_fix(
    run_files, overrides, world_size, named
):
    cfg = load_config(run_files, [o.format(policy=run_files.parent / "policy") for o in overrides])
    with pytest.raises(LmppoError, match=named.replace(".", r"\.")):
        resolve(cfg, device="cpu", world_size=world_size)


def test_a_supervised_stage_refuses_a_quantized_model():
    from lmppo.inputs.config import SupervisedConfig

    with pytest.raises(ValueError, match="frozen models of a PPO run"):
        SupervisedConfig(model={"path": "m", "quantize": "int8"}, data="d.jsonl", output_dir="o")


def test_the_remedies_climb_the_seeds_ladder_in_order(quantized_files):
    cfg = load_config(
        quantized_files, [f"reward.model.path={quantized_files.parent / 'rm'}", "reward.function=null"]
    )
    plan = memory_plan(cfg, available=1, device="cuda")
    changes = [change for change, _ in remedies(cfg, plan)]
    ladder = [
        "ppo.advantage=reinforce_pp",
        "models.policy_lora.enabled=true",
        "reward.model.quantize=int8",
        "reward.model.offload=model",
    ]
    positions = [next(i for i, c in enumerate(changes) if c.startswith(rung)) for rung in ladder]
    assert positions == sorted(positions) == list(range(len(ladder)))  # the rungs first, in the seeds' order
    quantized = next(c for c in changes if c.startswith("reward.model.quantize"))
    assert "models.reference.quantize=int8" in quantized  # the frozen pair is one rung


def test_lmppo_eval_compares_the_unquantized_start_with_the_exported_policy(run_files):
    from lmppo.inputs.resolve import frozen_policy_source

    overrides = ["models.policy.quantize=nf4", "models.policy_lora.enabled=true", "models.value.mode=shared"]
    cfg = load_config(run_files, overrides)
    assert frozen_policy_source(cfg, resolve(cfg, device="cpu")).quantize is None


def test_an_offloaded_model_is_brought_over_for_the_block_and_its_host_weights_kept():
    """``on_device``'s bookkeeping on the CPU (offload itself pins memory: CUDA only, tests/test_gpu.py):
    the block runs on copies, and the host tensors are the model's weights again after it."""
    from lmppo.modeling.distributed import gathered

    policy = toy_models().policy
    host = {name: p.data_ptr() for name, p in policy.named_parameters()}
    policy._lmppo_offloaded = torch.device("cpu")  # what quantize.offload records
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad(), gathered(policy):
        inside = {name: p.data_ptr() for name, p in policy.named_parameters()}
        logits = policy(ids).logits
    assert all(inside[n] != host[n] for n in host)  # the block ran on copies
    assert all(p.data_ptr() == host[n] for n, p in policy.named_parameters())
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, logits)


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_the_backward_through_a_quantized_layer_keeps_the_quantized_weight_not_a_dequantized_copy(scheme):
    """LoRA's update on a quantized base: what autograd keeps per layer is the stored weight, and the
    input's gradient is that of the dequantized weight."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 128)).requires_grad_(False)
    quantize(layer, scheme)
    dense = layer[0].weight.dequantize() if scheme == "int8" else layer[0].weight.get_original_weight()
    saved = []
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).square().sum().backward()
    assert any(is_quantized(t) for t in saved)  # the weight as stored; no dense copy of its shape
    assert not any(not is_quantized(t) and t.shape == dense.shape for t in saved)
    expected = torch.autograd.grad(torch.nn.functional.linear(x, dense, layer[0].bias).square().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-5)
