"""The user's own code that a config names: ``"package.module:name"`` or ``"path/to/file.py:name"`` (a reward
function, a judge, an environment), or a function handed to the Python API in this process
(``"python:NAME"``). A file is imported once per process; its errors name the config key and the file's
line, or show the user's frames only (:func:`lmppo.errors.user_code_error`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from lmppo.errors import LmppoError, read_from, user_code_error

# Functions handed to the Python API (lmppo.train(reward=fn)): the config names them "python:NAME"
PYTHON_FUNCTIONS: dict[str, Callable] = {}


def python_function_spec(function: Callable) -> str:
    """Register ``function`` for this process under its name; returns the spec a config holds for it."""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    PYTHON_FUNCTIONS[name] = function
    return f"python:{name}"


def load_function(spec: str, what: str = "reward function", kind: str = "function") -> Callable:
    """Import ``"package.module:function"`` or ``"path/to/file.py:function"`` (relative to the working
    directory), or look up a ``"python:NAME"`` function given to the Python API; errors name ``what``
    and say what it should be (``kind``: a function, or a class)."""
    if spec.startswith("python:"):
        if spec.removeprefix("python:") not in PYTHON_FUNCTIONS:
            raise LmppoError(
                f"{what} {spec!r} was a Python {kind.lower()} given to lmppo.train in another process; pass it again "
                f"(lmppo.train(..., reward=function) or environment=Class), or name an importable one: "
                f"'module:{kind}'"
            )
        return PYTHON_FUNCTIONS[spec.removeprefix("python:")]
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise LmppoError(
            f"{what} {spec!r} must look like 'package.module:{kind}' or 'path/to/file.py:{kind}'."
        )
    module = (
        _import_file(module_name, spec, what)
        if module_name.endswith(".py")
        else _import_module(module_name, spec, what, kind)
    )
    function = getattr(module, attribute, None)
    if function is None:
        close = _close_names(module, attribute)
        raise LmppoError(
            f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ".")
        )
    if not callable(function):
        raise LmppoError(f"{what} {spec!r}: {attribute!r} is a {type(function).__name__}, not a {kind}.")
    return function


def _close_names(module, attribute: str) -> list[str]:
    """The module's public names closest to a misspelt ``attribute`` (at most three)."""
    names = [name for name in vars(module) if not name.startswith("_")]
    return difflib.get_close_matches(attribute, names, n=3, cutoff=0.6)


def _import_module(name: str, spec: str, what: str, kind: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise LmppoError(
            f"{what} {spec!r}: cannot import module {name!r} ({err}); check the name and that it is importable "
            f"(installed, or on PYTHONPATH), or give a file: 'path/to/file.py:{kind}'."
        ) from err


def _import_file(path: str, spec: str, what: str):
    file = Path(path).expanduser()
    if not file.is_file():
        raise LmppoError(f"{what} {spec!r}: no file {file}{read_from(file)}.")
    name = f"lmppo_user_{file.stem}_{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:8]}"
    if name not in sys.modules:  # import once: the module may build tables at import time
        module_spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as err:
            del sys.modules[name]
            raise LmppoError(
                f"{what} {spec!r}: {err.filename}, line {err.lineno}: {err.msg}; fix the file"
            ) from None
        except Exception as err:
            del sys.modules[name]
            raise user_code_error(f"{what} {spec!r}, while its file was imported,", err) from None
    return sys.modules[name]
