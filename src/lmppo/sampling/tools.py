"""Tools the policy may call (``rollout.tools``, docs/multiturn.md): where they come from, their JSON schemas
(what the chat template renders with ``tools=``), the calls read from the policy's text and their answers.

A spec names a Python function (``path/to/file.py:function`` or ``module:function``, its schema from its
type hints and Google-style docstring), an MCP server over stdio (``mcp:<command>``) or one over streamable
HTTP (its ``http(s)://`` URL). A :class:`Toolbox` holds every source of a run, built once per process; a
:class:`lmppo.sampling.environments.ToolEnvironment` answers the policy's calls from it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from lmppo.errors import LmppoError
from lmppo.inputs.resolve import MCP_PREFIXES, ToolFunction, tool_function


class ToolSource(Protocol):
    """Where tools come from: their schemas, and a call's answer (a failed call raises; its message is
    what the policy reads)."""

    def schemas(self) -> list[dict]:
        """OpenAI-style ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        ...

    def call(self, name: str, arguments: dict) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class FunctionSource:
    """One Python function as a tool (:func:`lmppo.inputs.resolve.tool_function`); its arguments are the
    call's keyword arguments."""

    tool: ToolFunction

    def schemas(self) -> list[dict]:
        return [self.tool.schema]

    def call(self, name: str, arguments: dict) -> str:
        return str(self.tool.function(**arguments))

    def close(self) -> None:
        pass


def tool_source(spec: str, timeout_s: float) -> ToolSource:
    """The source ``spec`` names: an MCP server (started here, its tools listed) or a Python function."""
    if spec.startswith(MCP_PREFIXES):
        from lmppo.sampling.mcp_tools import mcp_source  # imports mcp: only a run with such a spec needs it

        return mcp_source(spec, timeout_s)
    return FunctionSource(tool_function(spec))


class Toolbox:
    """Every tool of a run by name, each answered by its source (``owners``: a tool's spec). The schemas
    are listed once, when the toolbox is made."""

    def __init__(self, sources: dict[str, ToolSource]) -> None:
        self.sources = sources  # spec -> source
        listed = [(spec, schema) for spec, source in sources.items() for schema in source.schemas()]
        self.owners: dict[str, str] = {}
        for spec, schema in listed:
            name = schema["function"]["name"]
            if name in self.owners:
                raise LmppoError(
                    f"rollout.tools: two tools are named {name!r}, from {self.owners[name]!r} and {spec!r}; "
                    "a call names its tool, so names must differ: rename one or remove a spec"
                )
            self.owners[name] = spec
        self.tool_schemas = [schema for _, schema in listed]

    def schemas(self) -> list[dict]:
        return self.tool_schemas

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """A call's answer and whether it failed: an unknown tool or a source that raises is an error the
        policy reads, never a crash."""
        if name not in self.owners:
            return f"error: no tool {name!r}; the tools are {sorted(self.owners)}", True
        try:
            return self.sources[self.owners[name]].call(name, arguments), False
        except LmppoError:  # the source itself failed (an MCP server that died twice): the run stops
            raise
        except Exception as err:  # the policy's call was wrong: it reads the error, the run goes on
            return f"error: {type(err).__name__}: {err}", True

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def open_toolbox(specs: list[str], timeout_s: float) -> Toolbox:
    """The toolbox of ``rollout.tools``; the sources already started are closed when a later one fails."""
    sources: dict[str, ToolSource] = {}
    try:
        for spec in specs:
            sources[spec] = tool_source(spec, timeout_s)
        return Toolbox(sources)
    except BaseException:
        for source in sources.values():
            source.close()
        raise


def tool_schemas(specs: list[str], timeout_s: float = 60.0) -> list[dict] | None:
    """The schemas of ``specs`` (None for none), their servers stopped again: what a stage that renders the
    run's prompts without calling any tool (``lmppo sft``) needs."""
    if not specs:
        return None
    toolbox = open_toolbox(specs, timeout_s)
    try:
        return toolbox.schemas()
    finally:
        toolbox.close()


# --------------------------------------------------------------------------------------------------
# Tool calls in the policy's text
# --------------------------------------------------------------------------------------------------


class ToolCall(NamedTuple):
    """One call the policy wrote; ``error``: it did not parse, and this is the answer the policy reads."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
UNCLOSED = "error: a <tool_call> was opened and never closed; end each call with </tool_call>"


def parse_tool_calls(text: str, tokenizer=None, tools: list[dict] | None = None) -> list[ToolCall]:
    """The calls in a policy's message: in the model's own format when its tokenizer has a
    ``response_template`` (transformers' response parsing; ``tools`` cast the arguments to their schema),
    else Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A call opened and never closed
    is a failed call."""
    template = getattr(tokenizer, "response_template", None)
    if template is None:
        return hermes_calls(text)
    return template_calls(text, tokenizer, template, tools)


def hermes_calls(text: str) -> list[ToolCall]:
    calls = [hermes_call(body) for body in HERMES_CALL.findall(text)]
    if "<tool_call>" in HERMES_CALL.sub("", text):
        calls.append(ToolCall("", {}, UNCLOSED))
    return calls


def hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise TypeError("arguments must be an object")
    except (ValueError, KeyError, TypeError) as err:
        return ToolCall("", {}, f'error: the call is not {{"name": ..., "arguments": {{...}}}} JSON ({err})')
    return ToolCall(name, arguments)


def template_calls(text: str, tokenizer, template: dict, tools: list[dict] | None) -> list[ToolCall]:
    """The calls transformers' parser reads with the tokenizer's response template; a message it cannot
    parse is one failed call, and calls past the last closing marker are unclosed ones."""
    try:
        message = tokenizer.parse_response(text, prefix="", tools=tools)
    except ValueError as err:
        return [ToolCall("", {}, f"error: the tool call does not parse ({err})")]
    calls = [template_call(call.get("function", call)) for call in message.get("tool_calls") or []]
    closed = len(re.findall(_close_pattern(template), text)) if _close_pattern(template) else len(calls)
    return calls[:closed] + [ToolCall("", {}, UNCLOSED)] * (len(calls) > closed)


def template_call(function: dict) -> ToolCall:
    arguments = function.get("arguments") or {}
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as err:
        return ToolCall("", {}, f"error: the call's arguments are not JSON ({err})")
    if not isinstance(arguments, dict):
        return ToolCall("", {}, "error: a call's arguments must be an object")
    return ToolCall(str(function.get("name", "")), arguments)


def _close_pattern(template: dict) -> str | None:
    """The regular expression that closes a tool call in a response template (None: it names none)."""
    field = template.get("fields", {}).get("tool_calls", {})
    close = field.get("close_pattern") or field.get("close")
    if close is None or "close_pattern" in field:
        return close
    return "|".join(map(re.escape, [close] if isinstance(close, str) else close))
