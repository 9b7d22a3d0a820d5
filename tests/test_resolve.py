"""The run spec: every decision a config implies, made once; the plan's rows and the built models agree
with it across the config matrix."""

import itertools

import pytest
import torch
from helpers import llama_config, toy_models
from transformers import LlamaForSequenceClassification

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve, resolve_device
from lmppo.math.estimators import ESTIMATORS
from lmppo.modeling.lora import LoraReference
from lmppo.runs.build import load_models
from lmppo.runs.plan import ladder, memory_plan


def test_a_cuda_run_without_a_visible_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LmppoError, match="run.device=cpu or auto"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_global_sizes_must_split_over_the_ranks(run_files):
    resolve(load_config(run_files, ["rollout.batch_size=8", "ppo.minibatch_size=4"]), world_size=2)
    with pytest.raises(LmppoError, match=r"ppo.minibatch_size=3 .*divisible by the 2 ranks"):
        resolve(load_config(run_files, ["rollout.batch_size=8", "ppo.minibatch_size=3"]), world_size=2)


def test_compile_on_a_cpu_without_a_cxx_compiler_is_refused_before_any_load(run_files, monkeypatch):
    cfg = load_config(run_files, ["run.compile=true"])
    resolve(cfg)  # this machine has one
    monkeypatch.setattr("lmppo.inputs.resolve.shutil.which", lambda name: None)
    with pytest.raises(LmppoError, match=r"no C\+\+ compiler is on PATH .* or set run.compile=false"):
        resolve(cfg)
    resolve(load_config(run_files, ["run.compile=false"]))  # eager needs none


def test_cross_section_refusals_come_before_any_load(run_files):
    with pytest.raises(LmppoError, match="fsdp2 shards the models over the ranks"):
        resolve(load_config(run_files, ["distributed.strategy=fsdp2"]))
    with pytest.raises(LmppoError, match="best-of-n fine-tunes on each round's winners"):
        resolve(
            load_config(
                run_files,
                ["run.algorithm=best_of_n", "rollout.samples_per_prompt=2", "rollout.asynchronous=true"],
            )
        )
    with pytest.raises(LmppoError, match="models.policy.dtype=bfloat16 would train every weight in 16 bits"):
        resolve(load_config(run_files, ["models.policy.dtype=bfloat16"]))


def test_an_environment_settles_its_episode_budget_and_refuses_what_it_cannot_run_with(run_files):
    env = "rollout.environment=lmppo.sampling.environments:SingleTurn"
    spec = resolve(load_config(run_files, [env, "rollout.max_turns=3", "models.value.mode=shared"]))
    assert spec.engine.environment.endswith(":SingleTurn") and spec.engine.max_episode_tokens == 3 * 6
    assert not spec.engine.values_from_decode  # an episode's values come from a pass over all of it
    spec = resolve(load_config(run_files, [env, "rollout.max_total_tokens=40"]))
    assert spec.engine.max_episode_tokens == 40
    assert resolve(load_config(run_files)).engine.max_episode_tokens == 6  # no environment: one response
    with pytest.raises(LmppoError, match=r"data.raw_prompts cannot run with it: remove one of the two"):
        resolve(load_config(run_files, [env, "data.raw_prompts=true"]))
    vllm = resolve(load_config(run_files, [env, "rollout.engine=vllm"]), device="cuda", present=False)
    assert vllm.engine.kind == "vllm" and not vllm.engine.sleeps  # its cache kept between an episode's turns
    with pytest.raises(LmppoError, match=r"rollout.max_total_tokens=4 is below rollout.max_new_tokens=6"):
        resolve(load_config(run_files, [env, "rollout.max_total_tokens=4"]))
    with pytest.raises(LmppoError, match=r"reward.overlong_buffer=7 tokens is longer than the 6"):
        resolve(load_config(run_files, ["reward.overlong_buffer=7"]))
    resolve(
        load_config(run_files, [env, "rollout.max_turns=2", "reward.overlong_buffer=7"])
    )  # 12 in an episode


@pytest.mark.parametrize(
    ("strategy", "shard_frozen", "engine", "shards", "frozen_shards", "from_decode"),
    [
        ("ddp", False, "hf", 1, 1, True),
        ("fsdp2", False, "hf", 2, 1, False),
        ("fsdp2", True, "hf", 2, 2, False),
    ],
)
def test_strategy_decides_what_is_sharded_and_where_values_come_from(
    run_files, strategy, shard_frozen, engine, shards, frozen_shards, from_decode
):
    overrides = [f"distributed.strategy={strategy}", f"distributed.shard_frozen={str(shard_frozen).lower()}"]
    cfg = load_config(
        run_files, [*overrides, "models.value.mode=shared", "rollout.batch_size=8", "ppo.minibatch_size=4"]
    )
    spec = resolve(cfg, world_size=2)
    assert spec.sharded == (strategy == "fsdp2") and spec.engine.values_from_decode == from_decode
    assert (spec.policy.shards, spec.value.shards, spec.reference.shards) == (shards, shards, frozen_shards)
    rows = {row.role: row for row in memory_plan(cfg, spec=spec).models}
    assert {role: row.shards for role, row in rows.items()} == {r.role: r.shards for r in spec.roles}


@pytest.fixture
def reward_model_dir(tmp_path):
    """A reward model on the policy's vocabulary, so a critic may start from it."""
    tokenizer = toy_models().tokenizer
    LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


CRITICS = {
    "shared": ["models.value.mode=shared"],
    "from-policy": ["models.value.init_from=policy"],
    "from-policy-lora": ["models.value.init_from=policy", "models.value.lora.enabled=true"],
    "from-reward": ["models.value.init_from=reward"],
    "from-reward-lora": ["models.value.init_from=reward", "models.value.lora.enabled=true"],
}


def frozen_dtypes(module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if not p.requires_grad}


@pytest.mark.parametrize(
    ("lora", "critic", "precision"),
    list(itertools.product([False, True], CRITICS, ["fp32", "bf16"])),
    ids=lambda v: {False: "full", True: "lora"}.get(v, v) if isinstance(v, bool) else v,
)
def test_the_plan_and_the_built_models_agree_on_every_role(
    run_files, reward_model_dir, lora, critic, precision
):
    """The config matrix: each role's parameters, trained share, frozen dtype and sharing, as the plan
    counts them and as the builders make them, both read off one spec."""
    overrides = [
        f"models.policy_lora.enabled={str(lora).lower()}",
        *CRITICS[critic],
        f"run.precision={precision}",
        f"reward.model.path={reward_model_dir}",
        "reward.function=null",
    ]
    cfg = load_config(run_files, overrides)
    spec = resolve(cfg, device="cpu")
    rows = {row.role: row for row in memory_plan(cfg, spec=spec).models}
    models = load_models(cfg, spec)
    built = {
        "policy": models.policy,
        "reference": models.reference,
        "reward": models.reward_models[0],
        "value": models.value.head if spec.value.shares else models.value,
    }
    for role in spec.roles:
        row, module = rows[role.role], built[role.role]
        assert (row.dtype, row.note) == (role.dtype, role.note)
        if isinstance(module, LoraReference):  # the policy's base, run without the adapter
            assert role.shares == "policy" and row.parameters == 0
            assert frozen_dtypes(models.policy) == {getattr(torch, role.dtype)}
            continue
        params = list(module.parameters())
        trained = [p for p in params if p.requires_grad]
        assert (row.parameters, row.trained) == (
            sum(p.numel() for p in params),
            sum(p.numel() for p in trained),
        )
        assert {p.dtype for p in trained} <= {torch.float32}  # trained weights are fp32 masters
        assert frozen_dtypes(module) <= {getattr(torch, role.dtype)}
        assert bool(trained) == (role.trained != "none")
    assert models.value.shared_trunk == (spec.value.shares == "policy")
    assert models.identities["value"]["init_from"] == (spec.value.init_from or "policy")
    assert (models.identities["reference"]["shared_with"] == "policy") == (spec.reference.source is None)


@pytest.mark.parametrize("advantage", [name for name, row in ESTIMATORS.items() if not row.critic])
def test_a_critic_free_run_plans_builds_and_records_no_value_model(run_files, monkeypatch, advantage):
    def no_critic(*args, **kwargs):
        raise AssertionError("a critic-free run built a value model")

    cfg = load_config(run_files, [f"ppo.advantage={advantage}", "rollout.samples_per_prompt=2"])
    with_critic = memory_plan(load_config(run_files, ["rollout.samples_per_prompt=2"]), device="cpu")
    spec = resolve(cfg, device="cpu")
    assert spec.value is None and not spec.engine.values_from_decode and not spec.estimator.critic
    assert spec.estimator.whiten == advantage.startswith("reinforce_pp")  # group baselines never whiten
    plan = memory_plan(cfg, spec=spec)
    assert not plan.critic and ["ppo.advantage=reinforce_pp"] not in ladder(cfg, plan)  # no critic to drop
    assert [row.role for row in plan.models] == ["policy", "reference", "reward"]
    assert plan.static < with_critic.static  # the critic's weights, gradients and Adam moments are gone
    monkeypatch.setattr("lmppo.modeling.models.make_value_model", no_critic)
    monkeypatch.setattr("lmppo.runs.build.make_value_model", no_critic)
    models = load_models(cfg, spec)
    assert models.value is None and "value" not in models.identities
    assert models.trained == [models.policy]


@pytest.mark.parametrize(
    ("matmuls", "precision", "why"),
    [
        ("amx", "bf16", "CPU with AMX"),
        ("avx512_bf16", "fp32", "run.precision=bf16 measured 1.2x faster"),
        (None, "fp32", "without bf16 matrix instructions"),
    ],
)
def test_auto_precision_on_a_cpu_is_bf16_where_it_has_amx_and_says_why(
    monkeypatch, run_files, matmuls, precision, why
):
    monkeypatch.setattr("lmppo.inputs.resolve.cpu_bf16_matmuls", lambda: matmuls)
    spec = resolve(load_config(run_files, ["run.precision=auto"]), device="cpu")
    assert (spec.precision, spec.fp32_matmul_precision) == (precision, "highest")
    assert why in spec.precision_reason
    explicit = resolve(
        load_config(run_files, ["run.precision=fp32", "run.fp32_matmul_precision=medium"]), device="cpu"
    )
    assert (explicit.precision, explicit.precision_reason) == ("fp32", "set by run.precision")
    assert explicit.fp32_matmul_precision == "medium"
