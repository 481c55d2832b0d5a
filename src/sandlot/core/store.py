"""SQLite store of sandboxes and kept artifacts: a real file, so a restart knows what ran."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandlot._sqlite import connect_shared, open_schema, write_transaction
from sandlot.models import ArtifactInfo, SandboxInfo, SandboxStatus

# What one kept file costs its owner's artifact quota: its bytes in whole 4 KiB blocks, and
# one block more for its inode and its share of the directories the host makes for it. Its
# size alone let 11,000 empty files in 11,000 directories (45 MB of the host's disk, 22,001
# inodes) cost nothing, again and again (red team, 2026-12-06).
BLOCK_BYTES = 4096


def artifact_charge(size_bytes: int) -> int:
    return -(-size_bytes // BLOCK_BYTES) * BLOCK_BYTES + BLOCK_BYTES


def _charge_sql(size_column: str) -> str:
    """:func:`artifact_charge` in SQL, of ``size_column`` (sizes are never negative)."""
    block = BLOCK_BYTES
    return f"(({size_column} + {block - 1}) / {block} * {block} + {block})"


# ``instance``: the manager instance (core/instances.py) that runs the sandbox; "" for a
# record of a sandlot from before instances. ``artifact_limit_bytes``: its owner's artifact
# quota when it was made (NULL: none), for a manager that keeps its artifacts after its own
# manager died, and never knew the owner's quota (the server's, given with each create).
# ``ended_at``: the record's, out of its JSON (NULL while it runs), so that the reaper finds
# the records past their retention by an index: it read ``json_extract(info, '$.ended_at')``
# of every record each pass, 2.4-3.3 s under the store's lock for one tenant's 10,000 (red
# team, 2026-12-06). The columns each query filters or sorts on are in its index, so that no
# query reads a record's ``info`` but those it returns: a column stored after ``info`` is
# read through its overflow pages.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS sandboxes (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        info TEXT NOT NULL,
        instance TEXT NOT NULL DEFAULT '',
        held INTEGER NOT NULL DEFAULT 0,
        artifact_limit_bytes INTEGER,
        ended_at REAL
    )""",
    "CREATE INDEX IF NOT EXISTS sandboxes_owner ON sandboxes (owner, status)",
    """CREATE TABLE IF NOT EXISTS artifacts (
        sandbox_id TEXT NOT NULL,
        path TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (sandbox_id, path)
    )""",
    # Each owner's kept and reserved artifacts, in charged bytes (artifact_charge), kept in
    # step with the artifacts table in the same transactions: a reservation summed the
    # owner's rows, so a sandbox's 100,000 empty files took a crashed manager's restart past
    # 13 minutes, each file's sum slower than the last (red team, 2026-12-06).
    """CREATE TABLE IF NOT EXISTS artifact_usage (
        owner TEXT PRIMARY KEY,
        charged_bytes INTEGER NOT NULL
    )""",
)
LIVE = (SandboxStatus.STARTING.value, SandboxStatus.RUNNING.value)
_LIVE_SLOTS = ",".join("?" * len(LIVE))
# An ended record, as SQL: written out (no placeholders) so that a query says it in the very
# words of the partial index below, which SQLite needs to use it.
_ENDED = "status NOT IN ({})".format(",".join(f"'{status}'" for status in LIVE))

MIGRATIONS: dict[str, str | tuple[str, ...]] = {
    "instance": "ALTER TABLE sandboxes ADD COLUMN instance TEXT NOT NULL DEFAULT ''",
    # 1 while an ended sandbox's teardown still holds its disk, cgroup and memory.
    "held": "ALTER TABLE sandboxes ADD COLUMN held INTEGER NOT NULL DEFAULT 0",
    "artifact_limit_bytes": "ALTER TABLE sandboxes ADD COLUMN artifact_limit_bytes INTEGER",
    # Filled in from the records once, when the column is added.
    "ended_at": (
        "ALTER TABLE sandboxes ADD COLUMN ended_at REAL",
        f"UPDATE sandboxes SET ended_at = json_extract(info, '$.ended_at') WHERE {_ENDED}",  # noqa: S608 - a constant
    ),
}
INDEXES = (
    "CREATE INDEX IF NOT EXISTS sandboxes_instance ON sandboxes (instance, status)",
    # Other instances' live records, read at every create: by status first, so that the
    # ended records (kept for the retention period) are never scanned.
    "CREATE INDEX IF NOT EXISTS sandboxes_live ON sandboxes (status, instance)",
    # The few ended records whose teardown still holds their limits: by owner (a refused
    # create's wait) and instance; a partial index, so the kept ended records are never read.
    "CREATE INDEX IF NOT EXISTS sandboxes_held_by ON sandboxes (owner, instance) WHERE held = 1",
    # A tenant's records in the order a listing pages them: a page's ids are read from the
    # index alone, and only the page's records are read and parsed (an offset of 9,999 read
    # and sorted all of a tenant's records, info and all: 11.6 s under the store's lock,
    # red team 2026-12-06); and everyone's, for an operator's listing.
    "CREATE INDEX IF NOT EXISTS sandboxes_by_owner ON sandboxes (owner, created_at, id)",
    "CREATE INDEX IF NOT EXISTS sandboxes_by_created ON sandboxes (created_at, id)",
    # Each tenant's ended records that hold nothing, newest last: its records cap. With the
    # columns of its own condition, which a query must restate, so that SQLite reads nothing
    # but the index (it does not take a partial index's condition for the columns' values).
    "CREATE INDEX IF NOT EXISTS sandboxes_ended_by_owner "
    f"ON sandboxes (owner, created_at, id, held, status) WHERE held = 0 AND {_ENDED}",
    # Ended records by when they ended: those past their retention.
    "CREATE INDEX IF NOT EXISTS sandboxes_ended_at ON sandboxes (ended_at, status, id) "
    "WHERE ended_at IS NOT NULL",
    # ... of them, those whose teardown has released them, which the retention pass forgets
    # (the one above is what a sandlot before 2026-12-07 on the same data directory uses).
    "CREATE INDEX IF NOT EXISTS sandboxes_ended_free ON sandboxes (ended_at, status, id, held) "
    "WHERE ended_at IS NOT NULL AND held = 0",
    # Ended records with no ended_at: those an older sandlot still running on the data
    # directory ends (its writes leave the column out), few at any time.
    "CREATE INDEX IF NOT EXISTS sandboxes_undated ON sandboxes (id) "
    f"WHERE ended_at IS NULL AND {_ENDED}",
    # Copies under way, few at any time: the stale ones are found without reading the rest.
    "CREATE INDEX IF NOT EXISTS artifacts_pending ON artifacts (created_at) WHERE sha256 = ''",
    # A file from before the usage table: its owners' usage, from their rows, once (SQL's
    # form of artifact_charge).
    "INSERT INTO artifact_usage (owner, charged_bytes) "  # noqa: S608 - a constant
    f"SELECT s.owner, SUM({_charge_sql('a.size_bytes')}) FROM artifacts a "
    "JOIN sandboxes s ON s.id = a.sandbox_id "
    "WHERE NOT EXISTS (SELECT 1 FROM artifact_usage) GROUP BY s.owner",
)

# Several processes share the file (one per manager instance): a writer waits this long for
# another's transaction, each of which is one short statement.
BUSY_TIMEOUT_S = 30.0

# The digest of an artifact row whose copy is under way (Store.reserve_artifact): it counts
# against its owner's quota, but is listed nowhere. After this long its process is taken to
# have died mid-copy (an export is cut after core/artifacts.EXPORT_TIMEOUT_S).
PENDING = ""
PENDING_ARTIFACT_TTL_S = 600.0

# Other instances' live records, by instance.
Elsewhere = dict[str, list[SandboxInfo]]
# Ids given to one statement (SQLite allows 32,766 parameters).
_IDS_AT_ONCE = 500


class Store:
    """Thread-safe, and shared by processes; every call is one short transaction.

    ``instance`` is the manager instance whose records :meth:`save` inserts.

    Two connections: one for writes and short reads, behind ``_lock``, and one for the reads
    whose length a tenant can choose (a listing's page, the reaper's search for records past
    the cap), behind a lock of its own: in WAL mode a reader neither waits for a writer nor
    holds one up, so a tenant's listing no longer holds every other tenant's create.
    """

    def __init__(self, path: Path, instance: str = "") -> None:
        self.path = path
        self.instance = instance
        self._lock = threading.Lock()
        self._db = open_schema(path, BUSY_TIMEOUT_S, SCHEMA, "sandboxes", MIGRATIONS, after=INDEXES)
        self._read_lock = threading.Lock()
        try:
            self._reader = connect_shared(path, BUSY_TIMEOUT_S)
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._db.close()

    def save(self, info: SandboxInfo, *, held: bool = False) -> None:
        """Insert or update the record; ``held``: it has ended, but its teardown still holds
        what it reserved, so the other processes of the data directory count it until
        :meth:`release`."""
        with self._lock:
            self._save(info, held=held)

    def release(self, sandbox_id: str) -> None:
        """Its teardown has ended: it holds nothing any more."""
        with self._lock:
            self._db.execute("UPDATE sandboxes SET held=0 WHERE id=? AND held=1", (sandbox_id,))

    def held_elsewhere(self, owner: str | None) -> dict[str, str]:
        """Ended sandboxes of other instances (``owner``'s, if given) whose teardown still
        holds their limits: id -> instance."""
        query = "SELECT id, instance FROM sandboxes INDEXED BY sandboxes_held_by WHERE held=1"
        args: tuple[str, ...] = ()
        if owner is not None:
            query, args = query + " AND owner = ?", (owner,)
        with self._lock:
            rows = self._db.execute(query + " AND instance != ?", (*args, self.instance))
            return {sandbox_id: instance for sandbox_id, instance in rows}

    def release_instance(self, instance: str) -> None:
        """A dead instance's leftovers are swept: its ended sandboxes hold nothing any more."""
        with self._lock:
            self._db.execute("UPDATE sandboxes SET held=0 WHERE instance=? AND held=1", (instance,))

    def _save(
        self, info: SandboxInfo, *, held: bool = False, artifact_limit_bytes: int | None = None
    ) -> None:
        self._db.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, info, instance, held, "
            "artifact_limit_bytes, ended_at) VALUES (?,?,?,?,?,?,?,?,?) "
            # The instance stays the one that made it: recovery saves others' records. The
            # artifact limit is the one given when the record was made.
            "ON CONFLICT(id) DO UPDATE SET status=excluded.status, info=excluded.info, "
            "held=excluded.held, ended_at=excluded.ended_at",
            (
                info.id,
                info.owner,
                info.status.value,
                info.created_at,
                info.model_dump_json(),
                self.instance,
                int(held),
                artifact_limit_bytes,
                info.ended_at,
            ),
        )

    def admit(
        self, decide: Callable[[Elsewhere], SandboxInfo], *, artifact_limit_bytes: int | None
    ) -> SandboxInfo:
        """Save the record ``decide`` returns, given the other instances' live records read
        in the same write transaction (``decide`` raises to refuse: nothing is saved), with
        its owner's ``artifact_limit_bytes`` (None: no limit).

        Processes admitting at once are serialized by SQLite's write lock, so the second
        one's check sees the first one's new sandbox: with a read, then a separate save, two
        processes on one data directory could each admit a tenant's last allowed sandbox."""
        with self._lock, write_transaction(self._db):
            info = decide(self._live_elsewhere())
            self._save(info, artifact_limit_bytes=artifact_limit_bytes)
        return info

    def artifact_limit(self, sandbox_id: str) -> int | None:
        """The artifact quota (bytes) of the sandbox's owner, as given when it was admitted;
        None for no limit (or no record)."""
        with self._lock:
            row = self._db.execute(
                "SELECT artifact_limit_bytes FROM sandboxes WHERE id=?", (sandbox_id,)
            ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def get(self, sandbox_id: str) -> SandboxInfo | None:
        with self._lock:
            row = self._db.execute(
                "SELECT info FROM sandboxes WHERE id=?", (sandbox_id,)
            ).fetchone()
        return SandboxInfo.model_validate_json(row[0]) if row else None

    def instance_of(self, sandbox_id: str) -> str | None:
        """The instance that runs (or ran) the sandbox; None if there is no record."""
        with self._lock:
            row = self._db.execute(
                "SELECT instance FROM sandboxes WHERE id=?", (sandbox_id,)
            ).fetchone()
        return str(row[0]) if row else None

    def list(
        self,
        owner: str | None = None,
        live_only: bool = False,
        instance: str | None = None,
        *,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Records, oldest first; ``limit`` of them from the ``offset``-th (None: all).

        The page's ids come from an index (``sandboxes_by_owner``, ``sandboxes_by_created``)
        alone, and only the page's records are read and parsed; on the reader connection,
        so the store's writes do not wait for it."""
        query = "SELECT id FROM sandboxes WHERE 1=1"
        args: list[str | int] = []
        if owner is not None:
            query += " AND owner=?"
            args.append(owner)
        if instance is not None:
            query += " AND instance=?"
            args.append(instance)
        if live_only:
            query += f" AND status IN ({','.join('?' * len(LIVE))})"
            args.extend(LIVE)
        query += " ORDER BY created_at, id LIMIT ? OFFSET ?"
        args += [-1 if limit is None else int(limit), int(offset)]
        with self._read_lock:
            # One read transaction: the page's records as they were when its ids were read.
            self._reader.execute("BEGIN")
            try:
                ids = [row[0] for row in self._reader.execute(query, args)]
                found = dict(self._infos(ids))
            finally:
                self._reader.execute("COMMIT")
        return [SandboxInfo.model_validate_json(found[i]) for i in ids if i in found]

    def _infos(self, ids: builtins.list[str]) -> builtins.list[tuple[str, str]]:
        """(id, info) of each of ``ids`` that has a record (on the reader connection)."""
        rows: list[tuple[str, str]] = []
        for start in range(0, len(ids), _IDS_AT_ONCE):
            chunk = ids[start : start + _IDS_AT_ONCE]
            rows += self._reader.execute(
                f"SELECT id, info FROM sandboxes WHERE id IN ({','.join('?' * len(chunk))})",  # noqa: S608 - placeholders only
                chunk,
            ).fetchall()
        return rows

    def live_elsewhere(self) -> Elsewhere:
        """Live records of instances other than this store's, by instance."""
        with self._lock:
            return self._live_elsewhere()

    def _live_elsewhere(self) -> Elsewhere:
        rows = self._db.execute(
            # Ended ones still held by their teardown count too (they keep their limits). Two
            # indexed halves: an OR of the two conditions made SQLite scan the whole table.
            f"SELECT instance, info FROM sandboxes WHERE status IN ({_LIVE_SLOTS}) "  # noqa: S608 - placeholders only
            "AND instance != ? UNION ALL "
            "SELECT instance, info FROM sandboxes INDEXED BY sandboxes_held_by "
            f"WHERE held=1 AND status NOT IN ({_LIVE_SLOTS}) AND instance != ?",
            (*LIVE, self.instance, *LIVE, self.instance),
        ).fetchall()
        found: Elsewhere = {}
        for instance, info in rows:
            found.setdefault(instance, []).append(SandboxInfo.model_validate_json(info))
        return found

    def backends_used(self, instance: str) -> set[str]:
        """Every backend a sandbox of ``instance`` ran on (whose leftovers a sweep seeks)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT json_extract(info, '$.backend') FROM sandboxes WHERE instance=?",
                (instance,),
            ).fetchall()
        return {r[0] for r in rows if isinstance(r[0], str)}

    def add_artifact(self, artifact: ArtifactInfo) -> None:
        """Record a copy made (of at most the size :meth:`reserve_artifact` reserved for it);
        its owner is charged for what it holds."""
        with self._lock, write_transaction(self._db):
            owner = self._owner_of(artifact.sandbox_id)
            before = self._row_size(artifact.sandbox_id, artifact.path)
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
            change = artifact_charge(artifact.size_bytes)
            if before is not None:
                change -= artifact_charge(before)
            self._charge(owner, change)

    def reserve_artifact(
        self, owner: str, sandbox_id: str, path: str, size_bytes: int, limit_bytes: int | None
    ) -> bool:
        """Record the artifact ``path`` of ``sandbox_id`` as being copied, its charge
        (:func:`artifact_charge` of ``size_bytes``) counted against ``owner``'s
        ``limit_bytes`` (None: no limit) from now on; False, recording nothing, if that would
        pass the limit. The check and the record are one write transaction: exports running
        at once (the destroys of a tenant's sandboxes, in any process of the data directory)
        each see the others' reservations, where reading the sum at each export's start let
        every one of them keep a whole quota. :meth:`add_artifact` records the copy made (at
        most the size reserved); :meth:`drop_artifact` gives the room back."""
        with self._lock, write_transaction(self._db):
            self._expire_pending(owner)
            charge = artifact_charge(size_bytes)
            # A row replaced (a rescue re-reserving what a crashed export reserved or kept)
            # gives its charge back: checked as new, the rescue of a crash was refused as
            # over the quota that its own rows filled (red team, 2026-12-07).
            before = self._row_size(sandbox_id, path)
            replaced = artifact_charge(before) if before is not None else 0
            if limit_bytes is not None and self._usage(owner) - replaced + charge > limit_bytes:
                return False
            self._db.execute(
                "INSERT OR REPLACE INTO artifacts VALUES (?,?,?,?,?)",
                (sandbox_id, path, size_bytes, PENDING, time.time()),
            )
            self._charge(owner, charge - replaced)
        return True

    def drop_artifact(self, sandbox_id: str, path: str) -> None:
        with self._lock, write_transaction(self._db):
            before = self._row_size(sandbox_id, path)
            if before is None:
                return
            self._db.execute(
                "DELETE FROM artifacts WHERE sandbox_id=? AND path=?", (sandbox_id, path)
            )
            self._charge(self._owner_of(sandbox_id), -artifact_charge(before))

    def artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]:
        """The artifacts kept for ``sandbox_id`` (not those still being copied)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id, path, size_bytes, sha256, created_at FROM artifacts "
                "WHERE sandbox_id=? AND sha256 != ? ORDER BY path",
                (sandbox_id, PENDING),
            ).fetchall()
        keys = ("sandbox_id", "path", "size_bytes", "sha256", "created_at")
        return [ArtifactInfo(**dict(zip(keys, row, strict=True))) for row in rows]

    def kept(self, sandbox_id: str, path: str) -> bool:
        """Whether ``sandbox_id`` kept an artifact at ``path`` (one row by its key: a download
        read every row of its sandbox, 35-100 ms of the event loop for 10,000 of them, red
        team 2026-12-06)."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM artifacts WHERE sandbox_id=? AND path=? AND sha256 != ?",
                (sandbox_id, path, PENDING),
            ).fetchone()
        return row is not None

    def sandboxes_with_artifacts_before(self, kept_before: float) -> builtins.list[str]:
        """Sandboxes whose newest kept artifact is older than ``kept_before`` (Unix time)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id FROM artifacts GROUP BY sandbox_id HAVING MAX(created_at) < ?",
                (kept_before,),
            ).fetchall()
        return [row[0] for row in rows]

    def artifact_bytes(self, owner: str) -> int:
        """What all of ``owner``'s kept artifacts, and those being copied, are charged."""
        with self._lock, write_transaction(self._db):
            self._expire_pending(owner)
            return self._usage(owner)

    def _usage(self, owner: str) -> int:
        row = self._db.execute(
            "SELECT charged_bytes FROM artifact_usage WHERE owner=?", (owner,)
        ).fetchone()
        return int(row[0]) if row else 0

    def _charge(self, owner: str | None, change: int) -> None:
        if owner is None or not change:
            return
        updated = self._db.execute(
            "UPDATE artifact_usage SET charged_bytes = MAX(0, charged_bytes + ?) WHERE owner=?",
            (change, owner),
        )
        if not updated.rowcount:
            self._db.execute("INSERT INTO artifact_usage VALUES (?, MAX(0, ?))", (owner, change))

    def _owner_of(self, sandbox_id: str) -> str | None:
        row = self._db.execute("SELECT owner FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return str(row[0]) if row else None

    def _row_size(self, sandbox_id: str, path: str) -> int | None:
        row = self._db.execute(
            "SELECT size_bytes FROM artifacts WHERE sandbox_id=? AND path=?", (sandbox_id, path)
        ).fetchone()
        return int(row[0]) if row else None

    def _expire_pending(self, owner: str) -> None:
        """A reservation older than the TTL is a copy its process never finished (it died):
        it no longer counts (inside a write transaction)."""
        stale = self._db.execute(
            "SELECT a.sandbox_id, a.path, a.size_bytes FROM artifacts a INDEXED BY "
            "artifacts_pending JOIN sandboxes s ON s.id = a.sandbox_id "
            "WHERE a.sha256 = '' AND a.created_at < ? AND s.owner = ?",
            (time.time() - PENDING_ARTIFACT_TTL_S, owner),
        ).fetchall()
        for sandbox_id, path, size_bytes in stale:
            self._db.execute(
                "DELETE FROM artifacts WHERE sandbox_id=? AND path=?", (sandbox_id, path)
            )
            self._charge(owner, -artifact_charge(size_bytes))

    def forget_ended_before(self, ended_before: float) -> int:
        """Delete the records of sandboxes that ended before ``ended_before`` (Unix time) and
        keep no artifacts; return how many went. By the ``ended_at`` index: only the records
        past their retention are read."""
        with self._lock:
            # Dated first: the migration dated the records of its time once, but an older
            # sandlot on the same data directory (a rolling upgrade, an old script) goes on
            # ending records without the column, and they were kept for good (red team,
            # 2026-12-07). Their JSON's own end, else now: kept a retention period from here.
            self._db.execute(
                "UPDATE sandboxes INDEXED BY sandboxes_undated "  # noqa: S608 - a constant
                "SET ended_at = COALESCE(json_extract(info, '$.ended_at'), ?) "
                f"WHERE ended_at IS NULL AND {_ENDED}",
                (time.time(),),
            )
            cursor = self._db.execute(
                "DELETE FROM sandboxes INDEXED BY sandboxes_ended_free "  # noqa: S608 - a constant
                # Not one still held: its teardown has not released it, and the other
                # processes count it until then (a short retention forgot it first: red
                # team, 2026-12-07).
                f"WHERE ended_at < ? AND {_ENDED} AND held = 0 AND NOT EXISTS "
                "(SELECT 1 FROM artifacts WHERE artifacts.sandbox_id = sandboxes.id)",
                (ended_before,),
            )
        return cursor.rowcount

    def forget_beyond(self, keep: int) -> int:
        """Delete each owner's ended records past its newest ``keep`` but those that keep
        artifacts (:meth:`kept_beyond` names those, for their artifacts to be deleted first:
        they count towards the ``keep``); return how many went. A tenant that made and
        destroyed sandboxes in a loop, each with its metadata cap, kept 7,774 records (106 MB
        of the store) in four minutes, for the whole retention period (red team,
        2026-12-06).

        The records past the cap are found on the reader connection, from the
        ``sandboxes_ended_by_owner`` index alone (it read every ended record's row under the
        store's lock); only their deletion takes the lock."""
        doomed = self._beyond(keep)
        gone = 0
        for start in range(0, len(doomed), _IDS_AT_ONCE):
            chunk = doomed[start : start + _IDS_AT_ONCE]
            with self._lock:
                cursor = self._db.execute(
                    # Ended and holding nothing still (they do not come back), and no artifact
                    # kept meanwhile.
                    f"DELETE FROM sandboxes WHERE id IN ({','.join('?' * len(chunk))}) "  # noqa: S608 - placeholders only
                    f"AND held = 0 AND {_ENDED} AND NOT EXISTS "
                    "(SELECT 1 FROM artifacts WHERE artifacts.sandbox_id = sandboxes.id)",
                    chunk,
                )
            gone += cursor.rowcount
        return gone

    def kept_beyond(self, keep: int) -> builtins.list[str]:
        """The ended records past their owner's newest ``keep`` that keep artifacts (or
        copies under way): the records cap counts them too, and their artifacts are deleted
        (``Artifacts.delete_beyond``, which frees their quota) before :meth:`forget_beyond`
        forgets them. Kept apart before, 30 sandboxes that each kept one empty file stayed
        past a cap of 5, for 4 KiB of quota each: 262,144 records a tenant at a 1 GiB
        artifact quota, where the cap was 10,000 (red team, 2026-12-06)."""
        doomed = self._beyond(keep)
        kept: list[str] = []
        with self._read_lock:
            for sandbox_id in doomed:
                row = self._reader.execute(
                    "SELECT 1 FROM artifacts WHERE sandbox_id = ? LIMIT 1", (sandbox_id,)
                ).fetchone()
                if row is not None:
                    kept.append(sandbox_id)
        return kept

    def _beyond(self, keep: int) -> builtins.list[str]:
        """Ids of each owner's ended records that hold nothing, past its newest ``keep``,
        from the ``sandboxes_ended_by_owner`` index alone: its owners one seek each, then
        each owner's ``keep`` newest entries skipped (on the reader connection)."""
        doomed: list[str] = []
        after, owner = ">=", ""  # every owner is >= "", the empty one too
        while True:
            with self._read_lock:
                row = self._reader.execute(
                    "SELECT owner FROM sandboxes INDEXED BY sandboxes_ended_by_owner "  # noqa: S608 - constants
                    f"WHERE held = 0 AND {_ENDED} AND owner {after} ? ORDER BY owner LIMIT 1",
                    (owner,),
                ).fetchone()
                if row is None:
                    return doomed
                after, owner = ">", str(row[0])
                doomed += [
                    r[0]
                    for r in self._reader.execute(
                        "SELECT id FROM sandboxes INDEXED BY sandboxes_ended_by_owner "  # noqa: S608 - a constant
                        f"WHERE owner = ? AND held = 0 AND {_ENDED} "
                        "ORDER BY created_at DESC, id DESC LIMIT -1 OFFSET ?",
                        (owner, keep),
                    )
                ]

    def delete_artifacts(self, sandbox_id: str) -> int:
        with self._lock, write_transaction(self._db):
            (charged,) = self._db.execute(
                f"SELECT COALESCE(SUM({_charge_sql('size_bytes')}), 0) "  # noqa: S608 - a constant
                "FROM artifacts WHERE sandbox_id=?",
                (sandbox_id,),
            ).fetchone()
            cursor = self._db.execute("DELETE FROM artifacts WHERE sandbox_id=?", (sandbox_id,))
            self._charge(self._owner_of(sandbox_id), -int(charged))
        return cursor.rowcount
