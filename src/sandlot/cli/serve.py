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
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            # Rich renders the help: an unescaped [ray] is markup and would vanish.
            help="Place sandboxes on this Ray cluster's nodes (e.g. auto, 10.0.0.1:6379; "
            r"default: SANDLOT_RAY_ADDRESS). Needs the \[ray] extra.",
        ),
    ] = None,
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
    if ray is not None:
        updates["ray_address"] = ray
    if workers is not None and workers != 1:
        console.print(
            "[red]--workers must be 1:[/] sandboxes live in the server process that created "
            "them; to scale out, serve a Ray cluster (--ray) from as many servers as you like"
        )
        raise typer.Exit(2)
    run_server(get_settings().model_copy(update=updates))
