"""Tiny Llama models for the toy world, and `build_toy_world` that writes everything to a directory.

The policy ties its input and output embeddings (as small chat models such as SmolLM2 do). The reward
model follows InstructGPT: a `LlamaForSequenceClassification` (one label) that starts from the SFT
policy's transformer with a fresh score head, and reads text through its own tokenizer and template.
Weights are initialised from a seed without touching the global RNG.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerBase,
)

from lmppo.errors import LmppoError
from lmppo.toy.task import DEFAULT_SIZES, tokenizer_corpus, toy_datasets, write_jsonl
from lmppo.toy.tokenizer import policy_tokenizer, reward_tokenizer, train_bpe

MAX_POSITIONS = 128  # prompt + response of the toy task stay under 64 tokens


def tiny_llama_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    **overrides,
) -> LlamaConfig:
    """A small Llama config whose vocabulary and special ids come from `tokenizer`."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )


def build_policy(tokenizer: PreTrainedTokenizerBase, *, seed: int, **sizes) -> LlamaForCausalLM:
    """A randomly initialised tiny causal LM (eval mode) for `tokenizer`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config(tokenizer, tie_word_embeddings=True, **sizes)).eval()


def reward_model_from_policy(
    policy: LlamaForCausalLM, reward_tokenizer: PreTrainedTokenizerBase, *, seed: int
) -> LlamaForSequenceClassification:
    """A reward model with the (SFT) policy's transformer and a new score head; ids and pad from its own tokenizer."""
    if len(reward_tokenizer) != policy.config.vocab_size:
        raise LmppoError(
            f"reward tokenizer has {len(reward_tokenizer)} tokens but the policy {policy.config.vocab_size}: "
            "a reward model can start from the policy only when both share the vocabulary"
        )
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.pad_token_id, config.bos_token_id = reward_tokenizer.pad_token_id, reward_tokenizer.bos_token_id
    config.eos_token_id = reward_tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    model.model.load_state_dict(policy.model.state_dict())
    return model.eval()


@dataclass(frozen=True)
class ToyWorld:
    """Where `build_toy_world` put things."""

    policy_dir: Path  # the untrained policy and its tokenizer
    reward_tokenizer_dir: Path  # the reward model's own tokenizer and chat template
    data: dict[str, Path]  # name -> JSONL file


def build_toy_world(out_dir: str | Path, seed: int = 0, sizes: dict[str, int] | None = None) -> ToyWorld:
    """Write the untrained policy with its tokenizer, the reward tokenizer and the toy data sets.

    out_dir/policy_base/       LlamaForCausalLM + policy tokenizer
    out_dir/reward_tokenizer/  the reward model's tokenizer (same vocabulary, own template)
    out_dir/data/*.jsonl       sft_train, sft_test, prefs_train, prefs_test, prompts_train, prompts_test
    """
    out_dir = Path(out_dir)
    bpe = train_bpe(tokenizer_corpus(seed))
    world = ToyWorld(out_dir / "policy_base", out_dir / "reward_tokenizer", {})
    tokenizer = policy_tokenizer(bpe)
    build_policy(tokenizer, seed=seed).save_pretrained(world.policy_dir)
    tokenizer.save_pretrained(world.policy_dir)
    reward_tokenizer(bpe).save_pretrained(world.reward_tokenizer_dir)
    for name, rows in toy_datasets(seed, sizes).items():
        world.data[name] = write_jsonl(rows, out_dir / "data" / f"{name}.jsonl")
    return world


def load_toy_world(out_dir: str | Path) -> ToyWorld:
    """The toy world an earlier :func:`build_toy_world` wrote to ``out_dir``."""
    out_dir = Path(out_dir)
    data = {name: out_dir / "data" / f"{name}.jsonl" for name in DEFAULT_SIZES}
    if missing := [str(path) for path in data.values() if not path.is_file()]:
        raise LmppoError(
            f"{out_dir} is not a toy world: {', '.join(missing)} missing; build it with build_toy_world"
        )
    return ToyWorld(out_dir / "policy_base", out_dir / "reward_tokenizer", data)
