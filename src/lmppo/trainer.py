"""The PPO step and its state: one ``PPOTrainer.step`` reads top to bottom in the order of the method.

All the math lives in :mod:`lmppo.core`; what is done to a rollout (sampling, stored passes, micro-batches,
the update's forward) lives in :mod:`lmppo.rollout`; a whole run (resume, guards, checkpoints, signals,
the final model) in :mod:`lmppo.run`. This module only orders the step and keeps its books.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from lmppo import core
from lmppo.build import PPOModels, build_generator, score_transform
from lmppo.checkpoint import capture_rng_state, flatten_state, restore_rng_state, unflatten_state
from lmppo.config import Config
from lmppo.data import Prompt, PromptStream
from lmppo.distributed import (
    CommCounter,
    all_sum,
    check_strategy,
    check_world_size,
    data_parallel,
    device_mesh,
    from_local_like,
    full_tensor,
    fully_shard_model,
    gather_objects,
    gathered,
    local_bytes,
    local_part,
    rank_seed,
    seed_everything,
    shard_like,
    whole_group,
)
from lmppo.errors import LmppoError, warn
from lmppo.metrics import timed
from lmppo.models import LoraReference, autocast, decoder_layers, trainable_parameters
from lmppo.rollout import (
    Generator,
    PolicyAndValue,
    Rollout,
    balanced_assignment,
    concat_rollouts,
    length_sorted_micro_batches,
    sequence_logprobs,
    token_budget_micro_batches,
    value_predictions,
)
from lmppo.scoring import CombinedReward, ScoredComponent
from lmppo.spec import resolve_precision


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier per PPO step: linear warmup, then constant / linear / cosine decay to 0."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return multiplier


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


class PPOTrainer:
    """PPO on a policy, a frozen reference, a reward and a critic; :meth:`step` is one iteration:

    1. **Rollout** (:meth:`collect_rollout`): sample one response per prompt with the current policy,
       recording ``logp_old`` and the policy version; regenerate a rollout older than allowed.
    2. **Reward** (:meth:`score_and_estimate`): the raw score of each response, preprocessed, on its last
       valid token, plus ``-beta * KL`` per token against the reference's stored log-probs.
    3. **Advantages**: stored values, masked GAE over the response (returns = A + V), whitening with
       global statistics.
    4. **Update** (:meth:`update`): ``ppo_epochs`` passes over shuffled minibatches
       (:meth:`minibatch_update`, micro-batch accumulation of :meth:`micro_batch_loss`: clipped surrogate,
       clipped value loss, optional entropy), gradient clipping, approx-KL early stop.
    5. **KL coefficient**: the fixed or adaptive controller, fed the step's mean per-sequence KL.

    Its whole state (weights, optimizer, schedule, controller, score normalisation, data position, every
    rank's RNG) is :meth:`state_payload` / :meth:`load_state_payload`, so a resumed run continues exactly.
    """

    def __init__(
        self,
        cfg: Config,
        models: PPOModels,
        prompts: list[Prompt],
        *,
        generator: Generator | None = None,
        ptx_batches: Callable[[], dict[str, torch.Tensor]] | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        check_strategy(cfg.distributed.strategy, world_size)
        check_world_size(
            world_size,
            **{
                "rollout.batch_size": cfg.rollout.batch_size,
                "ppo.minibatch_size": cfg.ppo.minibatch_size,
                "ppo.micro_batch_size": cfg.ppo.micro_batch_size,
            },
        )
        self.cfg, self.models, self.group = cfg, models, group
        self.policy, self.reference, self.value_model = models.policy, models.reference, models.value
        # Dropout stays off for the whole run (as in TRL): the stored log-probs and values and the
        # update's first forward then agree exactly, so the first ratio is 1. Gradients still flow.
        for model in (self.policy, self.value_model):
            model.eval()
        self.device = next(self.policy.parameters()).device
        self.precision = resolve_precision(cfg.run.precision, self.device)  # of every forward, see autocast
        self.stored_pass_batching = {  # rows or a token budget per forward of the passes without gradients
            "forward_batch_size": cfg.rollout.forward_batch_size,
            "forward_batch_tokens": cfg.rollout.forward_batch_tokens,
        }
        # The update's forward. With several ranks under DDP it syncs gradients during the backward, and
        # generation and the stored passes use the plain modules (no gradients to sync). Under FSDP2 the
        # models themselves are sharded (:meth:`_shard`) and every pass outside the update gathers them.
        self.train_module: nn.Module = PolicyAndValue(self.policy, self.value_model)
        self.sharded = group is not None and cfg.distributed.strategy == "fsdp2"
        self.sharded_checkpoints = self.sharded and cfg.distributed.checkpoint == "sharded"
        self.comm_counter: CommCounter | None = None
        if self.sharded:
            self.comm_counter = self._shard(group)
        elif group is not None:
            self.train_module, self.comm_counter = data_parallel(self.train_module, group)
        if cfg.rollout.engine == "vllm" and world_size > 1:
            raise LmppoError(
                "rollout.engine=vllm runs with one process; use rollout.engine=hf under torchrun"
            )
        self.generator = generator or build_generator(cfg, models)
        self.prompt_stream = PromptStream(
            prompts,
            cfg.rollout.batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
            rank=rank,
            world_size=world_size,
        )
        self.ptx_batches = ptx_batches
        self.rank, self.world_size = rank, world_size
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.ppo.lr_schedule, cfg.ppo.warmup_steps, cfg.run.steps)
        )
        self.kl_controller = self._build_kl_controller()
        self.reward = (  # a bare reward function (tests, the API) gets the config's one-source preprocessing
            models.reward
            if isinstance(models.reward, CombinedReward)
            else CombinedReward(
                [ScoredComponent("reward", models.reward, transform=score_transform(cfg.reward))]
            )
        )
        self.shuffle_generator = torch.Generator().manual_seed(cfg.run.seed + 1 + rank)
        self.step_count = 0  # PPO steps done
        self.policy_version = 0  # PPO steps that changed the policy; each rollout records the one it saw
        self.episodes = 0  # responses generated (all ranks)
        self.tokens = 0  # response tokens generated (all ranks)

    # ----------------------------------------------------------------------------------------------
    # set-up
    # ----------------------------------------------------------------------------------------------

    def _shard(self, group: torch.distributed.ProcessGroup) -> CommCounter:
        """FSDP2: split every model over the ranks, in place, one unit per decoder layer (see
        :func:`lmppo.distributed.fully_shard_model`). Trained weights stay fp32 shards and compute in
        the run's precision; the critic's head computes in fp32; a shared trunk is sharded once, with the
        policy; the frozen reference and reward model keep their dtype (``distributed.shard_frozen``)."""
        counter, mesh = CommCounter(), device_mesh(group)
        compute_dtype = torch.bfloat16 if self.precision == "bf16" else None
        value = self.value_model
        fully_shard_model(
            self.policy, decoder_layers(self.policy), mesh, counter, compute_dtype=compute_dtype
        )
        fully_shard_model(
            value,
            [] if value.shared_trunk else decoder_layers(value),
            mesh,
            counter,
            compute_dtype=compute_dtype,
            fp32_units=(value.head,),
            root=not value.shared_trunk,
        )
        if value.shared_trunk:  # FSDP2 sets up on the first forward, which must enter through the root:
            with torch.no_grad():  # one token through the policy, before any value pass enters at the trunk
                self.policy(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
            self.policy.reshard()
        if self.cfg.distributed.shard_frozen:
            for frozen in (self.reference, *self.models.reward_models):
                if frozen is not None and not isinstance(frozen, LoraReference):  # LoRA: the policy's view
                    fully_shard_model(frozen, decoder_layers(frozen), mesh, counter)
        return counter

    def _value_modules(self) -> tuple[nn.Module, ...]:
        """What a value pass runs: the critic, and with a shared trunk the policy that holds it."""
        return (self.value_model, self.policy) if self.value_model.shared_trunk else (self.value_model,)

    def _value_only_parameters(self) -> list[nn.Parameter]:
        """Critic parameters not already owned by the policy (with a shared trunk: the head only)."""
        policy_ids = {id(p) for p in self.policy.parameters()}
        return [p for p in trainable_parameters(self.value_model) if id(p) not in policy_ids]

    def _build_kl_controller(self) -> core.FixedKLController:
        kl = self.cfg.kl
        return (
            core.AdaptiveKLController(kl.beta, kl.target, kl.horizon)
            if kl.adaptive
            else core.FixedKLController(kl.beta)
        )

    def _build_optimizer(self) -> torch.optim.Optimizer:
        ppo = self.cfg.ppo
        groups = [
            {"params": trainable_parameters(self.policy), "lr": ppo.lr, "name": "policy"},
            {"params": self._value_only_parameters(), "lr": ppo.value_lr or ppo.lr, "name": "value"},
        ]
        # fused: one kernel per step instead of a dozen foreach passes over every parameter (as TRL's default)
        return torch.optim.AdamW(groups, weight_decay=ppo.weight_decay, eps=ppo.adam_eps, fused=True)

    # ----------------------------------------------------------------------------------------------
    # one PPO step
    # ----------------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        cfg = self.cfg
        seconds: dict[str, float] = {}
        with timed(seconds, "perf/step_s"):
            # 1. Rollout: sample responses with the current policy; refuse data older than allowed.
            with timed(seconds, "perf/rollout_s"), self.autocast(), gathered(self.policy):
                rollout = self.collect_rollout()
            lag = self.policy_version - rollout.policy_version

            # 2-3. Reward, stored passes, shaped rewards, GAE, whitening (stored in rollout.extras).
            with timed(seconds, "perf/score_s"):
                reward_stats = self.score_and_estimate(rollout)

            # 4. PPO epochs over shuffled minibatches; an engine with its own weights gets the new policy.
            with timed(seconds, "perf/update_s"):
                update_stats = self.update(rollout)
            policy_trained = not update_stats["policy/frozen"]
            if policy_trained and update_stats["health/nonfinite_updates"] < update_stats["policy/updates"]:
                self.policy_version += 1  # the policy changed: rollouts sampled before are one version older
                self.sync_generator(seconds)

            # 5. KL controller, fed the global mean per-sequence KL and stepped once per sample.
            beta = self.kl_controller.value
            self.kl_controller.update(reward_stats["kl/ref"], n_steps=cfg.rollout.batch_size)
            self.scheduler.step()
            self.step_count += 1

        n_tokens = reward_stats["response/length"] * cfg.rollout.batch_size
        trained_tokens = n_tokens * update_stats["policy/epochs"]
        self.episodes += cfg.rollout.batch_size
        self.tokens += round(n_tokens)
        metrics = {
            **reward_stats,
            **update_stats,
            "kl/beta": beta,
            "lag/policy_versions": float(lag),
            "health/nonfinite": reward_stats["health/nonfinite"] + update_stats["health/nonfinite_updates"],
            **seconds,
            "perf/rollout_tokens_per_s": n_tokens / max(seconds["perf/rollout_s"], 1e-9),
            "perf/train_tokens_per_s": trained_tokens / max(seconds["perf/update_s"], 1e-9),
            "perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.device.type == "cuda":
            metrics["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.comm_counter is not None:
            metrics.update(self.comm_counter.take())
        metrics["perf/trained_state_mb"] = self.trained_state_bytes() / 2**20
        return metrics

    def trained_state_bytes(self) -> int:
        """Bytes this rank holds of what training keeps: trained parameters, their gradients and the
        optimizer's state (under FSDP2 its shards, about 1/N of DDP's full copies)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        states = [v for state in self.optimizer.state.values() for v in state.values() if v.dim() > 0]
        return local_bytes(params) + local_bytes(grads) + local_bytes(states)

    def autocast(self):
        """The numerics of every forward pass: bf16 autocast under ``run.precision=bf16``, else nothing."""
        return autocast(self.precision, self.device)

    def sync_generator(self, seconds: dict[str, float] | None = None) -> None:
        """Give an engine that samples from its own copy of the weights (vLLM) the current policy;
        its time goes to ``seconds["perf/weight_sync_s"]``."""
        sync = getattr(self.generator, "sync_weights", None)  # optional in the Generator protocol
        if sync is None:  # HFGenerator samples from the trained module itself
            return
        with timed(seconds if seconds is not None else {}, "perf/weight_sync_s"):
            sync(self.policy, self.policy_version)

    def collect_rollout(self) -> Rollout:
        """Generate for the next prompts; regenerate when the rollout lags more than allowed."""
        max_age = self.cfg.rollout.max_rollout_age
        for _ in range(3):
            rollout = self.generator.generate(
                self.prompt_stream.next_batch(), policy_version=self.policy_version
            )
            if self.policy_version - rollout.policy_version <= max_age:
                return rollout
        raise LmppoError(
            f"the generator keeps returning rollouts {self.policy_version - rollout.policy_version} policy "
            f"versions old (rollout.max_rollout_age={max_age}); check that it syncs the policy weights"
        )

    @torch.inference_mode()
    def score_and_estimate(self, rollout: Rollout) -> dict[str, float]:
        """Reward, reference log-probs, values, shaped rewards, GAE and whitened advantages.

        Stores ``logp_ref``, ``values``, ``advantages``, ``returns`` (B, R) in ``rollout.extras`` so they
        follow the rollout through minibatch selection; returns the step's reward-side metrics.
        """
        cfg, group = self.cfg, self.group
        mask = rollout.response_mask
        stored_pass = self.stored_pass_batching
        seconds: dict[str, float] = {}
        with timed(seconds, "perf/reward_s"), self.autocast(), gathered(*self.models.reward_models):
            raw = self.reward.raw_scores(rollout.prompts, rollout.response_texts)
        rm_score_raw = self.reward.weighted(raw).to(mask.device)
        rm_score, component_rows, transform_stats = self.reward.shape(
            raw, rollout.terminated.to(mask.device), group
        )
        with timed(seconds, "perf/reference_s"), self.autocast(), gathered(self.reference):
            logp_ref = sequence_logprobs(self.reference, rollout, **stored_pass)
        if "values" in rollout.extras and rollout.policy_version == self.policy_version:
            # the decode loop read them off the current policy's hidden states (a shared-trunk critic)
            values, bootstrap_value = rollout.extras["values"], rollout.extras["bootstrap_value"]
            seconds["perf/values_s"] = 0.0
        else:
            with timed(seconds, "perf/values_s"), self.autocast(), gathered(*self._value_modules()):
                values, bootstrap_value = value_predictions(self.value_model, rollout, **stored_pass)
        tis_stats = self._truncated_importance_sampling(rollout) if cfg.ppo.tis_cap else {}

        # A truncated row either ends the episode (scored, nothing after it) or is unfinished (its future,
        # score included, is V(s_after)): never both, or truncation would be paid twice.
        if cfg.rollout.truncation == "terminal":
            bootstrap_value = torch.zeros_like(bootstrap_value)
        else:
            rm_score = torch.where(rollout.terminated, rm_score, 0.0)
        beta = self.kl_controller.value
        rewards = core.shaped_rewards(rm_score, rollout.logp_old, logp_ref, mask, beta, cfg.kl.estimator)
        advantages, returns = core.gae(rewards, values, mask, cfg.ppo.gamma, cfg.ppo.lam, bootstrap_value)
        adv_mean = core.masked_mean(advantages, mask, group)
        adv_std = core.masked_var(advantages, mask, unbiased=False, group=group).sqrt()
        if cfg.ppo.whiten_advantages:
            advantages = core.masked_whiten(advantages, mask, group=group)
        rollout.extras.update(logp_ref=logp_ref, values=values, advantages=advantages, returns=returns)

        kl_per_token = torch.where(
            mask.bool(), core.kl_estimate(rollout.logp_old, logp_ref, cfg.kl.estimator), 0.0
        )
        per_row = {  # sequence-level quantities, averaged over all ranks' rows
            "reward/rm_score": rm_score_raw,
            "reward/kl_penalty": -beta * kl_per_token.sum(1),
            "reward/shaped": rewards.sum(1),
            "kl/ref": kl_per_token.sum(1),
            "response/length": mask.sum(1),
            "response/eos_frac": rollout.terminated.float(),
            "response/truncated_frac": (~rollout.terminated).float(),
        }
        if transform_stats or component_rows or cfg.rollout.truncation == "bootstrap":
            per_row["reward/rm_score_used"] = rm_score
        per_row.update(component_rows)
        every_row = torch.ones(1, len(rollout), device=mask.device)
        stats = {
            key: core.masked_mean(value[None], every_row, group).item() for key, value in per_row.items()
        }
        stats.update(transform_stats)
        stats.update(seconds)
        stats.update(tis_stats)
        stats.update(
            {
                "adv/mean": adv_mean.item(),
                "adv/std": adv_std.item(),
                "value/explained_var": core.explained_variance(values, returns, mask, group).item(),
                "lag/rollout_age_s": time.time() - rollout.created_at,
                "health/nonfinite": nonfinite_count(rm_score_raw, logp_ref, values, mask, group),
            }
        )
        return stats

    def _truncated_importance_sampling(self, rollout: Rollout) -> dict[str, float]:
        """``ppo.tis_cap``: take the PPO ratio against the trainer's own log-probs of the samples and weight
        each token by ``min(p_trainer / p_engine, cap)`` (``extras["tis_weights"]``). The engine's
        log-probs move to ``extras["logp_engine"]``."""
        mask = rollout.response_mask
        with self.autocast(), gathered(self.policy):
            logp_trainer = sequence_logprobs(self.policy, rollout, **self.stored_pass_batching)
        weights = core.truncated_importance_weights(
            logp_trainer, rollout.logp_old, mask, self.cfg.ppo.tis_cap
        )
        rollout.extras.update(logp_engine=rollout.logp_old, tis_weights=weights)
        rollout.logp_old = logp_trainer
        return {
            "engine/tis_clip_frac": core.masked_mean(
                (weights >= self.cfg.ppo.tis_cap).float(), mask, self.group
            ).item()
        }

    def update(self, rollout: Rollout) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped-surrogate updates; stops early when approx KL is too high."""
        ppo = self.cfg.ppo
        totals: dict[str, float] = {}
        n_updates, epochs_run, ratio_max = 0, 0, 0.0
        local_minibatch = ppo.minibatch_size // self.world_size
        for _ in range(ppo.ppo_epochs):
            epochs_run += 1
            epoch_kl, epoch_updates = 0.0, 0
            for minibatch in rollout.minibatches(local_minibatch, self.shuffle_generator):
                stats = self.minibatch_update(minibatch)
                ratio_max = max(ratio_max, stats.pop("policy/ratio_max"))
                logp_gap = stats.pop("engine/logp_gap")
                if (
                    n_updates == 0
                ):  # before any update: the sampler's log-probs vs the trainer's, same weights
                    engine_logp_gap = logp_gap
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                epoch_kl += stats["policy/approx_kl"]
                epoch_updates += 1
                n_updates += 1
            if ppo.target_approx_kl is not None and epoch_kl / epoch_updates > ppo.target_approx_kl:
                break  # approx KL is a global token mean, the same on every rank: all stop together
        metrics = {key: value / n_updates for key, value in totals.items()}
        metrics["engine/logp_gap"] = engine_logp_gap
        ratio_var = metrics.pop("policy/ratio_sq") - metrics["policy/ratio_mean"] ** 2
        metrics["policy/ratio_std"] = math.sqrt(max(ratio_var, 0.0))
        metrics["policy/ratio_max"] = ratio_max
        metrics["policy/epochs"] = float(epochs_run)
        metrics["policy/updates"] = float(n_updates)
        metrics["policy/frozen"] = float(self.step_count < self.cfg.ppo.critic_warmup_steps)  # critic warmup
        metrics["health/nonfinite_updates"] = totals["health/nonfinite_updates"]  # a count, not a mean
        return metrics

    def minibatch_update(self, minibatch: Rollout) -> dict[str, float]:
        """One optimiser step on one minibatch (this rank's rows), accumulated over micro-batches.

        The loss is the token mean over the *global* minibatch: each micro-batch's token mean is weighted
        by its share of all ranks' response tokens (times the world size, which DDP's gradient average
        divides out). Gradients sync once, in the last backward; the reported statistics are global
        token means too, so every rank logs and decides the same.
        """
        ppo = self.cfg.ppo
        global_tokens = all_sum(minibatch.response_mask.sum(), self.group).clamp(min=1.0)
        micro_batches, weights = self._micro_batches(minibatch)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        ratio_max = 0.0
        critic_only = self.step_count < ppo.critic_warmup_steps
        if self.ptx_batches is not None and ppo.ptx_coef > 0 and not critic_only:
            with self._no_grad_sync():  # accumulated locally; the last micro-batch's backward syncs it
                ptx_loss = self.ptx_loss()
                (ppo.ptx_coef * ptx_loss).backward()
            sums["ptx/loss"] = ptx_loss.item() / self.world_size  # a mean over ranks after the sum below
        for i, (micro, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            stats, loss = self.micro_batch_loss(micro)
            # this micro-batch's token mean, weighted by its share of the global minibatch's tokens
            share = weight * micro.response_mask.sum() / global_tokens
            with self._no_grad_sync() if i < len(micro_batches) - 1 else nullcontext():
                (loss * share * self.world_size).backward()
            ratio_max = max(ratio_max, stats.pop("policy/ratio_max"))
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value * float(share)
        names = sorted(sums)
        totals = all_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64), self.group)
        sums = dict(zip(names, totals.tolist(), strict=True))
        if critic_only:  # critic warmup: the policy's parameters (a shared trunk too) keep their values
            for param in trainable_parameters(self.policy):
                param.grad = None
        sums["policy/grad_norm"], sums["value/grad_norm"], finite = self._clip_gradients()
        if finite:
            self.optimizer.step()
        sums["health/nonfinite_updates"] = 0.0 if finite else 1.0  # never apply a NaN/inf update
        sums["policy/ratio_max"] = ratio_max
        return sums

    def _micro_batches(self, minibatch: Rollout) -> tuple[list[Rollout], list[float]]:
        """This rank's micro-batches of ``minibatch`` and their loss weights (1, or 0 for padding).

        Under FSDP2 each forward and backward is a collective, so every rank runs as many as the rank
        with the most: the others repeat one row whose loss counts 0 (only a token budget can differ).
        """
        ppo = self.cfg.ppo
        if ppo.micro_batch_tokens:  # a budget per forward, after evening out the ranks' token counts
            minibatch = self._balanced_over_ranks(minibatch)
            micro_batches = list(token_budget_micro_batches(minibatch, ppo.micro_batch_tokens))
        else:
            micro_size = ppo.micro_batch_size // self.world_size if ppo.micro_batch_size else len(minibatch)
            micro_batches = list(length_sorted_micro_batches(minibatch, max(micro_size, 1)))
        weights = [1.0] * len(micro_batches)
        if self.sharded and ppo.micro_batch_tokens:  # row counts give every rank the same number already
            missing = max(gather_objects(len(micro_batches), self.group)) - len(micro_batches)
            micro_batches += [micro_batches[-1].select(torch.tensor([0]))] * missing
            weights += [0.0] * missing
        return micro_batches, weights

    def _balanced_over_ranks(self, minibatch: Rollout) -> Rollout:
        """This rank's share of all ranks' minibatch rows, split so that every rank forwards a similar
        number of tokens (the slowest rank sets the pace of each synchronised backward). The loss is a
        global token mean, so which rank computes a row changes no result."""
        if self.group is None:
            return minibatch
        every = concat_rollouts(
            [
                part.to(minibatch.response_ids.device)
                for part in gather_objects(minibatch.to("cpu"), self.group)
            ]
        )
        row_tokens = (every.query_mask.sum(1) + every.response_mask.sum(1)).long().tolist()
        mine = balanced_assignment(row_tokens, self.world_size)[self.rank]
        return every.select(torch.tensor(mine))

    def _no_grad_sync(self):
        """Skip DDP's gradient all-reduce for this backward (gradients accumulate locally). FSDP2
        reduce-scatters every backward instead: its gradients then accumulate as 1/N shards."""
        return self.train_module.no_sync() if self.group is not None and not self.sharded else nullcontext()

    def micro_batch_loss(self, micro: Rollout) -> tuple[dict[str, float], torch.Tensor]:
        ppo = self.cfg.ppo
        mask, extras = micro.response_mask, micro.extras
        with self.autocast():  # the forward only: backward runs each op in its forward's dtype
            logits, values = self.train_module(micro)
        logp_new, token_entropy = core.token_logprobs_and_entropy(logits, micro.response_ids)
        policy_loss, clip_frac = core.ppo_clip_loss(
            logp_new,
            micro.logp_old,
            extras["advantages"],
            mask,
            ppo.clip_eps,
            token_weights=extras.get("tis_weights"),
        )
        v_loss, v_clip_frac = core.value_loss(
            values, extras["values"], extras["returns"], mask, ppo.value_clip_eps
        )
        if ppo.ent_coef == 0:  # only a metric: the backward skips the entropy's (B, R, V) gradient sweep
            token_entropy = token_entropy.detach()
        entropy = core.masked_mean(token_entropy, mask)
        loss = policy_loss + ppo.vf_coef * v_loss - ppo.ent_coef * entropy
        if self.step_count < ppo.critic_warmup_steps:  # the value loss alone (x 0 keeps DDP's graph whole)
            loss = 0.0 * policy_loss + ppo.vf_coef * v_loss
        with torch.no_grad():
            ratio = torch.exp(torch.where(mask.bool(), logp_new - micro.logp_old, 0.0))
            stats = {
                "policy/loss": policy_loss.item(),
                "policy/clip_frac": clip_frac.item(),
                "policy/approx_kl": core.approx_kl(logp_new, micro.logp_old, mask).item(),
                "engine/logp_gap": core.masked_mean(
                    (logp_new - extras.get("logp_engine", micro.logp_old)).abs(), mask
                ).item(),
                "policy/entropy": entropy.item(),
                "policy/ratio_mean": core.masked_mean(ratio, mask).item(),
                "policy/ratio_sq": core.masked_mean(ratio**2, mask).item(),
                "policy/ratio_max": torch.where(mask.bool(), ratio, 0.0).max().item(),
                "value/loss": v_loss.item(),
                "value/clip_frac": v_clip_frac.item(),
            }
        return stats, loss

    def ptx_loss(self) -> torch.Tensor:
        """InstructGPT's PPO-ptx term: next-token loss on a batch of demonstrations (response tokens)."""
        batch = self.ptx_batches()
        with self.autocast():
            out = self.policy(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
        return out.loss.float()

    def _clip_gradients(self) -> tuple[float, float, bool]:
        """Clip policy and critic gradients separately; report pre-clip norms and whether both are finite.

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
            if (
                max_norm / (norm_value + 1e-6) < 1.0
            ):  # clip_grad_norm_'s factor; NaN / inf skip the step anyway
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            norms.append(norm_value)
        return norms[0], norms[1], all(math.isfinite(n) for n in norms)

    # ----------------------------------------------------------------------------------------------
    # checkpoint state: everything a resumed run needs to continue exactly
    # ----------------------------------------------------------------------------------------------

    def apply_changed_settings(self, changed: set[str]) -> None:
        """After a resume with ``--allow-config-change``: the changed settings the checkpoint's state would
        otherwise override (``changed``: dotted config keys) take effect from the next step."""
        ppo = self.cfg.ppo
        if changed & {"ppo.lr", "ppo.value_lr"}:  # the schedule's base rates; its position is kept
            self.scheduler.base_lrs = [ppo.lr, ppo.value_lr or ppo.lr]
            for group, base, multiplier in zip(
                self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas
            ):
                group["initial_lr"], group["lr"] = base, base * multiplier(self.scheduler.last_epoch)
        if changed & {"ppo.weight_decay", "ppo.adam_eps"}:
            for group in self.optimizer.param_groups:
                group["weight_decay"], group["eps"] = ppo.weight_decay, ppo.adam_eps
        if any(key.startswith("kl.") for key in changed):  # a new coefficient or controller starts afresh
            self.kl_controller = self._build_kl_controller()

    def _trained_modules(self) -> dict[str, tuple[nn.Module, set[int]]]:
        """name -> (module, ids of parameters saved under another name: the shared trunk)."""
        return {
            "policy": (self.policy, set()),
            "value": (self.value_model, {id(p) for p in self.policy.parameters()}),
        }

    def state_payload(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """``(tensors, state)`` for :func:`lmppo.checkpoint.save_checkpoint` (no pickle anywhere).

        Under FSDP2 every sharded weight and optimizer state is gathered whole (one all-gather per
        tensor, in the same order on every rank), so the checkpoint is the same as one process's and
        resumes on any number of ranks and either strategy. Only rank 0, which writes, keeps the
        tensors: the others return empty groups. With ``distributed.checkpoint=sharded`` each rank
        returns its own shards instead, as groups ``<group>-rank<r>`` that it writes itself.
        """
        if self.sharded_checkpoints:
            suffix, collect = f"-rank{self.rank}", lambda group: {k: local_part(v) for k, v in group.items()}
        else:
            suffix, collect = "", self._whole
        tensors = {
            f"{name}{suffix}": collect(
                {k: p.detach() for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
            )
            for name, (module, skip) in self._trained_modules().items()
        }
        optimizer_tensors, optimizer_skeleton = flatten_state(self.optimizer.state_dict())
        tensors[f"optimizer{suffix}"] = collect(optimizer_tensors)
        # Every rank's generators (each samples and shuffles its own stream); the rest of the state is
        # the same on every rank. A collective: every rank calls this, rank 0 writes.
        rng_json, rng_tensors = capture_rng_state()
        per_rank = gather_objects(
            (rng_json, {**rng_tensors, "shuffle": self.shuffle_generator.get_state()}), self.group
        )
        tensors["rng"] = {f"rank{r}/{k}": v for r, (_, t) in enumerate(per_rank) for k, v in t.items()}
        state = {
            "step": self.step_count,
            "policy_version": self.policy_version,
            "episodes": self.episodes,
            "tokens": self.tokens,
            "prompt_stream": self.prompt_stream.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "score_transform": self.reward.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer": optimizer_skeleton,
            "rng": [j for j, _ in per_rank],  # one entry per rank
            "sharded_ranks": self.world_size if self.sharded_checkpoints else None,  # groups split per rank
        }
        return tensors, state

    def _restore_rank_rng(
        self, tensors: dict[str, torch.Tensor], per_rank_json: list[dict], step: int
    ) -> None:
        """This rank's generators from the checkpoint; re-seeded when it was written by another world size."""
        saved_world = len(per_rank_json)
        if saved_world != self.world_size:  # check_compatible refused this unless --allow-config-change
            warn(
                f"the checkpoint was written by {saved_world} ranks and this run has {self.world_size}: weights, "
                "optimizer, schedule, KL controller and data position carry over, but each rank's sampling "
                "and shuffling generators start afresh, so the run does not continue bit for bit"
            )
            seed = rank_seed(self.cfg.run.seed + step, self.rank)  # not the streams the run started with
            seed_everything(seed)
            self.shuffle_generator.manual_seed(seed + 1)
            return
        prefix = f"rank{self.rank}/"
        rng = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        self.shuffle_generator.set_state(rng.pop("shuffle"))
        restore_rng_state(per_rank_json[self.rank], rng)

    def _whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` whole, gathered one at a time from their shards (every rank takes part), on rank 0;
        empty elsewhere, so no other rank holds a second copy of the trained state."""
        whole = {}
        for name, tensor in tensors.items():
            gathered = full_tensor(tensor)
            if self.rank == 0:
                whole[name] = gathered
        return whole

    def _saved_groups(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict):
        """The checkpoint's trained groups (``policy``, ``value``, ``optimizer``) and how a saved tensor
        takes a parameter's layout: whole tensors are cut into this rank's shard; this rank's own saved
        shards (a sharded checkpoint, same world size) are used as they are; every rank's saved shards
        (another world size) are put together whole first."""
        names = [*self._trained_modules(), "optimizer"]
        saved_ranks = state.get("sharded_ranks")
        if saved_ranks is None:
            return {name: tensors[name] for name in names}, shard_like
        if saved_ranks == self.world_size and self.sharded:
            return {name: tensors[f"{name}-rank{self.rank}"] for name in names}, from_local_like
        return {name: whole_group(tensors, name, saved_ranks) for name in names}, shard_like

    def _optimizer_state_like_params(self, optimizer_state: dict, place) -> dict:
        """A saved optimizer state with each parameter's moments laid out like that parameter by
        ``place(saved, param)``. Entries are indexed in param-group order."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, entry in optimizer_state["state"].items():
            for key, value in entry.items():
                if value.dim() > 0:  # not the step count
                    entry[key] = place(value, params[index])
        return optimizer_state

    def load_state_payload(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> None:
        saved, place = self._saved_groups(tensors, state)
        for name, (module, skip) in self._trained_modules().items():
            expected = {k: p for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
            if set(expected) != set(saved[name]):
                raise LmppoError(
                    f"checkpoint's {name} weights do not match this model ({len(saved[name])} saved tensors, "
                    f"{len(expected)} trainable here): was it written by a run with other models or LoRA settings?"
                )
            with torch.no_grad():
                for key, param in expected.items():
                    param.copy_(place(saved[name][key], param))
        optimizer_state = unflatten_state(saved["optimizer"], state["optimizer"])
        self.optimizer.load_state_dict(self._optimizer_state_like_params(optimizer_state, place))
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.reward.load_state_dict(state["score_transform"])
        self.prompt_stream.load_state_dict(state["prompt_stream"])
        self._restore_rank_rng(tensors["rng"], state["rng"], int(state["step"]))
        self.step_count, self.policy_version = int(state["step"]), int(state["policy_version"])
        self.sync_generator()  # an engine with its own weights gets the restored policy
        self.episodes, self.tokens = int(state["episodes"]), int(state["tokens"])
