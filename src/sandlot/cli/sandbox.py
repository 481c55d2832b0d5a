"""``sandlot sandbox``: sandboxes on a server, which outlive each command."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import DownloadColumn, Progress
from rich.table import Table

from sandlot.cli.common import (
    BackendOpt,
    EnvironmentOpt,
    JsonOpt,
    KeyOpt,
    MemoryOpt,
    NetworkOpt,
    RuntimeOpt,
    TimeoutOpt,
    UrlOpt,
    console,
    errors_exit_2,
    finish,
    print_json,
    remote_call,
    shown,
    visible,
)
from sandlot.cli.volume import VolumeOpt, parse_volumes
from sandlot.client import RemoteService
from sandlot.requests import RunCode, RunCommand, SandboxSpec, build

sandbox_app = typer.Typer(
    no_args_is_help=True,
    help="Sandboxes on a server (`sandlot serve`). Sandboxes outlive each command, so "
    "these need a server; `run-code` and `exec` above work embedded.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")


def _echo(stream: Any) -> Any:
    """The command's own output, written as it comes and verbatim, as `docker exec` passes
    it (see common.py: the user asked to run it; escaping would change what a pipe reads)."""

    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


@sandbox_app.command("create")
def sandbox_create(
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
    runtime: RuntimeOpt = None,
    environment: EnvironmentOpt = None,
    ttl_s: Annotated[float | None, typer.Option("--ttl-s", help="Lifetime.")] = None,
    volume: VolumeOpt = None,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Create a sandbox and print its id."""
    with errors_exit_2():
        volumes = parse_volumes(volume)
        spec = build(
            SandboxSpec,
            memory_mb=memory_mb,
            timeout_s=timeout_s,
            backend=backend,
            runtime=runtime,
            environment=environment,
            network=network,
            ttl_s=ttl_s,
            volumes=volumes,
        )
    info = remote_call(api_url, api_key, lambda s: s.create(spec))
    typer.echo(visible(info.id))  # the server's: plain, for `SB=$(...)`, but no escapes


@sandbox_app.command("ls")
def sandbox_ls(
    all_: Annotated[bool, typer.Option("--all", help="Include ended.")] = False,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List your sandboxes."""
    infos = remote_call(api_url, api_key, lambda s: s.list(include_ended=all_))
    if as_json:
        print_json([info.model_dump(mode="json") for info in infos])
        return
    table = Table("id", "status", "backend", "memory_mb", "owner", "expires in")
    now = time.time()
    for info in infos:
        left = f"{max(0, info.expires_at - now):.0f} s" if info.status == "running" else ""
        cells = (info.id, info.status, info.backend, info.limits.memory_mb, info.owner, left)
        table.add_row(*(shown(cell) for cell in cells))
    Console().print(table)


@sandbox_app.command("exec")
def sandbox_exec(
    sandbox_id: str,
    command: str,
    session: Annotated[str, typer.Option(help="Shell session.")] = "default",
    timeout_s: TimeoutOpt = None,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Run a shell command in a sandbox, streaming its output."""
    with errors_exit_2():
        request = build(RunCommand, command=command, session=session, timeout_s=timeout_s)
    result = remote_call(
        api_url,
        api_key,
        lambda s: s.run_command(
            sandbox_id,
            request,
            on_stdout=_echo(sys.stdout),
            on_stderr=_echo(sys.stderr),
        ),
    )
    raise typer.Exit(finish(result))


@sandbox_app.command("run-code")
def sandbox_run_code(
    sandbox_id: str,
    code: Annotated[str, typer.Argument(help="Python; '-' reads stdin.")],
    timeout_s: TimeoutOpt = None,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Run Python in a sandbox's persistent interpreter, streaming its output."""
    source = sys.stdin.read() if code == "-" else code
    with errors_exit_2():
        request = build(RunCode, code=source, timeout_s=timeout_s)
    result = remote_call(
        api_url,
        api_key,
        lambda s: s.run_code(
            sandbox_id,
            request,
            on_stdout=_echo(sys.stdout),
            on_stderr=_echo(sys.stderr),
        ),
    )
    raise typer.Exit(finish(result))


def _transfer(
    description: str, total: int | None, work: Any, api_url: str | None, api_key: str | None
) -> Any:
    with Progress(
        *Progress.get_default_columns(), DownloadColumn(), console=console, transient=True
    ) as progress:
        task = progress.add_task(description, total=total)
        return remote_call(api_url, api_key, lambda s: work(s, lambda n: progress.advance(task, n)))


@sandbox_app.command("upload")
def sandbox_upload(
    sandbox_id: str, local: Path, remote: str, api_url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """Upload a local file into the sandbox's /workspace (with progress)."""
    if not local.is_file():
        console.print(f"[red]{shown(local)} is not a file[/]")
        raise typer.Exit(2)
    size = _transfer(
        f"upload {shown(local.name)}",  # a progress description is markup too
        local.stat().st_size,
        lambda s, tick: s.upload(sandbox_id, remote, local, tick),
        api_url,
        api_key,
    )
    console.print(f"uploaded {shown(size)} bytes to /workspace/{shown(remote.lstrip('/'))}")


@sandbox_app.command("download")
def sandbox_download(
    sandbox_id: str, remote: str, local: Path, api_url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """Download a file from the sandbox's /workspace (with progress)."""
    size = _transfer(
        f"download {shown(remote)}",
        None,
        lambda s, tick: s.download(sandbox_id, remote, local, tick),
        api_url,
        api_key,
    )
    console.print(f"downloaded {shown(size)} bytes to {shown(local)}")


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str], api_url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Destroy sandboxes (their /workspace/artifacts are kept)."""

    async def destroy_all(service: RemoteService) -> None:
        for sandbox_id in sandbox_ids:
            await service.destroy(sandbox_id)
            console.print(f"destroyed {shown(sandbox_id)}")

    remote_call(api_url, api_key, destroy_all)
