"""What a run is doing, on the console from its first second to its last.

Code anywhere says where the run is with :func:`phase` (a stage: "loading the policy ...", "update") and
:func:`advance` (a counter inside it: "token 57/128"). The :class:`ProgressDisplay` of the main process
shows them live under the step line; written to a file or a scheduler's log (``--quiet``, or no terminal)
it prints the stages before step 1 as lines and then a step line every few steps. With no display open
(tests, other ranks, the library used on its own) a phase costs one function call. Only the main thread
reports: with ``rollout.asynchronous`` a worker thread samples while the main thread updates. A supervised
stage (SFT, reward-model training) prints :class:`BatchLines` whether a display is open or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Self

from rich.progress import Progress, TextColumn

from lmppo.errors import console

GIB = 2**30
WIDTH = 80  # the step line and the stage line fit a terminal of this width

_display: ProgressDisplay | None = None  # the open display of this process, if any


def size(n: float) -> str:
    """Bytes for people: MiB below a GiB, else GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


@contextmanager
def phase(label: str) -> Iterator[None]:
    """The run is in stage ``label`` for the block (stages nest: "step 3/200", then "update")."""
    display = _listening()
    if display is None:
        yield
        return
    display.enter(label)
    try:
        yield
    finally:
        display.leave()


def advance(what: str, done: int, total: int) -> None:
    """``done`` of ``total`` ``what`` (tokens, batches, epochs) of the current stage are done."""
    display = _listening()
    if display is not None:
        display.count(what, done, total)


class BatchLines:
    """A supervised stage's progress as lines, whatever stdout is (a terminal, a file, a pipe): batch k/n,
    the loss, the time so far and the ETA, at the first and the last batch, every tenth of the batches and
    at least every ``every_s`` seconds between (a long SFT redirected to a file still shows it is alive).
    With a display open they go through it (above its live lines)."""

    def __init__(self, stage: str, total: int, every_s: float = 30.0) -> None:
        self.stage, self.total, self.every_s = stage, total, every_s
        self.every_batches = max(1, total // 10)
        self._started = self._last_line = time.perf_counter()

    def batch(self, done: int, loss: float) -> None:
        """Batch ``done`` of ``total`` trained, with this ``loss``."""
        advance("batch", done, self.total)
        now = time.perf_counter()
        if done in (1, self.total) or done % self.every_batches == 0 or now - self._last_line >= self.every_s:
            self._last_line = now
            _say(self.line(done, loss, now - self._started))

    def line(self, done: int, loss: float, elapsed_s: float) -> str:
        eta = duration(elapsed_s / done * (self.total - done))
        done_of = f"{self.stage}: batch {done}/{self.total}"
        return f"{done_of}  loss {_number(loss, 3)}  {duration(elapsed_s)} elapsed  ETA {eta}"


def _say(line: str) -> None:
    """A line on stdout, through the open display when there is one."""
    if _display is None:
        print(line, flush=True)
    else:
        _display.note(line)


def _listening() -> ProgressDisplay | None:
    if _display is None or threading.current_thread() is not threading.main_thread():
        return None
    return _display


def _number(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, exponents without a leading zero (1.2e-5)."""
    return f"{x:.{digits}g}".replace("e-0", "e-").replace("e+0", "e+")


def duration(seconds: float) -> str:
    """A duration in a few characters: 8.4s, 12m30s, 3h05m, 2d04h."""
    if seconds < 60:
        return f"{seconds:.2g}s" if seconds < 9.95 else f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class ProgressDisplay:
    """The console of a run's main process: a step line (``reward/rm_score``, in an episode
    ``reward/total``; ``kl/ref``,
    ``policy/clip_frac``, seconds per step, the ETA from the average step time so far) with the current
    stage under it, live on a terminal; plain lines when ``quiet`` (chosen automatically when stdout is not
    a terminal): every stage entered before step 1, then a step line every ``every`` steps (default: about
    50 lines per run) and at the last. ``reward_label`` names the score: "rm" for a reward model, else
    "reward". ``total_steps=0``: no step line, the stages alone (``lmppo sft``, ``lmppo train-rm``). Use as
    a context manager; only the open one shows stages.
    """

    def __init__(
        self,
        total_steps: int,
        quiet: bool = False,
        start_step: int = 0,
        every: int | None = None,
        enabled: bool = True,
        reward_label: str = "reward",
    ) -> None:
        self.total_steps, self.start_step, self.enabled = total_steps, start_step, enabled
        self.reward_label = reward_label
        self.console = console()
        self.quiet = quiet or not self.console.is_terminal
        self.every = every or max(1, round(total_steps / 50))
        self._started = time.perf_counter()
        self._stages: list[str] = []
        self._counters: dict[str, str] = {}  # the innermost stage's counters, by what they count
        self._stepping = False  # training steps began: quiet mode no longer prints stages
        self._progress: Progress | None = None

    def begin_steps(self, start_step: int) -> None:
        """Training steps start now, after step ``start_step``: the ETA counts from here, and quiet mode
        prints step lines only."""
        self.start_step, self._started, self._stepping = start_step, time.perf_counter(), True

    def status_line(self, step: int, metrics: Mapping[str, float]) -> str:
        average_s = (time.perf_counter() - self._started) / max(step - self.start_step, 1)
        step_s = metrics.get("perf/step_s", average_s)
        shown = (("kl/ref", "kl", 2), ("policy/clip_frac", "clip", 2))
        values = self._reward(metrics) + [
            f"{label} {_number(metrics[name], digits)}" for name, label, digits in shown if name in metrics
        ]
        eta = duration(average_s * (self.total_steps - step))
        return "  ".join(
            [f"step {step}/{self.total_steps}", *values, f"{duration(step_s)}/step", f"ETA {eta}"]
        )

    def _reward(self, metrics: Mapping[str, float]) -> list[str]:
        """The reward: the score (``reward/rm_score``), or an episode's ``reward/total`` with its final and
        turn parts beside it where both are non-zero (either alone is the total)."""
        if "reward/total" not in metrics:
            score = metrics.get("reward/rm_score")
            return [] if score is None else [f"{self.reward_label} {_number(score, 3)}"]
        total, final, turn = (metrics[f"reward/{name}"] for name in ("total", "rm_score", "turn"))
        parts = f" (final {_number(final, 3)}, turn {_number(turn, 3)})" if final and turn else ""
        return [f"reward {_number(total, 3)}{parts}"]

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        line = self.status_line(step, metrics)
        if self._progress is not None:
            self._progress.update(self._steps, completed=step, description=line)
        elif step % self.every == 0 or step == self.total_steps:
            print(line, flush=True)

    def note(self, text: str) -> None:
        """A line of its own above the live display (between the log lines when quiet)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def enter(self, label: str) -> None:
        self._stages.append(label)
        self._counters = {}
        if self._progress is None and not self._stepping:
            print(f"{'  ' * (len(self._stages) - 1)}{label}", flush=True)
        self._show_stage()

    def leave(self) -> None:
        self._stages.pop()
        self._counters = {}
        self._show_stage()

    def count(self, what: str, done: int, total: int) -> None:
        self._counters[what] = f"{what} {done}/{total}"
        self._show_stage()

    @property
    def stage(self) -> str:
        """The line under the step line: the stages entered, innermost last, and its counters."""
        return " · ".join([*self._stages, *self._counters.values()])[:WIDTH]

    def _show_stage(self) -> None:
        if self._progress is not None:
            self._progress.update(self._stage, description=self.stage, visible=bool(self.stage))

    def __enter__(self) -> Self:
        global _display
        self._started = time.perf_counter()
        if not self.enabled:
            return self
        _display = self
        if not self.quiet:
            self._progress = Progress(TextColumn("{task.description}"), console=self.console)
            if self.total_steps:  # 0: stages only (a supervised stage: its epochs and steps)
                self._steps = self._progress.add_task(
                    f"step {self.start_step}/{self.total_steps}",
                    total=self.total_steps,
                    completed=self.start_step,
                )
            self._stage = self._progress.add_task("", total=None, visible=False)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        global _display
        if _display is self:
            _display = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
