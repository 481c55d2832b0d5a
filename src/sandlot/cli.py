"""The ``sandlot`` command."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import DownloadColumn, Progress
from rich.table import Table

from sandlot.client import RemoteService
from sandlot.config import get_settings, make_limits
from sandlot.errors import SandboxError
from sandlot.log import configure_logging
from sandlot.models import ExecResult
from sandlot.server.auth import AuthStore

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Isolated, stateful sandboxes for code that AI agents write.",
)
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
    typer.Option("--environment", "--env-name", help="Registry environment: python3 | node"),
]


@app.callback()
def _main() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)


@app.command()
def doctor() -> None:
    """Report which isolation features this host supports, and why each matters."""
    from sandlot.doctor import run_checks

    checks = run_checks(optional=True)
    table = Table(title="sandlot doctor")
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


@contextlib.contextmanager
def _errors_exit_2() -> Iterator[None]:
    """Our errors become their code and message on stderr, and exit status 2."""
    try:
        yield
    except SandboxError as exc:
        console.print(f"[red]error ({exc.code}):[/] {exc.message}")
        raise typer.Exit(2) from None


def _print_result(result: ExecResult) -> int:
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return _finish(result)


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
        _errors_exit_2(),
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
    raise typer.Exit(_print_result(result))


@app.command("run-code")
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


@app.command("exec")
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


@app.command()
def version() -> None:
    """Print the version."""
    from sandlot._version import __version__

    typer.echo(__version__)


# ---------------------------------------------------------------------- server


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Default: API_HOST (127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Default: API_PORT (8000).")] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="No API keys: local single-user use only.")
    ] = False,
    workers: Annotated[int | None, typer.Option(help="Must be 1 (see API_WORKERS).")] = None,
) -> None:
    """Run the REST + WebSocket server."""
    import uvicorn

    from sandlot.server import create_app

    updates: dict[str, object] = {}
    if host is not None:
        updates["api_host"] = host
    if port is not None:
        updates["api_port"] = port
    if no_auth:
        updates["auth_enabled"] = False
    if workers is not None and workers != 1:
        console.print(
            "[red]--workers must be 1:[/] sandboxes live in the server process that created "
            "them; run more servers, each with its own SANDLOT_DATA_DIR, to scale out"
        )
        raise typer.Exit(2)
    settings = get_settings().model_copy(update=updates)
    uvicorn.run(
        create_app(settings),
        host=settings.api_host,
        port=settings.api_port,
        log_level=settings.log_level.lower(),
        ws="websockets-sansio",
    )


# ---------------------------------------------------------------------- keys

image_app = typer.Typer(
    no_args_is_help=True, help="Environments (YAML registry) and their offline-built images."
)
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
    with _errors_exit_2():
        envs = (
            [get_environment(n, settings.registry_dir) for n in names]
            if names
            else list(load_registry(settings.registry_dir).values())
        )
        for env in envs:
            console.print(f"[bold]{env.name}[/]: {env.description}")
            build_image(env, settings.data_dir, force=force, progress=console.print)


keys_app = typer.Typer(no_args_is_help=True, help="API keys, tenant quotas and the audit log.")
app.add_typer(keys_app, name="keys")


@contextlib.contextmanager
def _auth_store() -> Iterator[AuthStore]:
    store = AuthStore(get_settings().data_dir / "sandlot.db")
    try:
        yield store
    finally:
        store.close()


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Whose sandboxes this key reaches.")],
    role: Annotated[str, typer.Option(help="admin | user | viewer")] = "user",
    name: Annotated[str, typer.Option(help="A label for people.")] = "",
) -> None:
    """Create a key and print it once (only its hash is stored)."""
    with _errors_exit_2(), _auth_store() as store:
        key_id, key = store.create_key(tenant, role, name)
    console.print(f"created {key_id} for tenant {tenant!r} with role {role}; store it now:")
    typer.echo(key)


@keys_app.command("list")
def keys_list() -> None:
    """List keys (never the keys themselves)."""
    table = Table("key_id", "tenant", "role", "name", "revoked")
    with _auth_store() as store:
        for key in store.list_keys():
            revoked = "yes" if key["revoked_at"] else ""
            table.add_row(key["key_id"], key["tenant"], key["role"], key["name"], revoked)
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key at once."""
    with _auth_store() as store:
        revoked = store.revoke_key(key_id)
    if not revoked:
        console.print(f"[red]no active key {key_id!r}[/] (see `sandlot keys list`)")
        raise typer.Exit(1)
    console.print(f"revoked {key_id}")


@keys_app.command("quota")
def keys_quota(
    tenant: str,
    max_sandboxes: Annotated[int | None, typer.Option(min=0)] = None,
    max_memory_mb: Annotated[int | None, typer.Option(min=0)] = None,
) -> None:
    """Set a tenant's quota (unset values keep TENANT_MAX_* defaults)."""
    with _auth_store() as store:
        store.set_quota(tenant, max_sandboxes, max_memory_mb)
    console.print(f"quota of {tenant!r}: sandboxes={max_sandboxes} memory_mb={max_memory_mb}")


@keys_app.command("audit")
def keys_audit(
    tenant: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1)] = 50,
) -> None:
    """Show the newest audit log entries."""
    table = Table("seq", "tenant", "key_id", "action", "sandbox", "outcome")
    with _auth_store() as store:
        for row in store.audit_log(tenant, limit):
            sandbox = row["sandbox_id"] or ""
            action, outcome = row["action"], row["outcome"]
            table.add_row(str(row["seq"]), row["tenant"], row["key_id"], action, sandbox, outcome)
    Console().print(table)


# ---------------------------------------------------------------------- sandboxes on a server

sandbox_app = typer.Typer(
    no_args_is_help=True,
    help="Sandboxes on a server (`sandlot serve`). Sandboxes outlive each command, so "
    "these need a server; `run-code` and `exec` above work embedded.",
)
app.add_typer(sandbox_app, name="sandbox")
UrlOpt = Annotated[
    str | None, typer.Option("--api-url", help="Default: SANDLOT_URL, else localhost.")
]
KeyOpt = Annotated[str | None, typer.Option("--api-key", help="Default: SANDLOT_API_KEY.")]


def _remote(api_url: str | None, api_key: str | None) -> RemoteService:
    settings = get_settings()
    url = api_url or settings.api_url or f"http://127.0.0.1:{settings.api_port}"
    return RemoteService(url, api_key or settings.api_key)


def _remote_call(api_url: str | None, api_key: str | None, work: Any) -> Any:
    """Run ``work(service)`` against the server; errors become a message and exit code 2."""

    async def main() -> Any:
        service = _remote(api_url, api_key)
        try:
            return await work(service)
        finally:
            await service.aclose()

    try:
        with _errors_exit_2():
            return asyncio.run(main())
    except httpx.TransportError as exc:
        console.print(
            f"[red]cannot reach the server:[/] {exc}; start `sandlot serve` "
            "or set --api-url / SANDLOT_URL"
        )
        raise typer.Exit(2) from None


@sandbox_app.command("create")
def sandbox_create(
    memory_mb: MemoryOpt = None,
    timeout_s: TimeoutOpt = None,
    network: NetworkOpt = False,
    backend: BackendOpt = None,
    runtime: RuntimeOpt = None,
    environment: EnvironmentOpt = None,
    ttl_s: Annotated[float | None, typer.Option("--ttl-s", help="Lifetime.")] = None,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Create a sandbox and print its id."""
    with _errors_exit_2():
        limits = make_limits(memory_mb=memory_mb, timeout_s=timeout_s)
    info = _remote_call(
        api_url,
        api_key,
        lambda s: s.create(
            backend=backend,
            runtime=runtime,
            environment=environment,
            limits=limits,
            network=network,
            ttl_s=ttl_s,
        ),
    )
    typer.echo(info.id)


@sandbox_app.command("ls")
def sandbox_ls(
    all_: Annotated[bool, typer.Option("--all", help="Include ended.")] = False,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """List your sandboxes."""
    infos = _remote_call(api_url, api_key, lambda s: s.list(include_ended=all_))
    table = Table("id", "status", "backend", "memory_mb", "owner", "expires in")
    now = time.time()
    for info in infos:
        left = f"{max(0, info.expires_at - now):.0f} s" if info.status == "running" else ""
        table.add_row(
            info.id, info.status, info.backend, str(info.limits.memory_mb), info.owner, left
        )
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
    result = _remote_call(
        api_url,
        api_key,
        lambda s: s.run_command(
            sandbox_id,
            command,
            session=session,
            timeout_s=timeout_s,
            on_stdout=_echo(sys.stdout),
            on_stderr=_echo(sys.stderr),
        ),
    )
    raise typer.Exit(_finish(result))


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
    result = _remote_call(
        api_url,
        api_key,
        lambda s: s.run_code(
            sandbox_id,
            source,
            timeout_s=timeout_s,
            on_stdout=_echo(sys.stdout),
            on_stderr=_echo(sys.stderr),
        ),
    )
    raise typer.Exit(_finish(result))


def _transfer(
    description: str, total: int | None, work: Any, api_url: str | None, api_key: str | None
) -> Any:
    with Progress(
        *Progress.get_default_columns(), DownloadColumn(), console=console, transient=True
    ) as progress:
        task = progress.add_task(description, total=total)
        return _remote_call(
            api_url, api_key, lambda s: work(s, lambda n: progress.advance(task, n))
        )


@sandbox_app.command("upload")
def sandbox_upload(
    sandbox_id: str, local: Path, remote: str, api_url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """Upload a local file into the sandbox's /workspace (with progress)."""
    if not local.is_file():
        console.print(f"[red]{local} is not a file[/]")
        raise typer.Exit(2)
    size = _transfer(
        f"upload {local.name}",
        local.stat().st_size,
        lambda s, tick: s.upload(sandbox_id, remote, local, tick),
        api_url,
        api_key,
    )
    console.print(f"uploaded {size} bytes to /workspace/{remote.lstrip('/')}")


@sandbox_app.command("download")
def sandbox_download(
    sandbox_id: str, remote: str, local: Path, api_url: UrlOpt = None, api_key: KeyOpt = None
) -> None:
    """Download a file from the sandbox's /workspace (with progress)."""
    size = _transfer(
        f"download {remote}",
        None,
        lambda s, tick: s.download(sandbox_id, remote, local, tick),
        api_url,
        api_key,
    )
    console.print(f"downloaded {size} bytes to {local}")


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str], api_url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    """Destroy sandboxes (their /workspace/artifacts are kept)."""

    async def destroy_all(service: RemoteService) -> None:
        for sandbox_id in sandbox_ids:
            await service.destroy(sandbox_id)
            console.print(f"destroyed {sandbox_id}")

    _remote_call(api_url, api_key, destroy_all)


def _echo(stream: Any) -> Any:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


def _finish(result: ExecResult) -> int:
    if result.text is not None:
        sys.stdout.write(result.text + "\n")
    if result.error is not None:
        sys.stderr.write(result.error.traceback)
    if result.kill_reason is not None:
        console.print(f"[red]killed: {result.kill_reason}[/] after {result.duration_ms:.0f} ms")
    return result.exit_code if result.exit_code is not None else 1


def _register_agent_commands() -> None:
    # `run`, `benchmark`, `models`: their heavy imports wait until one of them runs.
    from sandlot.agent.cli import register

    register(app)


_register_agent_commands()


if __name__ == "__main__":
    app()
