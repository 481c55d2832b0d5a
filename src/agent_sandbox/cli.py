"""The ``agent-sandbox`` command."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from agent_sandbox.config import get_settings
from agent_sandbox.errors import SandboxError
from agent_sandbox.log import configure_logging
from agent_sandbox.models import ExecResult

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Isolated, stateful sandboxes for code that AI agents write.",
)
console = Console(stderr=True)

MemoryOpt = Annotated[int | None, typer.Option("--memory-mb", help="Memory limit (MiB).")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout-s", help="Per-call timeout.")]
NetworkOpt = Annotated[bool, typer.Option("--network/--no-network", help="Allow network.")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="bubblewrap | unsafe-local")]


@app.callback()
def _main() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)


@app.command()
def doctor() -> None:
    """Report which isolation features this host supports, and why each matters."""
    from agent_sandbox.doctor import run_checks

    checks = run_checks()
    table = Table(title="agent-sandbox doctor")
    for column in ("check", "status", "detail", "why it matters"):
        table.add_column(column, overflow="fold")
    for check in checks:
        status = (
            "[green]ok[/]"
            if check.ok
            else ("[red]MISSING[/]" if check.required else "[yellow]off[/]")
        )
        table.add_row(check.name, status, check.detail, check.why)
    Console().print(table)
    if not all(c.ok for c in checks if c.required):
        console.print("[red]The bubblewrap backend cannot run here; fix the MISSING rows.[/]")
        raise typer.Exit(1)


def _print_result(result: ExecResult) -> int:
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.text is not None:
        sys.stdout.write(result.text + "\n")
    if result.error is not None:
        sys.stderr.write(result.error.traceback)
    if result.kill_reason is not None:
        console.print(f"[red]killed: {result.kill_reason}[/] after {result.duration_ms:.0f} ms")
    return result.exit_code if result.exit_code is not None else 1


def _one_shot(
    kind: str,
    source: str,
    memory_mb: int | None,
    timeout_s: float | None,
    network: bool,
    backend: str | None,
) -> None:
    from agent_sandbox.sandbox import Sandbox

    try:
        with Sandbox.create(
            memory_mb=memory_mb, timeout_s=timeout_s, network=network, backend=backend
        ) as sb:
            result = sb.run_code(source) if kind == "code" else sb.commands.run(source)
    except SandboxError as exc:
        console.print(f"[red]error ({exc.code}):[/] {exc.message}")
        raise typer.Exit(2) from None
    raise typer.Exit(_print_result(result))


@app.command("run-code")
def run_code(
    code: Annotated[str, typer.Argument(help="Python source; '-' reads stdin.")],
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
) -> None:
    """Run Python in a fresh sandbox and print what it printed (exit status follows it)."""
    _one_shot(
        "code", sys.stdin.read() if code == "-" else code, memory_mb, timeout_s, network, backend
    )


@app.command("exec")
def exec_command(
    command: Annotated[str, typer.Argument(help="A bash command line.")],
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
) -> None:
    """Run a shell command in a fresh sandbox (exit status follows it)."""
    _one_shot("shell", command, memory_mb, timeout_s, network, backend)


@app.command()
def version() -> None:
    """Print the version."""
    from agent_sandbox import __version__

    typer.echo(__version__)


if __name__ == "__main__":
    app()
