"""SQLite files that several processes open at once: the store and the API keys.

Every manager instance (and every server process) on a data directory has its own
connection to the same files, and any of them may be the first to open a new one.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# The first wait between two tries of a statement SQLite refused without waiting, and the
# longest: doubled from one to the other.
_FIRST_PAUSE_S = 0.001
_MAX_PAUSE_S = 0.05


def connect_shared(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection in WAL mode to ``path`` (made private to this user), whose writes wait up
    to ``busy_timeout_s`` for another process's transaction; autocommit unless
    :func:`write_transaction` says otherwise.

    Raises:
        sqlite3.OperationalError: the file stayed locked past ``busy_timeout_s``, or is not a
            database.
    """
    # A new file is made here, empty, with the umask's mode, and made private at once,
    # before anything is written to it or its companions exist.
    db = sqlite3.connect(
        path, timeout=busy_timeout_s, check_same_thread=False, isolation_level=None
    )
    try:
        private(path)
        _enter_wal(db, busy_timeout_s)
        # WAL + NORMAL: a committed row survives a crash of the process; only a power loss
        # can take the last few. FULL would fsync on every write.
        db.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        db.close()
        raise
    return db


def open_schema(
    path: Path,
    busy_timeout_s: float,
    schema: Sequence[str],
    table: str,
    add_columns: Mapping[str, str | Sequence[str]],
    after: Sequence[str] = (),
) -> sqlite3.Connection:
    """:func:`connect_shared`, then in one write transaction (two processes opening an old
    file at once must not both add a column: the second would fail on a duplicate): the
    ``schema`` statements, each of ``add_columns`` (column: its ALTER TABLE, or that and the
    statements that fill the new column in, run only when the column is added) that ``table``
    lacks, then ``after``."""
    db = connect_shared(path, busy_timeout_s)
    try:
        with write_transaction(db):
            for statement in schema:
                db.execute(statement)
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column, statements in add_columns.items():
                if column not in have:
                    for statement in (statements,) if isinstance(statements, str) else statements:
                        db.execute(statement)
            for statement in after:
                db.execute(statement)
    except BaseException:
        db.close()
        raise
    return db


def _enter_wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Switch the file to WAL (it stays so: the next openers find it done).

    SQLite answers "database is locked" at once, without its busy handler, to a connection
    changing the journal mode while another holds a lock on the file: two processes opening
    a new file together, one of them failed its start (28% of such pairs measured). So the
    change is retried here, for as long as any other write would wait.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = _FIRST_PAUSE_S
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or time.monotonic() + pause_s > deadline:
                raise
        else:
            return
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, _MAX_PAUSE_S)


def _busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


@contextlib.contextmanager
def write_transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, its lock taken at the start (waiting for other processes'),
    so that what it reads cannot change before it writes; rolled back on any exception."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def private(path: Path) -> None:
    """Make the SQLite file (and its WAL companions) readable by this user alone: it holds
    API key hashes and the audit log. SQLite gives new companions the file's own mode.

    By their names, never by opening the file: closing any descriptor of it drops every
    POSIX lock this process's connections hold on it (locks are the process's, per file),
    and another process closing its connection then took itself for the file's last user,
    checkpointed, and deleted the WAL and shared memory this one was still writing to:
    committed rows were lost, and every later statement failed with "database disk image is
    malformed" (red team, 2026-11-25; the server opens two connections, the store's and the
    keys', and each open made the file private)."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        # Another process's connection may delete a companion at any moment (its journal at
        # commit, the WAL at its last close): one that is gone needs no mode.
        with contextlib.suppress(FileNotFoundError):
            path.with_name(path.name + suffix).chmod(0o600)
