"""A small MCP server for tests/test_mcp_tools.py: over stdio, or streamable HTTP with ``--port PORT``.

``--label`` does nothing: tests give it to start a server of their own (one spec, one server per process).
"""

import argparse
import os

import anyio

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    MCP_1 = False
except ImportError:  # mcp 1 (which openenv's fastmcp pins), where the server was called FastMCP
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

    MCP_1 = True

server = MCPServer("lmppo-test", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Fail on the server side with the message (a ToolError's message reaches the client)."""
    raise ToolError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then answer: a tool that overruns a timeout (async, so the server answers others meanwhile)."""
    await anyio.sleep(seconds)
    return "slept"


@server.tool()
def pid() -> int:
    """The server's process id: the tests kill it and check it is gone."""
    return os.getpid()


@server.tool()
def crash() -> str:
    """Exit the server process at once, mid-call."""
    os._exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, help="serve streamable HTTP on this port instead of stdio")
    parser.add_argument("--label")
    port = parser.parse_args().port
    if port is None:
        server.run()
    elif MCP_1:  # its run takes no port: the server's settings hold it
        server.settings.port = port
        server.run("streamable-http")
    else:
        server.run("streamable-http", port=port)
