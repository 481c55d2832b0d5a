"""``sandlot volume``: a tenant's named volumes on a server (``/v1/volumes``), and the
``--volume`` option of ``sandlot sandbox create`` that attaches them."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import (
    JsonOpt,
    KeyOpt,
    UrlOpt,
    errors_exit_2,
    print_json,
    remote_call,
    shown,
)
from sandlot.errors import ConfigError
from sandlot.models import VolumeInfo, VolumeMount
from sandlot.requests import CreateVolume, build

volume_app = typer.Typer(
    no_args_is_help=True,
    help="Named volumes: files that outlive sandboxes (one sandbox at a time each).",
)

VolumeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--volume",
        "-v",
        help="Attach a named volume: NAME:PATH[:ro], PATH under /workspace (repeatable).",
    ),
]


def register(app: typer.Typer) -> None:
    app.add_typer(volume_app, name="volume")


def parse_volumes(given: list[str] | None) -> list[VolumeMount] | None:
    """``--volume NAME:PATH[:ro]`` options as mounts.

    Raises:
        ConfigError: an option not of that form (the message names --volume).
    """
    if not given:
        return None
    mounts = []
    for text in given:
        name, _, rest = text.partition(":")
        path, _, flag = rest.partition(":")
        if not name or not path or flag not in ("", "ro", "rw"):
            raise ConfigError(f"--volume {text!r}: give NAME:PATH or NAME:PATH:ro")
        try:
            mounts.append(VolumeMount(name=name, mount_path=path, read_only=flag == "ro"))
        except ValueError as exc:
            raise ConfigError(f"--volume {text!r}: {exc}") from None
    return mounts


@volume_app.command("create")
def volume_create(
    name: str,
    size_mb: Annotated[int, typer.Option("--size-mb", help="Its cap (MiB).")] = 256,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make an empty volume (prints its name)."""
    with errors_exit_2():
        request = build(CreateVolume, name=name, size_mb=size_mb)
    info = remote_call(api_url, api_key, lambda s: s.create_volume(request))
    if as_json:
        print_json(info.model_dump(mode="json"))
        return
    typer.echo(shown(info.name))


@volume_app.command("get")
def volume_get(
    name: str, api_url: UrlOpt = None, api_key: KeyOpt = None, as_json: JsonOpt = False
) -> None:
    """One volume: its size, what it uses, whether a sandbox has it."""
    info = remote_call(api_url, api_key, lambda s: s.get_volume(name))
    if as_json:
        print_json(info.model_dump(mode="json"))
        return
    _table([info])


@volume_app.command("ls")
def volume_ls(api_url: UrlOpt = None, api_key: KeyOpt = None, as_json: JsonOpt = False) -> None:
    """List your volumes."""
    infos = remote_call(api_url, api_key, lambda s: s.list_volumes())
    if as_json:
        print_json([info.model_dump(mode="json") for info in infos])
        return
    _table(infos)


def _table(infos: list[VolumeInfo]) -> None:
    table = Table("name", "size_mb", "used_mb", "attached", "age")
    now = time.time()
    for info in infos:
        used = f"{info.used_bytes / (1024 * 1024):.1f}"
        age = f"{max(0, now - info.created_at):.0f} s"
        cells = (info.name, info.size_mb, used, "yes" if info.attached else "no", age)
        table.add_row(*(shown(cell) for cell in cells))
    Console().print(table)


@volume_app.command("rm")
def volume_rm(name: str, api_url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Delete a volume and every file on it (refused while a sandbox has it)."""
    remote_call(api_url, api_key, lambda s: s.delete_volume(name))
    typer.echo(shown(name))
