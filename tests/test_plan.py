"""The memory plan: exact parameter counts, the seeds' bytes per parameter, what each option saves, the
refusal before a run that cannot fit (the plan against a run's measured peak: tests/test_bench.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from rich.console import Console

from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.runs import plan as plan_module
from lmppo.runs.build import load_models
from lmppo.runs.plan import memory_plan, plan_report, size


def rows_by_role(plan):
    return {row.role: row for row in plan.models}


def test_an_episode_budget_left_unset_is_refused_naming_the_two_keys_it_comes_from(run_files):
    """init's 32 new tokens x the default 4 turns fill the toy's 128-token window: the error says the budget
    was max_turns x max_new_tokens, not only the max_total_tokens the user never wrote."""
    from lmppo.errors import LmppoError

    environment = "rollout.environment=lmppo.sampling.environments:SingleTurn"
    with pytest.raises(
        LmppoError, match=r"(?s)max_total_tokens=128 leaves no room.*max_turns=4 x rollout.max_new"
    ):
        memory_plan(load_config(run_files, [environment, "rollout.max_new_tokens=32"]))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["models.policy_lora.enabled=true"],
        ["models.value.mode=shared"],
        ["models.value.lora.enabled=true"],
    ],
    ids=["full", "lora", "shared-critic", "lora-critic"],
)
def test_parameter_counts_are_those_of_the_loaded_models(run_files, overrides):
    cfg = load_config(run_files, overrides)
    rows = rows_by_role(memory_plan(cfg))
    models = load_models(cfg, resolve(cfg, device="cpu"))
    for role, module in (("policy", models.policy), ("value", models.value)):
        params = list(module.parameters())
        trained = sum(p.numel() for p in params if p.requires_grad)
        if role == "value" and cfg.models.value.mode == "shared":  # the head alone is the critic's own
            head = sum(p.numel() for p in module.head.parameters())
            assert rows[role].parameters == rows[role].trained == head
        else:
            assert (rows[role].parameters, rows[role].trained) == (sum(p.numel() for p in params), trained)


def test_bytes_per_parameter_follow_the_seeds(run_files):
    fp32 = rows_by_role(memory_plan(load_config(run_files)))
    assert fp32["policy"].total == 16 * fp32["policy"].parameters  # fp32 weight + grad + two Adam moments
    assert fp32["reference"].total == 4 * fp32["reference"].parameters
    bf16 = rows_by_role(memory_plan(load_config(run_files, ["run.precision=bf16"])))
    assert bf16["reference"].total == 2 * bf16["reference"].parameters  # frozen in bf16
    assert bf16["policy"].total == fp32["policy"].total  # trained weights stay fp32 masters
    lora = rows_by_role(memory_plan(load_config(run_files, ["models.policy_lora.enabled=true"])))["policy"]
    frozen = lora.parameters - lora.trained
    assert 0 < lora.trained < lora.parameters and lora.total == 4 * frozen + 16 * lora.trained


def test_each_memory_option_shrinks_its_phase(run_files):
    def phases(*overrides):
        return memory_plan(load_config(run_files, ["rollout.max_new_tokens=64", *overrides])).phases

    base = phases()
    assert phases("ppo.gradient_checkpointing=true")["update"] < base["update"]
    assert phases("ppo.micro_batch_tokens=40")["update"] < base["update"]
    assert phases("rollout.forward_batch_size=1")["stored passes"] < base["stored passes"]
    assert phases("rollout.forward_batch_tokens=40")["stored passes"] < base["stored passes"]
    assert phases("run.precision=bf16")["rollout"] < base["rollout"]  # a bf16 KV cache
    assert phases("rollout.max_new_tokens=100")["rollout"] > base["rollout"]


def test_a_rollout_engine_is_counted_in_every_phase_it_holds_memory(run_files):
    """vLLM on a GPU sleeps through the stored passes and the update when rollouts are synchronous; on CPU,
    or sampling the next batch (rollout.asynchronous), it holds its weights and KV cache in every phase.
    engine=hf with rollout.asynchronous holds a snapshot of the policy, and decodes during the update."""

    def plan(device, *overrides):
        cfg = load_config(run_files, ["run.precision=auto", *overrides])
        return memory_plan(cfg, device=device, available=2**50)

    for device in ("cpu", "cuda"):
        base = plan(device)
        policy = rows_by_role(base)["policy"]
        # rollout.vllm_kv_cache_gb=1 and its weights in the compute dtype (run.precision=auto: bf16 on a GPU)
        engine = 2**30 + policy.parameters * (4 if device == "cpu" else 2)
        vllm = plan(device, "rollout.engine=vllm")
        assert vllm.phases["rollout"] == engine
        stays = engine if device == "cpu" else 0
        for phase in ("stored passes", "update"):
            assert vllm.phases[phase] == base.phases[phase] + stays, (device, phase)
            overlapped = plan(device, "rollout.engine=vllm", "rollout.asynchronous=true")
            assert overlapped.phases[phase] == base.phases[phase] + engine, (device, phase)
        snapshot = plan(device, "rollout.asynchronous=true")
        assert snapshot.phases["rollout"] == base.phases["rollout"] + policy.stored_weights
        assert snapshot.phases["update"] == base.phases["update"] + snapshot.phases["rollout"]
        # the planned bytes, not the peak: the peak adds the process's measured memory, which drifts
        assert snapshot.needed_per_rank > base.needed_per_rank


@pytest.mark.parametrize("shard_frozen", [True, False])
def test_fsdp2_splits_what_each_rank_holds_and_adds_what_it_gathers(run_files, shard_frozen):
    def plan(*overrides):
        return memory_plan(load_config(run_files, list(overrides)), world_size=2)

    ddp = plan()
    fsdp2 = plan("distributed.strategy=fsdp2", f"distributed.shard_frozen={str(shard_frozen).lower()}")
    rows, whole = rows_by_role(fsdp2), rows_by_role(ddp)
    for role in ("policy", "value"):  # trained: weights, gradients and Adam moments split over the 2 ranks
        assert rows[role].total == pytest.approx(whole[role].total / 2, abs=8)
    assert rows["reference"].total == (
        whole["reference"].total // 2 if shard_frozen else whole["reference"].total
    )
    # the rollout holds the policy whole (fp32 here) on top of the shards; the update loses DDP's buckets
    assert fsdp2.phases["rollout"] == ddp.phases["rollout"] + 4 * whole["policy"].parameters
    assert fsdp2.phases["stored passes"] > ddp.phases["stored passes"]
    assert fsdp2.static < ddp.static
    report = Console(width=200, record=True)
    report.print(plan_report(fsdp2))
    text = report.export_text()  # export_text empties the record
    assert "FSDP2 (each rank's shards)" in text and "1/2" in text


def test_lmppo_plan_prints_the_table_and_the_verdict(run_files, capsys):
    assert run_cli("plan", str(run_files), "--memory-gb", "16", "--ranks", "2") == 0
    out = capsys.readouterr().out
    assert "memory plan per rank: cpu, fp32, 2 rank(s)" in out and "grads+Adam" in out
    assert "peak per rank" in out and "16.00 GiB available" in out and "fits" in out
    # "fits" means the run starts: what lmppo ppo refuses before loading a model, the plan refuses too
    assert run_cli("plan", str(run_files), "rollout.batch_size=16") == 2
    assert "rollout.batch_size=16 is larger than the 8 prompts" in capsys.readouterr().err


def test_plan_and_ppo_refuse_an_environment_that_does_not_import_before_any_model_loads(run_files, capsys):
    missing = f"rollout.environment={run_files.parent / 'my_env.py'}:GuessEnv"
    assert run_cli("plan", str(run_files), missing) == 2
    assert "rollout.environment" in capsys.readouterr().err  # the plan said "fits" for it
    (run_files.parent / "my_env.py").write_text("class GuessEnv:\n    pass\n")
    misspelt = f"rollout.environment={run_files.parent / 'my_env.py'}:GesEnv"
    assert run_cli("ppo", str(run_files), misspelt) == 2
    err = capsys.readouterr().err
    assert "did you mean 'GuessEnv'" in err and "Traceback" not in err
    assert not (run_files.parent / "run" / "checkpoints").exists()  # refused before step 0


def test_a_run_that_cannot_fit_is_refused_before_loading_unless_forced(run_files, capsys, monkeypatch):
    monkeypatch.setattr(plan_module, "available_memory", lambda device: 1024)  # 1 KiB free
    assert run_cli("ppo", str(run_files)) == 2
    err = capsys.readouterr().err
    assert "are available" in err and "ppo.gradient_checkpointing=true" in err and "--force" in err
    assert "Traceback" not in err and not (run_files.parent / "run" / "metrics.jsonl").exists()
    assert run_cli("ppo", str(run_files), "--force") == 0


def test_the_1b_example_shows_what_lmppo_plan_prints(tmp_path):
    """examples/llama_1b/README.md's figures come from the plan of the shipped config (no weights needed)."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks/random_models.py"),
            "llama-1b",
            str(tmp_path / "llama"),
            "--config-only",
        ],
        check=True,
        capture_output=True,
    )
    cfg = load_config(root / "examples/llama_1b/ppo.yaml", [f"models.policy.path={tmp_path / 'llama'}"])
    plan = memory_plan(cfg, available=80 * 2**30, world_size=1)
    readme = (root / "examples/llama_1b/README.md").read_text()
    assert plan.device == "cuda" and plan.precision == "bf16"
    assert f"peak per rank: {size(plan.peak)} = models {size(plan.static)}" in readme
    assert f"update (peak)      {size(plan.phases['update'])}" in readme
    # the 24 GB config down the memory ladder, and the refusal's rungs that lead to it
    small = load_config(
        root / "examples/llama_1b/ppo_24gb.yaml",
        [f"models.policy.path={tmp_path / 'llama'}", f"models.reference.path={tmp_path / 'llama'}"],
    )
    plan24 = memory_plan(small, available=24 * 2**30, world_size=1)
    assert plan24.fits and f"peak per rank: {size(plan24.peak)} = models {size(plan24.static)}" in readme
    refused = memory_plan(cfg, available=24 * 2**30, world_size=1)
    for change, saved in plan_module.remedies(cfg, refused)[:2]:
        assert f"`{change}` (" in readme and size(saved) in readme


def test_each_learned_reward_component_has_its_row_and_a_critic_starts_from_the_first(run_files, tmp_path):
    """Two reward models and a function: a row each (the function holds nothing); the critic of
    init_from=reward is the first learned component's network."""
    from helpers import COUNT_GOOD, llama_config, toy_models
    from transformers import LlamaForSequenceClassification

    tokenizer = toy_models().tokenizer
    for name, layers in (("a", 1), ("b", 2)):
        LlamaForSequenceClassification(
            llama_config(tokenizer, num_labels=1, num_hidden_layers=layers)
        ).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    components = [
        {"name": "a", "model": {"path": str(tmp_path / "a")}},
        {"name": "count", "function": COUNT_GOOD},
        {"name": "b", "model": {"path": str(tmp_path / "b")}},
    ]
    cfg = load_config(run_files, ["models.value.init_from=reward"])
    cfg = cfg.model_copy(update={"reward": type(cfg.reward)(components=components)})
    rows = rows_by_role(memory_plan(cfg))
    models = load_models(cfg, resolve(cfg, device="cpu"))
    learned = {c.name: c.model for c in models.reward.components if c.model is not None}
    for name in ("a", "b"):
        assert rows[f"reward {name}"].parameters == sum(p.numel() for p in learned[name].parameters())
    assert rows["reward count"].parameters == 0
    assert rows["value"].parameters == sum(p.numel() for p in models.value.parameters())
    assert rows["reward a"].parameters < rows["reward b"].parameters  # the critic came from a, the smaller


def test_a_response_longer_than_the_context_is_refused_by_the_context_check_not_the_plan(run_files):
    """The toy policy reads 128 tokens: 200 new ones are a context error, not "needs N GiB more memory"."""
    from lmppo.errors import LmppoError

    with pytest.raises(LmppoError, match=r"rollout.max_new_tokens=200 leaves no room .* 128-token context"):
        memory_plan(load_config(run_files, ["rollout.max_new_tokens=200"]))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["models.policy_lora.enabled=true"],
        ["models.policy_lora.enabled=true", "models.policy_lora.target_modules=all-linear"],
    ],
    ids=["full", "lora-attention", "lora-all-linear"],
)
def test_the_saved_activations_are_what_autograd_keeps_for_the_backward(run_files, overrides):
    """The plan's per-token activations of the update against the tensors autograd saves inside the decoder
    layers on a forward with gradients (each storage once, weights left out): within 15 %."""
    cfg = load_config(run_files, overrides)
    policy = load_models(cfg, resolve(cfg, device="cpu")).policy
    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    inside, saved = [False], {}

    def pack(tensor):
        address = tensor.untyped_storage().data_ptr()
        if inside[0] and address not in weights:
            saved[address] = tensor.untyped_storage().nbytes()
        return tensor

    for layer in (m for m in policy.modules() if type(m).__name__.endswith("DecoderLayer")):
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    input_ids = torch.randint(3, policy.config.vocab_size, (4, 24))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        policy(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.sum().backward()
    shape = plan_module.Shape.of(policy.config, policy)
    planned = input_ids.numel() * shape.saved_per_token(4, checkpointing=False)
    assert abs(planned / sum(saved.values()) - 1) < 0.15, (planned, sum(saved.values()))
