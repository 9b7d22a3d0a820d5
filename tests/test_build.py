"""Building a run from its config: the four models with identities, the reward, the generator options."""

import inspect

import pytest
import torch
from helpers import COUNT_GOOD

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.runs.build import generator_options, load_models, load_reward, load_value_model
from lmppo.sampling.engines import sampling_parts
from lmppo.sampling.hf_engine import hf_generator


def cpu_models(cfg):
    return load_models(cfg, resolve(cfg, device="cpu"))


def test_generator_options_are_every_setting_the_generator_takes(run_files):
    """Training and every evaluation sample through these options: none may be dropped on the way."""
    cfg = load_config(
        run_files,
        [
            "rollout.top_k=5",
            "rollout.top_p=0.9",
            "rollout.stop_token_ids=[3]",
            "rollout.temperature=0.7",
            "models.policy.chat_template='{{ x }}'",
            "data.max_prompt_length=40",
            "data.truncate_prompts=true",
            "rollout.generation_batch_tokens=512",
        ],
    )
    options = generator_options(cfg)
    keywords = {
        name
        for function in (sampling_parts, hf_generator)
        for name, p in inspect.signature(function).parameters.items()
        if p.kind == p.KEYWORD_ONLY
    }
    # the critic, the seed of an engine on another thread and a snapshot's weights, not sampling settings
    assert set(options) == keywords - {"value_model", "bootstrap_values", "seed", "owns_weights"}
    assert options == {
        "max_new_tokens": 6,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "stop_token_ids": [3],
        "chat_template": "{{ x }}",
        "raw_prompts": False,
        "max_prompt_length": 40,
        "truncate_prompts": True,
        "batch_tokens": 512,
    }


def test_load_models_records_each_models_identity(run_files):
    models = cpu_models(load_config(run_files))
    ids = models.identities
    assert list(ids) == ["policy", "reference", "reward", "value"]
    assert ids["policy"]["source"] == str(run_files.parent / "policy") and ids["policy"]["weights_sha256"]
    assert ids["reference"]["shared_with"] == "policy"  # the policy's starting weights, frozen
    assert ids["reference"]["weights_sha256"] == ids["policy"]["weights_sha256"]
    assert ids["reward"] == {"role": "reward", "function": COUNT_GOOD}
    assert ids["value"]["init_from"] == "policy" and ids["value"]["trainable_parameters"] > 0
    assert not any(p.requires_grad for p in models.reference.parameters())


def test_a_reward_model_is_scored_with_its_own_tokenizer_and_identified(
    tmp_path, make_reward_model, reward_tokenizer, run_files
):
    make_reward_model(reward_tokenizer).save_pretrained(tmp_path / "rm")
    reward_tokenizer.save_pretrained(tmp_path / "rm")
    cfg = load_config(run_files, [f"reward.model.path={tmp_path / 'rm'}", "reward.function=null"])
    reward = load_reward(cfg.reward, resolve(cfg).rewards)
    learned = reward.first_model()
    assert learned is not None and learned.score.tokenizer.eos_token == "[EOS]"  # the RM's, not the policy's
    assert reward.identity["role"] == "reward" and reward.identity["tokenizer_sha256"]
    scores = reward.reward(["tell me a story"], ["a good day"])
    assert scores.shape == (1,) and torch.isfinite(scores).all()


def test_a_critic_from_the_reward_needs_a_reward_model_with_the_policys_vocabulary(
    tmp_path, make_reward_model, reward_tokenizer, run_files
):
    cfg = load_config(run_files, ["models.value.init_from=reward"])
    with pytest.raises(LmppoError, match="needs a reward model.*init_from=policy"):
        resolve(cfg)  # refused before any model is loaded
    models = cpu_models(load_config(run_files))
    # a reward model with its own vocabulary would be fed the policy's token ids: refused, not an IndexError
    make_reward_model(reward_tokenizer).save_pretrained(tmp_path / "rm")
    reward_tokenizer.save_pretrained(tmp_path / "rm")
    rm = [f"reward.model.path={tmp_path / 'rm'}", "reward.function=null"]
    cfg = load_config(run_files, ["models.value.init_from=reward", *rm])
    with pytest.raises(LmppoError, match="own tokenizer with another vocabulary.*init_from=policy"):
        spec = resolve(cfg)
        load_value_model(
            spec.value, models.policy, load_reward(cfg.reward, spec.rewards), models.tokenizer, "cpu"
        )


def dtypes(module):
    return {p.dtype for p in module.parameters()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_precision_keeps_trained_weights_fp32_and_frozen_weights_bf16(run_files, lora):
    cfg = load_config(run_files, ["run.precision=bf16", f"models.policy_lora.enabled={lora}"])
    models = cpu_models(cfg)
    trained = [p for p in models.policy.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}  # fp32 masters for Adam
    frozen_policy = {p.dtype for p in models.policy.parameters() if not p.requires_grad}
    assert frozen_policy == ({torch.bfloat16} if lora else set())  # a LoRA base is frozen: 2 bytes/param
    if not lora:  # with LoRA the reference is that bf16 base, run without the adapter
        assert dtypes(models.reference) == {torch.bfloat16}
    assert dtypes(models.value) == {torch.float32}  # a critic copied from a frozen base is trained in fp32
    assert models.identities["reference"]["dtype"] == "bfloat16"


def test_auto_precision_is_fp32_on_cpu(run_files):
    models = cpu_models(load_config(run_files))
    assert dtypes(models.policy) == dtypes(models.reference) == {torch.float32}
