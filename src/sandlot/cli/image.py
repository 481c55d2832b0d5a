"""``sandlot image``: the registry's environments and their offline-built images."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import JsonOpt, console, errors_exit_2, print_json
from sandlot.config import get_settings
from sandlot.errors import SandboxError

if TYPE_CHECKING:
    from sandlot.environments import Environment

image_app = typer.Typer(
    no_args_is_help=True, help="Environments (YAML registry) and their offline-built images."
)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")


@image_app.command("ls")
def image_ls(as_json: JsonOpt = False) -> None:
    """List the registry's environments and whether each image is built and current."""
    from sandlot.backends.docker.images import ImageStatus, image_status
    from sandlot.environments import load_registry

    settings = get_settings()
    found: list[tuple[Environment, ImageStatus | None, str | None]] = []
    for env in load_registry(settings.registry_dir).values():
        try:
            found.append((env, image_status(env), None))
        except SandboxError as exc:
            found.append((env, None, exc.code))
    if as_json:
        print_json(
            [
                {
                    "environment": env.name,
                    "image": env.image,
                    "packages": list(env.packages),
                    "present": None if status is None else status.present,
                    "current": None if status is None else status.current,
                    "size_mb": None if status is None else status.size_mb,
                    "error": error,  # the error's code where dockerd could not be asked
                }
                for env, status, error in found
            ]
        )
        return
    table = Table("environment", "image", "packages", "built", "size_mb")
    for env, status, error in found:
        if status is None:
            built, size = f"? ({error})", ""
        else:
            built = "yes" if status.current else ("stale" if status.present else "no")
            size = "" if status.size_mb is None else str(status.size_mb)
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
