"""What every step of a run shares, whatever it trains with: the parts and counters (:class:`Stepper`),
and the two stages before any update, each returning the next stage's record:

1. **Sample** (:meth:`Stepper.sample`): prompts from the stream through the engine, with the current policy,
   into a :class:`~lmppo.sampling.rollout.Rollout` that records the policy version and ``logp_old``; a rollout
   older than ``rollout.max_rollout_age`` is sampled again. With ``rollout.asynchronous`` the batch sampled
   during the last update is taken and the next one started (:class:`lmppo.sampling.engines.RolloutsAhead`).
2. **Score** (:meth:`Stepper.score`): the reward's raw score of each response and its preprocessing, the
   reference's log-probs, the critic's values and, under ``ppo.tis_cap``, the trainer's own log-probs, into
   a :class:`~lmppo.sampling.rollout.ScoredRollout` and the reward side's metrics (:class:`Scores`).

:class:`lmppo.training.trainer.PPOTrainer` then estimates advantages and runs PPO's update;
:class:`lmppo.training.best_of_n.BestOfNTrainer` fine-tunes on each group's best. Neither computes the other's
work.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from lmppo.errors import LmppoError, warn
from lmppo.inputs.config import Config
from lmppo.inputs.data import PromptStream
from lmppo.inputs.resolve import RunSpec
from lmppo.math import core
from lmppo.modeling.compile import compiled_graphs
from lmppo.modeling.distributed import (
    CommCounter,
    all_sum,
    failing_together,
    full_tensor,
    gathered,
    trained_state_bytes,
)
from lmppo.modeling.models import PPOModels, autocast
from lmppo.progress import phase
from lmppo.rewards.scoring import CombinedReward
from lmppo.sampling.engines import Generator, RolloutsAhead
from lmppo.sampling.hf_engine import HFGenerator
from lmppo.sampling.passes import sequence_logprobs, value_predictions
from lmppo.sampling.rollout import Rollout, ScoredRollout, concat_rollouts, padded_tokens, stored_pass_batches
from lmppo.training.budgets import TokenBudgets
from lmppo.training.metrics import timed
from lmppo.training.step_results import Scores, UpdateResult, scored_metrics, step_metrics

T = TypeVar("T")


@dataclass
class TrainerParts:
    """What a trainer steps with, ready-made (:func:`lmppo.runs.build.build_trainer`)."""

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


class Stepper:
    """The parts a run's step works with and the counters a checkpoint keeps
    (:mod:`lmppo.runs.trainer_state`); a subclass's ``step`` is one iteration of its algorithm."""

    def __init__(self, cfg: Config, spec: RunSpec, parts: TrainerParts, *, group=None, rank: int = 0) -> None:
        self.cfg, self.spec, self.group = cfg, spec, group
        self.rank, self.world_size = rank, spec.world_size
        vars(self).update(vars(parts))  # the ready-made parts under their own names (models, generator, ...)
        models = self.models
        self.policy, self.reference, self.value_model = models.policy, models.reference, models.value
        self.device, self.precision = spec.device, spec.precision
        torch.set_float32_matmul_precision(spec.fp32_matmul_precision)  # process-wide, as the run is
        self.budgets = TokenBudgets.of(cfg)  # each phase's tokens per forward, halved on out-of-memory
        self.shuffle_generator = torch.Generator().manual_seed(cfg.run.seed + 1 + rank)
        self.step_count = 0  # steps done
        self.policy_version = 0  # steps that changed the policy; each rollout records the one it saw
        self.episodes = 0  # responses generated (all ranks)
        self.tokens = 0  # response tokens generated (all ranks)
        self.graphs_seen = 0  # run.compile: graphs compiled by the last step's end (perf/compiles)
        self.sampling_metrics: dict[str, float] = {}  # rollout.dynamic_sampling's counts of this step
        self.decode_loop = decode_loop(self.generator, spec)  # whose batch budget shrinks on out-of-memory
        # rollout.asynchronous: the next batch samples on a worker thread while this one is updated on
        self.ahead = (
            RolloutsAhead(self.generator, self.prompt_stream, self.autocast)
            if spec.engine.asynchronous
            else None
        )

    def recovering(self, phase: str, run: Callable[[int | None], T], failed_tokens: Callable[[], int]) -> T:
        """``run(budget)`` under ``phase``'s token budget, redone under half of it after an out-of-memory
        error (:mod:`lmppo.training.budgets`): in one process, and for generation on the decode loop."""
        recovers = self.world_size == 1 and (phase != "generation" or self.decode_loop is not None)
        if not recovers:
            return run(getattr(self.budgets, phase))
        return self.budgets.shrinking(phase, run, failed_tokens, self.cfg.run.oom_retries)

    def stored_pass(self, run: Callable[..., T], rollout: Rollout) -> T:
        """``run(forward_batch_size=, forward_batch_tokens=)``: a pass without gradients over ``rollout``,
        in forwards of the configured rows or, once set or halved, of the stored passes' token budget."""

        def batching(budget: int | None) -> dict:
            rows = None if budget else self.cfg.rollout.forward_batch_size
            return dict(forward_batch_size=rows, forward_batch_tokens=budget)

        def failed_tokens() -> int:
            batches = stored_pass_batches(rollout, *batching(self.budgets.stored_passes).values())
            return max(padded_tokens(batch) for _, batch in batches)

        return self.recovering("stored_passes", lambda budget: run(**batching(budget)), failed_tokens)

    def autocast(self):
        """The numerics of every forward pass: bf16 autocast under ``run.precision=bf16``, else nothing."""
        return autocast(self.precision, self.device)

    def step(self) -> dict[str, float]:
        raise NotImplementedError

    # ----------------------------------------------------------------------------------------------
    # 1. Sample
    # ----------------------------------------------------------------------------------------------

    def sample(self, seconds: dict[str, float]) -> Rollout:
        """This step's rollout from the engine (the module docstring); its times into ``seconds``."""
        trained_weights = None if self.spec.engine.owns_weights else self.policy
        with (
            phase("generating"),
            timed(seconds, "perf/rollout_s"),
            self.autocast(),
            gathered(trained_weights),
        ):
            rollout = self.collect_rollout()
        seconds["perf/generation_s"] = rollout.generation_s or seconds["perf/rollout_s"]
        if rollout.context_mask is not None:  # an environment's episodes
            seconds["perf/environment_s"] = rollout.environment_s
        return rollout

    def collect_rollout(self) -> Rollout:
        """Generate for the next prompts, or asynchronously take the batch sampled during the last update
        and start sampling the next; regenerate when the rollout lags more than allowed."""
        max_age = self.cfg.rollout.max_rollout_age
        rollout = self.ahead.take() if self.ahead is not None else None
        for _ in range(3):
            if rollout is None or self.policy_version - rollout.policy_version > max_age:
                rollout = self.generate_next()
                if self.cfg.rollout.dynamic_sampling:
                    rollout = self.with_signal(rollout)
            if self.policy_version - rollout.policy_version <= max_age:
                if self.ahead is not None:
                    self.ahead.start_next(self.policy_version)
                return rollout
        raise LmppoError(
            f"the generator keeps returning rollouts {self.policy_version - rollout.policy_version} policy "
            f"versions old (rollout.max_rollout_age={max_age}); check that it syncs the policy weights"
        )

    def generate_next(self) -> Rollout:
        """The current policy's responses to the stream's next batch of prompts."""
        batch = self.prompt_stream.next_samples()

        def generate(budget: int | None) -> Rollout:
            if self.decode_loop is not None:
                self.decode_loop.batch_tokens = budget
            return self.generator.generate(batch.prompts, self.policy_version, batch.sample_ids, batch.rows)

        return self.recovering("generation", generate, lambda: self.decode_loop.decode_tokens)

    def with_signal(self, rollout: Rollout) -> Rollout:
        """DAPO's dynamic sampling: groups whose samples all scored the same are set aside and more prompts
        are sampled, ``rollout.dynamic_sampling_rounds`` extra rounds at most, until every rank has a full
        share of groups with a signal (the ranks decide together: they sample in step). A batch still short
        takes set-aside groups. The rows keep their raw scores, so scoring does not score them again."""
        n, share = self.cfg.rollout.samples_per_prompt, len(rollout)
        kept, flat, rounds = [], [], 0
        weights = torch.tensor([float(c.weight) for c in self.reward.components])
        while True:
            rollout = dataclasses.replace(rollout, reward_raw=self._raw_scores(rollout).tolist())
            is_flat = core.flat_groups(torch.tensor(rollout.reward_raw) @ weights, n)  # the weighted score
            kept.append(rollout.select(~is_flat))
            flat.append(rollout.select(is_flat))
            missing = max(share - sum(map(len, kept)), 0)
            if rounds == self.cfg.rollout.dynamic_sampling_rounds or not all_sum(
                torch.tensor(missing), self.group
            ):
                break
            rounds, rollout = rounds + 1, self.generate_next()
        counts = torch.tensor([sum(map(len, flat)), sum(map(len, kept)), min(missing, sum(map(len, flat)))])
        flat_rows, signal_rows, flat_kept = (all_sum(counts.float(), self.group) / n).tolist()
        self.sampling_metrics = {
            "rollout/flat_groups_dropped": flat_rows - flat_kept,
            "rollout/flat_groups_kept": flat_kept,
            "rollout/signal_groups": signal_rows,
            "rollout/extra_rounds": float(rounds),
        }
        return concat_rollouts(kept + flat).select(slice(0, share))

    def _raw_scores(self, rollout: Rollout) -> torch.Tensor:
        """(B, C) each reward component's raw score of the rollout's responses (sampling may have scored
        them already)."""
        if rollout.reward_raw is not None:
            return torch.tensor(rollout.reward_raw)
        with self.autocast(), gathered(*self.models.reward_models):
            with failing_together(self.group):  # a reward function failing on one rank stops every rank
                raw = self.reward.raw_scores(rollout.prompts, rollout.response_texts)
        return torch.stack([raw[c.name].float().cpu() for c in self.reward.components], dim=1)

    # ----------------------------------------------------------------------------------------------
    # 2. Score
    # ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, rollout: Rollout) -> tuple[ScoredRollout, Scores]:
        """The reward, the reference's log-probs, values and the trainer's own log-probs (module docstring);
        the scored record and the reward side's metrics."""
        mask, seconds = rollout.action_mask, {}
        with timed(seconds, "perf/reward_s"):
            raw = dict(zip([c.name for c in self.reward.components], self._raw_scores(rollout).unbind(1)))
        rm_score_raw = self.reward.weighted(raw).to(mask.device)
        rm_score, component_rows, transform_stats = self.reward.shape(
            raw, rollout.terminated.to(mask.device), self.group
        )
        if self.cfg.reward.overlong_buffer is not None:  # DAPO: the score fades near the length limit
            rm_score, transform_stats["reward/overlong_penalty"] = self._overlong(rollout, rm_score)
        # A truncated row either ends the episode (scored, nothing after it) or is unfinished (its future,
        # score included, is V(s_after)): never both, or truncation would be paid twice.
        if self.spec.estimator.bootstrap_truncated:
            rm_score = torch.where(rollout.terminated, rm_score, 0.0)
        with timed(seconds, "perf/reference_s"), self.autocast(), gathered(self.reference):
            logp_ref = self.stored_pass(
                functools.partial(sequence_logprobs, self.reference, rollout), rollout
            )
        values = {}
        if self.value_model is not None:  # critic-free runs have no values
            values = self._values(rollout, seconds)
        tis = self._truncated_importance_sampling(rollout) if self.cfg.ppo.tis_cap else {}
        scored = ScoredRollout.after(rollout, rm_score=rm_score, logp_ref=logp_ref, **values, **tis)
        kl_per_token = torch.where(
            mask.bool(), core.kl_estimate(scored.logp_old_for_update, logp_ref, self.cfg.kl.estimator), 0.0
        )
        shown_used = transform_stats or component_rows or self.spec.estimator.bootstrap_truncated
        metrics = scored_metrics(
            scored, rm_score_raw, kl_per_token, component_rows if shown_used else None, self.group
        )
        metrics |= transform_stats | seconds
        if tis:
            clipped = (tis["tis_weights"] >= self.cfg.ppo.tis_cap).float()
            metrics["engine/tis_clip_frac"] = core.masked_mean(clipped, mask, self.group).item()
        return scored, Scores(metrics, kl_per_token)

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

    def _values(self, rollout: Rollout, seconds: dict[str, float]) -> dict[str, torch.Tensor]:
        """``values`` and ``bootstrap_value`` from the current critic: a stored pass, unless the decode loop
        read them off the current policy's trunk already."""
        if rollout.values is not None and rollout.policy_version == self.policy_version:
            seconds["perf/values_s"] = 0.0
            return {}
        with timed(seconds, "perf/values_s"), self.autocast(), gathered(*self._value_modules()):
            values, bootstrap_value = self.stored_pass(
                functools.partial(value_predictions, self.value_model, rollout), rollout
            )
        return {"values": values, "bootstrap_value": bootstrap_value}

    def _value_modules(self) -> tuple[nn.Module, ...]:
        """What a value pass runs: the critic, and with a shared trunk the policy that holds it."""
        return (self.value_model, self.policy) if self.value_model.shared_trunk else (self.value_model,)

    def _truncated_importance_sampling(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """``ppo.tis_cap``: the trainer's own log-probs of the samples (``logp_trainer``), which the PPO ratio
        is then taken against, and per-token weights ``min(p_trainer / p_sampler, cap)`` (``tis_weights``).
        ``logp_old`` stays the sampler's."""
        with self.autocast(), gathered(self.policy):
            logp_trainer = self.stored_pass(
                functools.partial(sequence_logprobs, self.policy, rollout), rollout
            )
        weights = core.truncated_importance_weights(
            logp_trainer, rollout.logp_old, rollout.action_mask, self.cfg.ppo.tis_cap
        )
        return {"logp_trainer": logp_trainer, "tis_weights": weights}

    # ----------------------------------------------------------------------------------------------
    # After the update
    # ----------------------------------------------------------------------------------------------

    def clip_gradients(self) -> tuple[float, float | None]:
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

    def end_step(self) -> None:
        """The learning-rate schedule and the step count move on: the schedule counts steps, also one whose
        updates were all skipped (a non-finite gradient, no winner of best-of-n), where torch would warn."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        self.step_count += 1

    def step_metrics(
        self, scores: Scores, update: UpdateResult, beta: float | None, lag: int, seconds: dict[str, float]
    ) -> dict[str, float]:
        """The step's metrics from its records (``beta``: the KL coefficient the rewards used, if any), and
        the run's counts of episodes and tokens moved on."""
        n_tokens = scores.mean_length * self.cfg.rollout.responses_per_step
        self.episodes += self.cfg.rollout.responses_per_step
        self.tokens += round(n_tokens)
        metrics = step_metrics(scores, update, beta=beta, lag=lag, seconds=seconds, n_tokens=n_tokens)
        if self.device.type == "cuda":
            metrics["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.comm_counter is not None:
            metrics.update(self.comm_counter.take())
        metrics["perf/trained_state_mb"] = trained_state_bytes(self.optimizer) / 2**20
        metrics.update(self.sampling_metrics)
        metrics.update(self.budgets.metrics())
        if self.cfg.run.compile:
            metrics["perf/compiles"] = self.compiles()
        return metrics

    def compiles(self) -> float:
        """``run.compile``: graphs compiled so far, with a warning when a step past the second adds one
        (shapes or guards that keep changing: each new graph costs a compile)."""
        graphs = compiled_graphs()
        if self.step_count > 2 and graphs > self.graphs_seen:
            warn(
                f"step {self.step_count} compiled {graphs - self.graphs_seen} more graph(s), {graphs} in all: "
                "something about the passes keeps changing (a model, a precision, a grad mode); each costs a compile"
            )
        self.graphs_seen = graphs
        return float(graphs)

    def sync_generator(self, seconds: dict[str, float] | None = None) -> None:
        """Give an engine that samples from its own copy of the weights (vLLM, a snapshot) the current
        policy; its time goes to ``seconds["perf/weight_sync_s"]``."""
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


def decode_loop(generator: Generator, spec: RunSpec) -> HFGenerator | None:
    """The transformers decode loop sampling the training batches in this process (an environment's
    included), whose decode batches generation's token budget sizes; None with vLLM or asynchronous
    sampling (on a worker thread: nothing there to redo)."""
    engine = getattr(generator, "engine", generator)  # an environment plays its episodes on an engine
    return engine if isinstance(engine, HFGenerator) and not spec.engine.asynchronous else None
