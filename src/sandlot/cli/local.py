"""Commands that need no server: ``doctor``, ``run-code``, ``exec`` and ``version``."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import (
    BackendOpt,
    EnvironmentOpt,
    JsonOpt,
    MemoryOpt,
    NetworkOpt,
    RuntimeOpt,
    TimeoutOpt,
    console,
    errors_exit_2,
    print_json,
    print_result,
    shown,
)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command("run-code")(run_code)
    app.command("exec")(exec_command)
    app.command()(version)


def doctor(as_json: JsonOpt = False) -> None:
    """Report which isolation features this host supports, and why each matters."""
    from sandlot.doctor import run_checks

    checks = run_checks(optional=True)
    usable = all(c.ok for c in checks if c.required)
    if as_json:
        print_json({"ok": usable, "checks": [asdict(check) for check in checks]})
        if not usable:
            raise typer.Exit(1)
        return
    table = Table(title="sandlot doctor")
    for column in ("check", "status", "detail", "why it matters"):
        table.add_column(column, overflow="fold")
    for check in checks:
        status = (
            "[green]ok[/]"
            if check.ok
            else ("[red]MISSING[/]" if check.required else "[yellow]off[/]")
        )
        table.add_row(shown(check.name), status, shown(check.detail), shown(check.why))
    Console().print(table)
    if not usable:
        console.print("[red]The bubblewrap backend cannot run here; fix the MISSING rows.[/]")
        raise typer.Exit(1)


def _one_shot(
    kind: str,
    source: str,
    memory_mb: int | None,
    timeout_s: float | None,
    network: bool,
    placement: tuple[str | None, str | None, str | None],
) -> None:
    from sandlot.sandbox import Sandbox

    backend, runtime, environment = placement
    with (
        errors_exit_2(),
        Sandbox.create(
            memory_mb=memory_mb,
            timeout_s=timeout_s,
            network=network,
            backend=backend,
            runtime=runtime,
            environment=environment,
        ) as sb,
    ):
        result = sb.run_code(source) if kind == "code" else sb.commands.run(source)
    raise typer.Exit(print_result(result))


def run_code(
    code: Annotated[str, typer.Argument(help="Python source; '-' reads stdin.")],
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
    runtime: RuntimeOpt = None,
    environment: EnvironmentOpt = None,
) -> None:
    """Run Python in a fresh sandbox and print what it printed (exit status follows it)."""
    source = sys.stdin.read() if code == "-" else code
    _one_shot("code", source, memory_mb, timeout_s, network, (backend, runtime, environment))


def exec_command(
    command: Annotated[str, typer.Argument(help="A bash command line.")],
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
    runtime: RuntimeOpt = None,
    environment: EnvironmentOpt = None,
) -> None:
    """Run a shell command in a fresh sandbox (exit status follows it)."""
    _one_shot("shell", command, memory_mb, timeout_s, network, (backend, runtime, environment))


def version() -> None:
    """Print the version."""
    from sandlot._version import __version__

    typer.echo(__version__)
