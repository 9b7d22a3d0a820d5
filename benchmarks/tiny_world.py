"""The benchmark's models and prompts, built locally and deterministically (nothing is downloaded).

The same recipe as the TRL anchor measurements: a byte-level BPE tokenizer trained on synthetic
sentences, a random ``LlamaForCausalLM`` policy (also the reference) and a random
``LlamaForSequenceClassification`` reward model (also the value model's starting point), chat-formatted
prompts of 13-17 tokens. One difference, for matched work: ``</s>`` is the tokenizer's last id and the
policy's vocabulary stops just before it, so the policy can never emit EOS and every response is
exactly ``max_new_tokens`` long, as in TRL with ``stop_token=None``. The reward model's vocabulary does
include ``</s>`` (lmppo renders the assistant turn, EOS included, with the RM's own template).

Layout of ``OUT/``: ``policy/`` and ``reward/`` (model + tokenizer each), ``prompts.jsonl`` (for
lmppo), ``prompt_ids.json`` (the same prompts rendered with the chat template, for TRL), ``info.json``.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SIZES = {  # name -> (hidden, layers, heads); vocab 1024, MLP 4 x hidden, untied embeddings
    "h128_l4": (128, 4, 4),
    "h256_l6": (256, 6, 8),
    "h512_l8": (512, 8, 8),
}
SPECIALS = ["<pad>", "<s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|system|>\\n' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WORDS = {
    "adj": [
        "red",
        "blue",
        "green",
        "quiet",
        "loud",
        "small",
        "large",
        "bright",
        "dark",
        "warm",
        "cold",
        "fast",
        "slow",
        "happy",
        "sad",
        "old",
        "new",
        "tiny",
    ],
    "noun": [
        "cat",
        "dog",
        "river",
        "mountain",
        "city",
        "robot",
        "garden",
        "ocean",
        "forest",
        "teacher",
        "student",
        "engine",
        "planet",
        "song",
        "book",
    ],
    "verb": [
        "runs",
        "sleeps",
        "sings",
        "jumps",
        "waits",
        "grows",
        "shines",
        "falls",
        "climbs",
        "dances",
        "builds",
        "reads",
        "listens",
        "flies",
    ],
    "place": [
        "near the lake",
        "in the park",
        "under the bridge",
        "on the hill",
        "at the market",
        "by the sea",
    ],
    "task": [
        "Write a short story about",
        "Describe",
        "Tell me something nice about",
        "Explain why people like",
        "Write a poem about",
        "Give a fun fact about",
        "Summarize a day of",
        "Compare two kinds of",
    ],
}
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "nu",
    "pe",
    "ra",
    "si",
    "to",
    "vu",
    "xe",
    "zo",
    "ba",
    "de",
    "fi",
    "gu",
    "ha",
    "jo",
    "ke",
    "lu",
    "ma",
    "ne",
    "ri",
    "so",
    "ta",
    "we",
    "yo",
]


@dataclass(frozen=True)
class WorldSpec:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    vocab: int = 1024  # the policy's output vocabulary; the tokenizer has one more id (</s>)
    prompts: int = 512
    seed: int = 1234

    @property
    def name(self) -> str:
        return f"h{self.hidden}_l{self.layers}_v{self.vocab}_s{self.seed}"


def sentence(rng: random.Random, names: list[str]) -> str:
    w = WORDS
    return (
        f"{rng.choice(names)} saw the {rng.choice(w['adj'])} {rng.choice(w['noun'])} {rng.choice(w['verb'])} "
        f"{rng.choice(w['place'])}, and {rng.randint(2, 999)} {rng.choice(w['noun'])}s {rng.choice(w['verb'])}."
    )


def prompt_text(rng: random.Random) -> str:
    w = WORDS
    return f"{rng.choice(w['task'])} the {rng.choice(w['adj'])} {rng.choice(w['noun'])} {rng.choice(w['place'])}."


def build_tokenizer(spec: WorldSpec):
    """Byte-level BPE with ``spec.vocab`` ids, then ``</s>`` appended as id ``spec.vocab``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(spec.seed)
    # pseudo-words give BPE enough distinct material to fill the vocabulary
    names = [
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize() for _ in range(400)
    ]
    corpus = [sentence(rng, names) for _ in range(20000)] + [prompt_text(rng) for _ in range(5000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        extra_special_tokens=SPECIALS[2:],
        padding_side="left",
    )
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    assert tokenizer.eos_token_id == spec.vocab == len(tokenizer) - 1, (
        "</s> must be the one id past the policy"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_config(spec: WorldSpec, tokenizer, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id < vocab_size else None,
    )


def build_world(spec: WorldSpec, out: Path) -> Path:
    """Build (once; reused when ``out/info.json`` matches ``spec``) and return ``out``."""
    info_path = out / "info.json"
    if info_path.is_file() and json.loads(info_path.read_text()).get("spec") == asdict(spec):
        return out
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = build_tokenizer(spec)
    torch.manual_seed(spec.seed)
    policy = LlamaForCausalLM(llama_config(spec, tokenizer, spec.vocab))
    torch.manual_seed(spec.seed + 1)
    reward = LlamaForSequenceClassification(llama_config(spec, tokenizer, len(tokenizer)))
    for name, model in (("policy", policy), ("reward", reward)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)

    rng = random.Random(spec.seed + 2)
    texts = [prompt_text(rng) for _ in range(spec.prompts)]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    (out / "prompt_ids.json").write_text(json.dumps(ids))
    lengths = [len(x) for x in ids]
    info = {
        "spec": asdict(spec),
        "policy_params": sum(p.numel() for p in policy.parameters()),
        "reward_params": sum(p.numel() for p in reward.parameters()),
        "prompt_tokens_min_mean_max": [min(lengths), sum(lengths) / len(lengths), max(lengths)],
    }
    info_path.write_text(json.dumps(info, indent=1))
    return out
