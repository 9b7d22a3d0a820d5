"""The PPO loop, readable top to bottom (seeds/003 §3.4, DESIGN.md "Data flow of one PPO step").

One step: rollout -> score -> stored passes (reference log-probs, values) -> shaped rewards -> GAE
(bootstrapping truncated rows) -> global advantage whitening -> ``ppo_epochs`` passes over shuffled
minibatches (micro-batch gradient accumulation) -> approx-KL early stop -> KL controller -> metrics.
All the math lives in :mod:`lmppo.core`; this module only orders it and keeps the books.
"""

from __future__ import annotations

import dataclasses
import math
import random
import resource
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from torch import nn
from transformers import GenerationConfig

from lmppo import core
from lmppo.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    capture_rng_state,
    check_compatible,
    flatten_state,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    unflatten_state,
)
from lmppo.config import Config
from lmppo.data import Prompt, PromptStream, load_demonstrations, load_prompts
from lmppo.distributed import (
    DistInfo,
    all_sum,
    any_rank,
    barrier,
    check_world_size,
    data_parallel,
    distributed_session,
    gather_objects,
    rank_seed,
)
from lmppo.errors import LmppoError
from lmppo.guards import Guards
from lmppo.metrics import MetricsLogger, ProgressDisplay, reduce_metrics
from lmppo.models import (
    ValueModel,
    freeze,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    make_reference,
    model_identity,
    resolve_source,
    with_lora,
)
from lmppo.rollout import (
    Generator,
    HFGenerator,
    Rollout,
    policy_logits_and_values,
    reference_logprobs,
    response_logits,
    value_predictions,
)
from lmppo.scoring import RewardFunction, RewardModelScorer, ScoreTransform, load_reward_function
from lmppo.sft import sft_batch


@dataclass
class PPOModels:
    """The four models of a run (the reward is a learned RM wrapped as a function, or a program)."""

    policy: nn.Module
    reference: nn.Module
    value: nn.Module
    tokenizer: object
    reward: RewardFunction
    identities: dict[str, dict] = field(default_factory=dict)


class PolicyAndValue(nn.Module):
    """The trained networks behind one ``forward``: (B, R, V) tempered response logits and (B, R) values.

    One module so that data parallelism wraps one forward and one set of parameters: DDP then syncs the
    policy's and the critic's gradients in the same backward, and a shared trunk is synced once.
    """

    def __init__(self, policy: nn.Module, value_model: ValueModel) -> None:
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, batch: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        if self.value_model.shared_trunk:
            return policy_logits_and_values(self.policy, self.value_model, batch)
        queries, responses = batch.query_ids.shape[1], batch.response_ids.shape[1]
        values = self.value_model(*batch.sequence_inputs())[:, queries - 1 : queries - 1 + responses]
        return response_logits(self.policy, batch), values


def trim_padding(rollout: Rollout) -> Rollout:
    """Drop the columns that are padding in every row: leading query columns (left padding) and response
    columns past the longest response. Positions count real tokens, so no real token moves."""
    first = int(rollout.query_mask.any(dim=0).long().argmax())  # first query column holding a real token
    length = int(rollout.response_mask.sum(1).max().clamp(min=1))
    if first == 0 and length == rollout.response_ids.shape[1]:
        return rollout
    queries = {name: getattr(rollout, name)[:, first:] for name in ("query_ids", "query_mask")}
    responses = {name: getattr(rollout, name)[:, :length] for name in ("response_ids", "response_mask", "logp_old")}
    extras = {k: v[:, :length] if v.dim() == 2 else v for k, v in rollout.extras.items()}
    return dataclasses.replace(rollout, **queries, **responses, extras=extras)


def length_sorted_micro_batches(minibatch: Rollout, size: int) -> Iterator[Rollout]:
    """Micro-batches of ``size`` rows, trimmed; with several, rows of similar length go together.

    Length is real query plus counted response tokens. Gradient accumulation sums token-weighted
    micro-batch losses, so grouping rows by length changes no result, only how many padded positions
    the forward passes compute.
    """
    order = torch.arange(len(minibatch))
    if size < len(minibatch):
        lengths = minibatch.query_mask.sum(1) + minibatch.response_mask.sum(1)
        order = torch.argsort(lengths.cpu(), descending=True, stable=True)
    for start in range(0, len(minibatch), size):
        yield trim_padding(minibatch.select(order[start : start + size]))


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Wall seconds of the block, into ``seconds[key]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = time.perf_counter() - started


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA); sampling draws from torch's global generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


class PPOTrainer:
    def __init__(
        self,
        cfg: Config,
        models: PPOModels,
        prompts: list[Prompt],
        *,
        generator: Generator | None = None,
        ptx_batches: Callable[[], dict[str, torch.Tensor]] | None = None,
        evaluator: Callable[[], dict[str, float]] | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        check_world_size(world_size, **{"rollout.batch_size": cfg.rollout.batch_size,
                                         "ppo.minibatch_size": cfg.ppo.minibatch_size,
                                         "ppo.micro_batch_size": cfg.ppo.micro_batch_size})
        self.cfg, self.models, self.group = cfg, models, group
        self.policy, self.reference, self.value_model = models.policy, models.reference, models.value
        # Dropout stays off for the whole run (as in TRL): the stored log-probs and values and the
        # update's first forward then agree exactly, so the first ratio is 1. Gradients still flow.
        for model in (self.policy, self.value_model):
            model.eval()
        # The update's forward. With several ranks it runs under DDP, which syncs gradients during the
        # backward; generation and the stored passes use the plain modules (no gradients to sync).
        self.train_module: nn.Module = PolicyAndValue(self.policy, self.value_model)
        self.allreduce_counter = None
        if group is not None:
            self.train_module, self.allreduce_counter = data_parallel(self.train_module, group)
        if cfg.rollout.engine == "vllm" and world_size > 1:
            raise LmppoError("rollout.engine=vllm runs with one process; use rollout.engine=hf under torchrun")
        self.generator = generator or build_generator(cfg, models)
        self.prompt_stream = PromptStream(prompts, cfg.rollout.batch_size, shuffle=cfg.data.shuffle,
                                          seed=cfg.run.seed, rank=rank, world_size=world_size)
        self.ptx_batches, self.evaluator = ptx_batches, evaluator
        self.rank, self.world_size = rank, world_size
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.ppo.lr_schedule, cfg.ppo.warmup_steps, cfg.run.steps)
        )
        self.kl_controller = (
            core.AdaptiveKLController(cfg.kl.beta, cfg.kl.target, cfg.kl.horizon)
            if cfg.kl.adaptive else core.FixedKLController(cfg.kl.beta)
        )
        self.score_transform = ScoreTransform(
            missing_eos_penalty=cfg.reward.missing_eos_penalty, clip=cfg.reward.clip, normalize=cfg.reward.normalize
        )
        self.shuffle_generator = torch.Generator().manual_seed(cfg.run.seed + 1 + rank)
        self.step_count = 0  # PPO steps done
        self.policy_version = 0  # PPO steps that changed the policy; each rollout records the one it saw
        self.episodes = 0  # responses generated (all ranks)
        self.tokens = 0  # response tokens generated (all ranks)

    # ----------------------------------------------------------------------------------------------
    # set-up
    # ----------------------------------------------------------------------------------------------

    def _trainable(self, module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def _value_only_parameters(self) -> list[nn.Parameter]:
        """Critic parameters not already owned by the policy (with a shared trunk: the head only)."""
        policy_ids = {id(p) for p in self.policy.parameters()}
        return [p for p in self._trainable(self.value_model) if id(p) not in policy_ids]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        ppo = self.cfg.ppo
        groups = [
            {"params": self._trainable(self.policy), "lr": ppo.lr, "name": "policy"},
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
            with timed(seconds, "perf/rollout_s"):
                rollout = self.collect_rollout()
            lag = self.policy_version - rollout.policy_version

            # 2-4. Score, stored passes, shaped rewards, GAE, whitening (stored in rollout.extras).
            with timed(seconds, "perf/score_s"):
                reward_stats = self.score_and_estimate(rollout)

            # 5. PPO epochs over shuffled minibatches; an engine with its own weights gets the new policy.
            with timed(seconds, "perf/update_s"):
                update_stats = self.update(rollout)
            if update_stats["health/nonfinite_updates"] < update_stats["policy/updates"]:
                self.policy_version += 1  # the policy changed: rollouts sampled before are one version older
                self.sync_generator(seconds)

            # 6. KL controller, fed the global mean per-sequence KL and stepped once per sample.
            beta = self.kl_controller.value
            self.kl_controller.update(reward_stats["kl/ref"], n_steps=cfg.rollout.batch_size)
            self.scheduler.step()
            self.step_count += 1

        n_tokens = reward_stats["response/length"] * cfg.rollout.batch_size
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
            "perf/train_tokens_per_s": n_tokens * update_stats["policy/epochs"] / max(seconds["perf/update_s"], 1e-9),
            "perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.allreduce_counter is not None:
            metrics["perf/allreduce_mb"] = self.allreduce_counter.take() / 2**20
        if self.evaluator is not None and cfg.run.eval_every and self.step_count % cfg.run.eval_every == 0:
            metrics.update(self.evaluator())
        return metrics

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
            rollout = self.generator.generate(self.prompt_stream.next_batch(), policy_version=self.policy_version)
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
        forward_batch = cfg.rollout.forward_batch_size
        seconds: dict[str, float] = {}
        with timed(seconds, "perf/reward_s"):
            rm_score_raw = self.models.reward(rollout.prompts, rollout.response_texts).float().to(mask.device)
            rm_score, transform_stats = self.score_transform(rm_score_raw, rollout.terminated, group)
        with timed(seconds, "perf/reference_s"):
            logp_ref = reference_logprobs(self.reference, rollout, micro_batch_size=forward_batch)
        with timed(seconds, "perf/values_s"):
            values, bootstrap_value = value_predictions(self.value_model, rollout, micro_batch_size=forward_batch)
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

        kl_per_token = torch.where(mask.bool(), core.kl_estimate(rollout.logp_old, logp_ref, cfg.kl.estimator), 0.0)
        per_row = {  # sequence-level quantities, averaged over all ranks' rows
            "reward/rm_score": rm_score_raw,
            "reward/kl_penalty": -beta * kl_per_token.sum(1),
            "reward/shaped": rewards.sum(1),
            "kl/ref": kl_per_token.sum(1),
            "response/length": mask.sum(1),
            "response/eos_frac": rollout.terminated.float(),
            "response/truncated_frac": (~rollout.terminated).float(),
        }
        if transform_stats or cfg.rollout.truncation == "bootstrap":
            per_row["reward/rm_score_used"] = rm_score
        every_row = torch.ones(1, len(rollout), device=mask.device)
        stats = {key: core.masked_mean(value[None], every_row, group).item() for key, value in per_row.items()}
        stats.update(transform_stats)
        stats.update(seconds)
        stats.update(tis_stats)
        stats.update({
            "adv/mean": adv_mean.item(),
            "adv/std": adv_std.item(),
            "value/explained_var": core.explained_variance(values, returns, mask, group).item(),
            "lag/rollout_age_s": time.time() - rollout.created_at,
            "health/nonfinite": all_sum(sum((~torch.isfinite(t)).sum().double() for t in (  # all ranks
                rm_score_raw, torch.where(mask.bool(), logp_ref, 0.0), torch.where(mask.bool(), values, 0.0))),
                group).item(),
        })
        return stats

    def _truncated_importance_sampling(self, rollout: Rollout) -> dict[str, float]:
        """``ppo.tis_cap``: take the PPO ratio against the trainer's own log-probs of the samples and weight
        each token by ``min(p_trainer / p_engine, cap)`` (``extras["tis_weights"]``). The engine's
        log-probs move to ``extras["logp_engine"]``."""
        mask = rollout.response_mask
        logp_trainer = reference_logprobs(self.policy, rollout, micro_batch_size=self.cfg.rollout.forward_batch_size)
        weights = core.truncated_importance_weights(logp_trainer, rollout.logp_old, mask, self.cfg.ppo.tis_cap)
        rollout.extras.update(logp_engine=rollout.logp_old, tis_weights=weights)
        rollout.logp_old = logp_trainer
        return {"lag/tis_clip_frac": core.masked_mean((weights >= self.cfg.ppo.tis_cap).float(), mask,
                                                      self.group).item()}

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
                logp_gap = stats.pop("lag/engine_logp_gap")
                if n_updates == 0:  # before any update: the sampler's log-probs vs the trainer's, same weights
                    engine_logp_gap = logp_gap
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                epoch_kl += stats["policy/approx_kl"]
                epoch_updates += 1
                n_updates += 1
            if ppo.target_approx_kl is not None and epoch_kl / epoch_updates > ppo.target_approx_kl:
                break  # approx KL is a global token mean, the same on every rank: all stop together
        metrics = {key: value / n_updates for key, value in totals.items()}
        metrics["lag/engine_logp_gap"] = engine_logp_gap
        ratio_var = metrics.pop("policy/ratio_sq") - metrics["policy/ratio_mean"] ** 2
        metrics["policy/ratio_std"] = math.sqrt(max(ratio_var, 0.0))
        metrics["policy/ratio_max"] = ratio_max
        metrics["policy/epochs"] = float(epochs_run)
        metrics["policy/updates"] = float(n_updates)
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
        micro_size = ppo.micro_batch_size // self.world_size if ppo.micro_batch_size else len(minibatch)
        micro_batches = list(length_sorted_micro_batches(minibatch, max(micro_size, 1)))
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        ratio_max = 0.0
        if self.ptx_batches is not None and ppo.ptx_coef > 0:
            with self._no_grad_sync():  # accumulated locally; the last micro-batch's backward syncs it
                ptx_loss = self.ptx_loss()
                (ppo.ptx_coef * ptx_loss).backward()
            sums["ptx/loss"] = ptx_loss.item() / self.world_size  # a mean over ranks after the sum below
        for i, micro in enumerate(micro_batches):
            stats, loss = self.micro_batch_loss(micro)
            share = micro.response_mask.sum() / global_tokens  # micro token mean -> global token mean
            with self._no_grad_sync() if i < len(micro_batches) - 1 else nullcontext():
                (loss * share * self.world_size).backward()
            ratio_max = max(ratio_max, stats.pop("policy/ratio_max"))
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value * float(share)
        names = sorted(sums)
        totals = all_sum(torch.tensor([sums[n] for n in names], dtype=torch.float64), self.group)
        sums = dict(zip(names, totals.tolist(), strict=True))
        sums["health/grad_norm"], sums["value/grad_norm"], finite = self._clip_gradients()
        if finite:
            self.optimizer.step()
        sums["health/nonfinite_updates"] = 0.0 if finite else 1.0  # never apply a NaN/inf update
        sums["policy/ratio_max"] = ratio_max
        return sums

    def _no_grad_sync(self):
        """Skip DDP's gradient all-reduce for this backward (gradients accumulate locally)."""
        return self.train_module.no_sync() if self.group is not None else nullcontext()

    def micro_batch_loss(self, micro: Rollout) -> tuple[dict[str, float], torch.Tensor]:
        ppo = self.cfg.ppo
        mask, extras = micro.response_mask, micro.extras
        logits, values = self.train_module(micro)
        logp_new = core.token_logprobs(logits, micro.response_ids)
        policy_loss, clip_frac = core.ppo_clip_loss(logp_new, micro.logp_old, extras["advantages"], mask, ppo.clip_eps,
                                                    token_weights=extras.get("tis_weights"))
        v_loss, v_clip_frac = core.value_loss(values, extras["values"], extras["returns"], mask, ppo.value_clip_eps)
        if ppo.ent_coef > 0:
            entropy = core.masked_entropy(logits, mask)
        else:  # only a metric: no graph through a (B, R, V) entropy
            with torch.no_grad():
                entropy = core.masked_entropy(logits, mask)
        loss = policy_loss + ppo.vf_coef * v_loss - ppo.ent_coef * entropy
        with torch.no_grad():
            ratio = torch.exp(torch.where(mask.bool(), logp_new - micro.logp_old, 0.0))
            stats = {
                "policy/loss": policy_loss.item(),
                "policy/clip_frac": clip_frac.item(),
                "policy/approx_kl": core.approx_kl(logp_new, micro.logp_old, mask).item(),
                "lag/engine_logp_gap": core.masked_mean(
                    (logp_new - extras.get("logp_engine", micro.logp_old)).abs(), mask).item(),
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
        out = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return out.loss

    def _clip_gradients(self) -> tuple[float, float, bool]:
        """Clip policy and critic gradients separately; report pre-clip norms and whether both are finite.

        ``clip_grad_norm_`` in two halves: the scaling pass runs only when it would change a gradient
        (its factor is clamped at 1), which saves a read and write of every gradient on most steps.
        """
        max_norm = self.cfg.ppo.max_grad_norm or float("inf")
        norms = []
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
            if max_norm / (norm + 1e-6) < 1.0:  # clip_grad_norm_'s factor; NaN / inf norms skip the step anyway
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            norms.append(float(norm))
        return norms[0], norms[1], all(math.isfinite(n) for n in norms)

    # ----------------------------------------------------------------------------------------------
    # checkpoint state: everything a resumed run needs to continue exactly
    # ----------------------------------------------------------------------------------------------

    def _trained_modules(self) -> dict[str, tuple[nn.Module, set[int]]]:
        """name -> (module, ids of parameters saved under another name: the shared trunk)."""
        return {"policy": (self.policy, set()), "value": (self.value_model, {id(p) for p in self.policy.parameters()})}

    def state_payload(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """``(tensors, state)`` for :func:`lmppo.checkpoint.save_checkpoint` (no pickle anywhere)."""
        tensors = {
            name: {k: p.detach() for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
            for name, (module, skip) in self._trained_modules().items()
        }
        optimizer_tensors, optimizer_skeleton = flatten_state(self.optimizer.state_dict())
        tensors["optimizer"] = optimizer_tensors
        # Every rank's generators (each samples and shuffles its own stream); the rest of the state is
        # the same on every rank. A collective: every rank calls this, rank 0 writes.
        rng_json, rng_tensors = capture_rng_state()
        per_rank = gather_objects((rng_json, {**rng_tensors, "shuffle": self.shuffle_generator.get_state()}),
                                  self.group)
        tensors["rng"] = {f"rank{r}/{k}": v for r, (_, t) in enumerate(per_rank) for k, v in t.items()}
        state = {
            "step": self.step_count,
            "policy_version": self.policy_version,
            "episodes": self.episodes,
            "tokens": self.tokens,
            "prompt_stream": self.prompt_stream.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "score_transform": self.score_transform.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer": optimizer_skeleton,
            "rng": [j for j, _ in per_rank],  # one entry per rank
        }
        return tensors, state

    def _restore_rank_rng(self, tensors: dict[str, torch.Tensor], per_rank_json: list[dict], step: int) -> None:
        """This rank's generators from the checkpoint; re-seeded when it was written by another world size."""
        saved_world = len(per_rank_json)
        if saved_world != self.world_size:  # check_compatible refused this unless --allow-config-change
            warnings.warn(
                f"the checkpoint was written by {saved_world} ranks and this run has {self.world_size}: weights, "
                "optimizer, schedule, KL controller and data position carry over, but each rank's sampling "
                "and shuffling generators start afresh, so the run does not continue bit for bit",
                stacklevel=2,
            )
            seed = rank_seed(self.cfg.run.seed + step, self.rank)  # not the streams the run started with
            seed_everything(seed)
            self.shuffle_generator.manual_seed(seed + 1)
            return
        prefix = f"rank{self.rank}/"
        rng = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        self.shuffle_generator.set_state(rng.pop("shuffle"))
        restore_rng_state(per_rank_json[self.rank], rng)

    def load_state_payload(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict) -> None:
        for name, (module, skip) in self._trained_modules().items():
            expected = {k: p for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
            if set(expected) != set(tensors[name]):
                raise LmppoError(
                    f"checkpoint's {name} weights do not match this model ({len(tensors[name])} saved tensors, "
                    f"{len(expected)} trainable here): was it written by a run with other models or LoRA settings?"
                )
            with torch.no_grad():
                for key, param in expected.items():
                    param.copy_(tensors[name][key])
        self.optimizer.load_state_dict(unflatten_state(tensors["optimizer"], state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_transform.load_state_dict(state["score_transform"])
        self.prompt_stream.load_state_dict(state["prompt_stream"])
        self._restore_rank_rng(tensors["rng"], state["rng"], int(state["step"]))
        self.step_count, self.policy_version = int(state["step"]), int(state["policy_version"])
        self.sync_generator()  # an engine with its own weights gets the restored policy
        self.episodes, self.tokens = int(state["episodes"]), int(state["tokens"])


def build_generator(cfg: Config, models: PPOModels) -> Generator:
    """The rollout engine ``rollout.engine`` names, with the config's sampling settings."""
    options = {
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
        "top_k": cfg.rollout.top_k, "top_p": cfg.rollout.top_p, "stop_token_ids": cfg.rollout.stop_token_ids,
        "chat_template": cfg.models.policy.chat_template, "raw_prompts": cfg.data.raw_prompts,
        "max_prompt_length": cfg.data.max_prompt_length, "truncate_prompts": cfg.data.truncate_prompts,
    }
    if cfg.rollout.engine == "vllm":
        from lmppo.vllm_engine import VLLMGenerator

        if cfg.models.policy.gguf_file or not Path(cfg.models.policy.path).is_dir():
            raise LmppoError("rollout.engine=vllm loads models.policy.path as a transformers directory; convert a "
                             "GGUF file first (lmppo.models.cache_gguf_as_transformers)")
        return VLLMGenerator(models.policy, models.tokenizer, cfg.models.policy.path, seed=cfg.run.seed,
                             kv_cache_gb=cfg.rollout.vllm_kv_cache_gb, **options)
    return HFGenerator(models.policy, models.tokenizer, **options)


# --------------------------------------------------------------------------------------------------
# The four models from the config
# --------------------------------------------------------------------------------------------------


def load_models(cfg: Config, device: torch.device) -> PPOModels:
    """Policy (+ LoRA), reference, reward (model or function) and critic, with identity records."""
    m = cfg.models
    policy_source = resolve_source(m.policy.path, m.policy.gguf_file)
    tokenizer = load_tokenizer(m.policy.path, m.policy.gguf_file, trust_remote_code=m.policy.trust_remote_code)
    policy = load_causal_lm(m.policy.path, gguf_file=m.policy.gguf_file, dtype=m.policy.dtype,
                            trust_remote_code=m.policy.trust_remote_code).to(device)
    policy = with_lora(policy, m.policy_lora)
    if m.reference is not None:
        reference_source = resolve_source(m.reference.path, m.reference.gguf_file)
        reference = freeze(load_causal_lm(m.reference.path, gguf_file=m.reference.gguf_file, dtype=m.reference.dtype,
                                          trust_remote_code=m.reference.trust_remote_code)).to(device)
    else:  # the policy's starting weights: adapter-disabled view with LoRA, else a frozen copy
        reference_source, reference = policy_source, make_reference(policy)

    reward_model, rm_source, rm_tokenizer = None, None, None
    if cfg.reward.model is not None:
        r = cfg.reward.model
        rm_source = resolve_source(r.path, r.gguf_file)
        rm_tokenizer = load_tokenizer(r.path, r.gguf_file, trust_remote_code=r.trust_remote_code)
        reward_model = load_reward_model(r.path, gguf_file=r.gguf_file, dtype=r.dtype,
                                         trust_remote_code=r.trust_remote_code).to(device)
        reward = RewardModelScorer(reward_model, rm_tokenizer, chat_template=r.chat_template,
                                   max_length=cfg.reward.max_length, batch_size=cfg.reward.batch_size)
    else:
        reward = load_reward_function(cfg.reward.function)

    value = _load_value_model(cfg, policy, reward_model, device)
    template = m.policy.chat_template
    identities = {
        "policy": model_identity("policy", policy, source=policy_source, tokenizer=tokenizer, chat_template=template),
        "reference": model_identity("reference", reference, source=reference_source, tokenizer=tokenizer,
                                    chat_template=template, shared_with="policy" if m.reference is None else None),
        "reward": (model_identity("reward", reward_model, source=rm_source, tokenizer=rm_tokenizer,
                                  chat_template=cfg.reward.model.chat_template) if reward_model is not None
                   else {"role": "reward", "function": cfg.reward.function}),
        "value": model_identity("value", value, shared_with="policy" if value.shared_trunk else None),
    }
    identities = {k: v if isinstance(v, dict) else v.to_dict() for k, v in identities.items()}
    identities["value"]["init_from"] = "policy" if value.shared_trunk else m.value.init_from
    return PPOModels(policy, reference, value, tokenizer, reward, identities)


def _load_value_model(cfg: Config, policy: nn.Module, reward_model: nn.Module | None, device) -> ValueModel:
    v = cfg.models.value
    if v.mode == "shared":
        return ValueModel.shared_trunk(policy).to(device)
    if v.init_from == "reward":
        if reward_model is None:
            raise LmppoError("models.value.init_from=reward needs a reward model (reward.model); "
                             "with a programmatic reward use models.value.init_from=policy")
        value = ValueModel.from_reward_model(reward_model)
    else:
        value = ValueModel.from_causal_lm(policy)
    return with_lora(value, v.lora).to(device)


# --------------------------------------------------------------------------------------------------
# A whole run: resume, guards, checkpoints, signals, the final model
# --------------------------------------------------------------------------------------------------


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to finish the current step, save and exit cleanly."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmppoError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def train(
    cfg: Config,
    *,
    resume: bool = False,
    allow_config_change: bool = False,
    evaluator_factory: Callable[[PPOModels], Callable[[], dict[str, float]]] | None = None,
) -> Path:
    """Run (or resume) PPO as configured; returns the run directory. Raises LmppoError on a guard abort.

    Under ``torchrun`` every rank calls this: data parallel over the process group torchrun describes.
    """
    device = resolve_device(cfg.run.device)
    with distributed_session(device.type) as dist_info:
        return _train(cfg, device, dist_info, resume, allow_config_change, evaluator_factory)


def _train(
    cfg: Config,
    device: torch.device,
    dist_info: DistInfo,
    resume: bool,
    allow_config_change: bool,
    evaluator_factory: Callable[[PPOModels], Callable[[], dict[str, float]]] | None,
) -> Path:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run_dir = Path(cfg.run.output_dir)
    checkpoint = _checkpoint_to_resume(run_dir, resume)
    barrier(dist_info.group)  # every rank has looked for a checkpoint before rank 0 writes the first one
    seed_everything(cfg.run.seed)  # every rank builds the same models (fresh heads, LoRA adapters)

    models = load_models(cfg, device)
    trainer = PPOTrainer(
        cfg, models, load_prompts(cfg.data.prompts, cfg.data.split),
        ptx_batches=_ptx_batches(cfg, models.tokenizer, device, dist_info.rank),
        evaluator=evaluator_factory(models) if evaluator_factory else None,
        group=dist_info.group, rank=dist_info.rank, world_size=dist_info.world_size,
    )
    if dist_info.world_size > 1:
        seed_everything(rank_seed(cfg.run.seed, dist_info.rank))  # then each rank samples its own responses
    guards = Guards(cfg.guards)
    manifest = {"config": cfg.model_dump(mode="json"), "identities": models.identities,
                "world_size": dist_info.world_size}

    def save(tag: str) -> Path | None:
        """Called on every rank (the RNG states are gathered); rank 0 writes. Returns the path on rank 0."""
        tensors, state = trainer.state_payload()
        state["guards"] = guards.state_dict()
        if not dist_info.is_main:
            return None
        return save_checkpoint(run_dir / CHECKPOINTS_DIR, trainer.step_count, tensors=tensors, state=state,
                               manifest=manifest, tag=tag, keep_last=cfg.run.keep_last)

    if checkpoint is not None:
        differences = check_compatible(checkpoint.manifest, manifest["config"], models.identities,
                                       allow_config_change, dist_info.world_size)
        manifest["resumed_with_differences"] = differences
        trainer.load_state_payload(checkpoint.tensors, checkpoint.state)
        guards.load_state_dict(checkpoint.state["guards"])
    else:
        if dist_info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
        save("ok")  # step 0: the pre-PPO bundle is the first last-known-good checkpoint

    with (
        MetricsLogger(run_dir, cfg.logging.sinks, is_main_process=dist_info.is_main, run_name=cfg.logging.run_name,
                      config=manifest["config"], resume_step=trainer.step_count if checkpoint else None) as logger,
        ProgressDisplay(cfg.run.steps, quiet=cfg.logging.quiet, start_step=trainer.step_count,
                        enabled=dist_info.is_main) as progress,
        StopOnSignal() as stop,
    ):
        while trainer.step_count < cfg.run.steps:
            metrics = reduce_metrics(trainer.step(), dist_info.group)
            logger.log(trainer.step_count, metrics)
            progress.update(trainer.step_count, metrics)
            violation = guards.check(trainer.step_count, metrics)
            if violation is not None:  # metrics are global, so every rank finds the same violation
                aborted = save("aborted")
                raise LmppoError(
                    f"guard {violation.rule!r} stopped the run at step {trainer.step_count}: {violation.message}\n"
                    f"The state at the abort is in {aborted}; the last known good checkpoint is "
                    f"{last_good_checkpoint(run_dir)} (the pre-PPO policy is {cfg.models.policy.path})."
                )
            if any_rank(stop.requested is not None, dist_info.group):  # a signal may reach one rank first
                path = save("interrupted")
                if dist_info.is_main:
                    progress.console.print(f"{stop.requested or 'a signal'}: saved {path}; continue with --resume")
                return run_dir
            every = cfg.run.checkpoint_every
            if every and trainer.step_count % every == 0 and trainer.step_count < cfg.run.steps:
                save("ok")
    save("ok")
    if dist_info.is_main:
        export_final(run_dir / "final", models, cfg)
    barrier(dist_info.group)  # no rank leaves (and tears the group down) before the final model is written
    return run_dir


def _checkpoint_to_resume(run_dir: Path, resume: bool) -> Checkpoint | None:
    latest = latest_checkpoint(run_dir)
    if resume:
        if latest is None:
            raise LmppoError(f"--resume: {run_dir} holds no checkpoint to resume; start the run without --resume")
        return load_checkpoint(latest)
    if latest is not None:
        raise LmppoError(
            f"{run_dir} already holds a run (checkpoint {latest.name}); continue it with --resume, or set "
            "run.output_dir to a new directory"
        )
    return None


def _ptx_batches(cfg: Config, tokenizer, device, rank: int = 0) -> Callable[[], dict[str, torch.Tensor]] | None:
    """PPO-ptx: an endless, seeded stream of SFT batches from data.ptx_demonstrations."""
    if cfg.data.ptx_demonstrations is None or cfg.ppo.ptx_coef == 0:
        return None
    examples = [{"prompt": p, "response": r} for p, r in load_demonstrations(cfg.data.ptx_demonstrations)]
    rng = random.Random(rank_seed(cfg.run.seed, rank))  # each rank its own demonstrations

    def next_batch() -> dict[str, torch.Tensor]:
        batch = sft_batch(tokenizer, rng.sample(examples, min(cfg.ppo.ptx_batch_size, len(examples))))
        return {k: v.to(device) for k, v in batch.items()}

    return next_batch


def export_final(out_dir: Path, models: PPOModels, cfg: Config) -> Path:
    """The trained policy as a plain transformers directory, with our decoding settings and a model card."""
    policy = models.policy
    if isinstance(policy, PeftModel):
        policy = policy.merge_and_unload()  # training is over: fold the adapter into the weights
    policy.generation_config = GenerationConfig(
        do_sample=True, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_token_id=sorted({*cfg.rollout.stop_token_ids, models.tokenizer.eos_token_id} - {None}),
        pad_token_id=models.tokenizer.pad_token_id,
    )
    policy.save_pretrained(out_dir)
    models.tokenizer.save_pretrained(out_dir)
    reward = cfg.reward.model.path if cfg.reward.model else f"the function {cfg.reward.function}"
    kl = (f"adaptive, target {cfg.kl.target} nats, horizon {cfg.kl.horizon}" if cfg.kl.adaptive
          else f"fixed beta = {cfg.kl.beta}")
    (out_dir / "README.md").write_text(
        f"# PPO policy trained with lmppo\n\n"
        f"- Started from: `{cfg.models.policy.path}` (reference: the starting weights)\n"
        f"- Reward: {reward}; preprocessing: missing-EOS penalty {cfg.reward.missing_eos_penalty}, "
        f"clip {cfg.reward.clip}, normalize {cfg.reward.normalize}\n"
        f"- KL: {cfg.kl.estimator} estimator per token in the reward, {kl}\n"
        f"- PPO: {cfg.run.steps} steps of {cfg.rollout.batch_size} prompts, {cfg.ppo.ppo_epochs} epochs, "
        f"clip {cfg.ppo.clip_eps}, gamma {cfg.ppo.gamma}, lambda {cfg.ppo.lam}, lr {cfg.ppo.lr}\n"
        f"- Decoding it was trained with (in generation_config.json): temperature {cfg.rollout.temperature}, "
        f"top_k {cfg.rollout.top_k}, top_p {cfg.rollout.top_p}, max_new_tokens {cfg.rollout.max_new_tokens}\n\n"
        "The evaluated artifact is these weights *with* that decoding and that reward preprocessing.\n"
    )
    return out_dir
