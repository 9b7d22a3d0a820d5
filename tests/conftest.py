"""Shared fixtures: tiny word-level tokenizers with chat templates and tiny Llama models, built locally.

Nothing is downloaded. Models are 2-layer Llamas with hidden size 32, so a forward pass takes milliseconds.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

WORDS = [
    "good",
    "bad",
    "fine",
    "nice",
    "cat",
    "dog",
    "sun",
    "rain",
    "tree",
    "bird",
    "a",
    "the",
    "is",
    "very",
    "happy",
    "sad",
    "tell",
    "me",
    "about",
    "write",
    "short",
    "story",
    "poem",
    "day",
    "night",
    "red",
    "blue",
    "one",
    "two",
    "three",
    "and",
    "or",
    "not",
    "it",
    "was",
]
POLICY_SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
# Turns end with EOS, as in ChatML-style templates (so with pad == EOS the prompt holds pad-id tokens).
POLICY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }} {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The reward model's own, different special tokens and template.
REWARD_SPECIALS = ["[PAD]", "[EOS]", "[Q]", "[A]", "<unk>"]
REWARD_TEMPLATE = "{% for m in messages %}{{ '[Q]' if m['role'] == 'user' else '[A]' }} {{ m['content'] }} {% endfor %}{{ eos_token }}"


def build_tokenizer(
    specials: list[str],
    words: list[str],
    *,
    pad: str,
    eos: str,
    bos: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ids are ``specials + words`` in order."""
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = [t for t in specials if t not in {pad, eos, bos, "<unk>"}]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        unk_token="<unk>",
        extra_special_tokens=extra,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def llama_config(tokenizer, **overrides) -> LlamaConfig:
    settings = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**{**settings, **overrides})


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


def boost_token(model: LlamaForCausalLM, token_id: int, logit: float) -> LlamaForCausalLM:
    """Add ``logit`` to one vocabulary entry's logit everywhere (a biased output layer)."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    biased.bias.data[token_id] = logit
    model.lm_head = biased
    return model


@pytest.fixture
def boosted():
    """``boost_token`` as a fixture, for tests that need a model that (almost) always stops early."""
    return boost_token
