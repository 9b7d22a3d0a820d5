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
functions the policy calls by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a bad
call is answered with an error message the policy reads, never a crash; a message with no call ends the
episode. The loop that drives them is :mod:`lmppo.sampling.episodes`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from lmppo.errors import LmppoError
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


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolEnvironment:
    """Tools the policy calls in its text, answered as ``tool`` messages; a turn without a call ends the
    episode. Subclass it with ``tools = {"name": function}`` (keyword arguments from the call's
    ``arguments``); ``reset`` keeps the row as ``self.row`` for tools that read it. A call that does not
    parse, names no known tool, has arguments the function refuses or raises is answered with the error
    (a failed call), so the policy can learn to call well."""

    tools: ClassVar[dict[str, Callable[..., Any]]] = {}
    result_role: ClassVar[str] = "tool"  # a template without a tool role: "user"

    def reset(self, row: dict[str, Any], seed: int) -> None:
        self.row, self.seed = row, seed

    def step(self, text: str) -> Step:
        calls = TOOL_CALL.findall(text)
        if not calls:
            return Step(done=True)
        results = [self.call(body) for body in calls]
        failures = sum(failed for _, failed in results)
        messages = [{"role": self.result_role, "content": answer} for answer, _ in results]
        return Step(messages=messages, tool_calls=len(calls), tool_failures=failures)

    def call(self, body: str) -> tuple[str, bool]:
        """One call's answer and whether it failed."""
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise TypeError("arguments must be an object")
        except (ValueError, KeyError, TypeError) as err:
            return f'error: the call is not {{"name": ..., "arguments": {{...}}}} JSON ({err})', True
        if name not in self.tools:
            return f"error: no tool {name!r}; the tools are {sorted(self.tools)}", True
        try:
            return str(self.tools[name](**arguments)), False
        except Exception as err:  # the policy's call was wrong: it reads the error, the run goes on
            return f"error: {type(err).__name__}: {err}", True


def load_environment(spec: str) -> Callable[[], Environment]:
    """The environment class ``rollout.environment`` names, checked to have ``reset`` and ``step``."""
    environment = load_function(spec, "rollout.environment", kind="Class")
    if not isinstance(environment, type) or not all(
        callable(getattr(environment, name, None)) for name in ("reset", "step")
    ):
        raise LmppoError(
            f"rollout.environment {spec!r} is not a class with reset(row, seed) and step(text) methods; "
            "name an environment class (see docs/multiturn.md), e.g. lmppo.sampling.environments:SingleTurn"
        )
    return environment
