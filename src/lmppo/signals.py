"""How a run stops when asked (SIGINT, SIGTERM): at the end of the step it is in, or at once while it
waits on something outside it.

A run that is training finishes its step, saves and exits (:class:`StopOnSignal` only sets a flag the loop
reads). But a wait that may last minutes is cut short: before step 1 nothing is saved yet, and a request
to a reward server (:func:`interruptible`) may hang on a slow or stalled peer. There the first signal
raises :class:`StopRequested` in the main thread, which interrupts the blocking call; the run then reports
what it kept (the last checkpoint, or nothing) and exits 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_waits = 0  # interruptible() blocks open in the main thread


class StopRequested(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error
    """The first SIGINT or SIGTERM, raised where the run could not wait for the end of a step."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal = signal.Signals(signal_number)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A blocking wait on something outside the run (a reward server) that the first signal cuts short."""
    global _waits
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    _waits += 1
    try:
        yield
    finally:
        _waits -= 1


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to finish the current step, save and exit cleanly; inside an
    :func:`interruptible` wait, or while ``immediate`` (before the first step, when nothing is saved
    yet), they raise :class:`StopRequested` at once. A second signal stops at once in any case."""

    def __init__(self, immediate: bool = False) -> None:
        self.requested: signal.Signals | None = None
        self.immediate = immediate
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)
        if self.immediate or _waits:
            raise StopRequested(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
