"""From a scored rollout to its advantages, by the run's estimator (``RunSpec.estimator``, a row of
:data:`lmppo.math.estimators.ESTIMATORS`; formulas in :mod:`lmppo.math.core` and docs/core.md):

- ``gae``: the KL-shaped rewards and the critic's values through masked GAE; returns = A + V, where the
  critic's A may take its own lambda (``ppo.lam_critic``, VC-PPO) and the policy's a length-adaptive one.
- ``grpo`` / ``dr_grpo`` / ``rloo``: the sequence score minus its group's baseline (the other samples of
  the same prompt), placed on the last token like a score and summed with the per-token KL penalty into
  the reward-to-go of each token. A group is whole on the rank that computes it: the prompt stream gives
  each rank whole prompts and the rank samples all of a prompt's responses, and the advantages are fixed
  here, before any shuffling, minibatch or micro-batch moves a row.
- ``reinforce_pp``: REINFORCE++, the KL-shaped reward-to-go whitened over the whole batch (all ranks);
  ``reinforce_pp_baseline`` the same on the score minus its group's mean.

With ``kl.in_loss`` the rewards carry no KL penalty: the update adds it to the loss instead. An
environment's turn rewards (multi-turn episodes) add to the per-token rewards on each turn's last action
token; a group estimator counts them in the episode's score instead, which its group then judges.
"""

from __future__ import annotations

import torch

from lmppo.inputs.config import Config
from lmppo.inputs.resolve import RunSpec
from lmppo.math import core
from lmppo.sampling.rollout import EstimatedRollout, ScoredRollout
from lmppo.training.step_results import RewardEstimates, Scores, estimate_metrics


def estimate(
    scored: ScoredRollout, scores: Scores, beta: float, cfg: Config, spec: RunSpec, group=None
) -> tuple[EstimatedRollout, dict[str, float]]:
    """The advantages and returns of a scored rollout, and the estimator's metrics."""
    estimated, estimates = advantages_of(scored, beta, cfg, spec, group)
    return estimated, estimate_metrics(estimated, estimates, scores.kl_per_token, group)


def advantages_of(
    scored: ScoredRollout, beta: float, cfg: Config, spec: RunSpec, group=None
) -> tuple[EstimatedRollout, RewardEstimates]:
    """Shaped rewards, advantages and returns of ``scored`` as ``spec.estimator`` says; what they were
    computed from, for the metrics."""
    mask, logp_old, rm_score = scored.action_mask, scored.logp_old_for_update, scored.rm_score
    estimator, bootstrap_value = spec.estimator, scored.bootstrap_value
    if not estimator.bootstrap_truncated:  # a truncated row ends there, scored (the score stage decided)
        bootstrap_value = None if bootstrap_value is None else torch.zeros_like(bootstrap_value)
    score, flat, turn_rewards = rm_score, None, scored.turn_rewards
    if estimator.groups:  # an episode's turn rewards count in its score, which its group judges
        n = estimator.group_size
        score, turn_rewards = scored.episode_score, None
        flat = core.flat_groups(score, n)
        score = core.group_advantages(score, n, estimator.group_baseline)
    reward_beta = 0.0 if estimator.kl_in_loss else beta
    rewards = core.shaped_rewards(score, logp_old, scored.logp_ref, mask, reward_beta, cfg.kl.estimator)
    if turn_rewards is not None:  # each turn's reward on its last action token (lmppo.sampling.episodes)
        rewards = rewards + turn_rewards
    if not estimator.critic:  # no critic: the return itself, the reward-to-go from each token
        advantages = returns = core.discounted_returns(rewards, mask, cfg.ppo.gamma)
    else:
        lam = estimator.lam_policy
        if lam is None:  # VAPO: the longer the response, the longer the horizon
            lam = core.length_adaptive_lam(mask, estimator.lam_alpha)
        advantages, returns = core.gae(
            rewards, scored.values, mask, cfg.ppo.gamma, lam, bootstrap_value, estimator.lam_critic
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
