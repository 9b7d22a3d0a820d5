"""The PPO step: one ``PPOTrainer.step`` reads top to bottom in the order of the method.

All the math lives in :mod:`lmppo.math.core`; sampling and scoring, which best-of-n shares, in
:class:`lmppo.training.sampler.Sampler` and :class:`lmppo.training.scorer.Scorer`, composed by
:class:`lmppo.training.base.Trainer`; the estimator in :mod:`lmppo.training.advantages`; the rollout's
records and their batching in :mod:`lmppo.sampling.rollout`, the update's forward in
:mod:`lmppo.sampling.passes`. What the trainer steps with is built by :func:`lmppo.runs.build.build_trainer`
(sharded or wrapped for data parallelism before it exists); its state in a checkpoint is
:mod:`lmppo.runs.trainer_state`; a whole run (resume, guards, checkpoints, signals, the final model) is
:mod:`lmppo.runs.run`. This module only orders the step, runs the update and keeps its books.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import astuple, fields

import torch

from lmppo.math import core
from lmppo.modeling.distributed import all_sum
from lmppo.modeling.models import trainable_parameters
from lmppo.progress import advance, phase
from lmppo.sampling.rollout import EstimatedRollout, padded_tokens, rank_micro_batches
from lmppo.training.advantages import estimate
from lmppo.training.base import Trainer
from lmppo.training.metrics import timed
from lmppo.training.step_results import (
    MinibatchResult,
    TokenMeans,
    UpdateResult,
    scored_metrics,
    update_metrics,
)


class PPOTrainer(Trainer):
    """PPO on a policy, a frozen reference, a reward and a critic (or none: a critic-free estimator);
    :meth:`step` is one iteration, each stage taking the record the one before returned:

    1. **Sample** (:meth:`Sampler.sample <lmppo.training.sampler.Sampler.sample>`): the current policy's
       responses, ``logp_old`` and the policy version recorded; a rollout older than allowed is sampled
       again (one version behind with ``rollout.asynchronous``).
    2. **Score** (:meth:`Scorer.score <lmppo.training.scorer.Scorer.score>`): the raw score of each
       response, preprocessed; the reference's log-probs and the per-token KL to it; the critic's values.
    3. **Estimate** (:func:`lmppo.training.advantages.estimate`): ``-beta * KL`` per token plus the score on
       the last valid token, masked GAE over the response (returns = A + V), whitening with global statistics.
    4. **Update** (:meth:`update`): ``ppo_epochs`` passes over shuffled minibatches
       (:meth:`minibatch_update`, micro-batch accumulation of :meth:`micro_batch_loss`: clipped surrogate,
       clipped value loss, optional entropy), gradient clipping, approx-KL early stop.
    5. **KL coefficient**: the fixed or adaptive controller, fed the step's mean per-sequence KL.
    """

    def step(self) -> dict[str, float]:
        """One PPO iteration (the class's docstring); returns its metrics, this rank's until reduced."""
        cfg = self.cfg
        seconds: dict[str, float] = {}
        critic_only = self.step_count < cfg.ppo.critic_warmup_steps  # critic warmup: the policy waits
        with timed(seconds, "perf/step_s"):
            rollout = self.sampler.sample(self.policy_version, seconds)  # 1
            lag = self.policy_version - rollout.policy_version
            with phase("scoring"), timed(seconds, "perf/score_s"):
                scored, reward = self.scorer.score(rollout, self.policy_version, seconds)  # 2
                stages = scored_metrics(scored, reward, cfg.ppo.tis_cap, self.group)
                estimated, estimated_metrics = estimate(  # 3
                    scored, self.kl_controller.value, self.spec.estimator, self.group
                )
                stages |= estimated_metrics
            # 4. PPO epochs over shuffled minibatches; an engine with its own weights gets the new policy.
            with phase("update"), timed(seconds, "perf/update_s"):
                update = self.update(estimated, critic_only)
            if update.policy_moved:
                self.policy_version += 1  # the policy changed: rollouts sampled before are one version older
                self.sync_generator(seconds)

            # 5. KL controller, fed the global mean per-sequence KL and stepped once per sample.
            beta = self.kl_controller.value
            self.kl_controller.update(stages["kl/ref"], n_steps=cfg.rollout.responses_per_step)
            self.end_step()
        return self.logged_metrics(stages, update, beta, lag, seconds)

    def update(self, rollout: EstimatedRollout, critic_only: bool = False) -> UpdateResult:
        """``ppo_epochs`` passes of clipped-surrogate updates; stops early when approx KL is too high.
        ``critic_only`` (critic warmup): the value loss alone, the policy's parameters keep their values."""
        ppo = self.cfg.ppo
        totals, results = TokenMeans(), []
        epochs_run, ratio_max, engine_logp_gap = 0, 0.0, 0.0
        local_minibatch = ppo.minibatch_size // self.world_size
        for _ in range(ppo.ppo_epochs):
            epochs_run += 1
            advance("epoch", epochs_run, ppo.ppo_epochs)
            epoch_kl, epoch_updates = 0.0, 0
            for minibatch in rollout.minibatches(local_minibatch, self.shuffle_generator):
                result = self.minibatch_update(minibatch, critic_only)
                if not results:  # before any update: the sampler's log-probs vs the trainer's, same weights
                    engine_logp_gap = result.means.logp_gap
                results.append(result)
                ratio_max = max(ratio_max, result.ratio_max)
                totals.add(result.means, 1.0)
                epoch_kl += result.means.approx_kl
                epoch_updates += 1
            if ppo.target_approx_kl is not None and epoch_kl / epoch_updates > ppo.target_approx_kl:
                break  # approx KL is a global token mean, the same on every rank: all stop together
        n = len(results)
        nonfinite = sum(not r.finite for r in results)
        metrics = update_metrics(totals, results, self.spec.estimator.kl_in_loss)
        metrics["engine/logp_gap"] = engine_logp_gap
        metrics["policy/ratio_max"] = ratio_max
        metrics["policy/frozen"] = float(critic_only)
        return UpdateResult(metrics, epochs_run, n, nonfinite, not critic_only and nonfinite < n)

    def minibatch_update(self, minibatch: EstimatedRollout, critic_only: bool = False) -> MinibatchResult:
        """One optimiser step on one minibatch (this rank's rows), accumulated over micro-batches.

        The loss is the token mean over the *global* minibatch: each micro-batch's token mean is weighted
        by its share of all ranks' response tokens (times the world size, which DDP's gradient average
        divides out). Gradients sync once, in the last backward; the reported statistics are global
        token means too, so every rank logs and decides the same.
        """
        sizes = torch.stack([minibatch.action_mask.sum(), minibatch.action_mask.new_tensor(len(minibatch))])
        global_tokens, global_rows = all_sum(sizes, self.group).clamp(min=1.0).unbind()
        failed = []  # the micro-batch that ran out of memory, if one does

        def accumulate(budget: int | None) -> tuple[TokenMeans, float, float | None]:
            micro_batches, weights = self.micro_batches(minibatch, budget)
            return self.accumulate(micro_batches, weights, global_tokens, global_rows, critic_only, failed)

        means, ratio_max, ptx_loss = self.budgets.shrinking(
            "update", accumulate, lambda: padded_tokens(failed[-1] if failed else minibatch), self.oom_retries
        )
        summed = [*astuple(means), *([] if ptx_loss is None else [ptx_loss])]
        summed = all_sum(torch.tensor(summed, dtype=torch.float64), self.group).tolist()
        means = TokenMeans(*summed[: len(fields(TokenMeans))])
        ptx_loss = None if ptx_loss is None else summed[-1]
        if critic_only:  # the policy's parameters (a shared trunk too) keep their values
            for param in trainable_parameters(self.policy):
                param.grad = None
        policy_norm, value_norm = self.clip_gradients()
        finite = math.isfinite(policy_norm) and math.isfinite(value_norm or 0.0)
        if finite:  # never apply a NaN/inf update
            self.optimizer.step()
        return MinibatchResult(means, policy_norm, value_norm, ratio_max, finite, ptx_loss)

    def micro_batches(self, minibatch: EstimatedRollout, budget: int | None) -> tuple[list, list[float]]:
        """This rank's micro-batches and their loss weights: ``ppo.micro_batch_size`` rows, or forwards of at
        most ``budget`` tokens once the update's budget is set (or halved after an out-of-memory error)."""
        return rank_micro_batches(
            minibatch,
            micro_batch_size=None if budget else self.cfg.ppo.micro_batch_size,
            micro_batch_tokens=budget,
            world_size=self.world_size,
            rank=self.rank,
            group=self.group,
            same_count=self.spec.sharded,
        )

    def accumulate(
        self,
        micro_batches: list[EstimatedRollout],
        weights: list[float],
        global_tokens: torch.Tensor,
        global_rows: torch.Tensor,
        critic_only: bool,
        failed: list[EstimatedRollout],
    ) -> tuple[TokenMeans, float, float | None]:
        """The minibatch's gradients, from zero, accumulated over its micro-batches (each one appended to
        ``failed`` as it starts: the last is the one that ran out, if one does); this rank's token means,
        largest ratio and PPO-ptx loss."""
        ppo = self.cfg.ppo
        mean_length = global_tokens / global_rows  # response tokens per row: sequence_mean's token weights
        self.optimizer.zero_grad(set_to_none=True)
        means, ratio_max, ptx_loss = TokenMeans(), 0.0, None
        if self.ptx_batches is not None and ppo.ptx_coef > 0 and not critic_only:
            with self._no_grad_sync():  # accumulated locally; the last micro-batch's backward syncs it
                loss = self.ptx_loss()
                (ppo.ptx_coef * loss).backward()
            ptx_loss = loss.item() / self.world_size  # a mean over ranks after the sum below
        for i, (micro, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            failed.append(micro)
            micro_means, micro_ratio_max, loss = self.micro_batch_loss(micro, mean_length, critic_only)
            # this micro-batch's token mean, weighted by its share of the global minibatch's tokens
            share = weight * micro.action_mask.sum() / global_tokens
            with self._no_grad_sync() if i < len(micro_batches) - 1 else nullcontext():
                (loss * share * self.world_size).backward()
            ratio_max = max(ratio_max, micro_ratio_max)
            means.add(micro_means, float(share))
        return means, ratio_max, ptx_loss

    def _no_grad_sync(self):
        """Skip DDP's gradient all-reduce for this backward (gradients accumulate locally). FSDP2
        reduce-scatters every backward instead: its gradients then accumulate as 1/N shards."""
        return (
            self.train_module.no_sync() if self.group is not None and not self.spec.sharded else nullcontext()
        )

    def micro_batch_loss(
        self, micro: EstimatedRollout, mean_length: torch.Tensor, critic_only: bool = False
    ) -> tuple[TokenMeans, float, torch.Tensor]:
        """The PPO loss of one micro-batch, its token-mean statistics and its largest ratio.
        ``mean_length``: the global minibatch's response tokens per row, for ``sequence_mean``."""
        ppo = self.cfg.ppo
        mask, logp_old = micro.action_mask, micro.logp_old_for_update
        with self.autocast():  # the forward only: backward runs each op in its forward's dtype
            logp_new, token_entropy, values = self.train_module(micro)
        weights = micro.tis_weights
        if ppo.loss_aggregation == "sequence_mean":
            weights = core.sequence_mean_weights(mask, mean_length, weights)
        policy_loss, clip_frac = core.ppo_clip_loss(
            logp_new,
            logp_old,
            micro.advantages,
            mask,
            ppo.clip_eps,
            weights,
            ppo.clip_eps_high,
            sequence_ratio=ppo.ratio_level == "sequence",
        )
        kl_loss = torch.zeros(
            ()
        )  # kl.in_loss, GRPO's term: k3 is >= 0 per token, its gradient pulls to the ref
        if self.spec.estimator.kl_in_loss:
            per_token = core.kl_estimate(logp_new, micro.logp_ref, "k3")
            kl_loss = core.masked_mean(per_token if weights is None else per_token * weights, mask)
        v_loss = v_clip_frac = torch.zeros(())  # no critic, no value loss
        if values is not None:
            v_loss, v_clip_frac = core.value_loss(
                values, micro.values, micro.returns, mask, ppo.value_clip_eps
            )
        if ppo.ent_coef == 0:  # only a metric: the backward skips the entropy's (B, R, V) gradient sweep
            token_entropy = token_entropy.detach()
        entropy = core.masked_mean(token_entropy, mask)
        kl_term = self.kl_controller.value * kl_loss
        loss = policy_loss + kl_term + ppo.vf_coef * v_loss - ppo.ent_coef * entropy
        if critic_only:  # the value loss alone (x 0 keeps DDP's graph whole)
            loss = 0.0 * policy_loss + ppo.vf_coef * v_loss
        with torch.no_grad():
            ratio = torch.exp(torch.where(mask.bool(), logp_new - logp_old, 0.0))
            means = TokenMeans(
                policy_loss=policy_loss.item(),
                clip_frac=clip_frac.item(),
                approx_kl=core.approx_kl(logp_new, logp_old, mask).item(),
                entropy=entropy.item(),
                ratio_mean=core.masked_mean(ratio, mask).item(),
                ratio_sq=core.masked_mean(ratio**2, mask).item(),
                value_loss=v_loss.item(),
                value_clip_frac=v_clip_frac.item(),
                logp_gap=core.masked_mean((logp_new - micro.logp_old).abs(), mask).item(),
                kl_loss=kl_loss.item(),
            )
            ratio_max = torch.where(mask.bool(), ratio, 0.0).max().item()
        return means, ratio_max, loss

    def ptx_loss(self) -> torch.Tensor:
        """InstructGPT's PPO-ptx term: next-token loss on a batch of demonstrations (response tokens)."""
        batch = self.ptx_batches()
        with self.autocast():
            out = self.policy(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
        return out.loss.float()
