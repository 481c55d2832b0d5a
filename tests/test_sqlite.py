"""SQLite files opened by several processes at once (the store, the API keys).

Two connections in one process lock a file as two processes do (SQLite shares its POSIX locks
per inode across connections), so threads stand in for processes here; the managers of
test_instances.py do the same through the whole start.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from sandlot._sqlite import connect_shared, write_transaction
from sandlot.core.store import Store
from sandlot.server.auth import QUOTA_COLUMNS, AuthStore

# Of 300 pairs opening a new file at once, 84 had one fail before the fix: 60 pairs fail
# with near certainty.
ROUNDS = 60


def _race(open_one: Callable[[], object]) -> list[BaseException]:
    """Call ``open_one`` from two threads released together; what each raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def one() -> None:
        start.wait(10)
        try:
            opened = open_one()
        except BaseException as exc:
            errors.append(exc)
        else:
            opened.close()  # type: ignore[attr-defined]

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors


def test_two_processes_can_open_a_new_store_at_once(tmp_path: Path) -> None:
    """Failed before: the second opener's switch to WAL got "database is locked" at once
    (SQLite does not wait for it), and its manager failed to start."""
    for i in range(ROUNDS):
        path = tmp_path / f"s{i}.db"
        assert _race(lambda path=path: Store(path, "x")) == []  # type: ignore[misc]
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_server_processes_can_open_new_keys_at_once(tmp_path: Path) -> None:
    for i in range(ROUNDS):
        path = tmp_path / f"k{i}.db"
        assert _race(lambda path=path: AuthStore(path)) == []  # type: ignore[misc]


def test_two_server_processes_upgrade_old_keys_once(tmp_path: Path) -> None:
    """A keys file from before the newer quota columns, opened by two servers at once: one
    adds the columns, the other finds them. Failed before: both read the old columns, and
    the second's ALTER TABLE failed on a duplicate column."""
    for i in range(ROUNDS):
        path = tmp_path / f"old{i}.db"
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE tenants (tenant TEXT PRIMARY KEY, max_sandboxes INTEGER, "
                "max_memory_mb INTEGER)"
            )
            db.execute("INSERT INTO tenants VALUES ('acme', 3, 2048)")
        db.close()
        assert _race(lambda path=path: AuthStore(path)) == []  # type: ignore[misc]
        with sqlite3.connect(path) as db:
            columns = [row[1] for row in db.execute("PRAGMA table_info(tenants)")]
            kept = db.execute("SELECT max_sandboxes, max_pids FROM tenants").fetchall()
        db.close()
        assert columns == ["tenant", *QUOTA_COLUMNS]
        assert kept == [(3, None)]


def test_a_file_locked_past_the_timeout_is_an_error_not_a_hang(tmp_path: Path) -> None:
    path = tmp_path / "held.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            connect_shared(path, busy_timeout_s=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_file_that_is_not_a_database_is_not_retried(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"not a database at all, " * 100)
    with pytest.raises(sqlite3.DatabaseError, match="not a database"):
        # A retry would wait the whole hour before saying so.
        connect_shared(path, busy_timeout_s=3600)


def test_a_failed_transaction_writes_nothing(tmp_path: Path) -> None:
    db = connect_shared(tmp_path / "t.db", busy_timeout_s=1)
    db.execute("CREATE TABLE t (x)")
    with pytest.raises(ValueError, match="refused"), write_transaction(db):
        db.execute("INSERT INTO t VALUES (1)")
        raise ValueError("refused")
    with write_transaction(db):
        db.execute("INSERT INTO t VALUES (2)")
    assert db.execute("SELECT x FROM t").fetchall() == [(2,)]
    db.close()


def test_the_files_are_private(tmp_path: Path) -> None:
    db = connect_shared(tmp_path / "p.db", busy_timeout_s=1)
    db.execute("CREATE TABLE t (x)")
    db.close()
    assert (tmp_path / "p.db").stat().st_mode & 0o777 == 0o600


def test_a_companion_file_deleted_by_another_process_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process's connection deletes a journal or WAL file whenever it commits or
    # closes: between the check and the chmod here it was gone, and a server's start failed
    # with FileNotFoundError (CI, two servers opening new keys at once).
    from sandlot import _sqlite

    path = tmp_path / "keys.db"
    real_chmod = Path.chmod

    def chmod_then_vanish(self: Path, mode: int, **kwargs: object) -> None:
        if self.name.endswith("-journal"):
            raise FileNotFoundError(2, "No such file or directory", str(self))
        real_chmod(self, mode)

    real_exists = Path.exists

    def journal_there(self: Path, **kwargs: bool) -> bool:
        return self.name.endswith("-journal") or real_exists(self, **kwargs)

    sqlite3.connect(path).close()
    monkeypatch.setattr(Path, "chmod", chmod_then_vanish)
    monkeypatch.setattr(Path, "exists", journal_there)  # seen, then gone before the chmod
    _sqlite.private(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_another_process_closing_never_removes_the_files_a_connection_uses(
    tmp_path: Path,
) -> None:
    # Failed before (red team, 2026-11-25): each open made the file private by opening and
    # closing it, which dropped the POSIX locks of the process's first connection. Another
    # process's close then checkpointed and deleted the WAL and shared memory still in use:
    # the rows written after it were lost to every other process.
    path = tmp_path / "shared.db"
    first = connect_shared(path, busy_timeout_s=5)
    first.execute("CREATE TABLE t (x)")
    first.execute("INSERT INTO t VALUES (1)")
    second = connect_shared(path, busy_timeout_s=5)  # as a server opens the store, then keys
    first.execute("INSERT INTO t VALUES (2)")
    src = Path(__file__).resolve().parent.parent / "src"
    opens_and_closes = (
        f"import sys; sys.path.insert(0, {str(src)!r}); from pathlib import Path; "
        "from sandlot._sqlite import connect_shared; "
        f"db = connect_shared(Path({str(path)!r}), 5); db.execute('SELECT 1'); db.close()"
    )
    subprocess.run([sys.executable, "-c", opens_and_closes], check=True, timeout=60)
    assert (tmp_path / "shared.db-wal").exists() and (tmp_path / "shared.db-shm").exists()
    first.execute("INSERT INTO t VALUES (3)")
    counts = (
        f"import sqlite3; print(sqlite3.connect({str(path)!r}).execute("
        "'SELECT COUNT(*) FROM t').fetchone()[0])"
    )
    seen = subprocess.run(
        [sys.executable, "-c", counts], check=True, timeout=60, capture_output=True, text=True
    )
    assert seen.stdout.strip() == "3"
    second.close()
    first.close()
