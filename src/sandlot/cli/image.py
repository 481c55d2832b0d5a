"""``sandlot image``: the registry's environments, their root file system trees (bubblewrap)
and the docker images imported from those same trees."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import JsonOpt, console, errors_exit_2, print_json, shown
from sandlot.config import get_settings
from sandlot.errors import SandboxError

if TYPE_CHECKING:
    from sandlot.backends.docker.images import ImageStatus
    from sandlot.backends.rootfs import TreeStatus
    from sandlot.environments import Environment

image_app = typer.Typer(
    no_args_is_help=True,
    help="Environments (YAML registry), their root file system trees and docker images.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")


def _docker_statuses(envs: list[Environment]) -> tuple[list[ImageStatus | None], str | None]:
    """Every image's status from one daemon connection, or the error's code without one."""
    import contextlib

    from sandlot.backends.docker.dockerd import connect
    from sandlot.backends.docker.images import image_status

    try:
        with contextlib.closing(connect()) as client:
            return [image_status(env, client) for env in envs], None
    except SandboxError as exc:
        return [None for _ in envs], exc.code


def _row(env: Environment, tree: TreeStatus, image: ImageStatus | None) -> dict[str, Any]:
    from sandlot.backends.rootfs import bubblewrap_mode

    settings = get_settings()
    mode, _ = bubblewrap_mode(env, settings.rootfs_dir)
    return {
        "environment": env.name,
        "spec": env.spec_hash(),
        "packages": list(env.packages),
        "pip": list(env.pip),
        "tree": str(tree.path) if tree.present else None,
        "tree_build": tree.build_id,
        "tree_size_mb": tree.size_mb,
        "stale_trees": [str(p) for p in tree.stale],
        "bubblewrap": mode,  # "tree", "host" (the host's /usr) or "missing"
        "image": env.image,
        "image_present": None if image is None else image.present,
        "image_current": None if image is None else image.current,
        # The image holds the very tree bubblewrap binds (same build).
        "image_same_tree": None
        if image is None or not tree.present
        else image.tree_build == tree.build_id,
        "image_size_mb": None if image is None else image.size_mb,
    }


@image_app.command("ls")
@image_app.command("list")
def image_ls(as_json: JsonOpt = False) -> None:
    """List the environments: each one's tree (bubblewrap) and image (docker), built and
    current or not."""
    from sandlot.backends.rootfs import tree_status
    from sandlot.environments import load_registry

    settings = get_settings()
    envs = list(load_registry(settings.registry_dir).values())
    images, error = _docker_statuses(envs)
    rows = [
        _row(env, tree_status(env, settings.rootfs_dir), image)
        for env, image in zip(envs, images, strict=True)
    ]
    if as_json:
        for row in rows:
            row["docker_error"] = error  # the error's code where dockerd could not be asked
        print_json(rows)
        return
    table = Table("environment", "bubblewrap", "tree_mb", "image", "built", "image_mb", "packages")
    for row in rows:
        mode = {"tree": "tree", "host": "host /usr (no tree)", "missing": "no tree"}
        if row["image_present"] is None:
            built = f"? ({error})"
        elif not row["image_present"]:
            built = "no"
        elif not row["image_current"]:
            built = "stale"
        else:
            built = "yes" + (" (other tree build)" if row["image_same_tree"] is False else "")
        cells = (
            row["environment"],
            mode[row["bubblewrap"]],
            "" if row["tree_size_mb"] is None else str(row["tree_size_mb"]),
            row["image"],
            built,
            "" if row["image_size_mb"] is None else str(row["image_size_mb"]),
            " ".join(row["packages"] + [f"pip:{r}" for r in row["pip"]]),  # "pkg[extra]"
        )
        table.add_row(*(shown(cell) for cell in cells))
    Console().print(table)


@image_app.command("build")
def image_build(
    names: Annotated[
        list[str] | None, typer.Argument(help="Environments to build (default: all).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if current.")] = False,
    docker: Annotated[
        bool,
        typer.Option("--docker/--no-docker", help="Import the tree into docker when it runs."),
    ] = True,
) -> None:
    """Build each environment's root file system tree offline (debootstrap, pip), then import
    that same tree into docker when a daemon answers. Skipped where already current."""
    import contextlib

    from sandlot.backends.docker.dockerd import connect
    from sandlot.backends.docker.images import import_tree
    from sandlot.backends.rootfs import build_tree
    from sandlot.environments import get_environment, load_registry

    settings = get_settings()
    with errors_exit_2():
        envs = (
            [get_environment(n, settings.registry_dir) for n in names]
            if names
            else list(load_registry(settings.registry_dir).values())
        )
        client = None
        if docker:
            try:
                client = connect()
            except SandboxError as exc:
                console.print(f"no docker ({shown(exc.message)}): building trees only")
        with contextlib.ExitStack() as stack:
            if client is not None:
                stack.callback(client.close)
            for env in envs:
                console.print(f"[bold]{shown(env.name)}[/]: {shown(env.description)}")
                debs = settings.data_dir / "build" / "debs"
                tree = build_tree(env, settings.rootfs_dir, debs, force=force, progress=_say)
                if client is not None:
                    import_tree(env, tree, settings.data_dir, client, progress=_say)


def _say(line: str) -> None:
    """A build's progress line (a command line, a path, "pip:pkg[extra]"): shown, not read
    as Rich markup."""
    console.print(shown(line))
