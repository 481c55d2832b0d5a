"""The ``sandlot`` command: one typer app, each group in its own module."""

from __future__ import annotations

import typer

from sandlot.cli import agent, image, keys, local, mcp, sandbox, serve, tools, volume
from sandlot.cli.common import errors_exit_2
from sandlot.config import get_settings
from sandlot.log import configure_logging

# Typer's --install-completion / --show-completion: completion is keyed to the name the
# command was started as, so `sandlot` and `agent-sandbox` each get their own.
app = typer.Typer(
    no_args_is_help=True,
    help="Isolated, stateful sandboxes for code that AI agents write.",
)


@app.callback()
def _main() -> None:
    with errors_exit_2():
        settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)


# Typer lists commands in the order they are registered, then the groups in theirs: this
# order gives doctor, run-code, exec, version, serve, run, benchmark; image, keys, sandbox,
# tools, models.
local.register(app)
serve.register(app)
mcp.register(app)
image.register(app)
keys.register(app)
sandbox.register(app)
tools.register(app, sandbox.sandbox_app)
volume.register(app)
agent.register(app)

__all__ = ["app"]
