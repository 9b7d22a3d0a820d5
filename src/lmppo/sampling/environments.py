"""Environments: what answers the policy between its turns (``rollout.environment``, docs/multiturn.md).

An environment is a plain Python class, named in the config like a reward function (``file.py:MyEnv`` or
``module:MyEnv``), made once per episode with no arguments:

- ``reset(row, seed)``: a new episode on one prompt row (the whole row: its extra columns, an answer key or a
  tool's data, reach the environment) and a seed derived from the sample's place in the prompt stream, so a
  run draws the same episodes on any number of ranks and after a resume;
- ``step(text) -> Step``: the policy's last message (its text, the stop token left out); returns the
  messages to append (tool results, the user's next turn, or none), a reward for that turn (optional) and
  whether the episode is done.

:class:`SingleTurn` is one response and done: today's behaviour. :class:`ToolEnvironment` runs plain Python
functions the policy calls by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (or the
model's own format, with ``rollout.tools``: :mod:`lmppo.sampling.tools`); a bad call is answered with an
error message the policy reads, never a crash; a message with no call ends the episode. The loop that drives them is :mod:`lmppo.sampling.episodes`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from lmppo.errors import LmppoError
from lmppo.sampling.tools import Toolbox, ToolCall, hermes_call, parse_tool_calls
from lmppo.user_code import load_function


@dataclass
class Step:
    """What an environment answers to one turn of the policy."""

    messages: list[dict[str, str]] = field(default_factory=list)  # {"role", "content"} to append
    reward: float = 0.0  # this turn's reward, placed on the turn's last action token
    done: bool = False  # the episode ended: no more turns
    tool_calls: int = 0  # tool calls this turn ran (a metric)
    tool_failures: int = 0  # of those, the ones answered with an error (a metric)


class Environment(Protocol):
    def reset(self, row: dict[str, Any], seed: int) -> None: ...

    def step(self, text: str) -> Step: ...


class SingleTurn:
    """One response per prompt and done: exactly a run without an environment."""

    def reset(self, row: dict[str, Any], seed: int) -> None:
        pass

    def step(self, text: str) -> Step:
        return Step(done=True)


class ToolEnvironment:
    """Tools the policy calls in its text, answered as ``tool`` messages; a turn without a call ends the
    episode. Subclass it with ``tools = {"name": function}`` (keyword arguments from the call's
    ``arguments``); ``reset`` keeps the row as ``self.row`` for tools that read it. A call that does not
    parse (one never closed included), names no known tool, has arguments the function refuses or raises is
    answered with the error (a failed call), so the policy can learn to call well.

    With ``rollout.tools`` the run makes a subclass (:func:`with_toolbox`) that also answers the toolbox's
    tools and reads calls in the model's own format when its tokenizer knows one."""

    tools: ClassVar[dict[str, Callable[..., Any]]] = {}
    result_role: ClassVar[str] = "tool"  # a template without a tool role: "user"
    toolbox: ClassVar[Toolbox | None] = None  # rollout.tools, set by with_toolbox
    tokenizer: ClassVar[Any] = None  # the policy's: the call format its response template parses

    def reset(self, row: dict[str, Any], seed: int) -> None:
        self.row, self.seed = row, seed

    def step(self, text: str) -> Step:
        schemas = self.toolbox.schemas() if self.toolbox is not None else None
        calls = parse_tool_calls(text, self.tokenizer, schemas)
        if not calls:
            return Step(done=True)
        results = [self.answer(call) for call in calls]
        failures = sum(failed for _, failed in results)
        messages = [{"role": self.result_role, "content": answer} for answer, _ in results]
        return Step(messages=messages, tool_calls=len(calls), tool_failures=failures)

    def call(self, body: str) -> tuple[str, bool]:
        """The answer to one Hermes call (the JSON between ``<tool_call>`` and ``</tool_call>``) and whether
        it failed."""
        return self.answer(hermes_call(body))

    def answer(self, call: ToolCall) -> tuple[str, bool]:
        """One call's answer and whether it failed: the class's own tools first, then the toolbox's."""
        if call.error is not None:
            return call.error, True
        if call.name in self.tools:
            try:
                return str(self.tools[call.name](**call.arguments)), False
            except Exception as err:  # the policy's call was wrong: it reads the error, the run goes on
                return f"error: {type(err).__name__}: {err}", True
        if self.toolbox is not None and call.name in self.toolbox.owners:
            return self.toolbox.call(call.name, call.arguments)
        names = sorted([*self.tools, *(self.toolbox.owners if self.toolbox is not None else ())])
        return f"error: no tool {call.name!r}; the tools are {names}", True


TOOL_ENVIRONMENT = "lmppo.sampling.environments:ToolEnvironment"  # what answers rollout.tools alone


def check_answers_tools(environment: type) -> None:
    """With ``rollout.tools``, ``rollout.environment`` must be a :class:`ToolEnvironment` (it answers the calls)."""
    if not (isinstance(environment, type) and issubclass(environment, ToolEnvironment)):
        raise LmppoError(
            f"rollout.tools needs an environment that answers tool calls, and rollout.environment "
            f"{environment.__name__} is not a lmppo.sampling.environments.ToolEnvironment: make it subclass "
            "ToolEnvironment (its own tools dict is kept, rollout.tools' added), or remove rollout.environment "
            "to let a plain ToolEnvironment answer rollout.tools"
        )


def with_toolbox(environment: type, toolbox: Toolbox, tokenizer) -> type[ToolEnvironment]:
    """``environment`` (a :class:`ToolEnvironment` subclass, its own ``tools`` kept) also answering the
    toolbox's tools, reading calls in the format ``tokenizer`` parses."""
    check_answers_tools(environment)
    both = sorted(set(environment.tools) & set(toolbox.owners))
    if both:
        raise LmppoError(
            f"the tool(s) {both} are both in {environment.__name__}.tools and rollout.tools "
            f"({', '.join(repr(toolbox.owners[name]) for name in both)}); a call names its tool, so rename "
            "one of each pair or remove it"
        )
    return type(environment.__name__, (environment,), {"toolbox": toolbox, "tokenizer": tokenizer})


# rollout.environment specs an ecosystem package serves: prefix -> the function making the environment class
PACKAGE_ENVIRONMENTS = {
    "openenv:": "lmppo.sampling.openenv_envs:openenv_environment",  # an OpenEnv server's URL
    "textarena:": "lmppo.sampling.textarena_envs:textarena_environment",  # a textarena game id
}


def load_environment(spec: str) -> Callable[[], Environment]:
    """The environment class ``rollout.environment`` names, checked to have ``reset`` and ``step``: a user's
    class, or one made for a package's environment (``openenv:URL``, ``textarena:GAME-ID``)."""
    for prefix, maker in PACKAGE_ENVIRONMENTS.items():
        if spec.startswith(prefix):
            module, _, function = maker.partition(":")
            return getattr(importlib.import_module(module), function)(spec[len(prefix) :])
    environment = load_function(spec, "rollout.environment", kind="Class")
    if not isinstance(environment, type) or not all(
        callable(getattr(environment, name, None)) for name in ("reset", "step")
    ):
        raise LmppoError(
            f"rollout.environment {spec!r} is not a class with reset(row, seed) and step(text) methods; "
            "name an environment class (see docs/multiturn.md), e.g. lmppo.sampling.environments:SingleTurn"
        )
    return environment
