"""Sampling, the first stage of every step: prompts from the stream through the generator, with the current
policy, into a :class:`~lmppo.sampling.rollout.Rollout` that records the policy version and ``logp_old``.

- A rollout older than ``rollout.max_rollout_age`` policy versions is sampled again.
- ``rollout.asynchronous``: the batch sampled on a worker thread during the last update is taken and the
  next one started (:class:`lmppo.sampling.engines.RolloutsAhead`).
- ``rollout.dynamic_sampling`` (DAPO): groups whose samples all scored alike are replaced with new prompts'
  (:meth:`Sampler.resample_flat_groups`).
- An out-of-memory error in generation halves the generator's decode budget and samples the batch again
  (:mod:`lmppo.training.budgets`), where the engine's decode batches can shrink (its ``decode_budget``);
  elsewhere (vLLM, or sampling on a worker thread) it stops the run with what the engine says frees memory
  for it (``Engine.memory_remedy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from lmppo.errors import LmppoError
from lmppo.inputs.config import Config
from lmppo.inputs.data import PromptStream
from lmppo.inputs.resolve import RunSpec
from lmppo.math import core
from lmppo.modeling.distributed import all_sum, gathered
from lmppo.progress import phase
from lmppo.sampling.engines import Generator, RolloutsAhead
from lmppo.sampling.rollout import Rollout, concat_rollouts
from lmppo.training.budgets import OutOfMemory, TokenBudgets, first_line
from lmppo.training.metrics import timed
from lmppo.training.scorer import Scorer


class Sampler:
    """Prompts -> Rollout (the module docstring): each call samples with the current policy, whose version
    the trainer counts and passes in."""

    def __init__(
        self,
        cfg: Config,
        spec: RunSpec,
        generator: Generator,
        prompt_stream: PromptStream,
        policy: nn.Module,
        scorer: Scorer,
        budgets: TokenBudgets,
        autocast: Callable[[], AbstractContextManager],
        *,
        oom_retries: int | None,
        group=None,
    ) -> None:
        self.cfg, self.spec, self.generator, self.prompt_stream = cfg, spec, generator, prompt_stream
        self.policy, self.scorer, self.budgets, self.autocast = policy, scorer, budgets, autocast
        self.group = group
        # the decode batches generation's token budget sizes; None with an engine whose batches cannot
        # shrink (vLLM) or asynchronous sampling (on a worker thread: nothing here to redo)
        self.decode_budget = None if spec.engine.asynchronous else generator.decode_budget
        self.oom_retries = None if self.decode_budget is None else oom_retries
        self.metrics: dict[str, float] = {}  # rollout.dynamic_sampling's counts of the last batch
        # rollout.asynchronous: the next batch samples on a worker thread while this one is updated on
        self.ahead = RolloutsAhead(generator, prompt_stream, autocast) if spec.engine.asynchronous else None

    def sample(self, policy_version: int, seconds: dict[str, float]) -> Rollout:
        """This step's rollout from the generator (the module docstring); its times into ``seconds``."""
        trained_weights = None if self.spec.engine.owns_weights else self.policy
        with (
            phase("generating"),
            timed(seconds, "perf/rollout_s"),
            self.autocast(),
            gathered(trained_weights),
        ):
            rollout = self.collect(policy_version)
        seconds["perf/generation_s"] = rollout.generation_s or seconds["perf/rollout_s"]
        if rollout.episode is not None:  # an environment's episodes
            seconds["perf/environment_s"] = rollout.episode.environment_s
        return rollout

    def collect(self, policy_version: int) -> Rollout:
        """Generate for the next prompts, or asynchronously take the batch sampled during the last update
        and start sampling the next; regenerate when the rollout lags more than allowed."""
        max_age = self.cfg.rollout.max_rollout_age
        rollout = self.ahead.take() if self.ahead is not None else None
        for _ in range(3):
            if rollout is None or policy_version - rollout.policy_version > max_age:
                rollout = self.generate(policy_version)
                if self.cfg.rollout.dynamic_sampling:
                    rollout = self.resample_flat_groups(rollout, policy_version)
            if policy_version - rollout.policy_version <= max_age:
                if self.ahead is not None:
                    self.ahead.start_next(policy_version)
                return rollout
        raise LmppoError(
            f"the generator keeps returning rollouts {policy_version - rollout.policy_version} policy "
            f"versions old (rollout.max_rollout_age={max_age}); check that it syncs the policy weights"
        )

    def generate(self, policy_version: int) -> Rollout:
        """The current policy's responses to the stream's next batch of prompts."""
        batch = self.prompt_stream.next_samples()

        def generate(budget: int | None) -> Rollout:
            if self.decode_budget is not None:
                self.decode_budget.tokens = budget
            return self.generator.generate(batch.prompts, policy_version, batch.sample_ids, batch.rows)

        def failed_tokens() -> int:
            return self.decode_budget.in_progress

        try:
            return self.budgets.shrinking("generation", generate, failed_tokens, self.oom_retries)
        except torch.OutOfMemoryError as err:
            if self.decode_budget is not None:  # several ranks: the run names every budget to halve
                raise
            raise OutOfMemory(  # what the engine itself can do instead
                f"out of memory in generation ({first_line(err)}), which cannot be redone in smaller decode "
                f"batches here: {self.generator.engine.memory_remedy}"
            ) from err

    def resample_flat_groups(self, rollout: Rollout, policy_version: int) -> Rollout:
        """DAPO's dynamic sampling: groups whose samples all scored the same are set aside and more prompts
        are sampled, ``rollout.dynamic_sampling_rounds`` extra rounds at most, until every rank has a full
        share of groups that scored apart (the ranks decide together: they sample in step). A batch still
        short takes set-aside groups. The rows keep their raw scores, so scoring does not score them again."""
        n, share = self.cfg.rollout.samples_per_prompt, len(rollout)
        kept, flat, rounds = [], [], 0
        weights = torch.tensor([float(c.weight) for c in self.scorer.reward.components])
        while True:
            rollout = dataclasses.replace(rollout, reward_raw=self.scorer.raw_scores(rollout).tolist())
            is_flat = core.flat_groups(torch.tensor(rollout.reward_raw) @ weights, n)  # the weighted score
            kept.append(rollout.select(~is_flat))
            flat.append(rollout.select(is_flat))
            missing = max(share - sum(map(len, kept)), 0)
            if rounds == self.cfg.rollout.dynamic_sampling_rounds or not all_sum(
                torch.tensor(missing), self.group
            ):
                break
            rounds, rollout = rounds + 1, self.generate(policy_version)
        counts = torch.tensor([sum(map(len, flat)), sum(map(len, kept)), min(missing, sum(map(len, flat)))])
        flat_rows, signal_rows, flat_kept = (all_sum(counts.float(), self.group) / n).tolist()
        self.metrics = {
            "rollout/flat_groups_dropped": flat_rows - flat_kept,
            "rollout/flat_groups_kept": flat_kept,
            "rollout/signal_groups": signal_rows,
            "rollout/extra_rounds": float(rounds),
        }
        return concat_rollouts(kept + flat).select(slice(0, share))

    def sync_weights(self, policy: nn.Module, policy_version: int, seconds: dict[str, float]) -> None:
        """Give the generator the policy after an update, once the batch in flight has finished on the
        weights it started with; the sync's time into ``seconds["perf/weight_sync_s"]``."""
        if self.ahead is not None:
            self.ahead.finished()
        with timed(seconds, "perf/weight_sync_s"):
            self.generator.sync_weights(policy, policy_version)

    def close(self, abandon: bool = False) -> None:
        """Let the batch in flight finish and shut the generator down; ``abandon``: drop both without any
        collective teardown (the run failed, a rank may be gone)."""
        if self.ahead is not None:
            self.ahead.close(abandon)
        self.generator.close(abandon)
