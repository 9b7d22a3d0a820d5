"""Scoring, the second stage of every step: a :class:`~lmppo.sampling.rollout.Rollout` in, a
:class:`~lmppo.sampling.rollout.ScoredRollout` out, with everything the estimator and the update read off
the samples before the policy moves:

- the reward: each component's raw score of each response (unless sampling scored it already), its
  preprocessing, DAPO's overlong shaping and, under ``rollout.truncation=bootstrap``, no score on an
  unfinished row (:meth:`Scorer.rewards`);
- the frozen reference's log-probs, and from them the per-token KL to the reference (the estimator's
  ``kl_estimator``), stored once on the record for the estimator and the metrics;
- the critic's values, unless the decode loop read them off the current policy's trunk already;
- under ``ppo.tis_cap``, the trainer's own log-probs and the truncated importance weights.

Each pass runs without gradients in forwards of a token budget that out-of-memory recovery may halve
(:mod:`lmppo.training.budgets`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import torch
from torch import nn

from lmppo.inputs.config import Config
from lmppo.inputs.resolve import RunSpec
from lmppo.math import core
from lmppo.modeling.distributed import failing_together, gathered
from lmppo.modeling.models import PPOModels
from lmppo.rewards.scoring import CombinedReward
from lmppo.sampling.passes import sequence_logprobs, value_predictions
from lmppo.sampling.rollout import Rollout, ScoredRollout, padded_tokens, stored_pass_batches
from lmppo.training.budgets import TokenBudgets
from lmppo.training.metrics import timed
from lmppo.training.step_results import RewardStage

T = TypeVar("T")


class Scorer:
    """Rollout -> ScoredRollout (the module docstring): the reward, the reference, the critic and the
    trainer's own log-probs over the samples."""

    def __init__(
        self,
        cfg: Config,
        spec: RunSpec,
        models: PPOModels,
        reward: CombinedReward,
        budgets: TokenBudgets,
        autocast: Callable[[], AbstractContextManager],
        *,
        oom_retries: int | None,
        group=None,
    ) -> None:
        self.cfg, self.spec, self.models, self.reward = cfg, spec, models, reward
        self.budgets, self.autocast, self.group = budgets, autocast, group
        self.oom_retries = oom_retries  # halvings of the stored passes' budget (None: no redo, several ranks)

    @torch.inference_mode()
    def score(
        self, rollout: Rollout, policy_version: int, seconds: dict[str, float]
    ) -> tuple[ScoredRollout, RewardStage]:
        """The scored record of ``rollout`` (sampled by ``policy_version`` or before) and its reward stage;
        each pass's time into ``seconds``."""
        mask, reference = rollout.action_mask, self.models.reference
        rm_score, reward = self.rewards(rollout, seconds)
        with timed(seconds, "perf/reference_s"), self.autocast(), gathered(reference):
            logp_ref = self.stored_pass(functools.partial(sequence_logprobs, reference, rollout), rollout)
        values = {}
        if self.models.value is not None:  # critic-free runs have no values
            values = self._values(rollout, policy_version, seconds)
        tis = self._truncated_importance_sampling(rollout) if self.cfg.ppo.tis_cap else {}
        logp_old = tis.get("logp_trainer", rollout.logp_old)  # ScoredRollout.logp_old_for_update
        kl = core.kl_estimate(logp_old, logp_ref, self.spec.estimator.kl_estimator)
        kl_ref = torch.where(mask.bool(), kl, 0.0)
        scored = ScoredRollout.after(
            rollout, rm_score=rm_score, logp_ref=logp_ref, kl_ref=kl_ref, **values, **tis
        )
        return scored, reward

    def rewards(self, rollout: Rollout, seconds: dict[str, float]) -> tuple[torch.Tensor, RewardStage]:
        """(B,) the score each row's reward uses, and what the reward stage made beside it."""
        mask = rollout.action_mask
        with timed(seconds, "perf/reward_s"):
            raw = dict(zip([c.name for c in self.reward.components], self.raw_scores(rollout).unbind(1)))
        rm_score_raw = self.reward.weighted(raw).to(mask.device)
        rm_score, component_rows, stats = self.reward.shape(
            raw, rollout.terminated.to(mask.device), self.group
        )
        if self.cfg.reward.overlong_buffer is not None:  # DAPO: the score fades near the length limit
            rm_score, stats["reward/overlong_penalty"] = self._overlong(rollout, rm_score)
        # A truncated row either ends the episode (scored, nothing after it) or is unfinished (its future,
        # score included, is V(s_after)): never both, or truncation would be paid twice.
        bootstrapped = self.spec.estimator.bootstrap_truncated
        if bootstrapped:
            rm_score = torch.where(rollout.terminated, rm_score, 0.0)
        differs = bool(stats) or bool(component_rows) or bootstrapped
        return rm_score, RewardStage(rm_score_raw, component_rows, stats, differs)

    def raw_scores(self, rollout: Rollout) -> torch.Tensor:
        """(B, C) each reward component's raw score of the rollout's responses (dynamic sampling may have
        scored them already)."""
        if rollout.reward_raw is not None:
            return torch.tensor(rollout.reward_raw)
        with self.autocast(), gathered(*self.models.reward_models):
            with failing_together(self.group):  # a reward function failing on one rank stops every rank
                raw = self.reward.raw_scores(rollout.prompts, rollout.response_texts)
        return torch.stack([raw[c.name].float().cpu() for c in self.reward.components], dim=1)

    def _overlong(self, rollout: Rollout, rm_score: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The score less ``reward.overlong_penalty`` x the share of the last ``overlong_buffer`` tokens
        before the limit each row used, and that penalty's mean."""
        reward = self.cfg.reward
        lengths = rollout.response_mask.sum(1).to(
            rm_score.device
        )  # actions and context: what the limit counts
        fraction = core.overlong_fraction(
            lengths, self.spec.engine.max_episode_tokens, reward.overlong_buffer
        )
        penalty = reward.overlong_penalty * fraction
        return rm_score - penalty, penalty.mean().item()

    def stored_pass(self, run: Callable[..., T], rollout: Rollout) -> T:
        """``run(forward_batch_size=, forward_batch_tokens=)``: a pass without gradients over ``rollout``,
        in forwards of the configured rows or, once set or halved, of the stored passes' token budget."""

        def batching(budget: int | None) -> dict:
            rows = None if budget else self.cfg.rollout.forward_batch_size
            return dict(forward_batch_size=rows, forward_batch_tokens=budget)

        def failed_tokens() -> int:
            batches = stored_pass_batches(rollout, *batching(self.budgets.stored_passes).values())
            return max(padded_tokens(batch) for _, batch in batches)

        return self.budgets.shrinking(
            "stored_passes", lambda budget: run(**batching(budget)), failed_tokens, self.oom_retries
        )

    def _values(
        self, rollout: Rollout, policy_version: int, seconds: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """``values`` and ``bootstrap_value`` from the current critic: a stored pass, unless the decode loop
        read them off the current policy's trunk already."""
        if rollout.values is not None and rollout.policy_version == policy_version:
            seconds["perf/values_s"] = 0.0
            return {}
        with timed(seconds, "perf/values_s"), self.autocast(), gathered(*self._value_modules()):
            values, bootstrap_value = self.stored_pass(
                functools.partial(value_predictions, self.models.value, rollout), rollout
            )
        return {"values": values, "bootstrap_value": bootstrap_value}

    def _value_modules(self) -> tuple[nn.Module, ...]:
        """What a value pass runs: the critic, and with a shared trunk the policy that holds it."""
        value = self.models.value
        return (value, self.models.policy) if value.shared_trunk else (value,)

    def _truncated_importance_sampling(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """``ppo.tis_cap``: the trainer's own log-probs of the samples (``logp_trainer``), which the PPO ratio
        is then taken against, and per-token weights ``min(p_trainer / p_sampler, cap)`` (``tis_weights``).
        ``logp_old`` stays the sampler's."""
        policy = self.models.policy
        with self.autocast(), gathered(policy):
            logp_trainer = self.stored_pass(functools.partial(sequence_logprobs, policy, rollout), rollout)
        weights = core.truncated_importance_weights(
            logp_trainer, rollout.logp_old, rollout.action_mask, self.cfg.ppo.tis_cap
        )
        return {"logp_trainer": logp_trainer, "tis_weights": weights}
