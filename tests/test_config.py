"""Config: YAML round-trip, overrides, and every validation error saying what is allowed."""

import re

import pytest
import yaml
from sample_environments import SPEC as ENVIRONMENT

from lmppo.errors import LmppoError
from lmppo.inputs.config import OTHER_TRAINERS_KEYS, Config, apply_override, load_config, validate_config
from lmppo.inputs.resolve import resolve

BASE = {
    "models": {"policy": {"path": "policy_dir"}},
    "reward": {"function": "my_rewards:score"},
    "data": {"prompts": "prompts.jsonl"},
}


def load_and_resolve(**kwargs) -> None:
    """A config loaded, then resolved on the CPU: the checks across sections are resolve's."""
    resolve(load_config(**kwargs), device="cpu")


def test_yaml_round_trip(tmp_path):
    cfg = load_config(
        base=BASE, overrides=["ppo.lr=3e-4", "rollout.stop_token_ids=[5, 7]", "kl.adaptive=true"]
    )
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert again.ppo.lr == 3e-4 and again.rollout.stop_token_ids == [5, 7] and again.kl.adaptive is True


def test_defaults_live_in_the_config():
    cfg = load_config(base=BASE)
    assert (cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.clip_eps, cfg.kl.estimator) == (1.0, 0.95, 0.2, "k1")
    assert cfg.models.reference is None and cfg.models.value.mode == "separate"


def test_overrides_do_not_mutate_the_base():
    load_config(base=BASE, overrides=["models.policy.dtype=bfloat16"])
    assert "dtype" not in BASE["models"]["policy"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ppo.lrr=1", "did you mean 'ppo.lr'"),
        ("rolout.batch_size=4", "did you mean 'rollout'"),
        ("models.policy.dtyp=float32", "did you mean 'models.policy.dtype'"),
        ("ppo.lr=-1", "ppo.lr: Input should be greater than 0"),
        ("ppo.clip_eps=0", "ppo.clip_eps: Input should be greater than 0"),
        ("ppo.gamma=1.5", "ppo.gamma: Input should be less than or equal to 1"),
        ("ppo.advantage=rloo", "set rollout.samples_per_prompt to 2 or more"),
        ("ppo.advantage=grpo rollout.samples_per_prompt=4 rollout.truncation=bootstrap", "has none"),
        ("ppo.advantage=reinforce_pp ppo.critic_warmup_steps=2", "ppo.critic_warmup_steps trains the critic"),
        ("ppo.advantage=rloo rollout.samples_per_prompt=2 ppo.lam_critic=1.0", "ppo.lam_critic is a lambda"),
        ("ppo.lam_policy=1.5", "must be between 0 and 1"),
        ("ppo.lam_policy=adaptive", "ppo.lam_policy"),
        ("ppo.clip_ratio_high=0.28", "did you mean 'ppo.clip_eps_high'"),
        ("ppo.micro_batch_size=5", "must divide ppo.minibatch_size"),
        ("ppo.micro_batch_size=4 ppo.micro_batch_tokens=100", "not both"),
        ("reward.model.path=rm_dir", "set exactly one of reward.model"),
        ("kl.estimator=k9", "kl.estimator"),
        ("rollout.truncation=bootstrap reward.missing_eos_penalty=1.0", "gives truncated rows no score"),
        ("ppo", "not of the form section.key=value"),
        ("models.policy.path.x=1", "is a value, not a section"),
        ("rollout.asynchronous=true rollout.max_rollout_age=0", "one policy version behind the update"),
    ],
)
def test_validation_errors_are_helpful(override, message):
    with pytest.raises(LmppoError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_and_resolve(base=BASE, overrides=override.split())


def test_missing_section_and_file_errors(tmp_path):
    with pytest.raises(LmppoError, match="data is required"):
        load_config(base={k: v for k, v in BASE.items() if k != "data"})
    with pytest.raises(LmppoError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed")
    with pytest.raises(LmppoError, match="not valid YAML"):
        load_config(bad)
    bad.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(LmppoError, match="mapping of sections"):
        load_config(bad)


def test_the_rollout_age_follows_asynchronous_rollouts_unless_set():
    assert load_config(base=BASE).rollout.max_rollout_age == 0
    assert load_config(base=BASE, overrides=["rollout.asynchronous=true"]).rollout.max_rollout_age == 1
    overrides = ["rollout.asynchronous=true", "rollout.max_rollout_age=2"]
    assert load_config(base=BASE, overrides=overrides).rollout.max_rollout_age == 2


def test_config_schema_is_strict_at_every_level():
    for section in Config.model_fields:
        with pytest.raises(LmppoError, match="unknown key"):
            load_config(base=BASE, overrides=[f"{section}.no_such_key=1"])


COMPONENTS = {
    "models": BASE["models"],
    "data": BASE["data"],
    "reward": {
        "components": [
            {"name": "helpful", "function": "my_rewards:score", "normalize": True},
            {"name": "short", "function": "my_rewards:brevity", "weight": 0.5, "missing_eos_penalty": 1.0},
        ]
    },
}


def test_reward_components_and_the_one_source_shorthand():
    sources = load_config(base=COMPONENTS).reward.sources()
    assert [(s.name, s.weight, s.normalize) for s in sources] == [
        ("helpful", 1.0, True),
        ("short", 0.5, False),
    ]
    (shorthand,) = load_config(base=BASE, overrides=["reward.clip=2"]).reward.sources()
    assert (shorthand.name, shorthand.function, shorthand.clip) == ("reward", "my_rewards:score", 2.0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.function=my_rewards:score", "move reward.function into each component"),
        ("reward.normalize=true", "move reward.normalize into each component"),
        ("reward.components.1.name=helpful", "the name 'helpful' is used twice"),
        ("reward.components.0.model.path=rm", "'helpful': set exactly one of model, function or url"),
        (
            "reward.gate.component=safety reward.gate.below=0.1",
            "reward.gate.component='safety' is not one of",
        ),
        ("rollout.truncation=bootstrap", "reward component 'short''s missing_eos_penalty"),
        ("reward.components.0.weigth=2", "did you mean 'reward.components.0.weight'"),
    ],
)
def test_reward_component_errors_name_the_fix(override, message):
    with pytest.raises(LmppoError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_and_resolve(base=COMPONENTS, overrides=override.split())


def test_a_gate_needs_components():
    with pytest.raises(LmppoError, match="reward.gate picks between reward.components"):
        load_config(base=BASE, overrides=["reward.gate.component=x", "reward.gate.below=0"])


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("ppo.learning_rate=1e-4", "unknown key 'ppo.learning_rate': did you mean 'ppo.lr'?"),
        ("learning_rate=1e-4", "did you mean 'ppo.lr'?"),  # a flat TRL config
        ("ppo.kl_coef=0.1", "did you mean 'kl.beta'?"),  # spelling alone says ppo.vf_coef
        ("ppo.target_kl=1", "did you mean 'ppo.target_approx_kl'?"),  # TRL's: stop the epochs early
        ("kl.target_kl=0.1", "did you mean 'kl.target'?"),  # verl's kl_ctrl: the adaptive controller's target
        ("ppo.beta=0.1", "did you mean 'kl.beta'?"),
        ("rollout.lr=1e-4", "did you mean 'ppo.lr'?"),
        ("ppo.temperature=0.7", "did you mean 'rollout.temperature'?"),
        ("ppo.steps=10", "did you mean 'run.steps'?"),  # not the near spelling ppo.warmup_steps
        ("rollout.max_length=64", "did you mean 'rollout.max_new_tokens'?"),
        ("reward.model.max_length=512", "did you mean 'reward.max_length'?"),  # one level too deep
    ],
)
def test_unknown_keys_suggest_the_key_they_mean_wherever_it_lives(override, suggestion):
    with pytest.raises(LmppoError, match=re.escape(suggestion)):
        load_config(base=BASE, overrides=[override])


def test_every_name_from_another_trainer_suggests_a_key_of_ours():
    for written, meant in OTHER_TRAINERS_KEYS.items():
        with pytest.raises(LmppoError, match=re.escape(f"did you mean {meant!r}?")):
            load_config(base=BASE, overrides=[f"{written}=1"])


def test_problems_name_the_override_or_the_file_they_came_from(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({**BASE, "ppo": {"lrr": 1}}))
    with pytest.raises(LmppoError) as err:
        load_config(path, ["ppo.learning_rate=1e-4", "kl.beta=-1"])
    assert str(err.value).splitlines() == [
        f"{path} with its overrides is not a valid lmppo config:",
        f"  - {path}: unknown key 'ppo.lrr': did you mean 'ppo.lr'?",
        "  - the override ppo.learning_rate=1e-4 (command line): unknown key 'ppo.learning_rate': did you "
        "mean 'ppo.lr'?",
        "  - the override kl.beta=-1 (command line): kl.beta: Input should be greater than or equal to 0 "
        "(got -1)",
    ]
    with pytest.raises(LmppoError, match=re.escape(f"{path} is not a valid lmppo config:\n  - unknown key")):
        load_config(path)  # no overrides: the file is the only source, named once


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (  # a cross-field check over a section the override changed: both
            "ppo.micro_batch_size=5",
            "FILE with the override ppo.micro_batch_size=5 (command line): ppo.micro_batch_size=5 must divide",
        ),
        (  # the override made the optional section its missing key belongs to
            "models.reference.dtype=bfloat16",
            "FILE with the override models.reference.dtype=bfloat16 (command line): models.reference.path "
            "is required",
        ),
        (  # a whole section given on the command line
            "models.policy={path: p, dtyp: float32}",
            "the override models.policy={path: p, dtyp: float32} (command line): unknown key "
            "'models.policy.dtyp'",
        ),
    ],
)
def test_a_problem_an_override_took_part_in_names_it(tmp_path, override, problem):
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(LmppoError, match=re.escape(problem.replace("FILE", str(path)))):
        load_config(path, [override])


def test_the_python_api_can_name_its_overrides():
    raw = dict(BASE)
    apply_override(raw, "ppo.lr=-1")
    with pytest.raises(LmppoError, match=re.escape("the override ppo.lr=-1 (lmppo.train): ppo.lr:")):
        validate_config(
            raw,
            source="the config given to lmppo.train",
            overrides=["ppo.lr=-1"],
            overrides_from="lmppo.train",
        )


def test_a_run_without_a_reward_source_takes_its_environment_s_turn_rewards_as_the_reward():
    no_reward = {key: value for key, value in BASE.items() if key != "reward"}
    with pytest.raises(
        LmppoError, match=r"the run has no reward: set exactly one of reward\.model.*rollout\.environment"
    ):
        load_and_resolve(base=no_reward)
    cfg = load_config(
        base=no_reward, overrides=[f"rollout.environment={ENVIRONMENT}", "models.value.init_from=policy"]
    )
    resolve(cfg, device="cpu")
    assert not cfg.reward.configured and cfg.reward.sources() == [] and not cfg.reward.learned
    assert cfg.reward.score_name(episodes=True) == "environment reward"
