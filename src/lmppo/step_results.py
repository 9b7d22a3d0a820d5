"""The PPO step's typed results and the metrics named from them: what one micro-batch, one minibatch and
the update report to :class:`lmppo.trainer.PPOTrainer`, and the reward-side metrics of a scored rollout.
The trainer steers by these records' fields; the dictionaries here are only what is logged.
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass, fields

import torch

from lmppo import core
from lmppo.distributed import all_sum
from lmppo.rollout import Rollout


@dataclass
class TokenMeans:
    """A micro-batch's statistics as token means over its response tokens; weighted by each micro-batch's
    share of the global minibatch's tokens and summed, the minibatch's global token means."""

    policy_loss: float = 0.0
    clip_frac: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    ratio_mean: float = 0.0
    ratio_sq: float = 0.0  # for the ratio's standard deviation
    value_loss: float = 0.0
    value_clip_frac: float = 0.0
    logp_gap: float = 0.0  # |logp_new - the sampler's logp_old|: before any update, engine vs trainer

    def add(self, other: TokenMeans, weight: float) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * weight)


@dataclass
class MinibatchResult:
    """One optimiser step: global token means, pre-clip gradient norms, the largest ratio on this rank."""

    means: TokenMeans
    policy_grad_norm: float
    value_grad_norm: float
    ratio_max: float
    finite: bool  # both gradient norms finite: the step was applied
    ptx_loss: float | None = None


@dataclass
class UpdateResult:
    """The PPO epochs of one step."""

    metrics: dict[str, float]  # policy/*, value/*, engine/logp_gap, ptx/loss: means over the updates
    epochs: int
    updates: int
    nonfinite_updates: int  # optimiser steps skipped for a NaN/inf gradient
    policy_moved: bool


@dataclass
class Estimates:
    """What scoring a rollout gives the rest of the step beside the metrics it logs."""

    metrics: dict[str, float]
    kl_ref: float  # the global mean per-sequence KL, for the controller
    mean_length: float  # response tokens per row (all ranks)


@dataclass
class RewardEstimates:
    """What the advantages were computed from, for the metrics."""

    rm_score: torch.Tensor  # (B,) the score used (preprocessed; 0 on unfinished rows under bootstrap)
    rewards: torch.Tensor  # (B, R) shaped
    kl_per_token: torch.Tensor  # (B, R) 0 off the response
    beta: float
    adv_mean: float  # before whitening
    adv_std: float


def rollout_metrics(
    rollout: Rollout,
    rm_score_raw: torch.Tensor,
    estimates: RewardEstimates,
    component_rows: dict[str, torch.Tensor] | None,
    group,
) -> dict[str, float]:
    """The reward-side metrics of a scored rollout: sequence-level quantities averaged over all ranks'
    rows, the advantages' statistics, the value fit, the rollout's age and the non-finite count.
    ``component_rows`` (with the score used) when preprocessing or components make it differ from the raw."""
    mask, e = rollout.response_mask, estimates
    per_row = {
        "reward/rm_score": rm_score_raw,
        "reward/kl_penalty": -e.beta * e.kl_per_token.sum(1),
        "reward/shaped": e.rewards.sum(1),
        "kl/ref": e.kl_per_token.sum(1),
        "response/length": mask.sum(1),
        "response/eos_frac": rollout.terminated.float(),
        "response/truncated_frac": (~rollout.terminated).float(),
    }
    if component_rows is not None:
        per_row["reward/rm_score_used"] = e.rm_score
        per_row.update(component_rows)
    every_row = torch.ones(1, len(rollout), device=mask.device)
    metrics = {key: core.masked_mean(value[None], every_row, group).item() for key, value in per_row.items()}
    return metrics | {
        "adv/mean": e.adv_mean,
        "adv/std": e.adv_std,
        "value/explained_var": core.explained_variance(rollout.values, rollout.returns, mask, group).item(),
        "lag/rollout_age_s": time.time() - rollout.created_at,
        "health/nonfinite": nonfinite_count(rm_score_raw, rollout.logp_ref, rollout.values, mask, group),
    }


def update_metrics(totals: TokenMeans, results: list[MinibatchResult]) -> dict[str, float]:
    """The update's metrics: each statistic's mean over its optimiser steps."""
    n = len(results)
    mean = TokenMeans(*(value / n for value in astuple(totals)))
    metrics = {
        "policy/loss": mean.policy_loss,
        "policy/clip_frac": mean.clip_frac,
        "policy/approx_kl": mean.approx_kl,
        "policy/entropy": mean.entropy,
        "policy/ratio_mean": mean.ratio_mean,
        "policy/ratio_std": math.sqrt(max(mean.ratio_sq - mean.ratio_mean**2, 0.0)),
        "value/loss": mean.value_loss,
        "value/clip_frac": mean.value_clip_frac,
        "policy/grad_norm": sum(r.policy_grad_norm for r in results) / n,
        "value/grad_norm": sum(r.value_grad_norm for r in results) / n,
    }
    if results[0].ptx_loss is not None:
        metrics["ptx/loss"] = sum(r.ptx_loss for r in results) / n
    return metrics


def nonfinite_count(rm_score_raw, logp_ref, values, mask, group) -> float:
    """Non-finite scores, reference log-probs and values (on response tokens) over all ranks' rows."""
    return all_sum(
        sum(
            (~torch.isfinite(t)).sum().double()
            for t in (
                rm_score_raw,
                torch.where(mask.bool(), logp_ref, 0.0),
                torch.where(mask.bool(), values, 0.0),
            )
        ),
        group,
    ).item()
