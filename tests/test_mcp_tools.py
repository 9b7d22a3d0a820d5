"""MCP servers as tool sources (lmppo.sampling.mcp_tools), against real servers: tests/mcp_server.py run as
a subprocess, over stdio and over streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from lmppo.errors import LmppoError  # noqa: E402
from lmppo.sampling.mcp_tools import McpToolError, _answer, mcp_source  # noqa: E402

SERVER = Path(__file__).parent / "mcp_server.py"
EXAMPLE = Path(__file__).parents[1] / "examples" / "mcp_calculator" / "server.py"


def stdio_spec(label: str) -> str:
    """A spec of the test server; each label is a server of its own (one spec, one server per process)."""
    return "mcp:" + shlex.join([sys.executable, str(SERVER), "--label", label])


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody has reaped yet is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, its stat was read
        return False
    return state not in ("Z", "X")


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


@pytest.fixture(scope="module")
def calculator():
    source = mcp_source(stdio_spec("shared"), timeout_s=1.0)
    yield source
    source.close()


def test_the_servers_tools_are_listed_as_function_schemas(calculator):
    schemas = {schema["function"]["name"]: schema for schema in calculator.schemas()}
    assert set(schemas) == {"add", "fail", "sleep", "pid", "crash"}
    assert schemas["add"] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"title": "A", "type": "integer"},
                    "b": {"title": "B", "type": "integer"},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_a_call_is_answered_and_the_same_spec_is_the_same_running_server(calculator):
    assert calculator.call("add", {"a": 2, "b": 3}) == "5"
    assert mcp_source(stdio_spec("shared"), timeout_s=1.0) is calculator


def test_many_threads_call_at_once(calculator):
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: calculator.call("add", {"a": i, "b": 1}), range(64)))
    assert answers == [str(i + 1) for i in range(64)]


def test_acall_answers_on_the_callers_loop(calculator):
    assert asyncio.run(calculator.acall("add", {"a": 1, "b": 1})) == "2"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("fail", {"message": "no such city"}, "no such city"),  # the tool raised on the server
        ("add", {"a": "x", "b": 1}, "validation error"),  # arguments the server refuses
        ("divide", {}, "Unknown tool"),
    ],
)
def test_a_failed_call_raises_with_the_servers_message_and_the_client_goes_on(
    calculator, name, arguments, message
):
    with pytest.raises(McpToolError, match=message):
        calculator.call(name, arguments)
    assert calculator.call("add", {"a": 1, "b": 2}) == "3"


def test_a_call_that_overruns_its_timeout_fails_and_the_next_is_answered(calculator):
    start = time.monotonic()
    with pytest.raises(McpToolError, match="'sleep' did not answer within 1 s"):
        calculator.call("sleep", {"seconds": 30})
    assert time.monotonic() - start < 3
    assert calculator.call("add", {"a": 1, "b": 2}) == "3"


def test_a_dead_server_is_restarted_once_then_a_second_death_stops_the_run():
    source = mcp_source(stdio_spec("restart"), timeout_s=5.0)
    try:
        first = int(source.call("pid", {}))
        os.kill(first, signal.SIGKILL)
        assert gone(first)
        assert source.call("add", {"a": 1, "b": 2}) == "3"  # restarted by this call, which is retried
        second = int(source.call("pid", {}))
        assert second != first
        with pytest.raises(LmppoError, match="died twice .* during a call of 'crash'"):
            source.call("crash", {})
        assert gone(second)
    finally:
        source.close()


def test_the_example_calculator_server():
    calculator = mcp_source("mcp:" + shlex.join([sys.executable, str(EXAMPLE)]), timeout_s=5.0)
    try:
        assert [schema["function"]["name"] for schema in calculator.schemas()] == [
            "add",
            "multiply",
            "divide",
            "sqrt",
        ]
        assert calculator.call("divide", {"a": 1, "b": 4}) == "0.25"
        with pytest.raises(McpToolError, match="cannot divide by zero"):
            calculator.call("divide", {"a": 1, "b": 0})
    finally:
        calculator.close()


def test_close_stops_the_server_and_a_new_request_starts_another():
    source = mcp_source(stdio_spec("close"), timeout_s=5.0)
    pid = int(source.call("pid", {}))
    source.close()
    source.close()  # a second close does nothing
    assert gone(pid, within_s=0)
    again = mcp_source(stdio_spec("close"), timeout_s=5.0)
    try:
        assert again is not source and int(again.call("pid", {})) != pid
    finally:
        again.close()


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("no-such-mcp-server --stdio", "the command 'no-such-mcp-server' cannot be run .* on PATH"),
        (
            shlex.join([sys.executable, "-c", "import sys; sys.exit('config.toml is missing')"]),
            "it exited or broke the protocol(.|\n)*config.toml is missing",
        ),
        (
            shlex.join([sys.executable, "-c", "import time; time.sleep(30)"]),
            "it did not complete the MCP handshake within 0.5 s; is it an MCP server on stdin/stdout",
        ),
    ],
    ids=["missing", "exits", "silent"],
)
def test_a_server_that_does_not_start_is_a_clear_error_at_once(command, message):
    start = time.monotonic()
    with pytest.raises(LmppoError, match=f"the MCP server .* did not start: {message}"):
        mcp_source(f"mcp:{command}", timeout_s=1.0, start_timeout_s=0.5)
    assert time.monotonic() - start < 5  # the silent one: the handshake's 0.5 s and the SDK's 2 s of grace


def test_a_url_nobody_answers_is_a_clear_start_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"  # bound, not listening: refused
        with pytest.raises(LmppoError, match="did not start: the URL did not answer as an MCP server"):
            mcp_source(url, timeout_s=1.0)


@pytest.mark.parametrize("spec", ["mcp:", "mcp:python 'server.py", "server.py"])
def test_a_spec_that_names_no_server_is_a_clear_error(spec):
    with pytest.raises(LmppoError, match="is not an MCP server; name one as 'mcp:<command line>'"):
        mcp_source(spec, timeout_s=1.0)


def test_an_answer_is_its_text_content_with_other_content_as_placeholders():
    from mcp.types import CallToolResult

    def result(**fields):  # the wire's camelCase names: mcp 1.x and 2.x name the Python fields differently
        return CallToolResult.model_validate(fields)

    image = {"type": "image", "data": "aGk=", "mimeType": "image/png"}
    drawn = result(content=[{"type": "text", "text": "a cat"}, image])
    assert _answer("draw", drawn) == "a cat\n[image content: image/png]"
    assert _answer("count", result(content=[], structuredContent={"n": 3})) == '{"n": 3}'
    with pytest.raises(McpToolError, match="the tool 'draw' failed without a message"):
        _answer("draw", result(content=[], isError=True))


def test_without_the_sdk_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp raises ImportError
    with pytest.raises(
        LmppoError, match=r"the MCP SDK is not installed here; install it with `pip install 'lmppo\[mcp\]'`"
    ):
        mcp_source("mcp:python server.py", timeout_s=1.0)


OWNER = """
import os, sys, time
from lmppo.sampling.mcp_tools import mcp_source
source = mcp_source(sys.argv[1], timeout_s=5.0)
print(source.call("pid", {}), flush=True)
if sys.argv[2] == "error":
    raise RuntimeError("the run failed")
time.sleep(60)
"""


@pytest.mark.parametrize("ending", ["error", "ctrl-c", pytest.param("sigkill", marks=pytest.mark.slow)])
def test_the_server_stops_with_the_process_that_started_it(ending):
    """On an error and on Ctrl-C, at exit; killed outright, the server reads its stdin's end."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, stdio_spec(ending), ending], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(owner.stdout.readline())
        if ending != "error":
            owner.send_signal(signal.SIGINT if ending == "ctrl-c" else signal.SIGKILL)
        exit_code = {"error": 1, "ctrl-c": -signal.SIGINT, "sigkill": -signal.SIGKILL}[ending]
        assert owner.wait(timeout=20) == exit_code  # it ended as the test meant it to
        assert gone(pid)
    finally:
        owner.kill()


@pytest.fixture
def http_server():
    """The test server over streamable HTTP on a free port, up: its URL and process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, (
                "the HTTP test server did not start"
            )
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/mcp", process
    process.kill()
    process.wait()


def test_a_server_over_streamable_http(http_server):
    url, process = http_server
    source = mcp_source(url, timeout_s=1.0)
    try:
        assert "add" in {schema["function"]["name"] for schema in source.schemas()}
        assert source.call("add", {"a": 20, "b": 22}) == "42"
        with pytest.raises(McpToolError, match="no such city"):
            source.call("fail", {"message": "no such city"})
        with pytest.raises(McpToolError, match="did not answer within 1 s"):
            source.call("sleep", {"seconds": 30})
        process.kill()
        process.wait()
        with pytest.raises(LmppoError, match="died, and its restart failed: the URL did not answer"):
            source.call("add", {"a": 1, "b": 2})
    finally:
        source.close()


def test_a_server_answers_an_episodes_calls_and_a_second_death_stops_the_episodes(tmp_path):
    """The run's path: rollout.tools naming the server, episodes answered from its toolbox; killed between two
    batches it is restarted once; killed again, the next batch stops with the clear error."""
    from test_tools import scripted_tool_episodes

    from lmppo.sampling.tools import open_toolbox
    from lmppo.toy.tokenizer import tools_tokenizer

    tokenizer = tools_tokenizer(["what is 2 plus 3?", "5", "2 plus 3 is 5."])
    toolbox = open_toolbox([stdio_spec("episodes")], timeout_s=5.0)
    episodes = scripted_tool_episodes(toolbox, tokenizer)
    try:
        for _ in range(2):  # the first death is survived, the second is not
            rollout = episodes.generate(["what is 2 plus 3?"] * 4, policy_version=0)
            assert rollout.episode.counts["tool_failures"].tolist() == [0] * 4
            context = [text for text, is_action in rollout.episode.transcripts[0] if not is_action]
            assert context[0].startswith("\n<|im_start|>tool\n5")  # the server's answer
            os.kill(int(toolbox.call("pid", {})[0]), signal.SIGKILL)
        with pytest.raises(LmppoError, match="died twice"):
            episodes.generate(["what is 2 plus 3?"] * 4, policy_version=0)
    finally:
        episodes.close()
        toolbox.close()
