"""The core's side of trust (issue 11): quotas cover every resource a sandbox reserves and
the host's capacity bounds the sum; kept artifacts and records are bounded, private, and one
bad file never loses the others. Admission and bookkeeping are the manager's, whatever
isolates the sandboxes: most tests run on the in-process backend, the artifact ones on every
embedded backend."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from sandlot import Sandbox, SandboxManager
from sandlot._portal import get_portal
from sandlot.core import admission
from sandlot.core.store import artifact_charge
from sandlot.errors import (
    CapacityExhausted,
    ConfigError,
    InvalidRequest,
    QuotaExceeded,
    SandboxFileBusy,
    SandboxFileNotFound,
    SandboxNotADirectory,
    SandboxNotFound,
)
from sandlot.guest.wire import MAX_JSON_DEPTH, MAX_RESULTS, nests_within
from sandlot.models import ArtifactInfo, Quota
from sandlot.requests import OpenPty, ReadFile, RunCode, SandboxSpec, WriteFile
from tests.conftest import make_settings, placement

QUOTA = Quota(
    max_sandboxes=10,
    max_memory_mb=4096,
    max_pids=1000,
    max_cpu_cores=1.0,
    max_disk_mb=200,
)


@pytest.fixture
def data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    path = data_root / f"admission-{request.node.name}"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("first", "second", "setting"),
    [
        ({"pids": 600}, {"pids": 600}, "TENANT_MAX_PIDS"),
        ({"cpu_cores": 0.75}, {"cpu_cores": 0.5}, "TENANT_MAX_CPU_CORES"),
        ({"disk_mb": 150}, {"disk_mb": 64}, "TENANT_MAX_DISK_MB"),
    ],
)
async def test_a_tenant_quota_bounds_every_reserved_resource(
    data_dir: Path, first: dict[str, float], second: dict[str, float], setting: str
) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        await mgr.create(SandboxSpec.model_validate(first), owner="acme", quota=QUOTA)
        with pytest.raises(QuotaExceeded, match=setting):
            await mgr.create(SandboxSpec.model_validate(second), owner="acme", quota=QUOTA)
        # Another tenant is not affected by acme's holdings.
        await mgr.create(SandboxSpec.model_validate(second), owner="globex", quota=QUOTA)


@pytest.mark.parametrize(
    ("override", "spec", "setting"),
    [
        ({"host_memory_overcommit": 0.001}, {"memory_mb": 64}, "SANDBOX_HOST_MEMORY_OVERCOMMIT"),
        ({"host_pids_fraction": 0.000001}, {"pids": 64}, "SANDBOX_HOST_PIDS_FRACTION"),
        ({"max_disk_mb": 1_048_576}, {"disk_mb": 1_048_576}, "SANDBOX_HOST_DISK_FRACTION"),
    ],
)
async def test_the_host_refuses_what_it_cannot_hold(
    data_dir: Path, override: dict[str, float], spec: dict[str, int], setting: str
) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", **override)
    async with SandboxManager(settings) as mgr:
        with pytest.raises(CapacityExhausted, match=setting):
            await mgr.create(SandboxSpec.model_validate(spec))
        assert mgr.live_count() == 0


async def test_the_host_counts_the_memory_of_the_cgroup_its_sandboxes_are_made_in(
    data_dir: Path,
) -> None:
    """Failed before (red team, 2026-12-07): admission counted the machine's MemTotal
    (``/proc/meminfo`` is not namespaced), not the limit of the pod (or any memory cgroup)
    the sandboxes are made in: 256 GiB of sandboxes were admitted into a 64 GiB pod, whose
    OOM then took whatever it chose, or Ray's memory monitor the node agent with every
    tenant's sandboxes. Here a real memory cgroup of 300 MB stands for the pod."""
    import os

    from sandlot.backends.cgroups import CgroupDriver, CgroupLimits

    if os.geteuid() != 0:
        pytest.skip("makes a real cgroup")
    driver = CgroupDriver.detect()
    pod = f"sandlot-pod-{os.getpid()}"
    driver.create((pod,), CgroupLimits(memory_bytes=300 << 20, pids_max=64, cpu_cores=1.0))
    try:
        settings = make_settings(data_dir, backend="unsafe-local", cgroup_root=f"{pod}/sandboxes")
        async with SandboxManager(settings) as mgr:
            await mgr.create(SandboxSpec(memory_mb=256))
            with pytest.raises(CapacityExhausted, match="SANDBOX_HOST_MEMORY"):
                await mgr.create(SandboxSpec(memory_mb=64))
        # An explicit ceiling lowers it further.
        lower = make_settings(data_dir / "b", backend="unsafe-local", host_memory_mb=100)
        async with SandboxManager(lower) as mgr:
            with pytest.raises(CapacityExhausted, match="SANDBOX_HOST_MEMORY_MB"):
                await mgr.create(SandboxSpec(memory_mb=128))
    finally:
        driver.path(pod).remove()


async def test_host_capacity_counts_every_tenant_and_frees_on_destroy(data_dir: Path) -> None:
    # CPU: 0.5 per sandbox; the host may hold as many as its cores times the factor.
    import os

    cores = os.cpu_count() or 1
    settings = make_settings(data_dir, backend="unsafe-local", host_cpu_overcommit=1.0 / cores)
    async with SandboxManager(settings) as mgr:  # capacity: 1 core in all
        a = await mgr.create(SandboxSpec(cpu_cores=0.5), owner="a")
        await mgr.create(SandboxSpec(cpu_cores=0.5), owner="b")
        with pytest.raises(CapacityExhausted, match="SANDBOX_HOST_CPU_OVERCOMMIT"):
            await mgr.create(SandboxSpec(cpu_cores=0.5), owner="c")
        await mgr.destroy(a.id)
        await mgr.create(SandboxSpec(cpu_cores=0.5), owner="c")


async def test_the_hosts_capacity_is_shared_by_every_data_directory(data_dir: Path) -> None:
    """Failed before (red team, 2026-12-07): each data directory's managers counted only
    their own store's sandboxes against the host's capacity, so two data directories on one
    host each admitted 2 x 128 MB against 300 MB. They share the host's ledger now (here one
    of the test's own, as ``/run/sandlot/reserved`` is for every manager of a host)."""
    import os

    cores = os.cpu_count() or 1
    ledger = data_dir / "ledger"
    managers = [
        SandboxManager(
            make_settings(
                data_dir / name,
                backend="unsafe-local",
                host_cpu_overcommit=1.0 / cores,  # 1 core in all: two sandboxes of 0.5
                host_ledger_dir=ledger,
            )
        )
        for name in ("one", "two")
    ]
    for mgr in managers:
        await mgr.start()
    try:
        first = await managers[0].create(SandboxSpec(cpu_cores=0.5))
        await managers[1].create(SandboxSpec(cpu_cores=0.5))
        for mgr in managers:
            with pytest.raises(CapacityExhausted, match="SANDBOX_HOST_CPU_OVERCOMMIT"):
                await mgr.create(SandboxSpec(cpu_cores=0.5))
        await managers[0].destroy(first.id)
        await managers[0].settle()  # released: the room is the host's again
        await managers[1].create(SandboxSpec(cpu_cores=0.5))
    finally:
        await managers[1].close()
        # A manager that closes leaves the ledger: the other one has the room.
        await managers[0].create(SandboxSpec(cpu_cores=0.5))
        await managers[0].close()


@pytest.mark.parametrize(
    ("cap", "over", "under"),
    [
        (1024, "v" * 2000, "v" * 500),
        # As stored, in JSON: 200 control characters are 1,200 bytes there (they counted as
        # 200 before, red team 2026-12-06: test_store_bounds.py has the store's side).
        (600, "\x01" * 200, "\x01" * 99),
    ],
    ids=["text", "control-characters"],
)
async def test_metadata_is_bounded(data_dir: Path, cap: int, over: str, under: str) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", max_metadata_bytes=cap)
    async with SandboxManager(settings) as mgr:
        with pytest.raises(ConfigError, match="SANDBOX_MAX_METADATA_BYTES"):
            await mgr.create(SandboxSpec(metadata={"k": over}))
        await mgr.create(SandboxSpec(metadata={"k": under}))


async def test_ended_records_are_forgotten_after_their_retention(data_dir: Path) -> None:
    # Failed before: every ended sandbox's row stayed forever (+160 MiB with none live).
    settings = make_settings(data_dir, backend="unsafe-local", record_retention_s=0.5)
    async with SandboxManager(settings) as mgr:
        ids = [(await mgr.create()).id for _ in range(5)]
        for sandbox_id in ids:
            await mgr.destroy(sandbox_id)
        assert len(await mgr.list(include_ended=True)) == 5
        await asyncio.sleep(0.8)
        await mgr.reap()
        assert await mgr.list(include_ended=True) == []
        with pytest.raises(SandboxNotFound):
            await mgr.get(ids[0])


def test_kept_state_is_private_to_the_server_user(
    manager: SandboxManager, sandbox: Sandbox
) -> None:
    # Failed before: the store (key hashes, audit log) and kept artifacts were world-readable.
    sandbox.files.write("artifacts/report.txt", "secret")
    sandbox.kill()
    store = manager.settings.data_dir / "sandlot.db"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    kept = get_portal().call(manager.artifact_path(sandbox.id, "report.txt"))
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(kept.parent.parent.stat().st_mode) == 0o700


def test_one_bad_artifact_does_not_lose_the_others(
    manager: SandboxManager, sandbox: Sandbox
) -> None:
    # Failed before: one non-UTF-8 name, or one unreadable file, lost every artifact.
    sandbox.files.write("artifacts/a.txt", "kept")
    made = sandbox.commands.run(
        "cd artifacts && printf x > \"$(printf 'bad\\377name')\" && printf y > locked "
        "&& chmod 000 locked && mkdir -p sub && printf z > sub/b.txt"
    )
    assert made.exit_code == 0, made.stderr
    sandbox.kill()
    kept = {a.path for a in get_portal().call(manager.list_artifacts(sandbox.id))}
    assert {"a.txt", "sub/b.txt"} <= kept
    root = manager.settings.data_dir / "artifacts" / sandbox.id
    assert not [p for p in root.rglob("*") if p.name.endswith(".partial")]


@pytest.mark.usefixtures("root_bubblewrap")
def test_sparse_artifacts_cost_a_destroy_no_more_than_the_disk_holds(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (the third red team's find, 2026-12-06): a copy refused for its size was
    not charged to the export's budget, so each sparse file of a TB read a whole disk's worth
    of zeros again: 50 of them on a 256 MiB disk took a destroy 60 s, 20 s of the manager's
    CPU and 3.6 GiB written on the host. An export now reads at most what the disk holds,
    smallest file first."""
    from sandlot.core import artifacts

    read: list[int] = []
    real_read = artifacts.read_through

    async def counted(*args: Any, **kwargs: Any) -> Any:
        async for chunk in real_read(*args, **kwargs):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(artifacts, "read_through", counted)
    kept = _kept_after(
        manager,
        "cd artifacts 2>/dev/null || mkdir artifacts && cd artifacts; printf kept > a.txt; "
        "for i in 1 2 3 4 5; do truncate -s 1T big$i; done",
    )
    assert kept == ["a.txt"]
    assert 0 < sum(read) < 64 << 20, sum(read)


def _kept_after(manager: SandboxManager, script: str) -> list[str]:
    """The artifacts kept of a sandbox (64 MB disk) that ran ``script``, then was killed."""
    sandbox = Sandbox.create(manager=manager, disk_mb=64)
    made = sandbox.commands.run(script)
    assert made.exit_code == 0, made.stderr
    sandbox.kill()
    return [a.path for a in get_portal().call(manager.list_artifacts(sandbox.id))]


@pytest.mark.usefixtures("root_bubblewrap")
def test_an_artifact_grown_since_it_was_listed_costs_no_more_than_its_listed_size(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (the fifth red team's find, 2026-12-06): a file listed empty and grown
    before its copy was read a whole chunk (1 MiB) and refused, charged nothing: 3,000 of
    them read 3 GiB a destroy. Each read asks for what is left of its bound and one byte.
    (The listing is made to say 0 here: the race the red team won, every time.)"""
    from sandlot.core import artifacts
    from sandlot.core.guest_link import GuestConnection
    from sandlot.guest.ops import Op

    read: list[int] = []  # the bytes each read of the guest brought back
    real_request = GuestConnection.request

    async def counted(self: GuestConnection, op: Op, payload: Any = None, **kw: Any) -> Any:
        reply = await real_request(self, op, payload, **kw)
        if op == Op.FILE_READ:
            read.append(len(base64.b64decode(reply["data"])))
        return reply

    monkeypatch.setattr(GuestConnection, "request", counted)
    monkeypatch.setattr(artifacts, "_listed_size", lambda entry: 0)
    kept = _kept_after(
        manager,
        "mkdir -p artifacts && for i in 1 2 3 4 5; do head -c 2000000 /dev/zero >artifacts/f$i;"
        " done",
    )
    assert kept == []
    assert sum(read) <= 5, read


async def test_artifacts_over_the_tenant_quota_leave_no_partial_copy(data_dir: Path) -> None:
    # Failed before: a file over the budget left an untracked partial copy on the host, and
    # a tenant's kept artifacts had no total.
    quota = Quota(max_sandboxes=5, max_memory_mb=4096, max_artifact_mb=1)
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create(owner="acme", quota=quota)
        await mgr.write_file(info.id, WriteFile(path="artifacts/big.bin"), b"x" * (3 << 20))
        await mgr.write_file(info.id, WriteFile(path="artifacts/small.txt"), b"ok")
        await mgr.destroy(info.id)
        kept = [a.path for a in await mgr.list_artifacts(info.id)]
        assert kept == ["small.txt"]
        root = data_dir / "artifacts" / info.id
        assert sorted(p.name for p in root.rglob("*")) == ["small.txt"]
        # The next sandbox of the tenant may keep only what is left of the quota.
        second = await mgr.create(owner="acme", quota=quota)
        await mgr.write_file(second.id, WriteFile(path="artifacts/m.bin"), b"y" * (1 << 20))
        await mgr.destroy(second.id)
        assert await mgr.list_artifacts(second.id) == []


async def test_a_bounded_read_stops_at_its_bound_whatever_the_size_said(data_dir: Path) -> None:
    # What MCP's read_file relies on (test_mcp.py races a growing file against it): the
    # bound is checked on the bytes read, one past it enough to refuse.
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create()
        await mgr.write_file(info.id, WriteFile(path="f.bin"), b"z" * (3 << 20))
        exact = await mgr.read_file(info.id, ReadFile(path="f.bin", max_bytes=3 << 20))
        assert len(exact) == 3 << 20
        with pytest.raises(InvalidRequest, match="more than 1048576 bytes"):
            await mgr.read_file(info.id, ReadFile(path="f.bin", max_bytes=1 << 20))
        assert await mgr.read_file(info.id, ReadFile(path="f.bin")) == exact  # no bound


async def test_destroys_at_once_keep_no_more_than_the_tenant_artifact_quota(
    data_dir: Path,
) -> None:
    # Failed before (red team, 2026-11-25): six sandboxes destroyed at once each kept a
    # 1.5 MiB artifact against a 2 MiB quota (9 MiB kept): every export read the tenant's
    # total at its start, before any of the others had recorded theirs.
    quota = Quota(max_sandboxes=10, max_memory_mb=4096, max_artifact_mb=2)
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        ids = []
        for _ in range(6):
            info = await mgr.create(owner="acme", quota=quota)
            blob = b"z" * (3 << 19)
            await mgr.write_file(info.id, WriteFile(path="artifacts/blob"), blob)
            ids.append(info.id)
        await asyncio.gather(*(mgr.destroy(i) for i in ids))
        kept = [a for i in ids for a in await mgr.list_artifacts(i)]
        assert len(kept) == 1 and kept[0].size_bytes == 3 << 19
        assert mgr._store.artifact_bytes("acme") == artifact_charge(3 << 19)
        # The refused copies left nothing on the host, and no reservation behind.
        files = [p for i in ids for p in (data_dir / "artifacts" / i).rglob("*") if p.is_file()]
        assert len(files) == 1


async def test_kept_files_cost_their_blocks_and_inodes_and_are_capped_per_sandbox(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed before (red team, 2026-12-06): a file was charged its size alone, so 11,000
    # empty files in 11,000 directories (45 MB of the host's disk, 22,001 inodes) cost a
    # tenant nothing, sandbox after sandbox.
    from sandlot.core import artifacts

    quota = Quota(max_sandboxes=5, max_memory_mb=4096, max_artifact_mb=1)
    plant = (
        "import os\nfor n in range(400):\n"
        "    os.makedirs(f'artifacts/d{n}')\n    open(f'artifacts/d{n}/e', 'w').close()"
    )
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create(owner="acme", quota=quota)
        await mgr.run_code(info.id, RunCode(code=plant))
        await mgr.destroy(info.id)
        kept = await mgr.list_artifacts(info.id)
        # 1 MiB holds 256 charges of 4 KiB: not 400 empty files.
        assert len(kept) == (1 << 20) // artifact_charge(0) == 256
        assert mgr._store.artifact_bytes("acme") == 1 << 20
        # And however large the quota, a sandbox keeps at most MAX_KEPT_FILES files.
        monkeypatch.setattr(artifacts, "MAX_KEPT_FILES", 30)
        second = await mgr.create(owner="other")
        await mgr.run_code(second.id, RunCode(code=plant))
        await mgr.destroy(second.id)
        assert len(await mgr.list_artifacts(second.id)) == 30


def test_the_artifact_usage_kept_in_step_is_the_sum_of_the_rows(tmp_path: Path) -> None:
    # A reservation now reads the owner's running total instead of summing its rows (which
    # made a sandbox of 100,000 files take a restart past 13 minutes): every way a row comes
    # and goes keeps the total equal to that sum.
    from sandlot.core.store import PENDING_ARTIFACT_TTL_S, Store

    store = Store(tmp_path / "store.db", "one")
    try:
        for sandbox_id, owner in (("a", "acme"), ("b", "acme"), ("c", "beta")):
            store._db.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, info) "
                "VALUES (?, ?, 'destroyed', 0, '{}')",
                (sandbox_id, owner),
            )

        def summed(owner: str) -> int:
            rows = store._db.execute(
                "SELECT a.size_bytes FROM artifacts a JOIN sandboxes s ON s.id = a.sandbox_id "
                "WHERE s.owner = ?",
                (owner,),
            ).fetchall()
            return sum(artifact_charge(size) for (size,) in rows)

        for n in range(20):
            assert store.reserve_artifact("acme", "ab"[n % 2], f"f{n}", n * 1000, None)
        for n in range(0, 20, 3):  # copied, smaller than reserved
            store.add_artifact(
                ArtifactInfo(
                    sandbox_id="ab"[n % 2],
                    path=f"f{n}",
                    size_bytes=n * 10,
                    sha256="x",
                    created_at=0,
                )
            )
        store.drop_artifact("a", "f2")
        store.drop_artifact("a", "missing")
        assert store.reserve_artifact("beta", "c", "g", 5000, None)
        assert store.reserve_artifact("acme", "a", "f4", 99_999, None)  # again: replaced
        assert store.artifact_bytes("acme") == summed("acme")
        store.delete_artifacts("b")
        assert store.artifact_bytes("acme") == summed("acme")
        store._db.execute(
            "UPDATE artifacts SET created_at = created_at - ? WHERE sha256 = ''",
            (PENDING_ARTIFACT_TTL_S + 1,),
        )
        assert store.artifact_bytes("acme") == summed("acme") > 0  # the copied ones stay
        assert store.artifact_bytes("beta") == summed("beta") == 0
    finally:
        store.close()


def test_an_artifacts_download_looks_up_its_one_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (red team, 2026-12-06): finding one kept artifact read every row of
    its sandbox into models, on the event loop: 35-100 ms a download of 1 byte with 10,000
    kept, and another tenant's GET from 1.6 to 130 ms median. Now one row by its key."""
    from sandlot.core.artifacts import Artifacts
    from sandlot.core.store import Store

    store = Store(tmp_path / "store.db", "one")
    try:
        assert store.reserve_artifact("acme", "sb-a", "kept.txt", 1, None)
        assert store.reserve_artifact("acme", "sb-a", "pending.txt", 1, None)
        store.add_artifact(
            ArtifactInfo(sandbox_id="sb-a", path="kept.txt", size_bytes=1, sha256="x", created_at=0)
        )
        artifacts = Artifacts(tmp_path, store)
        (tmp_path / "artifacts" / "sb-a").mkdir(parents=True)
        (tmp_path / "artifacts" / "sb-a" / "kept.txt").write_text("k")
        (tmp_path / "artifacts" / "sb-a" / "pending.txt").write_text("p")

        def every_row(sandbox_id: str) -> None:
            raise AssertionError("a download read every row of its sandbox")

        monkeypatch.setattr(store, "artifacts", every_row)
        assert artifacts.path("sb-a", "kept.txt").read_text() == "k"
        for missing in ("pending.txt", "other.txt"):  # still being copied, or never kept
            with pytest.raises(SandboxFileNotFound):
                artifacts.path("sb-a", missing)
        with pytest.raises(SandboxFileNotFound):
            artifacts.path("sb-b", "kept.txt")
    finally:
        store.close()


def test_artifact_reservations_count_across_processes_sharing_a_store(tmp_path: Path) -> None:
    from sandlot.core.store import PENDING_ARTIFACT_TTL_S, Store

    path = tmp_path / "store.db"
    one, two = Store(path, "one"), Store(path, "two")
    try:
        for sandbox_id in ("sb-a", "sb-b"):
            one._db.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, info) "
                "VALUES (?, 'acme', 'destroyed', 0, '{}')",
                (sandbox_id,),
            )
        mib = 1 << 20
        assert one.reserve_artifact("acme", "sb-a", "x", 3 * mib, 4 * mib)
        # The other store (another process's) sees the copy under way: no room for 2 MiB.
        assert not two.reserve_artifact("acme", "sb-b", "y", 2 * mib, 4 * mib)
        # Each file is charged its blocks and one more (artifact_charge): 4 MiB in all.
        assert two.reserve_artifact("acme", "sb-b", "y", 1 * mib - 8192, 4 * mib)
        assert one.artifacts("sb-a") == []  # under way: listed nowhere
        one.drop_artifact("sb-a", "x")
        assert two.artifact_bytes("acme") == 1 * mib - 4096
        # A reservation whose process died mid-copy stops counting after the TTL.
        two._db.execute(
            "UPDATE artifacts SET created_at = created_at - ?", (PENDING_ARTIFACT_TTL_S + 1,)
        )
        assert one.artifact_bytes("acme") == 0
    finally:
        one.close()
        two.close()


@pytest.mark.hostile
def test_a_guest_whose_limits_code_lowered_is_restarted(jail: Sandbox) -> None:
    # Failed before: with the guest's file limit set to 3 from inside, every later call
    # failed with a 400 (Too many open files) and the guest was never restarted.
    wedge = (
        "import os, resource\n"
        "try:\n"
        "    resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3))\n"
        "    outcome = 'lowered'\n"
        "except OSError as exc:\n"
        "    outcome = 'refused: %s' % exc\n"
        "outcome\n"
    )
    tried = jail.run_code(wedge)
    if jail.info.backend == "bubblewrap":  # its seccomp filter: prlimit64 on pid 0 only
        assert tried.text == "'refused: [Errno 1] Operation not permitted'", tried
    after = jail.run_code("40 + 2")
    assert after.text == "42", after
    assert jail.commands.run("echo hi").stdout == "hi\n"
    jail.files.write("still.txt", "ok")
    assert jail.files.read("still.txt") == "ok"


# A cell answers for itself: from its frames, the kernel's writer and the call's nonce, and a
# reply whose text and error are each 4 MiB (the default limit is 1 MiB).
FORGED_BIG_REPLY = """
import sys, time
f = sys._getframe()
while f is not None and 'writer' not in f.f_locals:
    f = f.f_back
big = 'A' * (4 << 20)
f.f_locals['writer'].send({"nonce": f.f_locals['state']["nonce"], "exit_code": 0,
    "text": big, "error": {"type": big, "message": big, "traceback": big}})
time.sleep(2)
"""


@pytest.mark.hostile
def test_a_reply_forged_by_its_cell_is_held_to_the_output_limit(
    manager: SandboxManager, isolated_backend: str
) -> None:
    """Failed before (a red team's find): the kernel clips a reply's text and error, but a
    cell runs in the kernel's process and can send its own; 20 MiB in each of three fields
    reached the host (~180 MiB of it for one call), past the 1 MiB limit. The guest's
    supervisor clips them now, where no cell reaches."""
    sb = Sandbox.create(manager=manager, **placement(isolated_backend), timeout_s=15)
    limit = sb.info.limits.output_limit_bytes
    try:
        result = sb.run_code(FORGED_BIG_REPLY)
        assert result.error is not None, result.model_dump(exclude={"text", "error"})
        fields = [result.text or "", *result.error.model_dump().values()]
        assert [len(f) <= limit for f in fields] == [True] * 4, [len(f) for f in fields]
        assert "characters omitted" in (result.text or "")
        # The kernel's own reply comes after the forged one, out of step: the next cell
        # says its kernel was lost (the documented cost of a cell that answers for itself).
        after = sb.run_code("6 * 7")
        assert after.text == "42" or after.state_lost, after
        assert sb.run_code("6 * 7").text == "42"
    finally:
        sb.kill()


DEEP_JSON = """
class Deep:
    def _repr_json_(self):
        v = 0
        for _ in range(%d):
            v = [v]
        return v
    def __repr__(self):
        return 'Deep()'
Deep()
"""


@pytest.mark.hostile
def test_a_rich_output_nested_past_the_bound_is_left_out_and_the_rest_kept(
    jail: Sandbox,
) -> None:
    """Failed before (a red team's find): a JSON output 900 lists deep came back, and every
    answer carrying it failed to serialize: the server's 500 for the caller's run_code. Past
    MAX_JSON_DEPTH the value is left out; its text is kept, and one just within comes
    whole."""
    deep = jail.run_code(DEEP_JSON % 900)
    [shown] = deep.results
    assert (shown.json_data, shown.text) == (None, "Deep()")
    deep.model_dump_json()  # the answer the server sends
    within = jail.run_code(DEEP_JSON % MAX_JSON_DEPTH).results[0].json_data
    depth = 0
    while isinstance(within, list):
        within, depth = within[0], depth + 1
    assert (depth, within) == (MAX_JSON_DEPTH, 0)


# A cell writes a display frame of its own to the kernel's socket, 50,000 lists deep: past
# the depth the guest's JSON parser takes.
FORGED_DEEP_FRAME = """
import os, struct, sys
f = sys._getframe()
while 'writer' not in f.f_locals:
    f = f.f_back
w, nonce = f.f_locals['writer'], f.f_locals['state']['nonce']
deep = '[' * 50000 + '0' + ']' * 50000
frame = ('{"display": {"data": {"application/json": %s}, "is_main_result": false}, '
         '"nonce": "%s"}' % (deep, nonce)).encode()
with w.lock:
    os.write(w.fd, struct.pack('>I', len(frame)) + frame)
'x'
"""


@pytest.mark.hostile
def test_a_frame_nested_past_the_parsers_depth_breaks_only_its_own_kernel(
    jail: Sandbox,
) -> None:
    """Failed before (found beside the red team's find above): the guest's parse of that
    frame raised RecursionError, which the supervisor did not take as the kernel's fault:
    the call failed with a 502 (GuestError). Now the kernel is restarted and the call
    returns, as for any reply out of step."""
    broken = jail.run_code(FORGED_DEEP_FRAME)
    assert (broken.error and broken.error.type, broken.state_lost) == ("KernelDied", True)
    assert jail.run_code("6 * 7").text == "42"


# A cell writes frames of its own to the kernel's socket, with lone surrogates escaped in
# its display bundle, its text and its error (the kernel's own writer sends none: it writes
# them as "?"), and a pair, which is one astral character.
FORGED_SURROGATES = r"""
import os, struct, sys, time
f = sys._getframe()
while 'writer' not in f.f_locals:
    f = f.f_back
w, nonce = f.f_locals['writer'], f.f_locals['state']['nonce']
frames = [
    '{"display": {"data": {"text/plain": "\\udcff", "application/json": ["\\ud800"]}, '
    '"is_main_result": false}, "nonce": "%s"}' % nonce,
    '{"nonce": "%s", "exit_code": 0, "text": "x\\ud800", "error": {"type": "E", '
    '"message": "\\udfff", "traceback": "\\ud83d\\ude00"}}' % nonce,
]
with w.lock:
    for frame in frames:
        os.write(w.fd, struct.pack('>I', len(frame)) + frame.encode())
time.sleep(2)
"""


@pytest.mark.hostile
def test_lone_surrogates_a_cell_forges_reach_no_answer(jail: Sandbox) -> None:
    """Held when tried (beside the red team's finds): the host would read them as lone
    surrogates, which UTF-8 cannot carry, and every answer serializing the result would fail
    (the server's 500); the guest's supervisor parses the kernel's frames and writes its own
    with them as "?" (``wire.encode_body``). A guard on that: a pair (an astral character)
    is kept."""
    result = jail.run_code(FORGED_SURROGATES)
    result.model_dump_json()  # the answer the server sends
    assert result.error is not None
    assert (result.text, result.error.message, result.error.traceback) == ("x?", "?", "\U0001f600")
    [shown] = result.results
    assert (shown.text, shown.json_data) == ("?", ["?"])


@pytest.mark.hostile
def test_an_exit_code_is_one_every_client_can_read(jail: Sandbox) -> None:
    """Failed before (a red team's note): ``sys.exit(10**4000)`` came back as a 4,001-digit
    exit code (into the audit log too), which no client's int64 reads. Outside a C int's
    range it is 1; codes within it are kept."""
    codes = [jail.run_code(f"import sys; sys.exit({c})").exit_code for c in ("10**4000", 7, -1)]
    assert codes == [1, 7, -1]


@pytest.mark.hostile
def test_a_display_nested_just_under_the_guests_parser_depth_costs_no_restart(
    jail: Sandbox,
) -> None:
    """Failed before (the second red team's find, 2026-12-06): a display frame 985 lists
    deep passed the guest's parser, but the host's, reading it two levels deeper inside the
    result, could not: a 502 and the whole guest restarted (the cell's variables gone). The
    guest now leaves out what the host would (past MAX_JSON_DEPTH)."""
    jail.run_code("kept = 41")
    frame_at = FORGED_DEEP_FRAME.replace("50000", "985")
    result = jail.run_code(frame_at)
    assert (result.exit_code, result.error, result.state_lost) == (0, None, False), result
    # The forged display, its value left out, and the cell's own value ('x').
    assert [(r.json_data, r.text) for r in result.results] == [(None, None), (None, "'x'")]
    assert jail.run_code("kept + 1").text == "42"


@pytest.mark.hostile
def test_a_kill_reason_names_a_limit_only_where_one_was_hit(jail: Sandbox) -> None:
    """Failed before (the third red team's find, 2026-12-06): a cell or command that sent
    itself SIGXCPU came back ``kill_reason="cpu"``, and a process left in the background
    could send it to a later call's shell. No CPU-time limit is ever set: it is a signal
    like any other."""
    cell = jail.run_code("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)")
    assert (cell.kill_reason, cell.state_lost) == ("killed", True), cell
    command = jail.commands.run("kill -XCPU $$")
    assert (command.exit_code, command.kill_reason) == (128 + 24, "killed"), command


@pytest.mark.hostile
def test_displays_streamed_to_a_listener_are_held_to_the_stream_budget(jail: Sandbox) -> None:
    """Failed before (the third red team's find, 2026-12-06): each display() of a cell with a
    listener was a frame of its own, outside the sandbox's stream budget (which stdout,
    stderr and terminals pay: 8 MiB a second, 8 MiB at once, 4 KiB more a frame): ~31,500
    a second, each parsed on the host's one event loop. Past the budget a display is left
    out of the stream, never out of the result."""
    shown: list[object] = []
    kept, started = 0, time.monotonic()
    # A cell keeps at most MAX_RESULTS (wire.py): cells enough to pass the 2,048-frame burst.
    for _ in range(16):
        result = jail.run_code("for i in range(2_000): display(i)", on_result=shown.append)
        assert result.exit_code == 0 and 0 < len(result.results) <= MAX_RESULTS, result
        kept += len(result.results)
    frames_allowed = (8 << 20) / 4096 * (1 + time.monotonic() - started)
    assert 0 < len(shown) <= frames_allowed, (len(shown), kept, frames_allowed)
    # Where the cells ran slower than the budget (gVisor), all may stream: nothing to show.
    assert len(shown) < kept or frames_allowed >= kept, (len(shown), kept, frames_allowed)


LEASE_HOLDER = r"""
import fcntl, os, signal, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease's break would end it, and the lease
fd = os.open("leased.txt", os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
open("lease-taken", "w").close()
time.sleep(30)
"""


@pytest.mark.hostile
def test_a_file_leased_in_the_sandbox_is_a_file_error_not_a_restart(
    jail: Sandbox, isolated_backend: str
) -> None:
    """Failed before (a red team's note, 2026-12-06): a write lease made the guest's open of
    the file fail with EAGAIN, which the guest reported as the pids limit, so the host
    restarted the guest (its variables lost) and tried again."""
    if isolated_backend == "docker+runsc":
        pytest.skip("gVisor takes the lease but does not break it on another's open")
    jail.run_code("kept = 41")
    jail.files.write("leased.txt", "a")
    jail.files.write("hold.py", LEASE_HOLDER)
    jail.commands.run("/usr/bin/python3 hold.py", background=True)
    deadline = time.monotonic() + 20
    while not jail.files.exists("lease-taken") and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(SandboxFileBusy, match="leased"):
        jail.files.write("leased.txt", "b")
    assert jail.run_code("kept + 1").text == "42"


@pytest.mark.hostile
def test_a_file_sandboxed_code_plants_costs_a_write_its_error_not_the_session(
    jail: Sandbox,
) -> None:
    """Failed before (the fourth red team's find, 2026-12-06): an errno the guest did not
    name (ENXIO for a FIFO at the path, ETXTBSY for a program running from it) was a plain
    file_error, which the host takes for a broken guest: it restarted the guest (the
    session's variables and processes gone) and wrote again."""
    jail.run_code("kept = 41")
    made = jail.commands.run(
        "mkfifo out.txt && cp /bin/sleep tool && (./tool 30 >/dev/null 2>&1 &) && sleep 0.2"
    )
    assert made.exit_code == 0, made.stderr
    with pytest.raises(InvalidRequest):
        jail.files.write("out.txt", "data")
    with pytest.raises(SandboxFileBusy, match="busy"):
        jail.files.write("tool", "data")
    assert jail.run_code("kept + 1").text == "42"


@pytest.mark.parametrize("kind", ["command", "cell"])
def test_a_call_that_waits_its_turn_is_not_taken_for_a_hung_guest(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Failed before (the fifth red team's find, 2026-12-06): the host's backstop (a call's
    timeout and BACKSTOP_S) counted from when the call was sent, so a short call queued
    behind a long one in its session (or behind a cell) ran out of it while it waited, and
    the host restarted a healthy guest: both calls failed and the session's state was lost.
    The guest says when a call waits and when it can run; the backstop counts from there."""
    import threading

    from sandlot.core import execution

    monkeypatch.setattr(execution, "BACKSTOP_S", 0.5)
    sandbox.run_code("kept = 41")
    if kind == "command":
        long_call = lambda: sandbox.commands.run("sleep 3; echo long", timeout_s=10)  # noqa: E731
        short_call = lambda: sandbox.commands.run("echo short", timeout_s=1)  # noqa: E731
    else:
        long_call = lambda: sandbox.run_code("import time; time.sleep(3); 'long'", timeout_s=10)  # noqa: E731
        short_call = lambda: sandbox.run_code("'short'", timeout_s=1)  # noqa: E731
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(long_call()))
    first.start()
    time.sleep(0.5)  # the long one runs: the short one waits its turn
    second = short_call()
    first.join(30)
    assert not second.state_lost and second.exit_code == 0, second
    assert not results[0].state_lost and results[0].exit_code == 0, results[0]
    assert sandbox.run_code("kept + 1").text == "42"


def test_nesting_is_measured_without_recursion() -> None:
    value: object = 0
    for _ in range(100_000):
        value = {"k": [value]}
    assert not nests_within(value)
    assert nests_within({"a": [1, {"b": []}]}, depth=3)
    assert not nests_within({"a": [1, {"b": [2]}]}, depth=3)


def test_a_tenants_ended_records_are_capped(tmp_path: Path) -> None:
    # Failed before (red team, 2026-12-06): nothing capped them but the retention period.
    from sandlot.core.store import Store

    store = Store(tmp_path / "store.db", "one")
    try:
        rows = [(f"a-{n}", "acme", "destroyed", float(n)) for n in range(30)]
        rows += [(f"b-{n}", "beta", "destroyed", float(n)) for n in range(5)]
        rows += [("a-live", "acme", "running", 0.0)]
        for sandbox_id, owner, status, created_at in rows:
            store._db.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, info) "
                "VALUES (?, ?, ?, ?, '{}')",
                (sandbox_id, owner, status, created_at),
            )
        assert store.reserve_artifact("acme", "a-0", "kept.txt", 1, None)  # the oldest
        assert store.forget_beyond(10) == 19
        left = {r[0] for r in store._db.execute("SELECT id FROM sandboxes").fetchall()}
        newest = {f"a-{n}" for n in range(20, 30)}
        assert left == newest | {"a-0", "a-live"} | {f"b-{n}" for n in range(5)}
    finally:
        store.close()


def test_listing_a_path_that_is_not_there_is_file_not_found(sandbox: Sandbox) -> None:
    """It was "not a directory" (before 2026-12-06), which E2B's clients do not expect."""
    with pytest.raises(SandboxFileNotFound):
        sandbox.files.list("not-there")
    sandbox.files.write("a-file", "x")
    with pytest.raises(SandboxNotADirectory):
        sandbox.files.list("a-file")


@pytest.mark.hostile
def test_a_file_planted_at_the_shells_state_directory_stops_no_command(jail: Sandbox) -> None:
    """Failed before (the fifth red team's find, 2026-12-06): a file at /tmp/.sandlot_shells
    made every later command fail with file_exists."""
    planted = jail.run_code(
        "import shutil, os; shutil.rmtree('/tmp/.sandlot_shells', ignore_errors=True);"
        " open('/tmp/.sandlot_shells', 'w').close()"
    )
    assert planted.exit_code == 0, planted
    first = jail.commands.run("cd /tmp && export KEPT=41 && echo ran")
    assert (first.exit_code, first.stdout) == (0, "ran\n"), first
    second = jail.commands.run("pwd; echo $KEPT")  # the session's cwd and env were kept
    assert second.stdout == "/tmp\n41\n", second


FIFO_PLANTER = r"""
import os, time
d = "/tmp/.sandlot_shells"
while True:
    os.makedirs(d, exist_ok=True)
    for i in range(1, 300):
        for name in ("default-%d.cwd" % i, "default-%d.env" % i):
            try:
                os.mkfifo(os.path.join(d, name))
            except OSError:
                pass
    time.sleep(0.001)
"""


@pytest.mark.hostile
def test_a_process_planting_fifos_where_commands_save_their_state_stops_none(
    jail: Sandbox,
) -> None:
    """Failed before (the sixth red team's find, 2026-12-06): a command's EXIT trap saved its
    cwd and env to predictable names in /tmp, and a leftover process put FIFOs there as fast
    as the guest removed them: every later command blocked in its trap and came back
    "timeout". The trap writes to anonymous files the guest opened for it."""
    jail.files.write("plant.py", FIFO_PLANTER)
    jail.commands.run("/usr/bin/python3 plant.py", background=True, timeout_s=60)
    time.sleep(0.5)
    for _ in range(3):
        result = jail.commands.run("cd /tmp && echo hi", timeout_s=3)
        assert (result.exit_code, result.kill_reason, result.stdout) == (0, None, "hi\n"), result
    assert jail.commands.run("pwd").stdout == "/tmp\n"  # the session's cwd was saved


KERNEL_DEAF = r"""
import os, socket, threading
keep = socket.socket(fileno=os.dup(3))  # the kernel's channel to the guest, kept open
a, b = socket.socketpair()
os.dup2(a.fileno(), 3)  # the kernel reads this pair now: the guest's frames go unread


def relay():
    while data := b.recv(65536):
        keep.sendall(data)


threading.Thread(target=relay, daemon=True).start()
"""


@pytest.mark.hostile
@pytest.mark.usefixtures("root_bubblewrap")
async def test_a_call_queued_behind_a_cancelled_one_still_has_a_backstop(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (the sixth red team's find, 2026-12-06): a cell made the kernel deaf to
    the guest, the user's next (big) cell was cancelled with the guest's thread stuck
    sending it while holding the kernel's lock, and a later cell queued behind it had no
    deadline at all: it waited for good. A queued call waits at most for the backstops of
    the calls in flight and its own; a cancelled one is no longer in flight."""
    from sandlot.core import execution

    monkeypatch.setattr(execution, "BACKSTOP_S", 1.0)
    async with SandboxManager(make_settings(data_dir, backend="bubblewrap")) as mgr:
        info = await mgr.create()
        # A terminal open all along (its budget is the sandbox's lifetime): not a call a
        # queued one waits for, so not one whose backstop it waits out.
        await mgr.start_pty(info.id, OpenPty(command="sleep 600"))
        deaf = await mgr.run_code(info.id, RunCode(code=KERNEL_DEAF))
        assert deaf.exit_code == 0, deaf
        big = RunCode(code="y = '" + "a" * (900 << 10) + "'", timeout_s=3)
        stuck = asyncio.ensure_future(mgr.run_code(info.id, big))
        await asyncio.sleep(1.0)
        stuck.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stuck
        later = await asyncio.wait_for(mgr.run_code(info.id, RunCode(code="2", timeout_s=2)), 30)
        assert later.state_lost, later  # the stuck guest was ended, and the call answered
        assert (await mgr.run_code(info.id, RunCode(code="3"))).text == "3"


async def test_one_slow_teardown_holds_no_other_sandboxs_expiry(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (red team, 2026-12-06): the reaper destroyed its expired sandboxes one
    after another, so one whose artifacts took their export's whole timeout (60 s) held
    another tenant's sandbox 61 s past its TTL. Here A's destroy takes 3 s; B, expired in
    the same pass, is gone at once."""
    settings = make_settings(data_dir, backend="unsafe-local", reaper_interval_s=3600)
    async with SandboxManager(settings) as mgr:
        slow = await mgr.create(SandboxSpec(ttl_s=0.2), owner="evil")
        other = await mgr.create(SandboxSpec(ttl_s=0.2), owner="victim")
        real = type(mgr).destroy

        async def destroy(this: SandboxManager, sandbox_id: str, **kwargs: Any) -> Any:
            if sandbox_id == slow.id:
                await asyncio.sleep(3)
            return await real(this, sandbox_id, **kwargs)

        monkeypatch.setattr(type(mgr), "destroy", destroy)
        await asyncio.sleep(0.3)
        started = time.monotonic()
        assert sorted(await mgr.reap()) == sorted([slow.id, other.id])
        assert time.monotonic() - started < 1
        while (await mgr.get(other.id)).status.value == "running":
            assert time.monotonic() - started < 1.5, "the other's expiry waited"
            await asyncio.sleep(0.02)
        assert (await mgr.get(other.id)).end_reason == "ttl"
        assert (await mgr.get(slow.id)).status.value == "running"  # still in its teardown
        assert sorted(await mgr.reap()) == []  # not started twice


async def test_an_orphans_artifacts_are_read_no_further_than_the_walk_may_go(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (red team, 2026-12-06): recovery read a whole directory's names before
    it looked at its cap of entries: a million hard links with long names took a restarted
    manager from 47 to 308 MB and 11.6 s. Here 2,000 names against a cap of 50."""
    import os

    from sandlot.core import artifacts

    settings = make_settings(data_dir, backend="unsafe-local")
    async with SandboxManager(settings) as mgr:
        info = await mgr.create()
        workspace = mgr._backend("unsafe-local").workspace_on_host(info.id)
        assert workspace is not None
        many = workspace / "artifacts" / "many"
        many.mkdir(parents=True)
        for n in range(2000):
            (many / f"{n:04d}-{'x' * 150}").touch()
        monkeypatch.setattr(artifacts._HostWalk, "MAX_ENTRIES", 50)
        read = []
        real_scandir = os.scandir

        def counting_scandir(fd: Any) -> Any:
            listing = real_scandir(fd)

            class Counted:
                def __enter__(self) -> Any:
                    listing.__enter__()
                    return self

                def __exit__(self, *exc: Any) -> None:
                    listing.__exit__(*exc)

                def __iter__(self) -> Any:
                    for entry in listing:
                        read.append(entry.name)
                        yield entry

            return Counted()

        monkeypatch.setattr(artifacts.os, "scandir", counting_scandir)
        await mgr._artifacts.export_from_host(info, workspace)
        assert len(read) <= 52, len(read)  # "many" itself, then at most the cap and one
        kept = await mgr.list_artifacts(info.id)
        assert 0 < len(kept) <= 50


async def test_the_pools_of_managers_on_one_data_directory_share_the_hosts_room(
    data_dir: Path,
) -> None:
    """Failed before (red team, 2026-12-07): two managers on one data directory each filled a
    warm pool of 3 sandboxes of 256 MB on a host with room for 3 (6 held, and 6 creates from
    the pools admitted): pooled sandboxes are in no store record, and a manager skipped its
    data directory's lines in the host's ledger. Those lines now say what the store does not
    show, and a peer counts that."""
    capacity_mb = 3 * 256 + 32
    settings = make_settings(
        data_dir,
        backend="unsafe-local",
        pool_size=3,
        host_memory_overcommit=capacity_mb / admission.physical_memory_mb(make_settings(data_dir)),
    )

    async def pooled(manager: SandboxManager, want: int) -> None:
        deadline = time.monotonic() + 20
        while manager.pooled_count() < want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a refill that would over-reserve has its chance

    async with SandboxManager(settings) as first:
        await pooled(first, 3)
        async with SandboxManager(settings) as second:
            await pooled(second, 3)
            assert first.pooled_count() + second.pooled_count() <= 3
            made = 0
            for manager in (first, second):
                for _ in range(3):
                    with contextlib.suppress(CapacityExhausted):
                        await manager.create(owner="acme")
                        made += 1
            assert made <= 3


@pytest.mark.parametrize("line", ['{"memory_mb": NaN}', '{"memory_mb": -1e9}', '{"pids": 1e400}'])
def test_a_ledger_line_no_sandlot_writes_neither_opens_nor_breaks_admission(
    tmp_path: Path, line: str
) -> None:
    """Failed before (red team, 2026-12-07): a line of NaN or a negative amount let every
    create through past the host's capacity, an infinite ``pids`` failed every create with a
    500. Such a line is skipped; a ledger directory others may write to is not used."""
    import fcntl
    import os

    from sandlot.core.host_ledger import HostLedger

    root = tmp_path / "ledger"
    root.mkdir(mode=0o700)
    (tmp_path / "data").mkdir()
    (tmp_path / "other").mkdir()
    ours = HostLedger.open(root, tmp_path / "data", "mine")
    assert ours is not None
    foreign = root / "0-0-foreign.json"
    foreign.write_text(line)
    fd = os.open(foreign, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held: a live manager's, as far as a reader can tell
        with ours.turn():
            assert ours.elsewhere() == []
        good = HostLedger.open(root, tmp_path / "other", "peer")
        assert good is not None
        good.publish([_Reserving(512)], [])
        with ours.turn():
            assert [r.memory_mb for r in ours.elsewhere()] == [512]
        good.close()
    finally:
        os.close(fd)
        ours.close()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert HostLedger.open(shared, tmp_path / "data", "x") is None


class _Reserving:
    """A Reservation of ``memory_mb`` and nothing else."""

    def __init__(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb
        self.cpu_cores = 0.0
        self.pids = 0
        self.disk_mb = 0
