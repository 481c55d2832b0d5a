"""API keys, roles, tenant quotas and the audit log, in the manager's SQLite file.

Keys are 256-bit random tokens, so a plain SHA-256 of the key is a safe thing to store (a
slow password hash protects guessable secrets; these are not guessable). The key itself is
shown once, at creation.

Roles: ``admin`` may do everything for every tenant; ``user`` may create, run and delete its
tenant's sandboxes; ``viewer`` may only read its tenant's sandboxes, files and artifacts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from sandlot._sqlite import open_schema
from sandlot.errors import AuthenticationError, ConfigError, Forbidden
from sandlot.models import Quota

KEY_PREFIX = "asb_"
# A tenant's own quota, column by column; NULL takes the TENANT_MAX_* default.
QUOTA_COLUMNS = {
    "max_sandboxes": "INTEGER",
    "max_memory_mb": "INTEGER",
    "max_pids": "INTEGER",
    "max_cpu_cores": "REAL",
    "max_disk_mb": "INTEGER",
    "max_artifact_mb": "INTEGER",
    "max_volumes": "INTEGER",
    "max_volume_mb": "INTEGER",
}
# Each request writes one audit row: one waits this long for another server process's.
BUSY_TIMEOUT_S = 5.0

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY,
        key_hash TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        role TEXT NOT NULL,
        name TEXT NOT NULL,
        created_at REAL NOT NULL,
        revoked_at REAL
    )""",
    """CREATE TABLE IF NOT EXISTS tenants (
        tenant TEXT PRIMARY KEY,
        max_sandboxes INTEGER,
        max_memory_mb INTEGER
    )""",
    """CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        request_id TEXT,
        key_id TEXT,
        tenant TEXT,
        action TEXT NOT NULL,
        sandbox_id TEXT,
        outcome TEXT NOT NULL,
        detail TEXT
    )""",
    """CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END""",
)


class Role(StrEnum):
    ADMIN = "admin"
    USER = "user"
    VIEWER = "viewer"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key (or the single local user when auth is off)."""

    key_id: str
    tenant: str
    role: Role

    @property
    def owner_filter(self) -> str | None:
        """The owner to scope sandbox lookups to (None: every tenant, for admins)."""
        return None if self.role is Role.ADMIN else self.tenant

    def require_write(self) -> None:
        if self.role is Role.VIEWER:
            raise Forbidden("this API key has the viewer role and can only read")

    def require_admin(self) -> None:
        if self.role is not Role.ADMIN:
            raise Forbidden(
                f"this needs an admin key (this one has the {self.role.value} role); a "
                "scraper on a private network may be let in with API_METRICS_PUBLIC=true"
            )


LOCAL_PRINCIPAL = Principal(key_id="local", tenant="local", role=Role.ADMIN)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class AuthStore:
    """Thread-safe; every call is one short transaction."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Quotas grew columns: a database from an older release gets the ones it lacks.
        added = {c: f"ALTER TABLE tenants ADD COLUMN {c} {k}" for c, k in QUOTA_COLUMNS.items()}
        self._db = open_schema(path, BUSY_TIMEOUT_S, SCHEMA, "tenants", added)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- keys

    def create_key(self, tenant: str, role: Role | str, name: str = "") -> tuple[str, str]:
        """Create a key; returns ``(key_id, key)``. The key is not stored and not shown again."""
        if not tenant or not tenant.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"tenant {tenant!r} must be letters, digits, '-' or '_'")
        if tenant.startswith("__"):
            # Ours: the pool's and the readiness probe's owners (core/live.py, server/app.py).
            raise ConfigError(f"tenant {tenant!r}: names starting '__' are reserved")
        try:
            role = Role(role)
        except ValueError:
            raise ConfigError(f"role {role!r} must be one of: admin, user, viewer") from None
        key_id = "key_" + secrets.token_hex(6)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            self._db.execute(
                "INSERT INTO api_keys VALUES (?,?,?,?,?,?,NULL)",
                (key_id, _hash(key), tenant, role.value, name, time.time()),
            )
        return key_id, key

    def revoke_key(self, key_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "UPDATE api_keys SET revoked_at=? WHERE key_id=? AND revoked_at IS NULL",
                (time.time(), key_id),
            )
        return cursor.rowcount == 1

    def list_keys(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key_id, tenant, role, name, created_at, revoked_at FROM api_keys "
                "ORDER BY created_at"
            ).fetchall()
        keys = ("key_id", "tenant", "role", "name", "created_at", "revoked_at")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def authenticate(self, key: str | None) -> Principal:
        """The principal of ``key``.

        Raises:
            AuthenticationError: no key, or an unknown or revoked one.
        """
        if not key:
            raise AuthenticationError(
                "no API key: send `Authorization: Bearer <key>` (create one with "
                "`sandlot keys create`)"
            )
        digest = _hash(key)
        with self._lock:
            row = self._db.execute(
                "SELECT key_id, key_hash, tenant, role, revoked_at FROM api_keys WHERE key_hash=?",
                (digest,),
            ).fetchone()
        if row is None or not hmac.compare_digest(row[1], digest) or row[4] is not None:
            raise AuthenticationError("unknown or revoked API key")
        return Principal(key_id=row[0], tenant=row[2], role=Role(row[3]))

    # -- quotas

    def set_quota(self, tenant: str, **limits: float | None) -> None:
        """Set some of ``tenant``'s quota (names from :class:`Quota`); None clears one back to
        the default.

        Raises:
            ConfigError: a name that is no quota.
        """
        unknown = set(limits) - set(QUOTA_COLUMNS)
        if unknown:
            raise ConfigError(f"no quota named {sorted(unknown)}; known: {sorted(QUOTA_COLUMNS)}")
        columns = list(limits)
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO tenants (tenant) VALUES (?)", (tenant,))
            if columns:
                assignments = ", ".join(f"{column}=?" for column in columns)
                self._db.execute(
                    f"UPDATE tenants SET {assignments} WHERE tenant=?",  # noqa: S608 - names from QUOTA_COLUMNS
                    (*limits.values(), tenant),
                )

    def quota(self, tenant: str, default: Quota) -> Quota:
        """``tenant``'s quota: its own values where set, ``default``'s elsewhere."""
        columns = ", ".join(QUOTA_COLUMNS)
        with self._lock:
            row = self._db.execute(
                f"SELECT {columns} FROM tenants WHERE tenant=?",  # noqa: S608 - fixed names
                (tenant,),
            ).fetchone()
        if row is None:
            return default
        own = {
            name: value for name, value in zip(QUOTA_COLUMNS, row, strict=True) if value is not None
        }
        return default.model_copy(update=own)

    # -- audit

    def audit(
        self,
        *,
        principal: Principal,
        action: str,
        outcome: str,
        request_id: str | None = None,
        sandbox_id: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO audit (at, request_id, key_id, tenant, action, sandbox_id, outcome,"
                " detail) VALUES (?,?,?,?,?,?,?,?)",
                (
                    time.time(),
                    request_id,
                    principal.key_id,
                    principal.tenant,
                    action,
                    sandbox_id,
                    outcome,
                    json.dumps(detail or {}, default=str),
                ),
            )

    def audit_log(self, tenant: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        query = (
            "SELECT seq, at, request_id, key_id, tenant, action, sandbox_id, outcome, detail "
            "FROM audit"
        )
        args: list[Any] = []
        if tenant is not None:
            query += " WHERE tenant=?"
            args.append(tenant)
        query += " ORDER BY seq DESC LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        keys = (
            "seq",
            "at",
            "request_id",
            "key_id",
            "tenant",
            "action",
            "sandbox_id",
            "outcome",
            "detail",
        )
        return [dict(zip(keys, row, strict=True)) for row in rows]
