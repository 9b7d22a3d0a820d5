"""Config: YAML round-trip, overrides, and every validation error saying what is allowed."""

import pytest
import yaml

from lmppo.config import Config, load_config
from lmppo.errors import LmppoError

BASE = {
    "models": {"policy": {"path": "policy_dir"}},
    "reward": {"function": "my_rewards:score"},
    "data": {"prompts": "prompts.jsonl"},
}


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
        ("ppo.minibatch_size=64", "larger than the 16 responses of a step"),
        ("ppo.advantage=rloo", "set rollout.samples_per_prompt to 2 or more"),
        ("ppo.advantage=grpo rollout.samples_per_prompt=4 rollout.truncation=bootstrap", "has none"),
        ("ppo.advantage=reinforce_pp ppo.critic_warmup_steps=2", "ppo.critic_warmup_steps trains the critic"),
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
        load_config(base=BASE, overrides=override.split())


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
    ],
)
def test_reward_component_errors_name_the_fix(override, message):
    with pytest.raises(LmppoError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(base=COMPONENTS, overrides=override.split())


def test_a_gate_needs_components():
    with pytest.raises(LmppoError, match="reward.gate picks between reward.components"):
        load_config(base=BASE, overrides=["reward.gate.component=x", "reward.gate.below=0"])
