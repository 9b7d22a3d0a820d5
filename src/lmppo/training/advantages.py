"""From a scored rollout to its advantages, by the run's estimator (``RunSpec.estimator``, a row of
:data:`lmppo.math.estimators.ESTIMATORS` settled with the config; formulas in :mod:`lmppo.math.core` and
docs/core.md):

- ``gae``: the KL-shaped rewards and the critic's values through masked GAE; returns = A + V, where the
  critic's A may take its own lambda (``ppo.lam_critic``, VC-PPO) and the policy's a length-adaptive one.
- ``grpo`` / ``dr_grpo`` / ``rloo``: the sequence score minus its group's baseline (the other samples of
  the same prompt), placed on the last token like a score and summed with the per-token KL penalty into
  the reward-to-go of each token. A group is whole on the rank that computes it: the prompt stream gives
  each rank whole prompts and the rank samples all of a prompt's responses, and the advantages are fixed
  here, before any shuffling, minibatch or micro-batch moves a row.
- ``reinforce_pp``: REINFORCE++, the KL-shaped reward-to-go whitened over the whole batch (all ranks);
  ``reinforce_pp_baseline`` the same on the score minus its group's mean.

The KL penalty is ``-beta`` times the per-token KL that scoring stored on the record (``kl_ref``). With
``kl.in_loss`` the rewards carry no KL penalty: the update adds it to the loss instead. An
environment's turn rewards (multi-turn episodes) add to the per-token rewards on each turn's last action
token; a group estimator counts them in the episode's score instead, which its group then judges.
"""

from __future__ import annotations

import torch

from lmppo.math import core
from lmppo.math.estimators import EstimatorSpec
from lmppo.sampling.rollout import EstimatedRollout, ScoredRollout
from lmppo.training.step_results import RewardEstimates, estimate_metrics


def estimate(
    scored: ScoredRollout, beta: float, estimator: EstimatorSpec, group=None
) -> tuple[EstimatedRollout, dict[str, float]]:
    """The advantages and returns of a scored rollout, and the estimator's metrics."""
    estimated, estimates = advantages_of(scored, beta, estimator, group)
    return estimated, estimate_metrics(estimated, estimates, group)


def advantages_of(
    scored: ScoredRollout, beta: float, estimator: EstimatorSpec, group=None
) -> tuple[EstimatedRollout, RewardEstimates]:
    """Shaped rewards, advantages and returns of ``scored`` as ``estimator`` says; what they were computed
    from, for the metrics."""
    mask, rm_score, bootstrap_value = scored.action_mask, scored.rm_score, scored.bootstrap_value
    if not estimator.bootstrap_truncated:  # a truncated row ends there, scored (the score stage decided)
        bootstrap_value = None if bootstrap_value is None else torch.zeros_like(bootstrap_value)
    score, flat = rm_score, None
    turn_rewards = None if scored.episode is None else scored.episode.turn_rewards
    if estimator.groups:  # an episode's turn rewards count in its score, which its group judges
        n = estimator.group_size
        score, turn_rewards = scored.episode_score, None
        flat = core.flat_groups(score, n)
        score = core.group_advantages(score, n, estimator.group_baseline)
    reward_beta = 0.0 if estimator.kl_in_loss else beta
    rewards = core.shaped_rewards(score, scored.kl_ref, mask, reward_beta)
    if turn_rewards is not None:  # each turn's reward on its last action token (lmppo.sampling.episodes)
        rewards = rewards + turn_rewards
    if not estimator.critic:  # no critic: the return itself, the reward-to-go from each token
        advantages = returns = core.discounted_returns(rewards, mask, estimator.gamma)
    else:
        lam = estimator.lam_policy
        if lam is None:  # VAPO: the longer the response, the longer the horizon
            lam = core.length_adaptive_lam(mask, estimator.lam_alpha)
        advantages, returns = core.gae(
            rewards, scored.values, mask, estimator.gamma, lam, bootstrap_value, estimator.lam_critic
        )
    adv_mean = core.masked_mean(advantages, mask, group)
    adv_std = core.masked_var(advantages, mask, unbiased=False, group=group).sqrt()
    if estimator.whiten:
        advantages = core.masked_whiten(advantages, mask, group=group)
    estimated = EstimatedRollout.after(scored, advantages=advantages, returns=returns)
    estimates = RewardEstimates(
        rewards, reward_beta, adv_mean.item(), adv_std.item(), flat, not estimator.kl_in_loss
    )
    return estimated, estimates
