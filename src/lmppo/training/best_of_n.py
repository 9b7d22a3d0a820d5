"""Best-of-N rejection sampling, the one-shot relative of PPO (Llama 2-Chat ran four rounds of it before
PPO): each round samples K responses per prompt from the current policy, scores them with the run's reward,
keeps each prompt's best and fine-tunes the policy on the winners with the response-only SFT loss. With
``rollout.environment`` a sample is an episode, judged by its reward plus its turn rewards, and the loss
reads its actions only.

It is a run like any other (``run.algorithm=best_of_n``, ``lmppo best-of-n``): :class:`BestOfNTrainer` steps
one round where :class:`~lmppo.training.trainer.PPOTrainer` steps one PPO iteration. It shares sampling and
scoring with PPO (:class:`lmppo.training.base.Trainer`'s sampler and scorer) and nothing after them: no
estimator, no PPO update.
Everything around the step (evaluation, guards, checkpoints, exact resume, ``best/`` and ``final/``, the
report) is :class:`lmppo.runs.run.PPORun`'s. No critic and no KL term: the fine-tuned policy's KL to the start
is what selection moved it, about ``log K - (K - 1) / K`` nats per sequence for one round of the ideal
best-of-K policy (the seeds' bound); the held-out ``eval/kl`` measures it.
"""

from __future__ import annotations

import math

import torch

from lmppo.math import core
from lmppo.modeling.models import checkpointing, trainable_parameters
from lmppo.progress import phase
from lmppo.sampling.passes import response_logprobs
from lmppo.sampling.rollout import Rollout, rank_micro_batches
from lmppo.training.base import Trainer
from lmppo.training.metrics import timed
from lmppo.training.step_results import UpdateResult, scored_metrics


def best_of_groups(scores: torch.Tensor, group_size: int, threshold: float | None = None) -> torch.Tensor:
    """Row indices of each group's best score (``group_size`` consecutive rows per prompt; the first
    of equal bests), without the groups whose best is below ``threshold``."""
    grouped = scores.reshape(-1, group_size)
    best, column = grouped.max(dim=1)  # max returns the first index of a tie
    rows = torch.arange(len(grouped), device=scores.device) * group_size + column
    return rows if threshold is None else rows[best >= threshold]


class BestOfNTrainer(Trainer):
    """One best-of-N round per :meth:`step`: sample K per prompt, score, fine-tune on each prompt's best. The
    state a checkpoint holds is every trainer's (policy, optimizer, schedule, prompt stream, RNGs), so a run
    resumes exactly between rounds."""

    def step(self) -> dict[str, float]:
        cfg, seconds = self.cfg, {}
        with timed(seconds, "perf/step_s"):
            rollout = self.sampler.sample(self.policy_version, seconds)  # batch_size prompts x K, in groups
            with phase("scoring"), timed(seconds, "perf/score_s"):
                # the reward's scores and the KL to the reference, for the metrics
                scored, reward = self.scorer.score(rollout, self.policy_version, seconds)
                stages = scored_metrics(scored, reward, cfg.ppo.tis_cap, self.group)
            score = scored.episode_score  # an episode's: the reward plus its turn rewards
            winners = best_of_groups(score, cfg.rollout.samples_per_prompt, cfg.best_of_n.threshold)
            with phase("update"), timed(seconds, "perf/update_s"):
                update = self.fine_tune(scored.select(winners))
            lag = self.policy_version - rollout.policy_version
            if update.policy_moved:
                self.policy_version += 1
            self.end_step()
        metrics = self.logged_metrics(stages, update, None, lag, seconds)  # no KL coefficient in a round
        kept = score[winners]
        metrics["bon/kept_frac"] = len(winners) / cfg.rollout.batch_size
        if len(kept):  # none above the threshold: no score (a NaN would count as a non-finite value)
            metrics["bon/winner_score"] = kept.mean().item()
        return metrics

    def fine_tune(self, winners: Rollout) -> UpdateResult:
        """``best_of_n.epochs`` passes of the response-only SFT loss over ``winners`` in shuffled
        minibatches (``ppo.minibatch_size`` rows; micro-batches as ``ppo.micro_batch_*`` say)."""
        ppo = self.cfg.ppo
        sums = {"sft/loss": 0.0, "policy/entropy": 0.0, "policy/grad_norm": 0.0}
        epochs = self.cfg.best_of_n.epochs if len(winners) else 0  # no winner kept: nothing to learn
        updates = nonfinite = 0
        for _ in range(epochs):
            for minibatch in winners.minibatches(ppo.minibatch_size, self.shuffle_generator):
                loss, entropy, norm = self.sft_update(minibatch)
                finite = math.isfinite(norm)
                updates, nonfinite = updates + 1, nonfinite + (not finite)
                for key, value in zip(sums, (loss, entropy, norm), strict=True):
                    sums[key] += value
        metrics = {key: total / max(updates, 1) for key, total in sums.items()} if updates else {}
        return UpdateResult(metrics, epochs, updates, nonfinite, nonfinite < updates)

    def sft_update(self, minibatch: Rollout) -> tuple[float, float, float]:
        """One optimizer step of the token-mean NLL of the responses' actions (temperature 1: the policy's own
        distribution; an episode's context is not the policy's to learn); returns the loss, the entropy and
        the pre-clip gradient norm."""
        ppo, tokens = self.cfg.ppo, minibatch.action_mask.sum().clamp(min=1.0)
        micro_batches, _ = rank_micro_batches(
            minibatch, micro_batch_size=ppo.micro_batch_size, micro_batch_tokens=ppo.micro_batch_tokens
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = entropy_sum = 0.0
        for micro in micro_batches:
            mask = micro.action_mask
            with self.autocast(), checkpointing(self.train_module.checkpointed):
                logp, entropy = response_logprobs(self.policy, micro, temperature=1.0)
            share = mask.sum() / tokens  # the minibatch's token mean, accumulated over micro-batches
            loss = -core.masked_mean(logp, mask)
            (loss * share).backward()
            loss_sum += (loss * share).item()
            entropy_sum += (core.masked_mean(entropy.detach(), mask) * share).item()
        norm, _ = self.clip_gradients()
        if math.isfinite(norm):  # never apply a NaN/inf update
            self.optimizer.step()
        else:
            for param in trainable_parameters(self.policy):
                param.grad = None
        return loss_sum, entropy_sum, norm
