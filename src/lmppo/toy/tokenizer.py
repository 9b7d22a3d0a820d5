"""Toy tokenizers: one byte-level BPE trained with `tokenizers`, wrapped twice as transformers tokenizers.

The policy and the reward model share the vocabulary (so a value model can start from the reward
model's weights, as in InstructGPT) but not the chat template, BOS or padding side: a reward model must
be fed text rendered with its own template, never the policy's ids, and a wrong rendering shows.

    policy  no BOS, left padding   <|user|>count to 3<|assistant|>1 2 3.<eos>
    reward  BOS, right padding     <bos>user:\ncount to 3\nassistant:\n1 2 3.<eos>

Pad and EOS are distinct tokens; every assistant turn ends with EOS. The tools world
(:mod:`lmppo.toy.tools`) trains its own BPE, with a ``tool`` role and no reward model.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
TOOL_TOKENS = ["<|tool|>"]  # the tools world's extra role (lmppo.toy.tools)
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")  # whole tokens of text, as in Qwen's vocabulary
ROLES = ("system", "user", "assistant")


def _check_roles(roles: tuple[str, ...]) -> str:
    return (
        f"{{%- for message in messages if message['role'] not in {list(roles)} -%}}"
        "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
        "{%- endfor -%}"
    )


def policy_template(roles: tuple[str, ...] = ROLES) -> str:
    """``<|role|>content`` per message, EOS after each assistant turn; other roles refused."""
    return _check_roles(roles) + (
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
        "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
    )


POLICY_TEMPLATE = policy_template()
TOOLS_TEMPLATE = policy_template((*ROLES, "tool"))
REWARD_TEMPLATE = _check_roles(ROLES) + (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + ':\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- '\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:\n' -}}{%- endif -%}"
)


def train_bpe(
    corpus: Iterable[str], vocab_size: int = 1024, special_tokens: list[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any text encodes, with no unknown token, and decodes back exactly.

    `vocab_size` is a ceiling: on the toy corpus merges run out at 561 tokens, every word whole.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    role_names = ["system:\nuser:\nassistant:\n"] * 100  # frequent enough to become whole tokens
    tok.train_from_iterator([*corpus, *role_names], trainer)
    return tok


def policy_tokenizer(bpe: Tokenizer, chat_template: str = POLICY_TEMPLATE) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()),
        pad_token="<pad>",
        eos_token="<eos>",
        padding_side="left",
        chat_template=chat_template,
    )


def reward_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe.to_str()),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="right",
        chat_template=REWARD_TEMPLATE,
    )


def tools_tokenizer(corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """The tools world's policy tokenizer: a tool role, and the call markers as whole tokens that decode as
    text (not control tokens: the environment must read them in the policy's turn)."""
    bpe = train_bpe(corpus, special_tokens=[*SPECIAL_TOKENS, *TOOL_TOKENS])
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_CALL_TOKENS])
    return policy_tokenizer(bpe, TOOLS_TEMPLATE)
