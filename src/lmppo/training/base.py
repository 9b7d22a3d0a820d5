"""What every trainer shares, whatever it trains with (:class:`Trainer`): the ready-made parts
(:class:`TrainerParts`), the counters a checkpoint keeps (:mod:`lmppo.runs.trainer_state`), the two stages
before any update, each returning the next stage's record, and the end of a step:

1. **Sample** (:class:`lmppo.training.sampler.Sampler`): prompts into a
   :class:`~lmppo.sampling.rollout.Rollout` with the current policy.
2. **Score** (:class:`lmppo.training.scorer.Scorer`): the rollout into a
   :class:`~lmppo.sampling.rollout.ScoredRollout`; its metrics are computed from the records after it
   (:func:`lmppo.training.step_results.scored_metrics`).

:class:`lmppo.training.trainer.PPOTrainer` then estimates advantages and runs PPO's update (with a critic,
or critic-free by its estimator); :class:`lmppo.training.best_of_n.BestOfNTrainer` fine-tunes on each
group's best. Both end a step alike: gradient clipping, the schedule, the logged metrics, the weight sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmppo.errors import warn
from lmppo.inputs.config import Config
from lmppo.inputs.data import PromptStream
from lmppo.inputs.resolve import RunSpec
from lmppo.math import core
from lmppo.modeling.compile import compiled_graphs
from lmppo.modeling.distributed import CommCounter, full_tensor, trained_state_bytes
from lmppo.modeling.models import PPOModels, autocast
from lmppo.rewards.scoring import CombinedReward
from lmppo.sampling.engines import Generator
from lmppo.training.budgets import TokenBudgets
from lmppo.training.sampler import Sampler
from lmppo.training.scorer import Scorer
from lmppo.training.step_results import UpdateResult, step_metrics


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


class Trainer:
    """The parts a run's step works with, its sampler and scorer, and the counters a checkpoint keeps; a
    subclass's ``step`` is one iteration of its algorithm."""

    def __init__(self, cfg: Config, spec: RunSpec, parts: TrainerParts, *, group=None, rank: int = 0) -> None:
        self.cfg, self.spec, self.group = cfg, spec, group
        self.rank, self.world_size = rank, spec.world_size
        self.models, self.train_module = parts.models, parts.train_module
        self.policy, self.value_model = parts.models.policy, parts.models.value
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.kl_controller = parts.kl_controller
        self.comm_counter, self.ptx_batches = parts.comm_counter, parts.ptx_batches
        self.device, self.precision = spec.device, spec.precision
        torch.set_float32_matmul_precision(spec.fp32_matmul_precision)  # process-wide, as the run is
        self.budgets = TokenBudgets.of(cfg)  # each phase's tokens per forward, halved on out-of-memory
        # halvings a phase may take after out-of-memory errors; None: several ranks cannot redo a phase
        self.oom_retries = cfg.run.oom_retries if self.world_size == 1 else None
        self.shuffle_generator = torch.Generator().manual_seed(cfg.run.seed + 1 + rank)
        self.step_count = 0  # steps done
        self.policy_version = 0  # steps that changed the policy; each rollout records the one it saw
        self.episodes = 0  # responses generated (all ranks)
        self.tokens = 0  # response tokens generated (all ranks)
        self.graphs_seen = 0  # spec.compile: graphs compiled by the last step's end (perf/compiles)
        self.scorer = Scorer(
            cfg, spec, parts.models, parts.reward, self.budgets, self.autocast,
            oom_retries=self.oom_retries, group=group,
        )  # fmt: skip
        self.sampler = Sampler(
            cfg, spec, parts.generator, parts.prompt_stream, self.policy, self.scorer, self.budgets,
            self.autocast, oom_retries=self.oom_retries, group=group,
        )  # fmt: skip

    @property
    def generator(self) -> Generator:
        """The sampler's generator (the run's pre-flight and evaluation sample on it too)."""
        return self.sampler.generator

    def autocast(self):
        """The numerics of every forward pass: bf16 autocast under ``run.precision=bf16``, else nothing."""
        return autocast(self.precision, self.device)

    def step(self) -> dict[str, float]:
        raise NotImplementedError

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

    def logged_metrics(
        self,
        stages: dict[str, float],
        update: UpdateResult,
        beta: float | None,
        lag: int,
        seconds: dict[str, float],
    ) -> dict[str, float]:
        """The step's metrics as the run logs them: its records' (``stages``: scoring's and the
        estimator's; ``beta``: the KL coefficient the rewards used, if any) and the process's (memory,
        collectives, sampling, budgets, compiles), with the run's counts of episodes and tokens moved on."""
        n_tokens = stages["response/length"] * self.cfg.rollout.responses_per_step
        self.episodes += self.cfg.rollout.responses_per_step
        self.tokens += round(n_tokens)
        metrics = step_metrics(stages, update, beta=beta, lag=lag, seconds=seconds, n_tokens=n_tokens)
        if self.device.type == "cuda":
            metrics["perf/peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.comm_counter is not None:
            metrics.update(self.comm_counter.take())
        metrics["perf/trained_state_mb"] = trained_state_bytes(self.optimizer) / 2**20
        metrics.update(self.sampler.metrics)
        metrics.update(self.budgets.metrics())
        if self.spec.compile:
            metrics["perf/compiles"] = self.compiles()
        return metrics

    def compiles(self) -> float:
        """``spec.compile``: graphs compiled so far, with a warning when a step past the second adds one
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
        if self.spec.engine.owns_weights:  # else the decode loop samples from the trained module itself
            self.sampler.sync_weights(
                self.policy, self.policy_version, seconds if seconds is not None else {}
            )

    def close(self, abandon: bool = False) -> None:
        """Let the batch in flight finish and shut the engine down (vLLM: before the process group ends);
        ``abandon`` (the run failed, a rank may be gone): drop both without any collective teardown."""
        self.sampler.close(abandon)
