"""``sandlot image``: the registry's environments and their offline-built images."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import console, errors_exit_2
from sandlot.config import get_settings
from sandlot.errors import SandboxError

image_app = typer.Typer(
    no_args_is_help=True, help="Environments (YAML registry) and their offline-built images."
)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")


@image_app.command("ls")
def image_ls() -> None:
    """List the registry's environments and whether each image is built and current."""
    from sandlot.backends.docker.images import image_status
    from sandlot.environments import load_registry

    settings = get_settings()
    table = Table("environment", "image", "packages", "built", "size_mb")
    for env in load_registry(settings.registry_dir).values():
        try:
            status = image_status(env)
            built = "yes" if status.current else ("stale" if status.present else "no")
            size = "" if status.size_mb is None else str(status.size_mb)
        except SandboxError as exc:
            built, size = f"? ({exc.code})", ""
        table.add_row(env.name, env.image, " ".join(env.packages), built, size)
    Console().print(table)


@image_app.command("build")
def image_build(
    names: Annotated[
        list[str] | None, typer.Argument(help="Environments to build (default: all).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if current.")] = False,
) -> None:
    """Build environment images offline: debootstrap from Debian's mirror, then docker import."""
    from sandlot.backends.docker.images import build_image
    from sandlot.environments import get_environment, load_registry

    settings = get_settings()
    with errors_exit_2():
        envs = (
            [get_environment(n, settings.registry_dir) for n in names]
            if names
            else list(load_registry(settings.registry_dir).values())
        )
        for env in envs:
            console.print(f"[bold]{env.name}[/]: {env.description}")
            build_image(env, settings.data_dir, force=force, progress=console.print)
