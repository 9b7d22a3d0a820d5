"""Prompt rows from tasks users already have: reasoning-gym's procedural datasets (``lmppo data reasoning-gym``).

A row holds the question as chat messages (``prompt``: the answer format as the system turn, the question as
the user's), the task's ``answer`` (None for a task that checks answers instead of comparing them), the
``task`` it came from, and the whole reasoning-gym ``entry``, which :class:`lmppo.rewards.tasks.ReasoningGym`
scores a response against with the task's own ``score_answer``.

reasoning-gym makes entry ``i`` of seed ``s`` from ``s + i``, so its seeds 1 and 2 share all but one entry.
Here a file's ``--seed`` is scaled by :data:`SEED_STRIDE` before it reaches reasoning-gym: files made with
different seeds never share an entry, and a held-out file is one made with another seed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
from pathlib import Path
from typing import Any

import yaml

from lmppo.errors import LmppoError

ANSWER_FORMAT = (
    "Think step by step, then give only the final answer between <answer> and </answer> tags, "
    "e.g. <answer>42</answer>; when the question shows an example answer, follow its format."
)  # what rewards.tasks extracts: the last <answer>...</answer> (reasoning-gym's extract_answer)
SEED_STRIDE = 100_000  # entries per --seed: the most rows one file may hold
MAX_SEED = 40_000  # SEED_STRIDE x MAX_SEED stays under 2**32, numpy's seed limit (pool_matrix seeds numpy)
INSTALL = "pip install 'lmppo[tasks]'"


def require(package: str, what: str):
    """``package`` imported, or an error naming the extra that installs it (imported lazily: an extra)."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise LmppoError(
            f"{what} needs the {package} package, which is not installed ({err}): `{INSTALL}`"
        ) from None


def reasoning_gym_rows(tasks: str, config: list[str], size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` prompt rows of ``tasks`` (one reasoning-gym task name, or several joined by commas: a
    composite, equal weights), with ``config`` settings ``key=value`` (``task.key=value`` for a composite)."""
    if not 1 <= size <= SEED_STRIDE:
        raise LmppoError(f"--size {size}: give 1 to {SEED_STRIDE} rows per file (more: several seeds)")
    if not 0 <= seed <= MAX_SEED:
        raise LmppoError(f"--seed {seed}: give a seed from 0 to {MAX_SEED}")
    gym = require("reasoning_gym", "lmppo data reasoning-gym")
    names = [name.strip() for name in tasks.split(",")]
    settings = _settings(config, names)
    for name in names:
        _check_task(gym, name, settings[name])
    return [_row(entry) for entry in _entries(gym, names, settings, size, seed * SEED_STRIDE)]


def _settings(config: list[str], names: list[str]) -> dict[str, dict[str, Any]]:
    """Each task's settings from ``key=value`` items (YAML values: ``3``, ``0.5``, ``[1, 2]``, ``true``)."""
    settings: dict[str, dict[str, Any]] = {name: {} for name in names}
    for item in config:
        key, sep, value = item.partition("=")
        task, dot, field = key.strip().rpartition(".")
        if not sep or not field or (task not in settings if dot else len(names) > 1):
            form = "task.key=value, task one of " + ", ".join(names) if len(names) > 1 else "key=value"
            raise LmppoError(f"--config {item!r}: give {form}")
        if field in ("seed", "size"):
            raise LmppoError(f"--config {item!r}: set the {field} with --{field}, not --config")
        settings[task if dot else names[0]][field] = yaml.safe_load(value)
    return settings


def _check_task(gym, name: str, settings: dict[str, Any]) -> None:
    """``name`` is a reasoning-gym task, and ``settings`` name fields of its config."""
    registry = gym.factory.DATASETS
    known = sorted(set(registry) - {"composite"})  # a composite is named by its tasks
    if name not in known:
        close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"it has {len(known)}, e.g. {', '.join(known[:6])}"
        )
        raise LmppoError(
            f"reasoning-gym has no task {name!r}: {hint} (for a composite, join task names with commas: "
            "leg_counting,basic_arithmetic)"
        )
    fields = [f.name for f in dataclasses.fields(registry[name][1]) if f.name not in ("seed", "size")]
    for key in settings:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise LmppoError(
                f"--config {key}: task {name} has no setting {key!r}; {hint}its settings are {', '.join(fields)}"
            )


def _entries(
    gym, names: list[str], settings: dict[str, dict[str, Any]], size: int, seed: int
) -> list[dict[str, Any]]:
    """The entries of the task's reasoning-gym dataset, or of a composite of several; its own checks'
    refusals as errors."""
    try:
        if len(names) == 1:
            dataset = gym.create_dataset(names[0], size=size, seed=seed, **settings[names[0]])
        else:
            spec = importlib.import_module("reasoning_gym.composite").DatasetSpec
            specs = [spec(name=name, weight=1.0, config=settings[name]) for name in names]
            dataset = gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
        return [dataset[i] for i in range(size)]
    except (AssertionError, ValueError, TypeError) as err:
        raise LmppoError(
            f"reasoning-gym refused {','.join(names)} with settings {settings}: {err or type(err).__name__}; "
            "change the --config values"
        ) from None


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    """One prompt row of a reasoning-gym entry, as JSON values."""
    entry = json.loads(json.dumps(entry, default=_plain))
    return {
        "prompt": [
            {"role": "system", "content": ANSWER_FORMAT},
            {"role": "user", "content": entry["question"]},
        ],
        "answer": entry["answer"],
        "task": entry["metadata"]["source_dataset"],
        "entry": entry,
    }


def _plain(value: Any) -> Any:
    """A value JSON has no type for, as a JSON one: numpy's arrays and numbers, sets."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    """``rows`` as JSONL at ``out``, written whole once every row is made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
