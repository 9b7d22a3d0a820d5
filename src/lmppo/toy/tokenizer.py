"""Toy tokenizers trained with `tokenizers` and wrapped as transformers tokenizers.

The policy and the reward model get deliberately different tokenizers and chat templates, as real
pairs often have: a reward model must be fed text rendered with its own template, never policy ids.

    policy  byte-level BPE (GPT-2 style), no BOS, left padding     <|user|>count to 3<|assistant|>1 2 3.<eos>
    reward  metaspace BPE (SentencePiece style), BOS, right padding <s><user>count to 3<assistant>1 2 3.</s>

Pad and EOS are distinct tokens in both; each assistant turn ends with EOS.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROLES = ("system", "user", "assistant")


_CHECK_ROLE = (
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}{%- endif -%}"
)
POLICY_TEMPLATE = (
    "{%- for message in messages -%}" + _CHECK_ROLE +
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
REWARD_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}" + _CHECK_ROLE +
    "{{- '<' + message['role'] + '>' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<assistant>' -}}{%- endif -%}"
)  # fmt: skip


def build_policy_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE: any text encodes (no unknown token) and decodes back exactly."""
    specials = ["<pad>", "<eos>", *(f"<|{r}|>" for r in ROLES)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=alphabet, show_progress=False))  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left",
        chat_template=POLICY_TEMPLATE,
    )  # fmt: skip


def build_reward_tokenizer(corpus: Iterable[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Metaspace BPE over the characters of the corpus: different ids, pieces and template from the policy's."""
    specials = ["<unk>", "<pad>", "<s>", "</s>", *(f"<{r}>" for r in ROLES)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         show_progress=False))  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        padding_side="right", chat_template=REWARD_TEMPLATE,
    )  # fmt: skip
