"""Abort rules checked on every step's globally reduced metrics (``GuardsConfig``; ``None`` = off).

Each rule is the stop threshold of a row of :mod:`lmppo.runs.failure_modes`, the table the diagnosis reads
too. A fired rule returns a :class:`GuardViolation` whose message names the rule, the observed value, the
threshold and the row's likely cause and fix; the trainer then saves an ``aborted`` checkpoint and points at
the last good one. Ranges and reasoning: docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmppo.runs.failure_modes import (
    BOUNDS,
    HELD_OUT_SCORES,
    REWARD_HACKING,
    FailureMode,
    nonfinite_mode,
)


@dataclass(frozen=True)
class GuardViolation:
    rule: str
    value: float
    threshold: float
    message: str

    def __str__(self) -> str:
        return self.message


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _advice(mode: FailureMode) -> str:
    return f"Likely: {mode.cause}; change: {mode.fix}."


def held_out_score(metrics: Mapping[str, float]) -> tuple[str, float] | None:
    """(metric, value) of the held-out score the guards and the best checkpoint follow: the judge's,
    else the RM's; None when the record has no finite one."""
    judge, rm = HELD_OUT_SCORES
    metric = judge if judge in metrics else rm
    value = metrics.get(metric)
    return (metric, value) if value is not None and math.isfinite(value) else None


def _held_out(metrics: Mapping[str, float]) -> float | None:
    score = held_out_score(metrics)
    return score[1] if score else None


class Guards:
    """Checks the rules of ``cfg`` (a ``GuardsConfig`` or anything with its attributes) each step.

    Steps are numbered from 1 as in metrics.jsonl; rules marked warm-up apply from step
    ``warmup_steps + 1``. A step with ``health/nonfinite > 0`` or any non-finite metric counts
    towards ``nonfinite_patience``; threshold rules ignore non-finite values (that rule's business).

    ``healthy`` says whether the last checked step broke no rule, warm-up aside and with no non-finite
    value: only such a step's checkpoint is a "last known good" one (tag ``ok``).
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.nonfinite_streak = 0
        # (mean training RM score since the previous eval, its standard error, held-out score)
        self.evals: list[tuple[float, float, float]] = []
        self._rm_sum, self._rm_sq_sum, self._rm_count = 0.0, 0.0, 0
        self.baseline: float | None = None  # the starting policy's held-out score, until step 1 pairs it
        self.healthy = True

    def start(self, metrics: Mapping[str, float]) -> None:
        """The step-0 evaluation of the starting policy: the first held-out score the
        ``reward_without_eval`` rule compares against, paired with step 1's training RM score (step 1
        samples from the starting policy)."""
        self.baseline = _held_out(metrics)

    def check(self, step: int, metrics: Mapping[str, float]) -> GuardViolation | None:
        if not self.cfg.enabled:
            return None
        nonfinite = sorted(name for name, value in metrics.items() if not math.isfinite(value))
        self._record(metrics, bool(nonfinite))
        self.healthy = self.nonfinite_streak == 0 and self._check_bounds(step, metrics, warmup=False) is None
        return (
            self._check_nonfinite(step, metrics, nonfinite)
            or self._check_bounds(step, metrics)
            or self._check_reward_without_eval(step)
        )

    def _record(self, metrics: Mapping[str, float], any_nonfinite: bool) -> None:
        bad_step = any_nonfinite or metrics.get("health/nonfinite", 0) > 0
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad_step else 0
        rm_score, patience = metrics.get(REWARD_HACKING.stop.metric), self._stop(REWARD_HACKING)
        if patience is None:
            return
        if rm_score is not None and math.isfinite(rm_score):
            if self.baseline is not None:  # the starting policy's training score and held-out score
                self.evals, self.baseline = [(rm_score, 0.0, self.baseline)], None
            self._rm_sum, self._rm_sq_sum = self._rm_sum + rm_score, self._rm_sq_sum + rm_score**2
            self._rm_count += 1
        heldout = _held_out(metrics)
        if heldout is None or not self._rm_count:
            return
        self.evals = [*self.evals, (*self._rm_window_mean_and_sem(), heldout)][-(patience + 1) :]
        self._rm_sum, self._rm_sq_sum, self._rm_count = 0.0, 0.0, 0

    def _stop(self, mode: FailureMode) -> float | None:
        """The stop threshold of ``mode`` in the config (None: the rule is off)."""
        return getattr(self.cfg, mode.stop.key)

    def _rm_window_mean_and_sem(self) -> tuple[float, float]:
        """The mean training RM score of the steps since the previous evaluation and its standard error
        (from the spread of those steps' scores; 0 for a single step)."""
        n, mean = self._rm_count, self._rm_sum / self._rm_count
        variance = max(self._rm_sq_sum - n * mean**2, 0.0) / (n - 1) if n > 1 else 0.0
        return mean, math.sqrt(variance / n)

    def _check_nonfinite(
        self, step: int, metrics: Mapping[str, float], names: list[str]
    ) -> GuardViolation | None:
        mode = nonfinite_mode(names)
        patience, count = self._stop(mode), mode.stop.metric
        if self.nonfinite_streak < patience:
            return None
        seen = ", ".join(names) or f"{count} = {_fmt(metrics[count])}"
        return GuardViolation(
            mode.guard,
            float(self.nonfinite_streak),
            float(patience),
            f"guard {mode.guard!r} fired at step {step}: non-finite values in {self.nonfinite_streak} "
            f"consecutive steps (guards.{mode.stop.key} = {patience}); this step: {seen}. {_advice(mode)}",
        )

    def _check_bounds(
        self, step: int, metrics: Mapping[str, float], warmup: bool = True
    ) -> GuardViolation | None:
        for mode in BOUNDS:
            stop, threshold = mode.stop, self._stop(mode)
            value = metrics.get(stop.metric)
            if threshold is None or value is None or not math.isfinite(value):
                continue
            if warmup and mode.after_warmup and step <= self.cfg.warmup_steps:
                continue
            if value > threshold if stop.upper else value < threshold:
                side = ">" if stop.upper else "<"
                return GuardViolation(
                    mode.guard,
                    float(value),
                    float(threshold),
                    f"guard {mode.guard!r} fired at step {step}: {stop.metric} = {_fmt(value)} {side} "
                    f"guards.{stop.key} = {_fmt(threshold)}. {_advice(mode)} If the threshold is wrong for "
                    f"this task, change guards.{stop.key} (null turns the rule off).",
                )
        return None

    def _check_reward_without_eval(self, step: int) -> GuardViolation | None:
        patience = self._stop(REWARD_HACKING)
        if patience is None or len(self.evals) < patience + 1:
            return None
        (rm_first, sem_first, heldout_first), *later = self.evals
        rm_last, sem_last, _ = later[-1]
        rm_rise = rm_last - rm_first
        # On a plateau the training score drifts up about every other window: only a rise larger than two
        # standard errors of the difference of the two window means counts.
        rm_noise = 2 * math.hypot(sem_first, sem_last)
        heldout_gain = max(heldout for *_, heldout in later) - heldout_first
        if rm_rise <= rm_noise or heldout_gain > 0:
            return None
        mode = REWARD_HACKING
        return GuardViolation(
            mode.guard,
            heldout_gain,
            0.0,
            f"guard {mode.guard!r} fired at step {step}: over the last {patience} evaluations the training RM "
            f"score rose by {_fmt(rm_rise)} (beyond its noise, {_fmt(rm_noise)}) while the held-out score "
            f"({', else '.join(HELD_OUT_SCORES)}) never beat {_fmt(heldout_first)} (best change "
            f"{_fmt(heldout_gain)}). {_advice(mode)} To tolerate it, raise guards.{mode.stop.key} (null: off).",
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "nonfinite_streak": self.nonfinite_streak,
            "evals": [list(e) for e in self.evals],
            "rm_sum": self._rm_sum,
            "rm_sq_sum": self._rm_sq_sum,
            "rm_count": self._rm_count,
            "baseline": self.baseline,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.nonfinite_streak = int(state["nonfinite_streak"])
        # checkpoints before the noise-aware rule kept (mean, held-out) pairs and no sum of squares: their
        # windows count as noiseless, which is the old rule
        self.evals = [
            (float(e[0]), float(e[1]) if len(e) == 3 else 0.0, float(e[-1])) for e in state["evals"]
        ]
        self._rm_sum, self._rm_count = float(state["rm_sum"]), int(state["rm_count"])
        noiseless = self._rm_sum**2 / self._rm_count if self._rm_count else 0.0
        self._rm_sq_sum = float(state.get("rm_sq_sum", noiseless))
        self.baseline = state.get("baseline")
