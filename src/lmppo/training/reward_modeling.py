"""Reward-model training on preference pairs (Bradley–Terry) and its held-out evaluation.

Pairs are rendered exactly as `lmppo.rewards.scoring.RewardModelScorer` renders what it scores: the reward
model's *own* tokenizer and chat template, whatever the policy uses. A sequence's score is the head's
output at its last real token (the EOS closing the assistant turn), located from the attention mask,
so it is right for left or right padding and when pad == EOS. (LlamaForSequenceClassification's own
pooling takes the last token that is not the pad id, which reads one token early when pad == EOS.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmppo.errors import LmppoError, warn
from lmppo.inputs.data import located_jsonl, prompt_of_row
from lmppo.modeling.loading import load_reward_model, load_tokenizer
from lmppo.modeling.lora import with_lora
from lmppo.modeling.models import ValueModel
from lmppo.rewards.scoring import RewardModelScorer
from lmppo.training.supervised import fit, merged, pad, trained_parameter_count

PAIR_KEYS = ("prompt", "chosen", "rejected")
RM_EVAL_FILE = "rm_eval.json"  # evaluate_reward_model's summary, beside the model and in a run directory
SLICE_KEYS = ("type", "length_bucket")


def sequence_scores(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) float32 scores of a one-label sequence classifier, read at each row's last real token."""
    # the reward model's backbone and score head applied at every position (same weights, not a copy)
    per_token = ValueModel.from_reward_model(model, copy_weights=False)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # the same for left and right padding
    scores = per_token(input_ids, attention_mask, positions)  # (B, L)
    last = (torch.arange(input_ids.shape[1], device=input_ids.device) * attention_mask).argmax(-1)
    return scores.gather(1, last.unsqueeze(1)).squeeze(1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged: the NLL of the observed preferences."""
    return -F.logsigmoid(chosen - rejected).mean()


def _pair_scores(
    model, scorer: RewardModelScorer, pairs: Sequence[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected scores from one forward pass over both halves (right-padded)."""
    rows = [scorer.render(p["prompt"], p[side]) for side in ("chosen", "rejected") for p in pairs]
    scores = sequence_scores(model, pad(rows, 0), pad([[1] * len(r) for r in rows], 0))
    return scores[: len(pairs)], scores[len(pairs) :]


def train_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[dict],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float = 0.01,
    warmup_frac: float = 0.05,
    max_grad_norm: float = 1.0,
    chat_template: str | None = None,
) -> dict:
    """Train `model` in place on {"prompt", "chosen", "rejected"} pairs; it is left in eval mode.

    `chat_template` overrides the tokenizer's, as `RewardModelScorer` does. Returns {"loss",
    "accuracy" (per step, on the training batch), "steps", "time_s"}.
    """
    if not pairs:
        raise LmppoError("reward model: no preference pairs to train on; check the preference data file")
    scorer = RewardModelScorer(model, tokenizer, chat_template=chat_template)

    def batch_loss(chunk: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = _pair_scores(model, scorer, chunk)
        return bradley_terry_loss(chosen, rejected), {"accuracy": (chosen > rejected).float().mean().item()}

    return fit(
        model,
        pairs,
        batch_loss,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        weight_decay=weight_decay,
        warmup_frac=warmup_frac,
        max_grad_norm=max_grad_norm,
        stage="reward model",
    )


def _summary(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    rewards = torch.cat([chosen, rejected])
    q10, q50, q90 = torch.quantile(rewards, torch.tensor([0.1, 0.5, 0.9])).tolist()
    return {
        "n": len(chosen),
        "accuracy": (chosen > rejected).float().mean().item(),
        "margin_mean": (chosen - rejected).mean().item(),
        "chosen_mean": chosen.mean().item(),
        "rejected_mean": rejected.mean().item(),
        "reward": {
            "mean": rewards.mean().item(),
            "std": rewards.std().item(),
            "q10": q10,
            "q50": q50,
            "q90": q90,
        },
    }


def evaluate_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[dict],
    *,
    batch_size: int = 64,
    slice_keys: Sequence[str] = SLICE_KEYS,
    chat_template: str | None = None,
) -> dict:
    """Held-out accuracy (chosen scored strictly above rejected) and reward distribution, overall and per slice.

    Returns the overall summary plus "slices": {key: {value: summary}} for each slice key that every
    pair carries (e.g. the toy's "type" and "length_bucket").
    """
    if not pairs:
        raise LmppoError("reward model evaluation: no preference pairs; check the held-out data file")
    scorer = RewardModelScorer(model, tokenizer, chat_template=chat_template, batch_size=batch_size)
    prompts = [p["prompt"] for p in pairs]
    chosen = scorer(prompts, [p["chosen"] for p in pairs])
    rejected = scorer(prompts, [p["rejected"] for p in pairs])
    result = _summary(chosen, rejected)
    result["slices"] = {}
    for key in (k for k in slice_keys if all(k in p for p in pairs)):
        values = [p[key] for p in pairs]
        result["slices"][key] = {}
        for value in sorted(set(values)):
            members = torch.tensor([v == value for v in values])
            result["slices"][key][value] = _summary(chosen[members], rejected[members])
    return result


def load_preference_jsonl(path: str | Path) -> list[dict]:
    """Rows {"prompt", "chosen", "rejected", ...}: the prompt a string or chat messages (or a "messages"
    list), the responses strings. A bad row is an error naming the file, the line and the problem.

    Pairs whose chosen and rejected responses are identical teach nothing: they are skipped with a warning.
    """
    rows, ties = [], []
    for where, row in located_jsonl(path):
        for key in ("chosen", "rejected"):
            if key not in row:
                raise LmppoError(f"{where}: missing key {key!r}; every row needs {list(PAIR_KEYS)}")
            if not isinstance(row[key], str):
                raise LmppoError(f"{where}: {key!r} must be the response text, got {type(row[key]).__name__}")
        row["prompt"] = prompt_of_row(row, where)
        if row["chosen"] == row["rejected"]:
            ties.append(where)
        else:
            rows.append(row)
    if ties and rows:
        warn(
            f"{path}: skipped {len(ties)} pairs whose chosen and rejected responses are identical ({ties[0]}, ...)"
        )
    if not rows:
        why = (
            f"in every line chosen and rejected are the same text ({', '.join(ties[:3])}), which teaches nothing"
            if ties
            else "it has no lines"
        )
        raise LmppoError(
            f"{path} holds no usable preference pairs: {why}. Each line must be a JSON object "
            f"{list(PAIR_KEYS)} with two different responses"
        )
    return rows


def run_train_rm(cfg) -> dict:
    """``lmppo train-rm CONFIG``: Bradley-Terry training of ``cfg.model`` (a new score head on a causal LM,
    or an existing reward model) on ``cfg.data`` pairs; saves it to ``cfg.output_dir`` with held-out metrics.

    With ``cfg.lora.enabled`` the backbone is frozen except for LoRA adapters, the score head is trained in
    full, and the adapters are merged before saving: the directory is a plain sequence-classification model."""
    m = cfg.model
    pairs = load_preference_jsonl(cfg.data)
    held_out = load_preference_jsonl(cfg.eval_data) if cfg.eval_data else None
    tokenizer = load_tokenizer(m)
    model = with_lora(load_reward_model(m, new_head=True, pad_token_id=tokenizer.pad_token_id), cfg.lora)
    stats = train_reward_model(
        model,
        tokenizer,
        pairs,
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        chat_template=m.chat_template,
    )
    stats["trained_parameters"] = trained_parameter_count(model)
    model = merged(model)
    out = Path(cfg.output_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if held_out:
        stats["eval"] = evaluate_reward_model(model, tokenizer, held_out, chat_template=m.chat_template)
        write_rm_eval_json(out, stats["eval"])
    return stats


def write_rm_eval_json(directory: str | Path, rm_eval: dict) -> Path:
    """Write ``DIRECTORY/rm_eval.json``: the output of :func:`evaluate_reward_model` (read by the report)."""
    path = Path(directory) / RM_EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rm_eval, indent=1) + "\n")
    return path
