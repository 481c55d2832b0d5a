"""``sandlot serve``: the REST + WebSocket server."""

from __future__ import annotations

from typing import Annotated

import typer

from sandlot.cli.common import console
from sandlot.config import get_settings


def register(app: typer.Typer) -> None:
    app.command()(serve)


def serve(
    host: Annotated[str | None, typer.Option(help="Default: API_HOST (127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Default: API_PORT (8000).")] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="No API keys: local single-user use only.")
    ] = False,
    workers: Annotated[int | None, typer.Option(help="Must be 1 (see API_WORKERS).")] = None,
) -> None:
    """Run the REST + WebSocket server."""
    from sandlot.server.run import serve as run_server

    updates: dict[str, object] = {}
    if host is not None:
        updates["api_host"] = host
    if port is not None:
        updates["api_port"] = port
    if no_auth:
        updates["auth_enabled"] = False
    if workers is not None and workers != 1:
        console.print(
            "[red]--workers must be 1:[/] sandboxes live in the server process that created "
            "them; run more servers, each with its own SANDLOT_DATA_DIR, to scale out"
        )
        raise typer.Exit(2)
    run_server(get_settings().model_copy(update=updates))
