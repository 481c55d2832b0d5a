"""sandlot as an MCP server: the tools that Claude Desktop, Claude Code, Cursor or any MCP
client call to run code in a sandbox without writing code against the SDK.

``sandlot mcp`` serves it over stdio on an embedded manager; ``sandlot serve`` mounts it at
``/mcp`` (streamable HTTP) as the API key's tenant. The MCP SDK is the optional ``mcp``
dependency: nothing here imports it until a server is built, so ``import sandlot`` never
needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandlot.errors import ConfigError
from sandlot.mcp.sessions import Binding, Resolver

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

    from sandlot.mcp.sessions import DefaultSandboxes
    from sandlot.tools import ToolRegistry

INSTALL_HINT = "pip install 'sandlot[mcp]'"


def build_server(
    resolve: Resolver, registry: ToolRegistry | None = None
) -> tuple[MCPServer[Any], DefaultSandboxes]:
    """The MCP server and the registry of its sessions' default sandboxes; close the
    registry (``await defaults.close()``) when the server stops. ``registry``: the tools it
    offers (default: ``SANDLOT_REGISTRY_DIR``'s).

    Raises:
        ConfigError: the MCP SDK is not installed.
    """
    try:
        from sandlot.mcp.tools import make_server
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "mcp":
            raise
        raise ConfigError(f"the MCP server needs the MCP SDK: {INSTALL_HINT}") from exc
    return make_server(resolve, registry)


__all__ = ["INSTALL_HINT", "Binding", "Resolver", "build_server"]
