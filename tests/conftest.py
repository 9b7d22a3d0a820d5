"""Fixtures over the builders in ``helpers.py``: tokenizers, tiny Llamas, and a saved run to start."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import yaml
from helpers import (
    COUNT_GOOD,
    POLICY_SPECIALS,
    POLICY_TEMPLATE,
    PROMPTS,
    REWARD_SPECIALS,
    REWARD_TEMPLATE,
    WORDS,
    boost_token,
    build_tokenizer,
    llama_config,
    toy_models,
)
from transformers import LlamaForCausalLM, LlamaForSequenceClassification


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need vLLM in this environment (`make test-vllm`): skipped elsewhere, also those
    that only start it in a subprocess."""
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(
            reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"
        )
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_without_bf16_matrix_units(monkeypatch):
    """``run.precision=auto`` is fp32 on this CPU whatever it is: the tests' tolerances and byte counts are
    fp32's, and machines differ (an AMX Xeon would pick bf16). Tests of that choice patch it themselves;
    a subprocess run reads the real CPU, and its config says ``run.precision`` where it matters."""
    monkeypatch.setattr("lmppo.inputs.resolve.cpu_bf16_matmuls", lambda: None)


@pytest.fixture
def make_policy_tokenizer():
    """Factory: the policy tokenizer (pad ``<pad>``, EOS ``</s>``, extra stop ``<|end|>``); ``pad_is_eos``."""

    def make(pad_is_eos: bool = False, words: list[str] = WORDS, chat_template: str | None = POLICY_TEMPLATE):
        return build_tokenizer(
            POLICY_SPECIALS,
            words,
            pad="</s>" if pad_is_eos else "<pad>",
            eos="</s>",
            bos="<s>",
            chat_template=chat_template,
        )

    return make


@pytest.fixture
def policy_tokenizer(make_policy_tokenizer):
    return make_policy_tokenizer()


@pytest.fixture
def make_causal_lm():
    """Factory: a random tiny Llama causal LM (eval mode) for ``tokenizer``; config overrides as kwargs."""

    def make(tokenizer, seed: int = 0, **overrides) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        return LlamaForCausalLM(llama_config(tokenizer, **overrides)).eval()

    return make


@pytest.fixture
def policy_model(make_causal_lm, policy_tokenizer):
    return make_causal_lm(policy_tokenizer)


@pytest.fixture
def make_reward_model():
    """Factory: a random tiny Llama sequence scorer (num_labels=1, eval mode) for ``tokenizer``."""

    def make(tokenizer, seed: int = 1, **overrides) -> LlamaForSequenceClassification:
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1, **overrides)).eval()

    return make


@pytest.fixture
def reward_tokenizer():
    """The reward model's tokenizer: other ids (reversed word order), other template, pad == EOS."""
    return build_tokenizer(
        REWARD_SPECIALS, WORDS[::-1], pad="[EOS]", eos="[EOS]", chat_template=REWARD_TEMPLATE
    )


@pytest.fixture
def boosted():
    """``boost_token`` as a fixture, for tests that need a model that (almost) always stops early."""
    return boost_token


@pytest.fixture
def run_files(tmp_path):
    """A policy directory, a prompt file and a config for a 2-step run."""
    models = toy_models()
    models.policy.save_pretrained(tmp_path / "policy")
    models.tokenizer.save_pretrained(tmp_path / "policy")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    config = {
        "models": {"policy": {"path": str(tmp_path / "policy")}, "value": {"init_from": "policy"}},
        "reward": {"function": COUNT_GOOD},
        "data": {"prompts": str(tmp_path / "prompts.jsonl")},
        "rollout": {"batch_size": 4, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 2, "ppo_epochs": 2, "lr": 1e-3},
        "run": {"output_dir": str(tmp_path / "run"), "steps": 2, "seed": 1, "precision": "fp32"},
        "logging": {"quiet": True},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def saved_rm(tmp_path_factory):
    tokenizer = build_tokenizer(
        REWARD_SPECIALS, WORDS, pad="[EOS]", eos="[EOS]", chat_template=REWARD_TEMPLATE
    )
    folder = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
