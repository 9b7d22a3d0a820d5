"""The PPO step: one ``PPOTrainer.step`` reads top to bottom in the order of the method.

All the math lives in :mod:`lmppo.core`; the rollout record and its batching in :mod:`lmppo.rollout`, the
passes over it in :mod:`lmppo.passes`, the engines behind :class:`lmppo.engines.Generator`; what the
trainer steps with is built by :func:`lmppo.build.build_trainer` (sharded or wrapped for data parallelism
before it exists); its state in a checkpoint is :mod:`lmppo.trainer_state`; a whole run (resume, guards,
checkpoints, signals, the final model) is :mod:`lmppo.run`. This module only orders the step and keeps its books.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import astuple, dataclass, fields

import torch
from torch import nn

from lmppo import core
from lmppo.advantages import fill_advantages
from lmppo.config import Config
from lmppo.data import PromptStream
from lmppo.distributed import (
    CommCounter,
    all_sum,
    failing_together,
    full_tensor,
    gathered,
    trained_state_bytes,
)
from lmppo.engines import Generator, RolloutsAhead
from lmppo.errors import LmppoError
from lmppo.metrics import timed
from lmppo.models import PPOModels, autocast, trainable_parameters
from lmppo.passes import sequence_logprobs, value_predictions
from lmppo.progress import advance, phase
from lmppo.resolve import RunSpec
from lmppo.rollout import Rollout, rank_micro_batches
from lmppo.scoring import CombinedReward
from lmppo.step_results import (
    Estimates,
    MinibatchResult,
    TokenMeans,
    UpdateResult,
    rollout_metrics,
    step_metrics,
    update_metrics,
)


@dataclass
class TrainerParts:
    """What a trainer steps with, ready-made (:func:`lmppo.build.build_trainer`)."""

    models: PPOModels
    train_module: nn.Module  # the update's forward: policy and critic, under DDP wrapped to sync gradients
    generator: Generator
    prompt_stream: PromptStream
    reward: CombinedReward
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_controller: core.FixedKLController
    comm_counter: CommCounter | None = None  # bytes the collectives moved (several ranks)
    ptx_batches: Callable[[], dict[str, torch.Tensor]] | None = None  # PPO-ptx demonstrations


class PPOTrainer:
    """PPO on a policy, a frozen reference, a reward and a critic; :meth:`step` is one iteration:

    1. **Rollout** (:meth:`collect_rollout`): sample one response per prompt with the current policy,
       recording ``logp_old`` and the policy version; regenerate a rollout older than allowed. With
       ``rollout.asynchronous`` take the batch sampled during the last update instead (one version behind)
       and start sampling the next (:class:`lmppo.engines.RolloutsAhead`).
    2. **Reward** (:meth:`score_and_estimate`): the raw score of each response, preprocessed, on its last
       valid token, plus ``-beta * KL`` per token against the reference's stored log-probs.
    3. **Advantages**: stored values, masked GAE over the response (returns = A + V), whitening with
       global statistics.
    4. **Update** (:meth:`update`): ``ppo_epochs`` passes over shuffled minibatches
       (:meth:`minibatch_update`, micro-batch accumulation of :meth:`micro_batch_loss`: clipped surrogate,
       clipped value loss, optional entropy), gradient clipping, approx-KL early stop.
    5. **KL coefficient**: the fixed or adaptive controller, fed the step's mean per-sequence KL.
    """

    def __init__(self, cfg: Config, spec: RunSpec, parts: TrainerParts, *, group=None, rank: int = 0) -> None:
        self.cfg, self.spec, self.group = cfg, spec, group
        self.rank, self.world_size = rank, spec.world_size
        vars(self).update(vars(parts))  # the ready-made parts under their own names (models, generator, ...)
        models = self.models
        self.policy, self.reference, self.value_model = models.policy, models.reference, models.value
        self.device, self.precision = spec.device, spec.precision
        torch.set_float32_matmul_precision(spec.fp32_matmul_precision)  # process-wide, as the run is
        r = cfg.rollout  # rows or a token budget per forward of the passes without gradients:
        self.stored_pass_batching = dict(
            forward_batch_size=r.forward_batch_size, forward_batch_tokens=r.forward_batch_tokens
        )
        self.shuffle_generator = torch.Generator().manual_seed(cfg.run.seed + 1 + rank)
        self.step_count = 0  # PPO steps done
        self.policy_version = 0  # PPO steps that changed the policy; each rollout records the one it saw
        self.episodes = 0  # responses generated (all ranks)
        self.tokens = 0  # response tokens generated (all ranks)
        # rollout.asynchronous: the next batch samples on a worker thread while this one is updated on
        self.ahead = (
            RolloutsAhead(self.generator, self.prompt_stream, self.autocast)
            if spec.engine.asynchronous
            else None
        )

    def autocast(self):
        """The numerics of every forward pass: bf16 autocast under ``run.precision=bf16``, else nothing."""
        return autocast(self.precision, self.device)

    def step(self) -> dict[str, float]:
        """One PPO iteration (the class's docstring); returns its metrics, this rank's until reduced."""
        cfg = self.cfg
        seconds: dict[str, float] = {}
        critic_only = self.step_count < cfg.ppo.critic_warmup_steps  # critic warmup: the policy waits
        with timed(seconds, "perf/step_s"):
            # 1. Rollout: sample responses with the current policy; refuse data older than allowed.
            trained_weights = None if self.spec.engine.owns_weights else self.policy
            with (
                phase("generating"),
                timed(seconds, "perf/rollout_s"),
                self.autocast(),
                gathered(trained_weights),
            ):
                rollout = self.collect_rollout()
            seconds["perf/generation_s"] = rollout.generation_s or seconds["perf/rollout_s"]
            lag = self.policy_version - rollout.policy_version

            # 2-3. Reward, stored passes, shaped rewards, GAE, whitening (filled into the rollout).
            with phase("scoring"), timed(seconds, "perf/score_s"):
                estimates = self.score_and_estimate(rollout)

            # 4. PPO epochs over shuffled minibatches; an engine with its own weights gets the new policy.
            with phase("update"), timed(seconds, "perf/update_s"):
                update = self.update(rollout, critic_only)
            if update.policy_moved:
                self.policy_version += 1  # the policy changed: rollouts sampled before are one version older
                self.sync_generator(seconds)

            # 5. KL controller, fed the global mean per-sequence KL and stepped once per sample.
            beta = self.kl_controller.value
            self.kl_controller.update(estimates.kl_ref, n_steps=cfg.rollout.responses_per_step)
            self.end_step()
        return self._step_metrics(estimates, update, beta, lag, seconds)

    def end_step(self) -> None:
        """The learning-rate schedule and the step count move on: the schedule counts steps, also one whose
        updates were all skipped (a non-finite gradient, no winner of best-of-n), where torch would warn."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        self.step_count += 1

    def _step_metrics(
        self, estimates: Estimates, update: UpdateResult, beta: float, lag: int, seconds: dict[str, float]
    ) -> dict[str, float]:
        n_tokens = estimates.mean_length * self.cfg.rollout.responses_per_step
        self.episodes += self.cfg.rollout.responses_per_step
        self.tokens += round(n_tokens)
        metrics = step_metrics(estimates, update, beta=beta, lag=lag, seconds=seconds, n_tokens=n_tokens)
        if self.device.type == "cuda":
            metrics["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.comm_counter is not None:
            metrics.update(self.comm_counter.take())
        metrics["perf/trained_state_mb"] = trained_state_bytes(self.optimizer) / 2**20
        return metrics

    def sync_generator(self, seconds: dict[str, float] | None = None) -> None:
        """Give an engine that samples from its own copy of the weights (vLLM) the current policy;
        its time goes to ``seconds["perf/weight_sync_s"]``."""
        if not self.spec.engine.owns_weights:  # the decode loop samples from the trained module itself
            return
        if self.ahead is not None:  # the batch in flight finishes on the weights it started with
            self.ahead.finished()
        with timed(seconds if seconds is not None else {}, "perf/weight_sync_s"):
            self.generator.sync_weights(self.policy, self.policy_version)

    def close(self, abandon: bool = False) -> None:
        """Let the batch in flight finish and shut the engine down (vLLM: before the process group ends);
        ``abandon`` (the run failed, a rank may be gone): drop both without any collective teardown."""
        if self.ahead is not None:
            self.ahead.close(abandon)
        self.generator.close(abandon)

    def collect_rollout(self) -> Rollout:
        """Generate for the next prompts, or asynchronously take the batch sampled during the last update
        and start sampling the next; regenerate when the rollout lags more than allowed."""
        max_age = self.cfg.rollout.max_rollout_age
        rollout = self.ahead.take() if self.ahead is not None else None
        for _ in range(3):
            if rollout is None or self.policy_version - rollout.policy_version > max_age:
                batch = self.prompt_stream.next_samples()
                rollout = self.generator.generate(batch.prompts, self.policy_version, batch.sample_ids)
            if self.policy_version - rollout.policy_version <= max_age:
                if self.ahead is not None:
                    self.ahead.start_next(self.policy_version)
                return rollout
        raise LmppoError(
            f"the generator keeps returning rollouts {self.policy_version - rollout.policy_version} policy "
            f"versions old (rollout.max_rollout_age={max_age}); check that it syncs the policy weights"
        )

    @torch.inference_mode()
    def score_and_estimate(self, rollout: Rollout) -> Estimates:
        """Reward, reference log-probs, values, shaped rewards, GAE and whitened advantages.

        Fills ``logp_ref``, ``values``, ``advantages`` and ``returns`` (B, R) into the rollout, so they follow
        it through minibatch selection; returns the step's reward-side metrics.
        """
        mask, stored_pass, seconds = rollout.response_mask, self.stored_pass_batching, {}
        with timed(seconds, "perf/reward_s"), self.autocast(), gathered(*self.models.reward_models):
            with failing_together(self.group):  # a reward function failing on one rank stops every rank
                raw = self.reward.raw_scores(rollout.prompts, rollout.response_texts)
        rm_score_raw = self.reward.weighted(raw).to(mask.device)
        rm_score, component_rows, transform_stats = self.reward.shape(
            raw, rollout.terminated.to(mask.device), self.group
        )
        with timed(seconds, "perf/reference_s"), self.autocast(), gathered(self.reference):
            rollout.logp_ref = sequence_logprobs(self.reference, rollout, **stored_pass)
        if self.value_model is not None:  # critic-free runs have no values
            self._store_values(rollout, seconds)
        tis_stats = self._truncated_importance_sampling(rollout) if self.cfg.ppo.tis_cap else {}
        estimates = fill_advantages(
            rollout, rm_score, self.kl_controller.value, self.cfg, self.spec, self.group
        )
        shown_used = transform_stats or component_rows or self.spec.estimator.bootstrap_truncated
        metrics = rollout_metrics(
            rollout, rm_score_raw, estimates, component_rows if shown_used else None, self.group
        )
        metrics |= transform_stats | seconds | tis_stats
        return Estimates(metrics, metrics["kl/ref"], metrics["response/length"], estimates.rm_score)

    def _store_values(self, rollout: Rollout, seconds: dict[str, float]) -> None:
        """``rollout.values`` (and ``bootstrap_value``) from the current critic: a stored pass, unless the
        decode loop read them off the current policy's trunk already."""
        if rollout.values is not None and rollout.policy_version == self.policy_version:
            seconds["perf/values_s"] = 0.0
            return
        with timed(seconds, "perf/values_s"), self.autocast(), gathered(*self._value_modules()):
            rollout.values, rollout.bootstrap_value = value_predictions(
                self.value_model, rollout, **self.stored_pass_batching
            )

    def _value_modules(self) -> tuple[nn.Module, ...]:
        """What a value pass runs: the critic, and with a shared trunk the policy that holds it."""
        return (self.value_model, self.policy) if self.value_model.shared_trunk else (self.value_model,)

    def _truncated_importance_sampling(self, rollout: Rollout) -> dict[str, float]:
        """``ppo.tis_cap``: the trainer's own log-probs of the samples (``rollout.logp_trainer``), which the
        PPO ratio is then taken against, and per-token weights ``min(p_trainer / p_sampler, cap)``
        (``rollout.tis_weights``). ``rollout.logp_old`` stays the sampler's."""
        mask = rollout.response_mask
        with self.autocast(), gathered(self.policy):
            logp_trainer = sequence_logprobs(self.policy, rollout, **self.stored_pass_batching)
        weights = core.truncated_importance_weights(
            logp_trainer, rollout.logp_old, mask, self.cfg.ppo.tis_cap
        )
        rollout.logp_trainer, rollout.tis_weights = logp_trainer, weights
        clipped = core.masked_mean((weights >= self.cfg.ppo.tis_cap).float(), mask, self.group)
        return {"engine/tis_clip_frac": clipped.item()}

    def update(self, rollout: Rollout, critic_only: bool = False) -> UpdateResult:
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

    def minibatch_update(self, minibatch: Rollout, critic_only: bool = False) -> MinibatchResult:
        """One optimiser step on one minibatch (this rank's rows), accumulated over micro-batches.

        The loss is the token mean over the *global* minibatch: each micro-batch's token mean is weighted
        by its share of all ranks' response tokens (times the world size, which DDP's gradient average
        divides out). Gradients sync once, in the last backward; the reported statistics are global
        token means too, so every rank logs and decides the same.
        """
        ppo = self.cfg.ppo
        sizes = torch.stack(
            [minibatch.response_mask.sum(), minibatch.response_mask.new_tensor(len(minibatch))]
        )
        global_tokens, global_rows = all_sum(sizes, self.group).clamp(min=1.0).unbind()
        mean_length = global_tokens / global_rows  # response tokens per row: sequence_mean's token weights
        micro_batches, weights = rank_micro_batches(
            minibatch,
            micro_batch_size=ppo.micro_batch_size,
            micro_batch_tokens=ppo.micro_batch_tokens,
            world_size=self.world_size,
            rank=self.rank,
            group=self.group,
            same_count=self.spec.sharded,
        )
        self.optimizer.zero_grad(set_to_none=True)
        means, ratio_max, ptx_loss = TokenMeans(), 0.0, None
        if self.ptx_batches is not None and ppo.ptx_coef > 0 and not critic_only:
            with self._no_grad_sync():  # accumulated locally; the last micro-batch's backward syncs it
                loss = self.ptx_loss()
                (ppo.ptx_coef * loss).backward()
            ptx_loss = loss.item() / self.world_size  # a mean over ranks after the sum below
        for i, (micro, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            micro_means, micro_ratio_max, loss = self.micro_batch_loss(micro, mean_length, critic_only)
            # this micro-batch's token mean, weighted by its share of the global minibatch's tokens
            share = weight * micro.response_mask.sum() / global_tokens
            with self._no_grad_sync() if i < len(micro_batches) - 1 else nullcontext():
                (loss * share * self.world_size).backward()
            ratio_max = max(ratio_max, micro_ratio_max)
            means.add(micro_means, float(share))
        summed = [*astuple(means), *([] if ptx_loss is None else [ptx_loss])]
        summed = all_sum(torch.tensor(summed, dtype=torch.float64), self.group).tolist()
        means = TokenMeans(*summed[: len(fields(TokenMeans))])
        ptx_loss = None if ptx_loss is None else summed[-1]
        if critic_only:  # the policy's parameters (a shared trunk too) keep their values
            for param in trainable_parameters(self.policy):
                param.grad = None
        policy_norm, value_norm = self._clip_gradients()
        finite = math.isfinite(policy_norm) and math.isfinite(value_norm or 0.0)
        if finite:  # never apply a NaN/inf update
            self.optimizer.step()
        return MinibatchResult(means, policy_norm, value_norm, ratio_max, finite, ptx_loss)

    def _no_grad_sync(self):
        """Skip DDP's gradient all-reduce for this backward (gradients accumulate locally). FSDP2
        reduce-scatters every backward instead: its gradients then accumulate as 1/N shards."""
        return (
            self.train_module.no_sync() if self.group is not None and not self.spec.sharded else nullcontext()
        )

    def micro_batch_loss(
        self, micro: Rollout, mean_length: torch.Tensor, critic_only: bool = False
    ) -> tuple[TokenMeans, float, torch.Tensor]:
        """The PPO loss of one micro-batch, its token-mean statistics and its largest ratio.
        ``mean_length``: the global minibatch's response tokens per row, for ``sequence_mean``."""
        ppo = self.cfg.ppo
        mask, logp_old = micro.response_mask, micro.logp_old_for_update
        with self.autocast():  # the forward only: backward runs each op in its forward's dtype
            logp_new, token_entropy, values = self.train_module(micro)
        weights = micro.tis_weights
        if ppo.loss_aggregation == "sequence_mean":
            weights = core.sequence_mean_weights(mask, mean_length, weights)
        policy_loss, clip_frac = core.ppo_clip_loss(
            logp_new, logp_old, micro.advantages, mask, ppo.clip_eps, token_weights=weights
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

    def _clip_gradients(self) -> tuple[float, float | None]:
        """Clip policy and critic gradients separately; return their pre-clip norms (None: no critic).

        ``clip_grad_norm_`` in two halves: the scaling pass runs only when it would change a gradient
        (its factor is clamped at 1), which saves a read and write of every gradient on most steps.
        Under FSDP2 the gradients are shards: their norm is reduced over the ranks (``full_tensor``).
        """
        max_norm = self.cfg.ppo.max_grad_norm or float("inf")
        norms = []
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
            norm_value = float(full_tensor(norm))
            if max_norm / (norm_value + 1e-6) < 1.0:  # clip_grad_norm_'s factor; NaN / inf skip the step
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            norms.append(norm_value)
        return norms[0], norms[1] if len(norms) > 1 else None
