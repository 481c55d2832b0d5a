"""``sandlot keys``: API keys, tenant quotas and the audit log, in the server's database."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import JsonOpt, console, errors_exit_2, print_json, shown
from sandlot.config import get_settings

if TYPE_CHECKING:
    from sandlot.server.auth import AuthStore

keys_app = typer.Typer(no_args_is_help=True, help="API keys, tenant quotas and the audit log.")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")


@contextlib.contextmanager
def _auth_store() -> Iterator[AuthStore]:
    # Imported here: the server package is heavy, and `sandlot --help` should not wait on it.
    from sandlot.server.auth import AuthStore

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
    with errors_exit_2(), _auth_store() as store:
        key_id, key = store.create_key(tenant, role, name)
    made = f"created {shown(key_id)} for tenant {shown(repr(tenant))} with role {shown(role)}"
    console.print(f"{made}; store it now:")
    typer.echo(key)


@keys_app.command("list")
def keys_list(as_json: JsonOpt = False) -> None:
    """List keys (never the keys themselves)."""
    with _auth_store() as store:
        keys = store.list_keys()
    if as_json:
        print_json(keys)
        return
    table = Table("key_id", "tenant", "role", "name", "revoked")
    for key in keys:
        revoked = "yes" if key["revoked_at"] else ""
        cells = (key["key_id"], key["tenant"], key["role"], key["name"], revoked)
        table.add_row(*(shown(cell) for cell in cells))
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key at once."""
    with _auth_store() as store:
        revoked = store.revoke_key(key_id)
    if not revoked:
        console.print(f"[red]no active key {shown(repr(key_id))}[/] (see `sandlot keys list`)")
        raise typer.Exit(1)
    console.print(f"revoked {shown(key_id)}")


@keys_app.command("quota")
def keys_quota(
    tenant: str,
    max_sandboxes: Annotated[int | None, typer.Option(min=0)] = None,
    max_memory_mb: Annotated[int | None, typer.Option(min=0)] = None,
    max_pids: Annotated[int | None, typer.Option(min=0)] = None,
    max_cpu_cores: Annotated[float | None, typer.Option(min=0)] = None,
    max_disk_mb: Annotated[int | None, typer.Option(min=0)] = None,
    max_artifact_mb: Annotated[int | None, typer.Option(min=0)] = None,
    max_volumes: Annotated[int | None, typer.Option(min=0)] = None,
    max_volume_mb: Annotated[int | None, typer.Option(min=0)] = None,
) -> None:
    """Set a tenant's quota (values not given keep TENANT_MAX_* defaults)."""
    given = {
        "max_sandboxes": max_sandboxes,
        "max_memory_mb": max_memory_mb,
        "max_pids": max_pids,
        "max_cpu_cores": max_cpu_cores,
        "max_disk_mb": max_disk_mb,
        "max_artifact_mb": max_artifact_mb,
        "max_volumes": max_volumes,
        "max_volume_mb": max_volume_mb,
    }
    with _auth_store() as store:
        store.set_quota(tenant, **{k: v for k, v in given.items() if v is not None})
    values = " ".join(f"{k.removeprefix('max_')}={v}" for k, v in given.items() if v is not None)
    console.print(f"quota of {shown(repr(tenant))}: {values or 'defaults'}")


@keys_app.command("audit")
def keys_audit(
    tenant: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Show the newest audit log entries."""
    with _auth_store() as store:
        rows = store.audit_log(tenant, limit)
    if as_json:
        # The store keeps each entry's detail as JSON text: hand it on as the object it is.
        print_json([{**row, "detail": json.loads(row["detail"] or "{}")} for row in rows])
        return
    table = Table("seq", "tenant", "key_id", "action", "sandbox", "outcome")
    for row in rows:
        cells = ("seq", "tenant", "key_id", "action", "sandbox_id", "outcome")
        table.add_row(*(shown(row[cell]) for cell in cells))
    Console().print(table)
