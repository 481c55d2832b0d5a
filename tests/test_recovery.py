"""Crash recovery: kill -9 a manager holding live sandboxes, restart it, find nothing left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sandlot import ConfigError, SandboxManager, SandboxStatus
from sandlot.backends.cgroups import CgroupDriver
from sandlot.backends.disk import mounted_below
from sandlot.requests import RunCode, SandboxSpec
from tests import leaks
from tests.conftest import make_settings, placement

CRASHER = """
import asyncio, json, os, sys
from sandlot import SandboxManager
from sandlot.models import Quota
from sandlot.requests import RunCode, RunCommand, SandboxSpec
from tests.conftest import make_settings

async def main():
    data_dir, count, pool_size, target, pools, quota, extra = sys.argv[1:8]
    quota = Quota(**json.loads(quota)) if quota else None
    backend, _, runtime = target.partition("+")
    mgr = SandboxManager(
        make_settings(data_dir, pool_size=int(pool_size), pools=json.loads(pools))
    )
    await mgr.start()
    while mgr.pooled_count() < int(pool_size) + sum(json.loads(pools).values()):
        await asyncio.sleep(0.05)
    out = []
    for _ in range(int(count)):
        info = await mgr.create(SandboxSpec(backend=backend, runtime=runtime or None), quota=quota)
        # A daemon that would outlive its call, to prove it dies with the sandbox.
        daemon = "setsid sleep 3600 >/dev/null 2>&1 < /dev/null &"
        await mgr.run_command(info.id, RunCommand(command=daemon))
        await mgr.run_code(info.id, RunCode(code="x = 1"))
        keep = "import os; os.makedirs('artifacts/sub', exist_ok=True); "
        keep += f"open('artifacts/out.txt', 'w').write('kept {info.id}'); "
        # Hostile leftovers the host-side copy must not follow or block on.
        keep += "os.symlink('/etc/shadow', 'artifacts/shadow'); os.mkfifo('artifacts/fifo'); "
        keep += "os.symlink('/etc', 'artifacts/sub/etc')"
        await mgr.run_code(info.id, RunCode(code=keep))
        if extra:
            assert (await mgr.run_code(info.id, RunCode(code=extra))).exit_code == 0
        ws = os.path.join(mgr.instance_dir, "sandboxes", info.id, "workspace")
        uid = os.stat(ws).st_uid if os.path.exists(ws) else None
        out.append({"id": info.id, "uid": uid})
    print(json.dumps(out), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def crash_a_manager(
    data_dir: Path,
    count: int,
    pool_size: int = 0,
    target: str = "bubblewrap",
    pools: dict[str, int] | None = None,
    quota: dict[str, int] | None = None,
    extra: str = "",
    helpers: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Run a manager in a child process with ``count`` live sandboxes (made with ``quota``,
    each running ``extra`` last), then kill -9 it; its children at that moment (the
    templates' bwrap) go in ``helpers``."""
    repo = Path(__file__).resolve().parent.parent
    argv = [str(data_dir), str(count), str(pool_size), target, json.dumps(pools or {})]
    argv += [json.dumps(quota) if quota else "", extra]
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, *argv],
        stdout=subprocess.PIPE,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": f"{repo / 'src'}:{repo}"},
        text=True,
    )
    try:
        assert proc.stdout is not None
        sandboxes: list[dict[str, Any]] = _json_line(proc.stdout)
        if helpers is not None:
            helpers += _children_of(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return sandboxes


def _json_line(stdout: Any) -> Any:
    """The first line of a child's stdout that is JSON: the manager's log lines go there
    too (a uid another run's sandbox held was logged before the answer: fresh root,
    2026-12-06)."""
    for line in stdout:
        if line.startswith(("[", "{")):
            return json.loads(line)
    raise AssertionError("the child ended without its answer")


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _processes_of(uids: set[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    found.append(int(entry.name))
            except FileNotFoundError:
                continue
    return found


def _wait_until(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(predicate())  # type: ignore[operator]


@pytest.mark.asyncio
async def test_restart_after_kill_9_cleans_every_orphan(
    data_root: Path, isolated_backend: str
) -> None:
    if isolated_backend != "bubblewrap":
        pytest.skip("bubblewrap's recovery; test_docker crashes a manager of docker sandboxes")
    data_dir = data_root / "crash"
    data_dir.mkdir()
    helpers: list[int] = []
    sandboxes = crash_a_manager(data_dir, count=3, helpers=helpers)
    assert len(sandboxes) == 3
    # Its templates' bwrap die with it (their death signal; the templates at their socket's
    # EOF), and the guests with them.
    assert len(helpers) >= 1, helpers
    assert _wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in helpers)), helpers
    uids = {s["uid"] for s in sandboxes}
    assert len(uids) == 3 and min(uids) >= 200_000  # one unprivileged host uid each

    settings = make_settings(data_dir)
    driver = CgroupDriver.detect()
    (crashed,) = leaks.instance_dirs(data_dir)
    instance = leaks.instance_of(crashed)
    cgroups_before = driver.children(settings.cgroup_root, instance)
    assert sorted(cgroups_before) == sorted(s["id"] for s in sandboxes)
    assert mounted_below(crashed / "sandboxes")  # loop disks still mounted: orphans

    async with SandboxManager(settings) as mgr:
        for s in sandboxes:
            info = await mgr.get(s["id"])
            assert info.status == SandboxStatus.DESTROYED
            assert info.end_reason == "recovered"
            # Failed before: the restart swept the workspaces without keeping the artifacts.
            kept = await mgr.list_artifacts(s["id"])
            assert [a.path for a in kept] == ["out.txt"]
            path = await mgr.artifact_path(s["id"], "out.txt")
            assert path.read_text() == f"kept {s['id']}"
        assert await mgr.list() == []
        assert driver.children(settings.cgroup_root, instance) == []
        assert mounted_below(data_dir) == []
        assert leaks.instance_dirs(data_dir) == [mgr.instance_dir]  # the dead one is gone
        assert _wait_until(lambda: _processes_of(uids) == []), _processes_of(uids)
        # And the restarted manager works.
        fresh = await mgr.create(SandboxSpec(**placement(isolated_backend)))
        assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"


def _host_side_recovery_dir(data_dir: Path, backend: str) -> Path:
    if backend != "bubblewrap":
        pytest.skip("bubblewrap's recovery reads the workspace on the host")
    data_dir.mkdir()
    return data_dir


@pytest.mark.asyncio
async def test_an_orphans_artifacts_are_kept_within_its_owners_quota(
    data_root: Path, isolated_backend: str
) -> None:
    # Failed before: the quota is the server's, given with each create, and a manager that
    # keeps a dead one's artifacts never knew it: both sandboxes kept both files (1.6 MB
    # against a 1 MiB quota).
    from sandlot.core.store import artifact_charge

    data_dir = _host_side_recovery_dir(data_root / "crash-quota", isolated_backend)
    big = "import os\nfor n in 'ab': open(f'artifacts/{n}.bin', 'wb').write(os.urandom(400_000))"
    quota = {"max_sandboxes": 5, "max_memory_mb": 4096, "max_artifact_mb": 1}
    sandboxes = crash_a_manager(data_dir, count=2, quota=quota, extra=big)

    async with SandboxManager(make_settings(data_dir)) as mgr:
        kept = [a for s in sandboxes for a in await mgr.list_artifacts(s["id"])]
        assert sum(a.size_bytes for a in kept) <= 1 << 20
        # The first sandbox's two fit; a third would not. The small files all fit.
        assert len([a for a in kept if a.path.endswith(".bin")]) == 2
        assert len([a for a in kept if a.path == "out.txt"]) == 2
        # Nothing is left reserved, on the host or in the store.
        charged = sum(artifact_charge(a.size_bytes) for a in kept)
        assert mgr._store.artifact_bytes("local") == charged
        staging = data_dir / "artifacts" / ".staging"
        assert not staging.exists() or list(staging.iterdir()) == []


@pytest.mark.asyncio
async def test_an_orphans_artifacts_are_kept_under_their_own_names(
    data_root: Path, isolated_backend: str
) -> None:
    # Failed before (red team, 2026-11-25): the host-side walk recorded a nested
    # "artifacts/b" but wrote its bytes to "b", and copied through ".<name>.partial" beside
    # the kept files: records with no file, or another file's bytes.
    from tests.test_manager import TRICKY_ARTIFACTS

    data_dir = _host_side_recovery_dir(data_root / "crash-names", isolated_backend)
    write = "import os\nos.makedirs('artifacts/artifacts', exist_ok=True)\n"
    for name, data in TRICKY_ARTIFACTS.items():
        write += f"open('artifacts/{name}', 'wb').write({data!r})\n"
    (sandbox,) = crash_a_manager(data_dir, count=1, extra=write)

    async with SandboxManager(make_settings(data_dir)) as mgr:
        kept = {a.path for a in await mgr.list_artifacts(sandbox["id"])}
        assert kept == {"out.txt", *TRICKY_ARTIFACTS}
        for name, data in TRICKY_ARTIFACTS.items():
            assert await mgr.read_artifact(sandbox["id"], name) == data


@pytest.mark.asyncio
async def test_warm_pool_never_exceeds_its_size_after_a_crash(
    data_root: Path, isolated_backend: str
) -> None:
    if isolated_backend != "bubblewrap":
        pytest.skip("bubblewrap's pool; test_docker crashes a manager with docker pools")
    data_dir = data_root / "crash-pool"
    data_dir.mkdir()
    crash_a_manager(data_dir, count=1, pool_size=2)
    settings = make_settings(data_dir, pool_size=2)
    (crashed,) = leaks.instance_dirs(data_dir)
    dead = leaks.instance_of(crashed)
    driver = CgroupDriver.detect()
    assert len(driver.children(settings.cgroup_root, dead)) == 3  # 1 taken + 2 pooled

    async with SandboxManager(settings) as mgr:
        instance = leaks.instance_of(mgr.instance_dir)
        deadline = time.monotonic() + 20
        while mgr.pooled_count() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert mgr.pooled_count() == 2
        assert driver.children(settings.cgroup_root, dead) == []
        assert len(driver.children(settings.cgroup_root, instance)) == 2
        sandboxes = mgr.instance_dir / "sandboxes"
        assert len(list(sandboxes.iterdir())) == 2
        taken = await mgr.create()
        assert taken.id in {p.name for p in sandboxes.iterdir()}
        assert (await mgr.run_code(taken.id, RunCode(code="1 + 1"))).text == "2"
    assert driver.children(settings.cgroup_root, instance) == []
    assert leaks.instance_dirs(data_dir) == []


# A sandlot from before instances: one manager per data dir, holding manager.lock
# exclusively, its backends' state at the top of the data dir, records with no instance.
LEGACY_CRASHER = """
import asyncio, fcntl, json, os, sys, time
from pathlib import Path
from sandlot.backends.base import GuestSpec
from sandlot.backends.bubblewrap.backend import BubblewrapBackend
from sandlot.core.store import Store
from sandlot.models import SandboxInfo
from tests.conftest import make_settings

async def main():
    data_dir = Path(sys.argv[1])
    settings = make_settings(data_dir)
    lock = os.open(data_dir / "manager.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, str(os.getpid()).encode())
    store, backend = Store(data_dir / "sandlot.db"), BubblewrapBackend(settings)
    ids = []
    for n in range(2):
        limits = settings.resolve_limits(None)
        now = time.time()
        info = SandboxInfo(
            id=f"sb-legacy{n}{os.getpid()}", backend="bubblewrap", status="running",
            owner="local", limits=limits, network=False, created_at=now,
            last_active_at=now, expires_at=now + 600, idle_timeout_s=600,
        )
        store.save(info)
        guest = await backend.start(GuestSpec(sandbox_id=info.id, limits=limits))
        ids.append(info.id)
    print(json.dumps(ids), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_a_pre_instance_data_dir_is_recovered_once(
    data_root: Path, isolated_backend: str
) -> None:
    if isolated_backend != "bubblewrap":
        pytest.skip("the layout of bubblewrap's state")
    data_dir = data_root / "legacy"
    data_dir.mkdir()
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", LEGACY_CRASHER, str(data_dir)],
        stdout=subprocess.PIPE,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": f"{repo / 'src'}:{repo}"},
        text=True,
    )
    try:
        assert proc.stdout is not None
        ids = _json_line(proc.stdout)
        # While the older sandlot lives, we do not start beside it.
        with pytest.raises(ConfigError, match=f"older sandlot process \\(pid {proc.pid}\\)"):
            await SandboxManager(make_settings(data_dir)).start()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    settings = make_settings(data_dir)
    legacy = leaks.instance_of(data_dir)
    driver = CgroupDriver.detect()
    assert sorted(driver.children(settings.cgroup_root, legacy)) == sorted(ids)
    assert mounted_below(data_dir / "sandboxes")
    async with SandboxManager(settings) as mgr:
        for sandbox_id in ids:
            info = await mgr.get(sandbox_id)
            assert (info.status, info.end_reason) == (SandboxStatus.DESTROYED, "recovered")
        assert driver.children(settings.cgroup_root, legacy) == []
        assert mounted_below(data_dir) == []
        assert not (data_dir / "sandboxes").exists() and not (data_dir / "guest").exists()
        fresh = await mgr.create(SandboxSpec(**placement(isolated_backend)))
        assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"
    # Once: the next start finds nothing of it to recover.
    async with SandboxManager(settings) as mgr:
        assert not (data_dir / "sandboxes").exists()


async def test_a_start_that_fails_in_recovery_gives_back_what_it_claimed(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (red team, 2026-12-06, by reading): a start whose recovery raised left
    its freshly claimed instance directory behind, one more dead instance a failed start."""
    from sandlot.core import recovery

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a remains' surprise")

    data_dir = data_root / "failed-start"
    monkeypatch.setattr(recovery, "recover", broken)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="surprise"):
            await SandboxManager(make_settings(data_dir, backend="unsafe-local")).start()
    assert leaks.instance_dirs(data_dir) == []
    monkeypatch.undo()
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        assert (await mgr.create()).id


@pytest.mark.asyncio
async def test_a_running_manager_recovers_a_peer_that_died_under_its_own_cgroup_root(
    data_root: Path, isolated_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed before (red team, 2026-12-07), twice: a manager that stays up never recovered a
    # peer of its data directory that died (only a start did), so the peer's disks, mounts
    # and cgroups stayed while it ran; and a recovery swept under its own SANDBOX_CGROUP_ROOT,
    # so a peer that ran under another left its cgroups for good.
    if isolated_backend != "bubblewrap":
        pytest.skip("bubblewrap's cgroups and disks")
    from sandlot.core import recovery

    monkeypatch.setattr(recovery, "LOOK_EVERY_S", 0.5)
    data_dir = data_root / "peer"
    data_dir.mkdir()
    settings = make_settings(data_dir)
    driver = CgroupDriver.detect()
    async with SandboxManager(
        make_settings(data_dir, cgroup_root=settings.cgroup_root + "-peer")
    ) as mgr:
        sandboxes = crash_a_manager(data_dir, count=1)
        dead = [d for d in leaks.instance_dirs(data_dir) if d != mgr.instance_dir]
        (crashed,) = dead
        instance = leaks.instance_of(crashed)
        assert driver.children(settings.cgroup_root, instance) == [sandboxes[0]["id"]]
        assert mounted_below(crashed)

        def recovered() -> bool:
            return (
                driver.children(settings.cgroup_root, instance) == []
                and not crashed.exists()
                and not mounted_below(data_dir)
            )

        deadline = time.monotonic() + 20
        while not recovered() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert recovered(), (driver.children(settings.cgroup_root, instance), crashed.exists())
        info = await mgr.get(sandboxes[0]["id"])
        assert (info.status, info.end_reason) == (SandboxStatus.DESTROYED, "recovered")
        assert [a.path for a in await mgr.list_artifacts(info.id)] == ["out.txt"]
