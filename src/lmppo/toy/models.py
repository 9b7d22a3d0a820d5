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
from lmppo.toy.task import tokenizer_corpus, toy_datasets, write_jsonl
from lmppo.toy.tokenizer import policy_tokenizer, reward_tokenizer, tools_tokenizer, train_bpe
from lmppo.toy.tools import tools_corpus, tools_datasets

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
    reward_tokenizer_dir: Path | None  # the reward model's own tokenizer and chat template (None: no RM)
    data: dict[str, Path]  # name -> JSONL file


TASKS = ("instruct", "tools")  # lmppo.toy.task, lmppo.toy.tools


def build_toy_world(
    out_dir: str | Path, seed: int = 0, sizes: dict[str, int] | None = None, task: str = "instruct"
) -> ToyWorld:
    """Write the untrained policy with its tokenizer, the reward tokenizer and the toy data sets.

    out_dir/policy_base/       LlamaForCausalLM + policy tokenizer
    out_dir/reward_tokenizer/  the reward model's tokenizer (same vocabulary, own template); not for tools
    out_dir/data/*.jsonl       sft_train, sft_test, prefs_train, prefs_test, prompts_train, prompts_test
                               (tools: sft_train and sft_test hold episodes; no preference pairs)
    """
    out_dir = Path(out_dir)
    if task == "tools":  # a programmatic reward: no reward model, so no reward tokenizer
        tokenizer, rm_tokenizer = tools_tokenizer(tools_corpus(seed)), None
        datasets = tools_datasets(seed, sizes)
    else:
        bpe = train_bpe(tokenizer_corpus(seed))
        tokenizer, rm_tokenizer = policy_tokenizer(bpe), reward_tokenizer(bpe)
        datasets = toy_datasets(seed, sizes)
    world = ToyWorld(out_dir / "policy_base", rm_tokenizer and out_dir / "reward_tokenizer", {})
    build_policy(tokenizer, seed=seed).save_pretrained(world.policy_dir)
    tokenizer.save_pretrained(world.policy_dir)
    if rm_tokenizer is not None:
        rm_tokenizer.save_pretrained(world.reward_tokenizer_dir)
    for name, rows in datasets.items():
        world.data[name] = write_jsonl(rows, out_dir / "data" / f"{name}.jsonl")
    return world


def load_toy_world(out_dir: str | Path) -> ToyWorld:
    """The toy world an earlier :func:`build_toy_world` wrote to ``out_dir``."""
    out_dir = Path(out_dir)
    data = {path.stem: path for path in sorted((out_dir / "data").glob("*.jsonl"))}
    if not (out_dir / "policy_base").is_dir() or "prompts_train" not in data:
        raise LmppoError(
            f"{out_dir} is not a toy world (no policy_base/ or data/prompts_train.jsonl); build it with "
            "build_toy_world"
        )
    rm_tokenizer = out_dir / "reward_tokenizer"
    return ToyWorld(out_dir / "policy_base", rm_tokenizer if rm_tokenizer.is_dir() else None, data)
