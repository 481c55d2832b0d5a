"""The store's bounds on what one tenant leaves in it, and the cost of its queries.

Red team, 2026-12-06: one tenant's ended records stalled every tenant's calls. Records that
kept an empty artifact each were never forgotten (30 kept past a cap of 5); metadata of
control characters took six bytes of the store for each byte of the cap; and a listing's
last page, or the reaper's pass, read and parsed every record under the store's one lock
(11.6 s for ``limit=1&offset=9999``), which another tenant's create waited for (20-28 s).

Work is measured here, never time: what SQLite reads (``rchar`` of ``/proc/self/io``: its
pages come by ``pread``), its query plans, and whether the store's write lock is taken.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import SandboxManager
from sandlot.core import admission
from sandlot.core.artifacts import Artifacts
from sandlot.core.store import Store, artifact_charge
from sandlot.errors import ConfigError
from sandlot.models import ArtifactInfo, ResolvedLimits, SandboxInfo, SandboxStatus
from sandlot.requests import WriteFile
from tests.conftest import make_settings

RECORDS = 10_000
# Each record's metadata: 40 MB of records in all, which a query that reads them shows.
METADATA = {"k": "m" * 4000}
MIB = 1 << 20


@pytest.fixture
def data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    path = data_root / f"bounds-{request.node.name}"
    path.mkdir()
    return path


def _info(sandbox_id: str, owner: str, n: int, *, ended: bool = True) -> SandboxInfo:
    start = 1_000_000.0 + n
    return SandboxInfo(
        id=sandbox_id,
        backend="unsafe-local",
        status=SandboxStatus.DESTROYED if ended else SandboxStatus.RUNNING,
        owner=owner,
        limits=ResolvedLimits(
            memory_mb=256,
            cpu_cores=1.0,
            pids=64,
            timeout_s=10.0,
            disk_mb=64,
            output_limit_bytes=1 << 20,
            output_file_limit_mb=1,
        ),
        network=False,
        metadata=METADATA,
        created_at=start,
        last_active_at=start,
        expires_at=start + 60,
        idle_timeout_s=60.0,
        ended_at=start + 1 if ended else None,
        end_reason="user" if ended else None,
    )


def _fill(store: Store, owner: str, count: int, *, artifacts: bool = False) -> None:
    """``count`` ended records of ``owner`` through the store's own save, in one transaction
    (10,000 commits would take seconds); each keeping one empty artifact if ``artifacts``."""
    store._db.execute("BEGIN")
    for n in range(count):
        info = _info(f"{owner}-{n:05d}", owner, n)
        store._save(info)
        if artifacts:
            store._db.execute(
                "INSERT INTO artifacts VALUES (?, 'a', 0, 'e3b0', ?)", (info.id, time.time())
            )
    store._db.execute("COMMIT")


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A store file with one tenant's 10,000 ended records (40 MB), each keeping one empty
    artifact (so none of them is forgotten), and another tenant's one live record."""
    path = tmp_path_factory.mktemp("big") / "sandlot.db"
    store = Store(path, "one")
    try:
        _fill(store, "greedy", RECORDS, artifacts=True)
        store.save(_info("quiet-live", "quiet", 0, ended=False))
    finally:
        store.close()
    yield path


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _reads(call: Callable[[], Any]) -> tuple[Any, int]:
    """What ``call`` returns, and the bytes this process read meanwhile."""
    before = _read_bytes()
    result = call()
    return result, _read_bytes() - before


class _NoWriteLock:
    """Stands for the store's write lock: a call that takes it fails."""

    def __enter__(self) -> None:
        raise AssertionError("the store's write lock was taken")

    def __exit__(self, *exc: object) -> None:
        return None


def _plans(store: Store, call: Callable[[], Any]) -> list[tuple[str, list[str]]]:
    """Each statement ``call`` ran on any of the store's connections, and its query plan."""
    statements: list[str] = []
    connections = [c for c in vars(store).values() if isinstance(c, sqlite3.Connection)]
    for connection in connections:
        connection.set_trace_callback(statements.append)
    try:
        call()
    finally:
        for connection in connections:
            connection.set_trace_callback(None)
    probe = sqlite3.connect(store.path)
    try:
        return [
            (sql, [row[3] for row in probe.execute("EXPLAIN QUERY PLAN " + sql)])
            for sql in statements
            if "sandboxes" in sql and not sql.startswith(("BEGIN", "COMMIT"))
        ]
    finally:
        probe.close()


# ---------------------------------------------------------------- metadata, as stored


def test_metadata_is_counted_as_the_store_holds_it() -> None:
    # Failed before: counted as UTF-8, 16,000 control characters passed a cap of 16,384 and
    # took 94 KiB of the store (each written \u0001).
    cap = 16_384
    with pytest.raises(ConfigError, match="SANDBOX_MAX_METADATA_BYTES"):
        admission.check_metadata({"k": "\x01" * 16_000}, cap)
    with pytest.raises(ConfigError, match="as stored"):
        admission.check_metadata({"k": "\x01" * (cap // 6 + 1)}, cap)
    with pytest.raises(ConfigError):
        admission.check_metadata({"k": '"' * (cap // 2 + 1)}, cap)
    # What fits the cap as counted takes no more than that in the stored record, and the
    # punctuation of its entry ('"":"",').
    empty = _info("sb", "acme", 0).model_copy(update={"metadata": {}})
    for value in ("\x01" * (cap // 6 - 1), "a" * (cap - 1), "é" * (cap // 2 - 1), "\n\\" * 4000):
        metadata = {"k": value}
        admission.check_metadata(metadata, cap)
        stored = empty.model_copy(update={"metadata": metadata}).model_dump_json().encode()
        assert len(stored) - len(empty.model_dump_json().encode()) <= cap + 5, value[:4]


# ------------------------------------------------------ the records cap counts them all


async def test_records_that_keep_artifacts_count_towards_the_cap(data_dir: Path) -> None:
    # Failed before: a record that kept an artifact was never forgotten, so 30 sandboxes that
    # kept an empty file each all stayed past a cap of 5 (4 KiB of quota apiece).
    settings = make_settings(
        data_dir, backend="unsafe-local", max_ended_records=3, reaper_interval_s=3600
    )
    async with SandboxManager(settings) as mgr:  # reaped below, not meanwhile
        ids = []
        for _ in range(6):
            info = await mgr.create(owner="acme")
            await mgr.write_file(info.id, WriteFile(path="artifacts/a"), b"")
            await mgr.destroy(info.id)
            ids.append(info.id)
        assert mgr._store.artifact_bytes("acme") == 6 * artifact_charge(0)
        await mgr.settle()  # a record counts once its teardown holds nothing
        await mgr.reap()
        left = [info.id for info in await mgr.list(owner="acme", include_ended=True)]
        assert left == ids[3:]  # the newest three, with their artifacts
        for sandbox_id in ids[3:]:
            assert [a.path for a in await mgr.list_artifacts(sandbox_id)] == ["a"]
        # The forgotten ones' artifacts went with them: their files and their quota.
        assert mgr._store.artifact_bytes("acme") == 3 * artifact_charge(0)
        for sandbox_id in ids[:3]:
            assert not (data_dir / "artifacts" / sandbox_id).exists()
            assert mgr._store.artifacts(sandbox_id) == []


async def test_the_cap_deletes_artifacts_before_it_forgets_their_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot.core import artifacts as artifacts_module

    monkeypatch.setattr(artifacts_module, "DELETED_BEYOND_A_PASS", 1)  # one a pass, here
    store = Store(tmp_path / "sandlot.db", "one")
    try:
        _fill(store, "acme", 8)
        _fill(store, "beta", 2)
        artifacts = Artifacts(tmp_path, store)
        for n in (0, 1, 6, 7):
            sandbox_id = f"acme-{n:05d}"
            assert store.reserve_artifact("acme", sandbox_id, "f", 10, None)
            kept = ArtifactInfo(
                sandbox_id=sandbox_id, path="f", size_bytes=10, sha256="x", created_at=time.time()
            )
            store.add_artifact(kept)
            (tmp_path / "artifacts" / sandbox_id).mkdir(parents=True)
            (tmp_path / "artifacts" / sandbox_id / "f").write_bytes(b"0123456789")
        # Alone, forget_beyond leaves the records that keep artifacts (their files are not
        # the store's to delete, nor under its lock).
        assert store.kept_beyond(3) == ["acme-00001", "acme-00000"]
        assert await artifacts.delete_beyond(3) == 1
        assert await artifacts.delete_beyond(3) == 1
        assert await artifacts.delete_beyond(3) == 0
        assert store.artifact_bytes("acme") == 2 * artifact_charge(10)
        assert not (tmp_path / "artifacts" / "acme-00000").exists()
        assert (tmp_path / "artifacts" / "acme-00007" / "f").exists()
        assert store.forget_beyond(3) == 5
        assert [i.id for i in store.list(owner="acme")] == [f"acme-{n:05d}" for n in (5, 6, 7)]
        assert len(store.list(owner="beta")) == 2
    finally:
        store.close()


# ------------------------------------------------------------------- the queries' cost


def test_a_listing_page_reads_only_its_own_records(big_store: Path) -> None:
    # Failed before: every page read and sorted all 10,000 records (their info too), under
    # the store's write lock.
    store = Store(big_store, "two")
    try:
        page, read = _reads(lambda: store.list(owner="greedy", limit=1, offset=RECORDS - 1))
        assert [info.id for info in page] == [f"greedy-{RECORDS - 1:05d}"]
        assert read < 2 * MIB, read  # the records are 40 MB
        page, read = _reads(lambda: store.list(owner="greedy", limit=1000, offset=RECORDS - 1000))
        assert [info.id for info in page] == [f"greedy-{n:05d}" for n in range(9000, RECORDS)]
        assert read < 10 * MIB, read  # a page's own records: 4 MB
        assert [i.id for i in store.list(owner="quiet")] == ["quiet-live"]
        assert len(store.list(limit=5, offset=RECORDS - 2)) == 3  # everyone's
        # Nor does it hold up the store's writes: it reads on a connection of its own.
        store._lock = _NoWriteLock()  # type: ignore[assignment]
        assert len(store.list(owner="greedy", limit=1000)) == 1000
        store._lock = threading.Lock()
        for sql, plan in _plans(store, lambda: store.list(owner="greedy", limit=1, offset=9999)):
            steps = " | ".join(plan)
            assert "TEMP B-TREE" not in steps, (sql, steps)
            assert "COVERING INDEX" in steps or "(id=?)" in steps, (sql, steps)
    finally:
        store._lock = threading.Lock()
        store.close()


def test_the_reapers_pass_reads_no_record(big_store: Path) -> None:
    # Failed before: forget_ended_before parsed every record's JSON each pass (2.4-3.3 s for
    # one tenant's 10,000), and forget_beyond read every ended record's row, all under the
    # store's lock.
    store = Store(big_store, "two")
    try:
        gone, read = _reads(lambda: store.forget_ended_before(time.time()))
        assert gone == 0  # each keeps an artifact
        assert read < 2 * MIB, read
        beyond, read = _reads(lambda: store.kept_beyond(RECORDS))
        assert beyond == []
        assert read < 2 * MIB, read
        store._lock = _NoWriteLock()  # type: ignore[assignment]
        gone, read = _reads(lambda: store.forget_beyond(RECORDS))
        assert gone == 0
        assert read < 2 * MIB, read
        store._lock = threading.Lock()
        beyond = store.kept_beyond(RECORDS - 2)
        assert beyond == ["greedy-00001", "greedy-00000"]
        for call in (
            lambda: store.forget_ended_before(time.time()),
            lambda: store.forget_beyond(RECORDS - 2),
        ):
            for sql, plan in _plans(store, call):
                steps = " | ".join(plan)
                # The undated records' partial index holds only those it dates.
                assert (
                    "COVERING INDEX" in steps
                    or "(id=?)" in steps
                    or "USING INDEX sandboxes_undated" in steps
                ), (sql, steps)
    finally:
        store._lock = threading.Lock()
        store.close()


def test_records_past_their_retention_are_found_by_when_they_ended(tmp_path: Path) -> None:
    store = Store(tmp_path / "sandlot.db", "one")
    try:
        _fill(store, "acme", 10)
        store.save(_info("live", "acme", 0, ended=False))
        store._db.execute("INSERT INTO artifacts VALUES ('acme-00002', 'a', 0, 'x', 0)")
        # Records 0-4 ended before 1_000_006.
        assert store.forget_ended_before(1_000_006.0) == 4
        left = [i.id for i in store.list(owner="acme")]
        assert left == ["live", "acme-00002"] + [f"acme-{n:05d}" for n in range(5, 10)]
    finally:
        store.close()


def test_a_store_from_before_the_ended_at_column_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "sandlot.db"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT "
        "NULL, created_at REAL NOT NULL, info TEXT NOT NULL, instance TEXT NOT NULL DEFAULT "
        "'', held INTEGER NOT NULL DEFAULT 0, artifact_limit_bytes INTEGER)"
    )
    for n, ended in enumerate((True, True, False)):
        info = _info(f"sb-{n}", "acme", n, ended=ended)
        old.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, info) VALUES (?,?,?,?,?)",
            (info.id, info.owner, info.status.value, info.created_at, info.model_dump_json()),
        )
    old.commit()
    old.close()
    stores = [Store(path, "one"), Store(path, "two")]  # the second finds it done
    try:
        rows = dict(stores[0]._db.execute("SELECT id, ended_at FROM sandboxes").fetchall())
        assert rows == {"sb-0": 1_000_001.0, "sb-1": 1_000_002.0, "sb-2": None}
        assert stores[1].forget_ended_before(1_000_001.5) == 1
        assert [i.id for i in stores[0].list()] == ["sb-1", "sb-2"]
    finally:
        for store in stores:
            store.close()


def test_a_record_ended_by_an_older_sandlot_on_the_data_dir_is_forgotten_in_time(
    tmp_path: Path,
) -> None:
    # Failed before (red team, 2026-12-07): an older sandlot running beside this one on the
    # data directory (a rolling upgrade, an old script) ends records without ended_at, as its
    # save knows no such column; the migration dated records once, when it added the column,
    # so those were kept for good.
    path = tmp_path / "sandlot.db"
    Store(path, "new").close()
    old = sqlite3.connect(path)
    for n, info in enumerate((_info("old-0", "acme", 0), _info("old-1", "acme", 1))):
        if n == 1:
            info.ended_at = None  # a record whose JSON says no end either: dated now
        # What 396077e's Store._save writes.
        old.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, info, instance, held, "
            "artifact_limit_bytes) VALUES (?,?,?,?,?,?,?,?)",
            (info.id, info.owner, info.status.value, info.created_at, info.model_dump_json(),
             "old", 0, None),
        )  # fmt: skip
    old.commit()
    old.close()
    store = Store(path, "new-again")
    try:
        before = time.time()
        assert store.forget_ended_before(1_000_005.0) == 1
        rows = dict(store._db.execute("SELECT id, ended_at FROM sandboxes").fetchall())
        assert list(rows) == ["old-1"] and rows["old-1"] >= before
        assert store.forget_ended_before(time.time() + 1) == 1
    finally:
        store.close()


class _Killed(BaseException):
    """Stands for a kill -9: nothing after it runs."""


@pytest.mark.asyncio
async def test_an_artifact_delete_cut_by_a_crash_leaves_no_files_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed before (red team, 2026-12-07): the rows (and their charge) went first, then the
    # files; a manager killed between the two (0.86 s for 8,176 files) left them on disk with
    # no row and no charge, and no pass of any manager ever looked at them again.
    from sandlot.core import artifacts as artifacts_module

    store = Store(tmp_path / "sandlot.db", "one")
    info = _info("sb-kept", "acme", 0)
    store.save(info)
    directory = tmp_path / "artifacts" / info.id
    directory.mkdir(parents=True)
    for n in range(20):
        (directory / f"f{n}").write_bytes(b"x" * 4000)
        store.add_artifact(
            ArtifactInfo(
                sandbox_id=info.id, path=f"f{n}", size_bytes=4000, sha256="ab", created_at=1.0
            )
        )

    def killed(path: Path) -> bool:
        raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(artifacts_module, "remove_tree", killed)
        with pytest.raises(_Killed):
            await Artifacts(tmp_path, store).delete(info.id)
    store.close()
    store = Store(tmp_path / "sandlot.db", "two")  # the next manager, and its reaper's pass
    try:
        assert store.artifacts(info.id) == []
        assert store.artifact_bytes("acme") == 0
        await Artifacts(tmp_path, store).delete_older_than(0.0)
        left = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
        assert left == [], f"{len(left)} files left with no row, charged to no one"
    finally:
        store.close()


def test_a_reservation_that_replaces_a_row_is_checked_without_it(tmp_path: Path) -> None:
    # Failed before (red team, 2026-12-07): the rescue of a crashed export re-reserves the
    # paths that export reserved, and was checked as if they were new: refused as over the
    # quota its own rows filled, for the 10 minutes a pending row lives.
    store = Store(tmp_path / "sandlot.db", "one")
    try:
        store.save(_info("sb", "acme", 0))
        limit = artifact_charge(2 * MIB) + artifact_charge(MIB)
        assert store.reserve_artifact("acme", "sb", "a", 2 * MIB, limit)
        assert store.reserve_artifact("acme", "sb", "a", 2 * MIB, limit)  # the same again
        assert store.artifact_bytes("acme") == artifact_charge(2 * MIB)
        assert store.reserve_artifact("acme", "sb", "b", MIB, limit)
        assert not store.reserve_artifact("acme", "sb", "c", 1, limit)
    finally:
        store.close()


def test_a_record_its_teardown_still_holds_is_not_forgotten(tmp_path: Path) -> None:
    """Failed before (red team, 2026-12-07): the retention pass deleted an ended record
    whose teardown had not released it yet, and the other processes on the data directory
    stopped counting its limits, so a create refused for that room went through early."""
    mine, peer = Store(tmp_path / "sandlot.db", "aaaa"), Store(tmp_path / "sandlot.db", "bbbb")
    try:
        mine.save(_info("sb-held", "acme", 0), held=True)  # destroyed, torn down still
        assert "sb-held" in peer.held_elsewhere("acme")
        assert peer.forget_ended_before(time.time()) == 0
        assert "sb-held" in peer.held_elsewhere("acme")
        mine.release("sb-held")
        assert peer.forget_ended_before(time.time()) == 1
    finally:
        mine.close()
        peer.close()
