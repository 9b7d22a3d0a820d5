"""The one exception type for user mistakes (bad config, bad data, missing files), the one way to
warn a user, and the console everything a user reads is printed on.

The CLI prints an ``LmppoError`` as a short paragraph without a traceback; anything else is a bug
and keeps its traceback. Messages name the thing that is wrong and say how to fix it. A warning
(:func:`warn`) reaches the user as one plain line, ``warning: ...``; it still goes through Python's
``warnings`` machinery, so it can be filtered, turned into an error or caught in a test.
"""

import os
import sys
import warnings


class LmppoError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""

    exit_code = 2


class UserCodeError(LmppoError):
    """The user's own code (a reward function, a judge) raised: the message names it and shows its frames."""


def user_code_error(what: str, err: BaseException) -> UserCodeError:
    """``what`` raised ``err``: a message with the frames of the user's code only (lmppo's are left out)."""
    import traceback
    from pathlib import Path

    package = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(package)]
    shown = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(err))
    return UserCodeError(
        f"{what} raised {type(err).__name__}: {err}\n--- its traceback ---\n{shown.rstrip()}"
    )


def read_from(path) -> str:
    """Where a relative ``path`` was looked for, for a message (empty for an absolute one): paths in a
    config and on the command line are read from the working directory."""
    from pathlib import Path

    if Path(path).expanduser().is_absolute():
        return ""
    return f" in {Path.cwd()} (a relative path is read from the working directory)"


def with_context(err: LmppoError, context: str) -> LmppoError:
    """``err`` (same class, same exit code) with a line saying where it happened and what was kept."""
    err.args = (f"{err}\n--- {context}",)
    return err


class GuardAbort(LmppoError):
    """A guard (lmppo.runs.guards) stopped the run after saving an ``aborted`` checkpoint. It exits with 3, so
    a job scheduler tells a run that watched itself fail from bad input (2) and does not requeue it as is."""

    exit_code = 3

    def __init__(self, message: str, run_dir) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class Interrupted(LmppoError):
    """A run stopped by SIGINT / SIGTERM after saving a checkpoint. It exits with 128 + the signal's number
    (130, 143: the shell's convention), so a job scheduler sees an unfinished job and can requeue it."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number


class LmppoWarning(UserWarning):
    """Something a user should know that does not stop the run (see :func:`warn`)."""


def warn(message: str) -> None:
    """Warn the user: shown as ``warning: <message>`` on stderr, not as Python's ``file:line: UserWarning``
    followed by a line of lmppo's source."""
    warnings.warn(message, LmppoWarning, stacklevel=2)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if not issubclass(category, LmppoWarning):
        return _python_show_warning(message, category, filename, lineno, file, line)
    try:
        print(f"warning: {message}", file=file or sys.stderr)
    except OSError:  # no stderr to write to (a closed pipe): as Python's own does
        pass


_python_show_warning = warnings.showwarning
warnings.showwarning = _show_warning


def console(*, stderr: bool = False):
    """A rich console on stdout (or stderr). Outside a terminal (a file, a scheduler's log) rich would
    cut tables at 80 columns; there it prints them 200 wide, unless ``COLUMNS`` says otherwise."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or "COLUMNS" in os.environ else 200
    return Console(stderr=stderr, width=width)
