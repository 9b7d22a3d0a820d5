"""MCP servers as tool sources: ``rollout.tools`` entries ``mcp:<command line>`` (a server over stdio) and
``http(s)://`` URLs (streamable HTTP), on the official ``mcp`` SDK (``pip install 'lmppo[mcp]'``).

A server is started once per process (:func:`mcp_source` gives the same source for the same spec) and its
client runs on an event loop of its own in a daemon thread: ``call`` is a thread-safe synchronous wrapper,
so the environment's worker threads call it concurrently over one connection (``acall`` for a caller on
another loop). Its ``list_tools`` gives OpenAI-style function schemas; a call's text content is its answer.

A call fails (raises :class:`McpToolError`, which the toolbox answers as a failed call, and the run goes on)
when the tool errs on the server, when the server refuses the call, or after ``timeout_s``. A server that
dies is restarted once, by the next call, which is retried; a second death, or a server that does not
start, is an :class:`~lmppo.errors.LmppoError` that stops the run. The server is stopped by ``close()``, at
exit (also after Ctrl-C or an error), and a stdio server exits by itself when its stdin closes with a
process killed outright.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shlex
import tempfile
import threading
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import Any

from lmppo.errors import LmppoError

START_TIMEOUT_S = 60.0  # a start and handshake: `npx -y some-server` may download the server first
CLOSE_TIMEOUT_S = 15.0  # the SDK closes stdin, waits 2 s, then SIGTERMs and SIGKILLs the process tree
STDERR_TAIL_BYTES = 2000  # of a stdio server's stderr, shown when it fails to start or dies


class McpToolError(Exception):
    """A call that failed: the tool erred, the server refused the call or it ran out of time. Its message
    is what the policy reads."""


@dataclass(frozen=True)
class _Connection:
    """One running server (or HTTP session) and its client: ``task`` holds it open until cancelled."""

    session: Any  # mcp.ClientSession
    schemas: list[dict]
    task: asyncio.Task


_sources: dict[str, McpSource] = {}
_sources_lock = threading.Lock()


def mcp_source(spec: str, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S) -> McpSource:
    """The tool source of the MCP server ``spec`` names, started on its first request in this process (a
    later request gets it as made then); ``timeout_s`` bounds each call, ``start_timeout_s`` a start (or
    restart) and its handshake."""
    with _sources_lock:
        if spec not in _sources:
            _sources[spec] = McpSource(spec, timeout_s, start_timeout_s)
        return _sources[spec]


class McpSource:
    """The tools of one MCP server: ``schemas``, ``call`` (from any thread), ``acall``, ``close``."""

    def __init__(self, spec: str, timeout_s: float, start_timeout_s: float) -> None:
        _require_sdk(spec)
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        self.command = _command(spec)  # None for a URL
        # The server's log goes to a file, not the console: SDK servers log each failed call with a
        # traceback. Its tail is shown when the server fails to start or dies.
        self._stderr = tempfile.TemporaryFile() if self.command else None
        self._restarted = self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lmppo {spec}", daemon=True)
        self._thread.start()
        self._restart_lock = asyncio.Lock()
        try:
            self._connection = self._run(self._open())
        except BaseException:  # a failed start, or Ctrl-C during it: no server is left running
            self._stop()
            raise
        atexit.register(self.close)

    def schemas(self) -> list[dict]:
        """The server's tools as OpenAI-style function schemas."""
        return list(self._connection.schemas)

    def call(self, name: str, arguments: dict) -> str:
        """The answer of tool ``name``; raises :class:`McpToolError` for a failed call."""
        return self._run(self._call(name, arguments))

    async def acall(self, name: str, arguments: dict) -> str:
        """:meth:`call` for a coroutine on another event loop."""
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        )

    def close(self) -> None:
        """Stop the server (a stdio one's process tree) and the client's thread; a second close does nothing."""
        with _sources_lock:
            if _sources.get(self.spec) is self:
                del _sources[self.spec]
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop()

    def _run(self, coroutine, timeout: float | None = None):
        """Run ``coroutine`` on the client's loop and wait for it (its own timeouts bound it)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _stop(self) -> None:
        """Cancel what runs on the loop (the connection, calls in flight), then stop the loop."""
        with suppress(TimeoutError):
            self._run(_cancel_tasks(), timeout=CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        if self._stderr:
            self._stderr.close()

    # ----------------------------------------------------------------------------------------------
    # On the client's loop
    # ----------------------------------------------------------------------------------------------

    async def _call(self, name: str, arguments: dict) -> str:
        while True:
            connection = self._connection
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await _while_open(connection, connection.session.call_tool(name, arguments))
            except TimeoutError:
                raise McpToolError(f"the tool {name!r} did not answer within {self.timeout_s:g} s") from None
            except Exception as err:
                if await self._alive(connection):  # the server refused this call
                    raise McpToolError(str(_leaf(err)) or type(_leaf(err)).__name__) from None
                await self._restart(connection, name)  # then retry the call
                continue
            return _answer(name, result)

    async def _alive(self, connection: _Connection) -> bool:
        """Whether the server still answers: a failed call is the server's answer or its death."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await _while_open(connection, connection.session.send_ping())
        except Exception:
            return False
        return True

    async def _restart(self, dead: _Connection, name: str) -> None:
        """Replace the dead connection, once per source; concurrent calls that saw it die restart it once."""
        async with self._restart_lock:
            if self._connection is not dead:
                return
            if self._closed:
                raise McpToolError(f"the MCP server {self.spec!r} was closed")
            if self._restarted:
                raise self._died_twice(name)
            self._restarted = True
            await _shut(dead)
            self._connection = await self._open()

    async def _open(self) -> _Connection:
        """Start the server (or connect to the URL) and list its tools, within ``start_timeout_s``."""
        opened = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._hold(opened))
        done, _ = await asyncio.wait([opened], timeout=self.start_timeout_s)
        if opened in done and opened.exception() is None:
            session, schemas = opened.result()
            return _Connection(session, schemas, task)
        task.cancel()  # a stdio_client cancelled mid-start still stops its process
        with suppress(BaseException):
            await task
        if opened in done:
            raise self._start_error(_leaf(opened.exception()))
        raise self._start_error(None)

    async def _hold(self, opened: asyncio.Future) -> None:
        """Open the connection, report it through ``opened``, and hold it until cancelled: the SDK's
        contexts must be entered and left in one task."""
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                listing = await session.list_tools()
                opened.set_result((session, [_function_schema(tool) for tool in listing.tools]))
                await asyncio.Event().wait()
        except Exception as err:  # once started, a broken connection shows in the next call instead
            if not opened.done():
                opened.set_exception(err)

    def _transport(self):
        if self.command is None:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.spec)
        from mcp import StdioServerParameters, stdio_client

        # The server sees this process's environment (API keys, PYTHONPATH), not the SDK's short list.
        server = StdioServerParameters(command=self.command[0], args=self.command[1:], env=dict(os.environ))
        return stdio_client(server, errlog=self._stderr)

    # ----------------------------------------------------------------------------------------------
    # Messages
    # ----------------------------------------------------------------------------------------------

    def _start_error(self, err: BaseException | None) -> LmppoError:
        if isinstance(err, FileNotFoundError | PermissionError):
            why = f"the command {self.command[0]!r} cannot be run ({err.strerror}); is it installed and on PATH?"
        elif err is None:
            kind = (
                "an MCP server on stdin/stdout"
                if self.command
                else "an MCP server's streamable-HTTP endpoint"
            )
            why = f"it did not complete the MCP handshake within {self.start_timeout_s:g} s; is it {kind}?"
        elif self.command:
            why = f"it exited or broke the protocol during the handshake ({_describe(err)})"
        else:
            why = f"the URL did not answer as an MCP server ({_describe(err)}); is the server up at that address?"
        what = "died, and its restart failed" if self._restarted else "did not start"
        return LmppoError(
            f"rollout.tools: the MCP server {self.spec!r} {what}: {why}{self._stderr_tail()}\n"
            "Run the server's command (or check its URL) by hand to see it work, or remove it from "
            "rollout.tools."
        )

    def _died_twice(self, name: str) -> LmppoError:
        return LmppoError(
            f"rollout.tools: the MCP server {self.spec!r} died twice (it was restarted once; it died again "
            f"during a call of {name!r}), so the run stops.{self._stderr_tail()}\n"
            "Fix what makes it exit (run it by hand to see), or remove it from rollout.tools."
        )

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        # pread leaves the shared file offset where the server's writes go
        tail = os.pread(fd, STDERR_TAIL_BYTES, max(0, size - STDERR_TAIL_BYTES)).decode(errors="replace")
        return (
            f"\n--- the end of its stderr ---\n{tail.rstrip()}" if tail.strip() else " (its stderr is empty)"
        )


async def _cancel_tasks() -> None:
    """Cancel every other task on this loop and wait for them (a held connection stops its server)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def _while_open(connection: _Connection, request) -> Any:
    """``request``'s result, or ConnectionError when the connection ends first: on mcp 1.x a request whose
    HTTP transport broke waits forever (the session's "connection closed" answer is cancelled with it)."""
    answer = asyncio.ensure_future(request)
    try:
        await asyncio.wait({answer, connection.task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            raise ConnectionError("the connection to the MCP server closed")
        return answer.result()
    finally:
        answer.cancel()  # a no-op once it is done; else (closed, timed out) nobody waits for it


async def _shut(connection: _Connection) -> None:
    """Close a connection: cancelling its task leaves the SDK's contexts, which stop a stdio server."""
    connection.task.cancel()
    with suppress(BaseException):
        await connection.task


def _answer(name: str, result) -> str:
    """A ``CallToolResult``'s text (non-text content as a placeholder); raises for one marked an error."""
    fields = result.model_dump(by_alias=True, exclude_none=True)  # the wire's names in every SDK version
    parts = [_content_text(content) for content in fields.get("content", [])]
    if not parts and "structuredContent" in fields:
        parts = [json.dumps(fields["structuredContent"])]
    text = "\n".join(parts)
    if fields.get("isError"):
        raise McpToolError(text or f"the tool {name!r} failed without a message")
    return text


def _content_text(content: dict) -> str:
    kind = content.get("type")
    if kind == "text":
        return content["text"]
    if kind == "resource" and "text" in content["resource"]:
        return content["resource"]["text"]
    what = content.get("mimeType") or content.get("uri") or content.get("resource", {}).get("uri")
    return f"[{kind} content: {what}]" if what else f"[{kind} content]"


def _function_schema(tool) -> dict:
    """An MCP tool as an OpenAI-style function schema (what chat templates' ``tools=`` take)."""
    fields = tool.model_dump(by_alias=True, exclude_none=True)
    parameters = dict(fields.get("inputSchema") or {"type": "object", "properties": {}})
    parameters.pop("title", None)  # pydantic's model name ("addArguments"): noise in the prompt
    description = fields.get("description") or fields.get("title", "")
    return {
        "type": "function",
        "function": {"name": fields["name"], "description": description, "parameters": parameters},
    }


def _command(spec: str) -> list[str] | None:
    """``mcp:<command line>``'s words; None for an http(s) URL."""
    if spec.startswith(("http://", "https://")):
        return None
    try:
        words = shlex.split(spec.removeprefix("mcp:")) if spec.startswith("mcp:") else []
    except ValueError:  # an unclosed quote
        words = []
    if not words:
        raise LmppoError(
            f"rollout.tools: {spec!r} is not an MCP server; name one as 'mcp:<command line>' (a server over "
            "stdio, quotes closed, e.g. 'mcp:python examples/mcp_calculator/server.py') or as its http(s):// URL."
        )
    return words


def _require_sdk(spec: str) -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise LmppoError(
            f"rollout.tools names the MCP server {spec!r}, but the MCP SDK is not installed here; "
            "install it with `pip install 'lmppo[mcp]'`, or remove the server from rollout.tools."
        ) from None


def _leaf(err: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the one that says what went wrong."""
    while isinstance(err, BaseExceptionGroup):
        err = err.exceptions[0]
    return err


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
