"""``docs/config.md``: the configuration reference, generated from the schema in :mod:`lmppo.inputs.config`.

Every key with its type, default and description, one table per section. The schema is the one source:
``python -m lmppo.inputs.config_reference > docs/config.md`` rewrites the page, and a test fails when the page
and the schema disagree.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from lmppo.inputs.config import Config, LoraConfig, ModelSource, SupervisedConfig, section_of

HEADER = """# Configuration reference

Generated from `src/lmppo/inputs/config/` by `python -m lmppo.inputs.config_reference > docs/config.md`; a
test fails when this page is stale. A config is YAML with these sections; any key can be overridden on the
command line as `section.key=value` (`lmppo ppo CONFIG ppo.lr=3e-6 rollout.asynchronous=true`), list items by
index (`reward.components.1.weight=2`). Unknown keys are errors naming the nearest valid one. `lmppo init`
writes a commented starter config.
"""


# sections that recur (every model, every LoRA): one table each at the end, a row where they are used
SHARED = {ModelSource: "a model", LoraConfig: "a LoRA section"}


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "required"
    default = field.default.model_dump() if isinstance(field.default, BaseModel) else field.default
    return f"`{json.dumps(default)}`"


def _rows(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Table rows of ``model``'s keys, nested sections flattened into dotted keys."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = section_of(field.annotation)
        if section is None:
            yield f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {_text(field.description)} |"
            continue
        is_list = typing.get_origin(field.annotation) is list
        kind = SHARED.get(section, "list of sections" if is_list else "section")
        optional = " or null" if field.default is None else ""
        default = "required" if field.is_required() else ("`null`" if field.default is None else "")
        note = _text(field.description or _first_sentence(section.__doc__))
        yield f"| `{key}` | {kind}{optional} | {default} | {note} |"
        if section not in SHARED:
            yield from _rows(section, f"{key}[]." if is_list else f"{key}.")


def _text(text: str | None) -> str:
    """Docstring or description text for one table cell."""
    return " ".join((text or "").split()).replace("``", "`").replace("|", "\\|")


def _first_sentence(doc: str | None) -> str:
    return _text(doc).split(". ")[0].rstrip(".")


def _table(model: type[BaseModel], prefix: str) -> str:
    return "\n".join(["| key | type | default | description |", "|---|---|---|---|", *_rows(model, prefix)])


def _section(title: str, model: type[BaseModel], prefix: str) -> str:
    return f"### {title}\n\n{_text(model.__doc__)}\n\n{_table(model, prefix)}\n"


def reference() -> str:
    """The whole page: the PPO run's sections, the recurring sections, the supervised stages' config."""
    parts = [HEADER, "## A PPO run (`lmppo ppo`, `lmppo best-of-n`, `lmppo plan`, `lmppo eval`)\n"]
    for name, field in Config.model_fields.items():
        parts.append(_section(f"`{name}`", section_of(field.annotation), f"{name}."))
    parts.append("## Recurring sections\n")
    parts += [_section(title.capitalize(), model, "") for model, title in SHARED.items()]
    parts.append("## A supervised stage (`lmppo sft`, `lmppo train-rm`)\n")
    parts.append(_section("The stage's config", SupervisedConfig, ""))
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
