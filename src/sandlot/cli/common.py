"""What the command groups share: the consoles, the error handler, result printing, the
options several groups take, and the call to a server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import unicodedata
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape as rich_escape

from sandlot.client import RemoteService
from sandlot.config import get_settings
from sandlot.errors import SandboxError
from sandlot.models import ExecResult

console = Console(stderr=True)

MemoryOpt = Annotated[int | None, typer.Option("--memory-mb", help="Memory limit (MiB).")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout-s", help="Per-call timeout.")]
NetworkOpt = Annotated[bool, typer.Option("--network/--no-network", help="Allow network.")]
BackendOpt = Annotated[
    str | None, typer.Option("--backend", help="bubblewrap | docker | unsafe-local")
]
RuntimeOpt = Annotated[
    str | None, typer.Option("--runtime", help="docker only: runc | runsc (gVisor)")
]
EnvironmentOpt = Annotated[
    str | None,
    typer.Option(
        "--environment",
        "--env-name",
        help="Registry environment or alias: python3, python-data, node, or one of "
        "SANDLOT_REGISTRY_DIR's (`sandlot image list` lists this machine's). "
        "Default: SANDBOX_ENVIRONMENT (python3; the server's own for `sandbox create`).",
    ),
]
UrlOpt = Annotated[
    str | None, typer.Option("--api-url", help="Default: SANDLOT_URL, else localhost.")
]
KeyOpt = Annotated[str | None, typer.Option("--api-key", help="Default: SANDLOT_API_KEY.")]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="One JSON document on stdout instead of the table.")
]


@contextlib.contextmanager
def errors_exit_2() -> Iterator[None]:
    """Our errors become their code and message on stderr, and exit status 2."""
    try:
        yield
    except SandboxError as exc:
        # A message may carry what sandboxed code chose (a file name, a link's target: red
        # team, 2026-12-06, a dangling link's target set the terminal's title; one with
        # "[/]" crashed the CLI with Rich's MarkupError): shown, never interpreted.
        console.print(f"[red]error ({shown(exc.code)}):[/] {shown(exc.message)}")
        raise typer.Exit(2) from None


# The output of what the user asked to run (a command's or a cell's stdout and stderr, the
# value it printed, its traceback) is passed through byte for byte, as `docker exec` passes
# it: it is the program's own output, which the user may pipe, redirect or mean to style
# (colours, a progress bar), and escaping it would change what a script reads. Everything
# else the CLI prints that a server or a sandbox supplied goes through shown().


def print_result(result: ExecResult) -> int:
    sys.stdout.write(result.stdout)  # the run's own output: verbatim (see above)
    sys.stderr.write(result.stderr)
    return finish(result)


def finish(result: ExecResult) -> int:
    """Print what the run left besides its output; the exit status the command takes."""
    if result.text is not None:
        sys.stdout.write(result.text + "\n")  # the run's own output: verbatim (see above)
    if result.error is not None:
        sys.stderr.write(result.error.traceback)
    if result.kill_reason is not None:
        took = f"{result.duration_ms:.0f}"
        console.print(f"[red]killed: {shown(result.kill_reason)}[/] after {took} ms")
    return result.exit_code if result.exit_code is not None else 1


def remote(api_url: str | None, api_key: str | None) -> RemoteService:
    settings = get_settings()
    url = api_url or settings.api_url or f"http://127.0.0.1:{settings.api_port}"
    return RemoteService(url, api_key or settings.api_key)


def remote_call(api_url: str | None, api_key: str | None, work: Any) -> Any:
    """Run ``work(service)`` against the server; errors become a message and exit code 2."""

    async def main() -> Any:
        service = remote(api_url, api_key)
        try:
            return await work(service)
        finally:
            await service.aclose()

    try:
        with errors_exit_2():
            return asyncio.run(main())
    except httpx.TransportError as exc:
        console.print(
            f"[red]cannot reach the server:[/] {shown(exc)}; start `sandlot serve` "
            "or set --api-url / SANDLOT_URL"
        )
        raise typer.Exit(2) from None


def print_json(document: object) -> None:
    """``document`` as the whole of stdout. ASCII-only JSON escapes every control character
    and every non-ASCII one, so text a client stored reaches the terminal only as escapes."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def shown(value: object, *, lines: bool = False) -> str:
    """Text from a store, a server or a sandbox, safe to print with Rich (in a table, in a
    message): markup is escaped and control characters (escape sequences among them) are
    shown as ``\\xNN``, so a name, a message or a sandbox id chosen by a client can neither
    restyle nor rewrite the operator's terminal, nor crash the print with bad markup.
    ``lines``: newlines and tabs are kept (a traceback's tail, a critique)."""
    return rich_escape(visible(value, lines=lines))


def visible(value: object, *, lines: bool = False) -> str:
    """``value`` as text with its control characters shown as ``\\xNN`` (newlines and
    tabs kept where ``lines``), for a plain print that Rich does not read: no markup to
    escape there."""
    text = "" if value is None else str(value)
    kept = "\n\t" if lines else ""
    return "".join(
        ch
        if ch in kept or (ch.isprintable() and not unicodedata.category(ch).startswith("C"))
        else _hex(ch)
        for ch in text
    )


def _hex(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
