"""A calculator as an MCP server over stdio: the tools a policy may call, in a process of their own.

Name it in a config (paths relative to the directory you run lmppo from):

    rollout:
      tools: ["mcp:python examples/mcp_calculator/server.py"]

lmppo starts it once per process, lists its tools (their schemas come from the type hints and
docstrings) and answers the policy's calls through it (README.md: trying it by hand).
"""

import math

try:  # mcp 2
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1, where the server was called FastMCP
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

# WARNING: at INFO the SDK logs every failed call with a traceback.
server = MCPServer("calculator", log_level="WARNING")


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@server.tool()
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        # A ToolError's message is the answer the policy reads; other exceptions reach it as a bare
        # "Error executing tool divide".
        raise ToolError("cannot divide by zero")
    return a / b


@server.tool()
def sqrt(x: float) -> float:
    """The square root of a non-negative number."""
    if x < 0:
        raise ToolError(f"cannot take the square root of the negative number {x}")
    return math.sqrt(x)


if __name__ == "__main__":
    server.run()  # stdio: lmppo talks to it over its stdin and stdout
