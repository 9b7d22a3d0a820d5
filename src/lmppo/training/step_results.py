"""A step's typed results and the metrics named from them: what scoring's reward stage and the estimator
made beside their records, and what one micro-batch, one minibatch and the update report to
:class:`lmppo.training.trainer.PPOTrainer`. Each stage's metrics are computed from its records after it.
The trainer steers by these records' fields and by two global means of scoring's metrics (``kl/ref`` feeds
the KL controller, ``response/length`` the run's token count); the dictionaries are otherwise only logged.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import astuple, dataclass, fields

import torch

from lmppo.math import core
from lmppo.modeling.distributed import all_sum
from lmppo.sampling.rollout import EpisodePart, EstimatedRollout, ScoredRollout


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
    kl_loss: float = 0.0  # kl.in_loss: the k3 estimate of KL(new || reference) per token

    def add(self, other: TokenMeans, weight: float) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * weight)


@dataclass
class MinibatchResult:
    """One optimiser step: global token means, pre-clip gradient norms, the largest ratio on this rank."""

    means: TokenMeans
    policy_grad_norm: float
    value_grad_norm: float | None  # None without a critic
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


@dataclass(frozen=True)
class RewardStage:
    """What scoring's reward stage made beside the scored record (which keeps the score used), for the
    metrics: the raw score and what preprocessing did to it."""

    raw: torch.Tensor  # (B,) the components' raw scores, weighted: reward/rm_score
    component_rows: dict[str, torch.Tensor]  # per row: reward/<name>/raw and /used, reward/gate_frac
    stats: dict[str, float]  # preprocessing's: normalisation, clipping, penalties (reward/overlong_penalty)
    differs: bool  # preprocessing, components or bootstrapping make the score used differ from the raw


@dataclass(frozen=True)
class RewardEstimates:
    """What the advantages were computed from, for the metrics."""

    rewards: torch.Tensor  # (B, R) shaped
    beta: float  # the KL coefficient in the rewards
    adv_mean: float  # before whitening
    adv_std: float
    flat_groups: torch.Tensor | None = None  # (B,) bool, group baselines: the row's group scored alike
    kl_in_reward: bool = True  # False under kl.in_loss: the update's loss carries it (policy/kl_loss)


def row_means(per_row: dict[str, torch.Tensor], rows: int, device, group) -> dict[str, float]:
    """Each (B,) quantity's mean over all ranks' rows."""
    every_row = torch.ones(1, rows, device=device)
    return {key: core.masked_mean(value[None], every_row, group).item() for key, value in per_row.items()}


def scored_metrics(
    scored: ScoredRollout, reward: RewardStage, tis_cap: float | None, group
) -> dict[str, float]:
    """The scoring side of a step, from its records: sequence-level quantities averaged over all ranks'
    rows (the score used and each component's when ``reward.differs``; in an episode, ``reward/total``: the
    raw score plus the turn rewards, what the displays call the reward), the rollout's age, the non-finite
    count, the preprocessing's statistics and, under ``ppo.tis_cap``, the share of capped weights."""
    mask = scored.action_mask
    per_row = {
        "reward/rm_score": reward.raw,
        "kl/ref": scored.kl_ref.sum(1),
        "response/length": mask.sum(1),
        "response/eos_frac": scored.terminated.float(),
        "response/truncated_frac": (~scored.terminated).float(),
    }
    if reward.differs:
        per_row["reward/rm_score_used"] = scored.rm_score
        per_row.update(reward.component_rows)
    if scored.episode is not None:  # an environment's episodes: the reward is the final score plus the turns'
        per_row |= episode_rows(scored.episode)
        per_row["reward/total"] = reward.raw + per_row["reward/turn"].to(reward.raw.device)
    metrics = row_means(per_row, len(scored), mask.device, group)
    metrics["lag/rollout_age_s"] = time.time() - scored.created_at
    metrics["health/nonfinite"] = nonfinite_count(
        reward.raw, scored.logp_ref, scored.values, scored.action_mask, group
    )
    metrics |= reward.stats
    if scored.tis_weights is not None:
        clipped = (scored.tis_weights >= tis_cap).float()
        metrics["engine/tis_clip_frac"] = core.masked_mean(clipped, mask, group).item()
    return metrics


def episode_rows(episode: EpisodePart) -> dict[str, torch.Tensor]:
    """Per episode: each count its environment reports (``episode/<name>``), the context tokens its turns
    inserted and the sum of its turn rewards."""
    rows = {f"episode/{name}": count.float() for name, count in episode.counts.items()}
    rows["episode/context_tokens"] = episode.context_mask.sum(1)
    rows["reward/turn"] = episode.turn_rewards.sum(1)
    return rows


def estimate_metrics(estimated: EstimatedRollout, e: RewardEstimates, group) -> dict[str, float]:
    """The estimator's side: the shaped reward and its KL penalty per sequence, the advantages' statistics
    and, with a critic, the value fit."""
    per_row = {"reward/shaped": e.rewards.sum(1)}
    if e.kl_in_reward:
        per_row["reward/kl_penalty"] = -e.beta * estimated.kl_ref.sum(1)
    if e.flat_groups is not None:  # no learning signal from a group whose samples all scored the same
        per_row["adv/flat_group_frac"] = e.flat_groups.float()
    metrics = row_means(per_row, len(estimated), estimated.response_mask.device, group)
    metrics |= {"adv/mean": e.adv_mean, "adv/std": e.adv_std}
    if estimated.values is not None:  # a critic-free run logs no value metrics rather than zeros
        metrics["value/explained_var"] = core.explained_variance(
            estimated.values, estimated.returns, estimated.action_mask, group
        ).item()
    return metrics


def update_metrics(totals: TokenMeans, results: list[MinibatchResult], kl_in_loss: bool) -> dict[str, float]:
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
        "policy/grad_norm": sum(r.policy_grad_norm for r in results) / n,
    }
    if results[0].value_grad_norm is not None:  # a critic-free run logs no value metrics rather than zeros
        metrics["value/loss"] = mean.value_loss
        metrics["value/clip_frac"] = mean.value_clip_frac
        metrics["value/grad_norm"] = sum(r.value_grad_norm for r in results) / n
    if kl_in_loss:
        metrics["policy/kl_loss"] = mean.kl_loss
    if results[0].ptx_loss is not None:
        metrics["ptx/loss"] = sum(r.ptx_loss for r in results) / n
    return metrics


def step_metrics(
    stages: dict[str, float],
    update: UpdateResult,
    *,
    beta: float | None,
    lag: int,
    seconds: dict[str, float],
    n_tokens: float,
) -> dict[str, float]:
    """One step's metrics from its records: the stages' before the update (scoring's, the estimator's), the
    update, the controller's beta (None: no KL coefficient in this step), the lag and the phase times with
    the throughputs made from them."""
    return {
        **stages,
        **update.metrics,
        "policy/epochs": float(update.epochs),
        "policy/updates": float(update.updates),
        "health/nonfinite_updates": float(update.nonfinite_updates),
        **({} if beta is None else {"kl/beta": beta}),
        "lag/policy_versions": float(lag),
        "health/nonfinite": stages["health/nonfinite"] + update.nonfinite_updates,
        **seconds,
        "perf/rollout_tokens_per_s": n_tokens / max(seconds["perf/rollout_s"], 1e-9),
        "perf/train_tokens_per_s": n_tokens * update.epochs / max(seconds["perf/update_s"], 1e-9),
        "perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def nonfinite_count(rm_score_raw, logp_ref, values, mask, group) -> float:
    """Non-finite scores, reference log-probs and values if any (on response tokens) over all ranks' rows."""
    per_token = [t for t in (logp_ref, values) if t is not None]
    checked = [rm_score_raw, *(torch.where(mask.bool(), t, 0.0) for t in per_token)]
    return all_sum(sum((~torch.isfinite(t)).sum().double() for t in checked), group).item()
