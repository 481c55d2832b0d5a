"""``sandlot mcp``: the MCP server on stdio, for Claude Desktop, Claude Code, Cursor and
other MCP clients that start their servers as a command.

stdout is the protocol: every log line goes to stderr (``log.configure_logging`` and the MCP
SDK's own handler both write there).
"""

from __future__ import annotations

import asyncio
from typing import Any

import typer

from sandlot.cli.common import console, errors_exit_2
from sandlot.config import get_settings
from sandlot.core import SandboxManager


def register(app: typer.Typer) -> None:
    app.command("mcp")(mcp)


def mcp() -> None:
    """Serve the MCP tools on stdin/stdout, with sandboxes on this machine
    (configured like the SDK: SANDLOT_DATA_DIR, SANDBOX_BACKEND, ...)."""
    with errors_exit_2():
        asyncio.run(_serve())
    console.print("mcp: the client closed the session", style="dim")


async def _serve() -> None:
    from sandlot.mcp import Binding, build_server

    async with SandboxManager(get_settings()) as manager:
        # One process is one session: its sandboxes are the local user's.
        binding = Binding(service=manager, caller="local")

        def resolve(_request: Any) -> Binding:
            return binding

        server, defaults = build_server(resolve)
        try:
            await server.run_stdio_async()
        finally:
            await defaults.close()
