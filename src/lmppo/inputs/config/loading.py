"""A config from YAML, a dict and ``a.b=c`` overrides, validated: ``load_config(path, overrides)`` is the one
entry point. Every problem is one line naming the override or file it came from; an unknown key names the
key it most likely meant (:func:`lmppo.inputs.config.keys.unknown_key_hint`)."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lmppo.errors import LmppoError
from lmppo.inputs.config.keys import unknown_key_hint
from lmppo.inputs.config.schema import Config
from lmppo.inputs.config.section import Section


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    base: dict | None = None,
    schema: type[Section] = Config,
) -> Section:
    """Read a YAML file (or start from ``base``), apply ``section.key=value`` overrides, validate."""
    raw: dict[str, Any] = copy.deepcopy(base or {}) if path is None else read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, source=str(path) if path else "config", schema=schema, overrides=overrides)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's sections as plain data, not yet validated."""
    path = Path(path)
    if path.is_dir():
        raise LmppoError(f"config file {path} is a directory; pass the path of a YAML config file")
    if not path.is_file():
        raise LmppoError(f"config file {path} does not exist; pass the path of a YAML config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise LmppoError(f"config file {path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise LmppoError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise LmppoError(f"override {override!r} is not of the form section.key=value")
    *parents, leaf = _override_path(override)
    node = raw
    for part in parents:
        if isinstance(node, dict) and node.get(part) is None:  # an unset optional section (models.reference)
            node[part] = {}
        node = node[_list_index(node, part, override)] if isinstance(node, list) else node[part]
        if not isinstance(node, dict | list):
            raise LmppoError(f"override {override!r}: {part!r} is a value, not a section")
    node[_list_index(node, leaf, override) if isinstance(node, list) else leaf] = yaml.safe_load(value)


def _override_path(override: str) -> list[str]:
    """The location an override sets: ``reward.components.1.weight=2`` -> reward, components, 1, weight."""
    return override.partition("=")[0].strip().split(".")


def _list_index(node: list, part: str, override: str) -> int:
    """``part`` as an index into a list of the config (``reward.components.1.weight=2``)."""
    if not part.isdigit() or int(part) >= len(node):
        raise LmppoError(
            f"override {override!r}: {part!r} is not an index of that list (it has {len(node)} items: 0 to "
            f"{len(node) - 1})"
        )
    return int(part)


def validate_config(
    raw: dict[str, Any],
    source: str = "config",
    schema: type[Section] = Config,
    overrides: Sequence[str] = (),
    overrides_from: str = "command line",
) -> Section:
    """``raw`` as a ``schema``, or an LmppoError listing every problem, one line each. ``overrides`` are the
    ``a.b=c`` overrides already applied to ``raw`` (given on ``overrides_from``): a problem they caused
    names them rather than ``source``."""
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        if not overrides:  # the one source: named once, above its problems
            problems = "\n".join(f"  - {_describe(e, schema)}" for e in err.errors())
            raise LmppoError(f"{source} is not a valid lmppo config:\n{problems}") from None
        problems = "\n".join(
            f"  - {_origin(e, source, overrides, overrides_from)}: {_describe(e, schema)}"
            for e in err.errors()
        )
        raise LmppoError(f"{source} with its overrides is not a valid lmppo config:\n{problems}") from None


def _origin(error: dict[str, Any], source: str, overrides: Sequence[str], overrides_from: str) -> str:
    """Where a problem came from: the last override that set its location (or a section around it), else
    ``source`` with the overrides inside its location (a cross-field check over what they changed), else
    ``source`` alone."""
    loc = [str(p) for p in error["loc"]]
    if error["type"] == "missing":  # nothing set a missing key: whoever made its section did this
        loc = loc[:-1] or loc
    setting = [o for o in overrides if _is_prefix(_override_path(o), loc)]
    if setting:
        return f"the override {_redacted(setting[-1])} ({overrides_from})"
    inside = [_redacted(o) for o in overrides if _is_prefix(loc, _override_path(o))]
    if inside:
        return f"{source} with the override{'s' * (len(inside) > 1)} {', '.join(inside)} ({overrides_from})"
    return source


def _redacted(override: str) -> str:
    """An override as said back, with a URL's credentials (user:password@) hidden."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", override)


def _is_prefix(head: list[str], path: list[str]) -> bool:
    return path[: len(head)] == head


def _describe(error: dict[str, Any], schema: type[Section]) -> str:
    loc = [str(p) for p in error["loc"]]
    where = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"unknown key {where!r}: {unknown_key_hint(loc, schema)}"
    if error["type"] == "missing":
        return f"{where} is required"
    if error["type"] == "value_error":  # our own cross-field checks: the message says it all
        return error["msg"].removeprefix("Value error, ")
    return f"{where}: {error['msg']} (got {error.get('input')!r})"
