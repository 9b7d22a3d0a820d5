"""OpenEnv environments (``rollout.environment: openenv:...``, docs/multiturn.md), on the ``openenv`` package
(``pip install 'lmppo[openenv]'``).

- ``openenv:URL`` (``http(s)://`` or ``ws(s)://``): an OpenEnv server. Each episode opens a session of its
  own (a WebSocket, OpenEnv's generic client: the server's action and observation classes need not be
  importable here), resets it and steps it on the policy's turns; the methods are async, so the episodes of
  a turn step together on the generator's event loop. The server's ``/schema`` is read when the class is
  made: a server that is not there is an error naming the URL.
- ``openenv:file.py:Class`` or ``openenv:module:Class``: an OpenEnv ``Environment`` subclass (the
  server-side class of an environment package) played in-process, one instance per episode.

Both reset with ``seed=`` the episode's seed and the prompt row's fields as keyword arguments: the server
(and the in-process class likewise) passes on those its ``reset`` accepts. The policy's turn is the action's
one string field; the observation's one string field is the user's next message; its reward and done are
the turn's. Another mapping is a subclass overriding :meth:`OpenEnvEnvironment.reset_arguments`,
:meth:`~OpenEnvEnvironment.action` or :meth:`~OpenEnvEnvironment.messages`.

A session's connection lasts the episode and is closed when the episode ends (done, or dropped by the run
when it was cut). A dropped connection is opened again once per episode, the episode replayed on the new
session (reset with the same arguments, its actions so far stepped again: an environment deterministic for a
seed continues where it was); a second drop is an error naming the URL.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
import urllib.error
import urllib.request
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from websockets.exceptions import ConnectionClosed

from lmppo.errors import LmppoError
from lmppo.sampling.environments import Step
from lmppo.user_code import load_function

URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
SCHEMA_TIMEOUT_S = 10.0  # reading /schema when the class is made


def openenv_environment(spec: str) -> type[OpenEnvEnvironment]:
    """The environment class of ``rollout.environment: openenv:SPEC``: a server's URL or a local class."""
    if spec.startswith(URL_SCHEMES):
        return served_environment(spec)
    return local_environment(spec)


class OpenEnvEnvironment:
    """What maps lmppo's episode to an OpenEnv environment and back; subclass it to change the mapping."""

    name: ClassVar[str]  # the URL or the class's spec, in messages
    action_field: ClassVar[str | None] = None  # the action's one string field: None when it has no such one
    observation_field: ClassVar[str | None] = None  # the observation's one string field, likewise

    def reset_arguments(self, row: dict[str, Any], seed: int) -> dict[str, Any]:
        """The keyword arguments of the environment's reset: the row's fields and the seed."""
        return {**row, "seed": seed}

    def action(self, text: str) -> dict[str, Any]:
        """The action of the policy's turn ``text`` (the fields of the environment's action)."""
        if self.action_field is None:
            raise self._no_default("action", "action(self, text) -> dict of the action's fields")
        return {self.action_field: text}

    def messages(self, observation: dict[str, Any]) -> list[dict[str, str]]:
        """The messages an observation (its fields, reward and done aside) appends to the conversation."""
        if self.observation_field is None:
            raise self._no_default("observation", "messages(self, observation) -> list of chat messages")
        text = observation.get(self.observation_field) or ""
        return [{"role": "user", "content": text}] if text else []

    def answer(self, observation: dict[str, Any], reward: float | None, done: bool) -> Step:
        """An observation as the turn's :class:`Step` (no reward: 0)."""
        messages = [] if done else self.messages(observation)  # a finished episode reads no more
        return Step(messages=messages, reward=float(reward or 0.0), done=done)

    def _no_default(self, model: str, method: str) -> LmppoError:
        return LmppoError(
            f"rollout.environment openenv:{self.name}: its {model} has no single string field for lmppo's "
            f"default mapping, so lmppo cannot tell where the text goes. Subclass the class that "
            f"lmppo.sampling.openenv_envs.openenv_environment({self.name!r}) returns, define {method}, and "
            "name the subclass in rollout.environment (file.py:Class); see docs/multiturn.md, OpenEnv "
            "environments"
        )


# --------------------------------------------------------------------------------------------------
# A server: one WebSocket session per episode
# --------------------------------------------------------------------------------------------------

DROPPED = (OSError, ConnectionClosed)  # a connection refused, reset or closed mid-call


def served_environment(url: str) -> type[ServedEnvironment]:
    """The environment class of the OpenEnv server at ``url``, its text fields read from its ``/schema``."""
    schemas = _read_schemas(url)
    return type(
        "OpenEnv",
        (ServedEnvironment,),
        {
            "name": url,
            "url": url,
            "action_field": _text_field(schemas.get("action", {}), alone=True),
            "observation_field": _text_field(schemas.get("observation", {})),
        },
    )


class ServedEnvironment(OpenEnvEnvironment):
    """An episode on its own session of the server at ``url``."""

    url: ClassVar[str]

    async def reset(self, row: dict[str, Any], seed: int) -> None:
        self.arguments, self.actions = self.reset_arguments(row, seed), []
        self.client, self.reconnected = None, False
        await self._on_session()

    async def step(self, text: str) -> Step:
        action = self.action(text)
        result = await self._on_session(lambda: self.client.step(action))
        self.actions.append(action)
        step = self.answer(result.observation, result.reward, result.done)
        if step.done:
            self._close()
        return step

    async def _on_session(self, request: Callable[[], Awaitable] | None = None):
        """``request()`` on the episode's session, opened first when there is none; after a dropped
        connection (once per episode) on a new one."""
        while True:
            try:
                if self.client is None:
                    await self._open()
                return None if request is None else await request()
            except DROPPED as err:
                self._close()
                self.client = None
                if self.reconnected:
                    raise self._lost(err) from None
                self.reconnected = True
            except RuntimeError as err:
                if str(err).startswith("Server error"):  # the server's answer was an error frame
                    raise self._refused(err) from None
                raise

    async def _open(self) -> None:
        """A new session, reset and the episode's actions so far replayed on it."""
        # no message timeout of the client's own: rollout.environment_timeout_s bounds each call
        client = _session_client()(base_url=self.url, message_timeout_s=None)
        self.client = client
        self._close = weakref.finalize(self, _close_later, client, asyncio.get_running_loop())
        await client.connect()
        await client.reset(**self.arguments)
        for action in self.actions:
            await client.step(action)

    def _lost(self, err: BaseException) -> LmppoError:
        return LmppoError(
            f"rollout.environment openenv:{self.url}: the OpenEnv server at {self.url} does not answer "
            f"({type(err).__name__}: {err}), and did not after lmppo connected again once, on a new session. "
            f"Check that the server runs and is reachable at {self.url} (its log says why it stopped), then "
            "resume the run from its last checkpoint (lmppo ppo --resume RUN_DIR)"
        )

    def _refused(self, err: RuntimeError) -> LmppoError:
        capacity = "CAPACITY_REACHED" in str(err)
        fix = (
            "it serves fewer sessions than the live episodes: every episode of a batch holds one, so start "
            "it with max_concurrent_envs (create_app) at least rollout.batch_size and run.eval_batch_size"
            if capacity
            else "its log says more"
        )
        return LmppoError(f"rollout.environment openenv:{self.url}: the OpenEnv server refused: {err}; {fix}")


@functools.cache
def _session_client() -> type:
    """OpenEnv's generic client held to one server session. Where it would open a new connection by itself
    after its socket closed (a new session, where the episode was never reset) this one raises
    ``ConnectionError``, so lmppo replays the episode."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.protocol import State

    class SessionClient(GenericEnvClient):
        opened = False

        async def _connect_async(self):
            if self.opened and (self._ws is None or self._ws.state is not State.OPEN):
                raise ConnectionError("the episode's connection was closed")
            await super()._connect_async()
            self.opened = True
            return self

    return SessionClient


def _close_later(client, loop: asyncio.AbstractEventLoop) -> None:
    """Close ``client`` on ``loop`` (its own), from whatever thread: the socket is the loop's."""

    async def close() -> None:
        await client.close()

    if not loop.is_closed():
        asyncio.run_coroutine_threadsafe(close(), loop)


def _read_schemas(url: str) -> dict[str, Any]:
    """The server's ``/schema`` (its action and observation models), or an error naming ``url``."""
    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        with urllib.request.urlopen(f"{http}/schema", timeout=SCHEMA_TIMEOUT_S) as answer:
            return json.load(answer)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise LmppoError(
            f"rollout.environment openenv:{url}: no OpenEnv server answers at {url} ({http}/schema: {err}). "
            "Start the environment's server (e.g. `uvicorn server.app:app --port 8000` in its folder, or its "
            "Docker image) or fix the URL"
        ) from None


def _text_field(schema: dict[str, Any], alone: bool = False) -> str | None:
    """The model's one string field (its metadata aside), or None; ``alone``: no other field is required."""
    properties = {name: field for name, field in schema.get("properties", {}).items() if name != "metadata"}
    strings = [name for name, field in properties.items() if _is_string(field)]
    if len(strings) != 1 or (alone and not set(schema.get("required", [])) <= set(strings)):
        return None
    return strings[0]


def _is_string(field: dict[str, Any]) -> bool:
    return field.get("type") == "string" or any(_is_string(option) for option in field.get("anyOf", []))


# --------------------------------------------------------------------------------------------------
# A local Environment subclass, in-process
# --------------------------------------------------------------------------------------------------


def local_environment(spec: str) -> type[LocalEnvironment]:
    """The class of an OpenEnv ``Environment`` subclass ``spec`` names, its action and observation models
    read from the annotations of its ``step``."""
    from openenv.core.env_server import Action, Environment, Observation

    environment = load_function(spec, "rollout.environment", kind="Class")
    hints = _step_hints(environment)
    action, observation = hints.get("action"), hints.get("return")
    if not (
        isinstance(environment, type)
        and issubclass(environment, Environment)
        and _subclass(action, Action)
        and _subclass(observation, Observation)
    ):
        raise LmppoError(
            f"rollout.environment openenv:{spec} is not an OpenEnv Environment subclass whose step is "
            "annotated `def step(self, action: MyAction) -> MyObservation` (openenv.core.env_server's "
            "Environment, Action and Observation): name such a class, or a server's URL (openenv:http://...)"
        )
    return type(
        "OpenEnv",
        (LocalEnvironment,),
        {
            "name": spec,
            "environment_class": environment,
            "action_class": action,
            "action_field": _text_field(action.model_json_schema(), alone=True),
            "observation_field": _text_field(observation.model_json_schema()),
        },
    )


class LocalEnvironment(OpenEnvEnvironment):
    """An episode on an instance of ``environment_class`` of its own."""

    environment_class: ClassVar[type]
    action_class: ClassVar[type]

    def reset(self, row: dict[str, Any], seed: int) -> None:
        self.environment = self.environment_class()
        self._close = weakref.finalize(self, self.environment.close)
        self.environment.reset(**_accepted(self.environment.reset, self.reset_arguments(row, seed)))

    def step(self, text: str) -> Step:
        from openenv.core.env_server import serialize_observation

        result = serialize_observation(
            self.environment.step(self.action_class.model_validate(self.action(text)))
        )
        step = self.answer(result["observation"], result["reward"], result["done"])
        if step.done:
            self._close()
        return step


def _step_hints(environment: object) -> dict[str, Any]:
    """The annotations of ``environment.step``, resolved (none where they do not resolve)."""
    try:
        return typing.get_type_hints(environment.step)
    except (AttributeError, NameError, TypeError):
        return {}


def _accepted(function: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``arguments`` ``function`` takes (all with ``**kwargs``), as an OpenEnv server filters them."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return arguments
    return {name: value for name, value in arguments.items() if name in parameters}


def _subclass(cls: object, base: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, base)
