"""SQLite store of sandboxes and kept artifacts: a real file, so a restart knows what ran."""

from __future__ import annotations

import builtins
import fcntl
import os
import sqlite3
import threading
from pathlib import Path

from sandlot.errors import ConfigError
from sandlot.models import ArtifactInfo, SandboxInfo, SandboxStatus

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    info TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_owner ON sandboxes (owner, status);
CREATE TABLE IF NOT EXISTS artifacts (
    sandbox_id TEXT NOT NULL,
    path TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (sandbox_id, path)
);
"""

LIVE = (SandboxStatus.STARTING.value, SandboxStatus.RUNNING.value)


class Store:
    """Thread-safe; every call is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def save(self, info: SandboxInfo) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, info) VALUES (?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET status=excluded.status, info=excluded.info",
                (info.id, info.owner, info.status.value, info.created_at, info.model_dump_json()),
            )

    def get(self, sandbox_id: str) -> SandboxInfo | None:
        with self._lock:
            row = self._db.execute(
                "SELECT info FROM sandboxes WHERE id=?", (sandbox_id,)
            ).fetchone()
        return SandboxInfo.model_validate_json(row[0]) if row else None

    def list(self, owner: str | None = None, live_only: bool = False) -> builtins.list[SandboxInfo]:
        query = "SELECT info FROM sandboxes WHERE 1=1"
        args: list[str] = []
        if owner is not None:
            query += " AND owner=?"
            args.append(owner)
        if live_only:
            query += f" AND status IN ({','.join('?' * len(LIVE))})"
            args.extend(LIVE)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at", args).fetchall()
        return [SandboxInfo.model_validate_json(r[0]) for r in rows]

    def backends_used(self) -> set[str]:
        """Every backend a sandbox of this store ever ran on (whose leftovers a sweep seeks)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT json_extract(info, '$.backend') FROM sandboxes"
            ).fetchall()
        return {r[0] for r in rows if isinstance(r[0], str)}

    def add_artifact(self, artifact: ArtifactInfo) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO artifacts VALUES (?,?,?,?,?)",
                (
                    artifact.sandbox_id,
                    artifact.path,
                    artifact.size_bytes,
                    artifact.sha256,
                    artifact.created_at,
                ),
            )

    def artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id, path, size_bytes, sha256, created_at FROM artifacts "
                "WHERE sandbox_id=? ORDER BY path",
                (sandbox_id,),
            ).fetchall()
        keys = ("sandbox_id", "path", "size_bytes", "sha256", "created_at")
        return [ArtifactInfo(**dict(zip(keys, row, strict=True))) for row in rows]

    def sandboxes_with_artifacts_before(self, kept_before: float) -> builtins.list[str]:
        """Sandboxes whose newest kept artifact is older than ``kept_before`` (Unix time)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id FROM artifacts GROUP BY sandbox_id HAVING MAX(created_at) < ?",
                (kept_before,),
            ).fetchall()
        return [row[0] for row in rows]

    def artifact_bytes(self, owner: str) -> int:
        """Bytes of artifacts kept for all of ``owner``'s sandboxes."""
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(a.size_bytes), 0) FROM artifacts a "
                "JOIN sandboxes s ON s.id = a.sandbox_id WHERE s.owner=?",
                (owner,),
            ).fetchone()
        return int(row[0])

    def forget_ended_before(self, ended_before: float) -> int:
        """Delete the records of sandboxes that ended before ``ended_before`` (Unix time) and
        keep no artifacts; return how many went."""
        with self._lock:
            cursor = self._db.execute(
                f"DELETE FROM sandboxes WHERE status NOT IN ({','.join('?' * len(LIVE))}) "  # noqa: S608 - placeholders only
                "AND json_extract(info, '$.ended_at') < ? "
                "AND id NOT IN (SELECT sandbox_id FROM artifacts)",
                (*LIVE, ended_before),
            )
        return cursor.rowcount

    def delete_artifacts(self, sandbox_id: str) -> int:
        with self._lock:
            cursor = self._db.execute("DELETE FROM artifacts WHERE sandbox_id=?", (sandbox_id,))
        return cursor.rowcount


def private(path: Path) -> None:
    """Make the SQLite file (and its WAL companions) readable by this user alone: it holds
    API key hashes and the audit log. SQLite gives new companions the file's own mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)
    for suffix in ("", "-wal", "-shm", "-journal"):
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            companion.chmod(0o600)


def lock_data_dir(data_dir: Path) -> int:
    """Take the data directory's lock file; one manager per data directory.

    Raises:
        ConfigError: another process holds it.
    """
    fd = os.open(data_dir / "manager.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"data directory {data_dir} is in use by another sandlot process "
            f"(pid {holder}); set SANDLOT_DATA_DIR to another directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
