"""Out-of-memory recovery: each phase of a step forwards under a token budget, and an out-of-memory error
inside a phase halves that phase's budget and redoes the phase.

Redoing a phase loses nothing: generation and the stored passes only compute, and an update's minibatch
applies nothing before its optimizer step, after its last micro-batch. The halved budget holds for the
rest of the run and across a resume (:class:`TokenBudgets` is trainer state in every checkpoint), so a
long run pays for the discovery once. A phase that ran out ``run.oom_retries`` times stops the run with
the budgets to set and the memory plan's next remedies (:class:`OutOfMemory`).

One process only: under several ranks, the rank that ran out would leave the others waiting in a
collective, so the error stops the run at once, naming the budgets too.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from lmppo.errors import LmppoError, warn
from lmppo.inputs.config import Config

T = TypeVar("T")

# phase -> the config key of its token budget (one forward of that phase holds at most this many positions)
BUDGET_KEYS = {
    "generation": "rollout.generation_batch_tokens",
    "stored_passes": "rollout.forward_batch_tokens",
    "update": "ppo.micro_batch_tokens",
}
PHASE_NAMES = {"generation": "generation", "stored_passes": "a stored pass", "update": "the update"}


class OutOfMemory(LmppoError):
    """A phase ran out of memory after its budget was halved ``run.oom_retries`` times (or in a run that
    cannot redo it); the run adds the memory plan's remedies."""


@dataclass
class TokenBudgets:
    """Each phase's token budget per forward (None: the whole batch, or the config's rows), as the run
    has learned them."""

    generation: int | None
    stored_passes: int | None
    update: int | None
    halvings: dict[str, int] = field(default_factory=dict)  # per phase, over the run
    step_retries: int = 0  # phases redone this step: perf/oom_retries

    @classmethod
    def of(cls, cfg: Config) -> TokenBudgets:
        return cls(
            cfg.rollout.generation_batch_tokens, cfg.rollout.forward_batch_tokens, cfg.ppo.micro_batch_tokens
        )

    def state_dict(self) -> dict:
        return {phase: getattr(self, phase) for phase in BUDGET_KEYS} | {"halvings": dict(self.halvings)}

    def load_state_dict(self, state: dict) -> None:
        for phase in BUDGET_KEYS:
            setattr(self, phase, state[phase])
        self.halvings = dict(state["halvings"])

    def reset(self, cfg: Config, changed: set[str]) -> None:
        """A resume with ``--allow-config-change``: a budget the config changed is the config's again."""
        configured = TokenBudgets.of(cfg)
        for phase, key in BUDGET_KEYS.items():
            if key in changed:
                setattr(self, phase, getattr(configured, phase))
                self.halvings.pop(phase, None)

    def metrics(self) -> dict[str, float]:
        """``perf/oom_retries`` of this step (then reset), and every budget a halving has set."""
        shrunk = {
            f"perf/{BUDGET_KEYS[phase].split('.')[1]}": float(getattr(self, phase)) for phase in self.halvings
        }
        retries, self.step_retries = self.step_retries, 0
        return {"perf/oom_retries": float(retries), **shrunk}

    def shrinking(
        self, phase: str, run: Callable[[int | None], T], failed_tokens: Callable[[], int], limit: int | None
    ) -> T:
        """``run(budget)`` under ``phase``'s budget; after an out-of-memory error, again under half of it,
        ``limit`` halvings at most over the run (None: the phase cannot be redone, its error stops the
        run). ``failed_tokens()``: the positions of the forward that ran out (what the budget halves when
        it was larger, or unset)."""
        if limit is None:
            return run(getattr(self, phase))
        while True:
            try:
                return run(getattr(self, phase))
            except torch.OutOfMemoryError as err:
                self._halve(phase, failed_tokens(), limit, err)
            free_memory()  # outside the except: its traceback no longer holds the failed phase's tensors

    def _halve(self, phase: str, failed_tokens: int, limit: int, err: torch.OutOfMemoryError) -> None:
        key, name = BUDGET_KEYS[phase], PHASE_NAMES[phase]
        if self.halvings.get(phase, 0) >= limit:
            raise OutOfMemory(
                f"out of memory in {name} after {key} was halved {limit} times (run.oom_retries) to "
                f"{getattr(self, phase)} tokens per forward ({first_line(err)})"
            ) from err
        budget = getattr(self, phase)
        halved = max(1, min(budget or failed_tokens, failed_tokens) // 2)
        setattr(self, phase, halved)
        self.halvings[phase] = self.halvings.get(phase, 0) + 1
        self.step_retries += 1
        warn(
            f"out of memory in {name} ({failed_tokens} tokens in one forward): it is redone with {key}={halved} "
            f"and keeps that budget for the rest of the run; set it in the config to start there"
        )


def out_of_memory_error(err: torch.OutOfMemoryError, budgets: TokenBudgets, world_size: int) -> OutOfMemory:
    """An out-of-memory error no phase could redo: several ranks, or an engine with its own memory (vLLM)."""
    where = "the phase that ran out cannot be redone with a smaller budget"
    if world_size > 1:
        where = f"{world_size} ranks cannot redo a phase (the others would wait in a collective)"
    halve = ", ".join(
        f"{key}={b // 2}" for phase, key in BUDGET_KEYS.items() if (b := getattr(budgets, phase))
    )
    return OutOfMemory(
        f"out of memory ({first_line(err)}); {where}. Smaller forwards: "
        + (halve or "set the token budgets " + ", ".join(BUDGET_KEYS.values()))
    )


def first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


def free_memory() -> None:
    """Give the failed phase's memory back: its tensors to the collector, the CUDA cache to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
