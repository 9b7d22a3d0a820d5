"""Supervised fine-tuning on demonstrations: the policy's starting point (and PPO's reference).

Each example is rendered exactly as the policy will see it during rollouts: the chat template with the
generation prompt gives the query, the response tokens plus EOS follow. Only the response (EOS
included) is a target; query and padding positions get the label -100. A demonstrated episode (tool calls,
their results, the user's next turns) is rendered as an episode is played (:mod:`lmppo.sampling.episodes`):
each assistant turn is a target, the context between turns is not. Works for any HF causal LM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmppo.errors import LmppoError
from lmppo.inputs.data import (
    Continuation,
    Prompt,
    as_messages,
    encode_context,
    load_demonstrations,
    render_query_ids,
)
from lmppo.modeling.loading import load_causal_lm, load_tokenizer
from lmppo.modeling.lora import with_lora
from lmppo.sampling.tools import tool_schemas
from lmppo.training.supervised import fit, merged, pad, trained_parameter_count

IGNORE = -100  # label of positions that carry no loss


def sft_features(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    response: Continuation,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one demonstration: labels are -100 on the query, the ids on response + EOS; in
    a demonstrated episode on each assistant turn + EOS, -100 on the context between turns. ``tools``: the
    schemas the run renders (``rollout.tools``), so SFT sees what rollouts do."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise LmppoError("SFT: the tokenizer has no EOS token; set tokenizer.eos_token so responses can end")
    turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
    history = as_messages(prompt)
    ids = render_query_ids(tokenizer, prompt, chat_template, tools=tools)
    labels = [IGNORE] * len(ids)
    starts = [i for i, message in enumerate(turns) if message["role"] == "assistant"] + [len(turns)]
    for start, end in zip(starts, starts[1:]):
        turn, between = turns[start]["content"], turns[start + 1 : end]
        # split_special_tokens: a response's text never becomes a control token; the EOS target is appended
        turn_ids = tokenizer(turn, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [eos]
        ids, labels = ids + turn_ids, labels + turn_ids
        if end < len(turns):  # another turn follows: the context up to its generation prompt
            stop_text = tokenizer.decode([eos])
            context = encode_context(
                tokenizer, chat_template, history, turn, stop_text, between, more_turns=True, tools=tools
            )
            ids, labels = ids + context, labels + [IGNORE] * len(context)
        history = [*history, turns[start], *between]
    return ids, labels


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict],
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> dict[str, torch.Tensor]:
    """Collate {"prompt", "response"} examples into input_ids, attention_mask and labels (right-padded).

    Labels come from the features, not from masking pad ids, so an EOS target survives when pad == EOS.
    """
    features = [
        sft_features(tokenizer, ex["prompt"], ex["response"], chat_template, tools) for ex in examples
    ]
    ids = [f[0] for f in features]
    # padded positions are masked out of attention and loss, so the fill id is never read
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "input_ids": pad(ids, pad_id),
        "attention_mask": pad([[1] * len(i) for i in ids], 0),
        "labels": pad([f[1] for f in features], IGNORE),
    }


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float = 0.01,
    warmup_frac: float = 0.05,
    max_grad_norm: float = 1.0,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> dict:
    """Train `model` in place on {"prompt", "response"} examples; it is left in eval mode.

    `chat_template` overrides the tokenizer's, as the rollout generator's option does; `tools`: the schemas
    of the PPO run this SFT prepares (its ``rollout.tools``), rendered as its rollouts render them. Returns
    {"loss": per-step mean response-token NLL, "steps", "tokens" (response tokens), "time_s"}.
    """
    if not examples:
        raise LmppoError("SFT: no demonstrations to train on; check the SFT data file")

    def batch_loss(chunk: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = sft_batch(tokenizer, chunk, chat_template, tools)
        loss = model(**batch).loss  # HF shifts labels and averages over the non -100 targets
        return loss, {"tokens": int((batch["labels"] != IGNORE).sum())}

    stats = fit(
        model,
        examples,
        batch_loss,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        weight_decay=weight_decay,
        warmup_frac=warmup_frac,
        max_grad_norm=max_grad_norm,
        stage="SFT",
    )
    stats["tokens"] = sum(stats.pop("tokens", []))
    return stats


@torch.no_grad()
def response_nll(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict],
    batch_size: int = 64,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> float:
    """Mean NLL per response token (EOS included) on held-out demonstrations; exp() is the perplexity."""
    total, count = response_nll_sum(model, tokenizer, examples, batch_size, chat_template, tools)
    return total / max(count, 1)


def response_nll_sum(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[dict],
    batch_size: int = 64,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> tuple[float, int]:
    """(summed NLL, response tokens) over ``examples``: what ranks add up for a global mean."""
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = sft_batch(tokenizer, examples[start : start + batch_size], chat_template, tools)
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        total += model(**batch).loss.item() * n
        count += n
    return total, count


def run_sft(cfg) -> dict:
    """``lmppo sft CONFIG``: fine-tune ``cfg.model`` on ``cfg.data`` (all weights, or LoRA adapters merged at the
    end when ``cfg.lora.enabled``) and save it (with its tokenizer) to ``cfg.output_dir``."""
    tokenizer = load_tokenizer(cfg.model)
    model = with_lora(load_causal_lm(cfg.model), cfg.lora)
    examples = [{"prompt": p, "response": r} for p, r in load_demonstrations(cfg.data)]
    tools = tool_schemas(cfg.tools)
    stats = train_sft(
        model,
        tokenizer,
        examples,
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        chat_template=cfg.model.chat_template,
        tools=tools,
    )
    stats["trained_parameters"] = trained_parameter_count(model)
    model = merged(model)  # what is evaluated is what is saved
    if cfg.eval_data:
        held_out = [{"prompt": p, "response": r} for p, r in load_demonstrations(cfg.eval_data)]
        stats["eval_nll"] = response_nll(
            model, tokenizer, held_out, chat_template=cfg.model.chat_template, tools=tools
        )
    model.save_pretrained(cfg.output_dir)
    tokenizer.save_pretrained(cfg.output_dir)
    return stats
