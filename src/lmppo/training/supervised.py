"""What the two supervised stages share (SFT and reward-model training): padding, epochs of shuffled
batches, the AdamW + warmup/cosine update rule, and saving a LoRA model merged."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch
from peft import PeftModel
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from lmppo.errors import LmppoError
from lmppo.modeling.models import trainable_parameters
from lmppo.progress import BatchLines, phase


def pad(rows: Sequence[Sequence[int]], value: int, side: str = "right") -> torch.Tensor:
    """Pad int lists to one (B, L) tensor on the given side."""
    width = max(len(r) for r in rows)
    fill = [[value] * (width - len(r)) for r in rows]
    padded = [f + list(r) if side == "left" else list(r) + f for f, r in zip(fill, rows)]
    return torch.tensor(padded, dtype=torch.long)


def shuffled_batches(items: Sequence, batch_size: int, rng: random.Random):
    """One epoch: `items` in a fresh random order, in chunks of `batch_size` (the last may be short)."""
    order = list(range(len(items)))
    rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        yield [items[i] for i in order[start : start + batch_size]]


class UpdateRule:
    """AdamW with linear warmup then cosine decay and gradient-norm clipping: SFT's and RM training's step."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        total_steps: int,
        weight_decay: float,
        warmup_frac: float,
        max_grad_norm: float,
    ) -> None:
        self.params = trainable_parameters(model)
        if not self.params:
            raise LmppoError(
                f"{type(model).__name__} has no trainable parameters: load it unfrozen to train it"
            )
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.schedule = get_cosine_schedule_with_warmup(
            self.optimizer, int(warmup_frac * total_steps), total_steps
        )
        self.max_grad_norm = max_grad_norm

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()


def fit(
    model: torch.nn.Module,
    items: Sequence,
    batch_loss: Callable[[list], tuple[torch.Tensor, dict[str, float]]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float,
    warmup_frac: float,
    max_grad_norm: float,
    stage: str,
) -> dict:
    """``epochs`` of shuffled batches of ``items``, one :class:`UpdateRule` step on each batch's loss.

    ``batch_loss(batch) -> (loss, extras)``. The model trains in train mode and is left in eval mode.
    ``stage`` names the progress lines ("SFT", "reward model").
    Returns ``{"loss": per-step losses, <each extra>: per-step values, "steps", "time_s"}``.
    """
    total_steps = epochs * -(-len(items) // batch_size)
    update = UpdateRule(
        model,
        lr=lr,
        total_steps=total_steps,
        weight_decay=weight_decay,
        warmup_frac=warmup_frac,
        max_grad_norm=max_grad_norm,
    )
    rng, history, start = random.Random(seed), {"loss": []}, time.perf_counter()
    lines = BatchLines(stage, total_steps)  # a long SFT shows where it is, whatever stdout is
    model.train()
    for epoch in range(epochs):
        with phase(f"epoch {epoch + 1}/{epochs}"):
            for batch in shuffled_batches(items, batch_size, rng):
                loss, extras = batch_loss(batch)
                update.step(loss)
                history["loss"].append(loss.item())
                for name, value in extras.items():
                    history.setdefault(name, []).append(value)
                lines.batch(len(history["loss"]), history["loss"][-1])
    model.eval()
    return {**history, "steps": len(history["loss"]), "time_s": time.perf_counter() - start}


def merged(model: torch.nn.Module) -> PreTrainedModel:
    """A LoRA model with its adapter folded into the weights (a plain transformers model); else ``model``."""
    return model.merge_and_unload() if isinstance(model, PeftModel) else model


def trained_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in trainable_parameters(model))
