"""SandboxManager behaviour that does not depend on isolation, on the unsafe-local backend."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from sandlot import (
    AsyncSandbox,
    ConfigError,
    SandboxLimits,
    SandboxManager,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxStatus,
)
from sandlot.core import live as live_module
from sandlot.errors import SandboxFileNotFound, SandboxHeldElsewhere
from sandlot.requests import RunCode, RunCommand, SandboxSpec, SetTimeout, WriteFile, build
from tests.conftest import make_settings

pytestmark = pytest.mark.asyncio


@pytest.fixture
def data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    path = data_root / f"mgr-{request.node.name}"
    path.mkdir()
    return path


async def test_ttl_expiry_destroys_sandbox(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create(SandboxSpec(ttl_s=0.3))
        await asyncio.sleep(1.0)
        after = await mgr.get(info.id)
        assert after.status == SandboxStatus.DESTROYED
        assert after.end_reason == "ttl"
        with pytest.raises(SandboxNotRunning, match="ttl"):
            await mgr.run_code(info.id, RunCode(code="1"))


async def test_idle_timeout_spares_active_sandboxes(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        idle = await mgr.create(SandboxSpec(idle_timeout_s=0.5))
        busy = await mgr.create(SandboxSpec(idle_timeout_s=0.5))
        # A call longer than the idle timeout must not get its sandbox reaped mid-call.
        result = await mgr.run_code(busy.id, RunCode(code="import time; time.sleep(1.2); 'ok'"))
        assert result.text == "'ok'"
        assert (await mgr.get(idle.id)).end_reason == "idle"
        assert (await mgr.get(busy.id)).status == SandboxStatus.RUNNING


async def test_extend_moves_the_deadline(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create(SandboxSpec(ttl_s=0.5))
        await mgr.extend(info.id, SetTimeout(ttl_s=30))
        await asyncio.sleep(1.0)
        assert (await mgr.get(info.id)).status == SandboxStatus.RUNNING
        with pytest.raises(ConfigError, match="ttl_s"):
            await mgr.extend(info.id, build(SetTimeout, ttl_s=0))


async def test_owners_cannot_see_each_other(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        alice = await mgr.create(owner="alice")
        bob = await mgr.create(owner="bob")
        assert [s.id for s in await mgr.list(owner="alice")] == [alice.id]
        with pytest.raises(SandboxNotFound):
            await mgr.get(bob.id, owner="alice")
        with pytest.raises(SandboxNotFound):
            await mgr.run_code(bob.id, RunCode(code="1"), owner="alice")
        with pytest.raises(SandboxNotFound):
            await mgr.destroy(bob.id, owner="alice")
        assert (await mgr.get(bob.id)).status == SandboxStatus.RUNNING


async def test_unknown_sandbox_and_bad_arguments(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        with pytest.raises(SandboxNotFound):
            await mgr.run_code("sb-nope", RunCode(code="1"))
        with pytest.raises(ConfigError, match="unknown backend 'nope'"):
            await mgr.create(SandboxSpec(backend="nope"))
        with pytest.raises(ConfigError, match="ttl_s"):
            await mgr.create(build(SandboxSpec, ttl_s=-1))
        info = await mgr.create()
        with pytest.raises(ConfigError, match="timeout_s"):
            await mgr.run_code(info.id, build(RunCode, code="1", timeout_s=0))
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1)


async def test_two_managers_share_a_data_dir_and_run_only_their_own(data_dir: Path) -> None:
    settings = make_settings(data_dir, backend="unsafe-local")
    async with SandboxManager(settings) as first, SandboxManager(settings) as second:
        assert first.instance_dir != second.instance_dir
        mine = await first.create()
        assert (await second.create()).id != mine.id
        # The store is the data dir's: the other's record is visible, its sandbox is not.
        assert mine.id in [s.id for s in await second.list(include_ended=True)]
        assert mine.id not in [s.id for s in await second.list()]
        for call in (
            second.run_code(mine.id, RunCode(code="1")),
            second.destroy(mine.id),
            second.extend(mine.id, SetTimeout(ttl_s=30)),
        ):
            with pytest.raises(SandboxHeldElsewhere, match=f"pid {os.getpid()}") as caught:
                await call
            assert caught.value.pid == os.getpid()
        # Another tenant asking about it still learns nothing.
        with pytest.raises(SandboxNotFound):
            await second.run_code(mine.id, RunCode(code="1"), owner="mallory")
        assert (await first.run_code(mine.id, RunCode(code="6 * 7"))).text == "42"
        first_dir = first.instance_dir
    assert not first_dir.exists()
    assert [p.name for p in (data_dir / "instances").iterdir()] == [".recovery"]


async def test_a_pre_instance_sandlot_on_the_data_dir_is_refused(data_dir: Path) -> None:
    # What an older sandlot holds while it runs: the data dir's lock, exclusively.
    fd = os.open(data_dir / "manager.lock", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"4242")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ConfigError, match="older sandlot process \\(pid 4242\\)"):
            await SandboxManager(make_settings(data_dir, backend="unsafe-local")).start()
    finally:
        os.close(fd)
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        # And while we run, an older sandlot cannot take it.
        fd = os.open(data_dir / "manager.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        await mgr.create()


async def test_store_is_a_real_sqlite_file_that_survives_restart(data_dir: Path) -> None:
    settings = make_settings(data_dir, backend="unsafe-local")
    async with SandboxManager(settings) as mgr:
        info = await mgr.create(SandboxSpec(metadata={"task": "t1"}), owner="alice")
        await mgr.destroy(info.id)
    rows = sqlite3.connect(data_dir / "sandlot.db").execute(
        "SELECT id, owner, status FROM sandboxes"
    )
    assert list(rows) == [(info.id, "alice", "destroyed")]
    async with SandboxManager(settings) as mgr:
        again = await mgr.get(info.id)
        assert again.metadata == {"task": "t1"}
        assert again.end_reason == "user"
        assert [s.id for s in await mgr.list(include_ended=True)] == [info.id]


async def test_close_destroys_live_sandboxes(data_dir: Path) -> None:
    mgr = SandboxManager(make_settings(data_dir, backend="unsafe-local"))
    await mgr.start()
    info = await mgr.create()
    instance_dir = mgr.instance_dir
    assert (instance_dir / "local-sandboxes" / info.id).is_dir()
    await mgr.close()
    assert not instance_dir.exists()
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as again:
        assert (await again.get(info.id)).end_reason == "shutdown"


async def test_guest_killed_between_calls_reports_lost_state(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create()
        await mgr.run_code(info.id, RunCode(code="x = 1"))
        # Kill the supervisor from outside, as an OOM kill between calls would.
        pid = (await mgr.run_code(info.id, RunCode(code="import os; os.getppid()"))).text
        assert pid is not None
        # The killer fires after its own call has returned: nobody has been told yet.
        killer = await mgr.run_command(
            info.id, RunCommand(command=f"(sleep 0.3; kill -9 {pid}) >/dev/null 2>&1 &")
        )
        assert not killer.state_lost
        await asyncio.sleep(1.0)
        result = await mgr.run_code(info.id, RunCode(code="'x' in globals()"))
        assert result.text == "False"
        assert result.state_lost
        assert not (await mgr.run_code(info.id, RunCode(code="1"))).state_lost


async def test_a_guest_killed_again_and_again_is_restarted_at_a_paced_rate(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sandboxed code can kill its own supervisor on every call; each restart costs the host
    # a new guest (on gVisor a container restart) that nobody is charged for. Past the
    # burst, a restart waits out the window; a destroy never waits for it.
    monkeypatch.setattr(live_module, "RESTART_BURST", 2)
    monkeypatch.setattr(live_module, "RESTART_WINDOW_S", 60.0)
    kill_supervisor = RunCode(code="import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create()
        live = mgr._live[info.id]
        for _ in range(2):  # the burst: two restarts at once
            assert (await mgr.run_code(info.id, kill_supervisor)).state_lost
            assert (await mgr.run_code(info.id, RunCode(code="1"))).text == "1"
        assert (await mgr.run_code(info.id, kill_supervisor)).state_lost
        assert 55 < live.restart_wait_s() <= 60
        paced = asyncio.create_task(mgr.run_code(info.id, RunCode(code="1")))
        await asyncio.sleep(0.5)
        assert not paced.done()  # waiting out the window, not restarting
        destroyed = await asyncio.wait_for(mgr.destroy(info.id), 10)
        assert destroyed.status == SandboxStatus.DESTROYED
        with pytest.raises(SandboxNotRunning):
            await asyncio.wait_for(paced, 5)  # it ends with the sandbox


async def test_async_sdk_with_explicit_manager(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        async with await AsyncSandbox.create(manager=mgr) as sb:
            await sb.run_code("x = 41")
            assert (await sb.run_code("x + 1")).text == "42"
            result = await sb.commands.run("echo hi && exit 3")
            assert (result.exit_code, result.stdout) == (3, "hi\n")
            await sb.files.write("data/a.txt", "hello")
            assert await sb.files.read("data/a.txt") == "hello"
        assert sb.info.status == SandboxStatus.DESTROYED


async def test_cancelled_call_is_stopped_in_the_guest(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create()
        task = asyncio.create_task(
            mgr.run_command(info.id, RunCommand(command="sleep 30", timeout_s=60))
        )
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The session lock is free again only if the guest really ended the command.
        result = await asyncio.wait_for(
            mgr.run_command(info.id, RunCommand(command="echo free")), 5
        )
        assert result.stdout == "free\n"


async def test_warm_pool_serves_default_creates_and_refills(data_dir: Path) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", pool_size=2)
    async with SandboxManager(settings) as mgr:
        await _until(lambda: mgr.pooled_count() == 2)
        assert mgr._pools is not None
        pooled_ids = mgr._pools.ids()
        first = await mgr.create(SandboxSpec(metadata={"k": "v"}), owner="alice")
        assert first.id in pooled_ids
        assert (first.owner, first.metadata, first.status) == ("alice", {"k": "v"}, "running")
        assert (await mgr.run_code(first.id, RunCode(code="6 * 7"))).text == "42"
        # A create that differs from the pool's defaults gets a fresh sandbox.
        custom = await mgr.create(SandboxSpec(memory_mb=128))
        assert custom.id not in pooled_ids
        await _until(lambda: mgr.pooled_count() == 2)
        await asyncio.sleep(0.3)
        assert mgr.pooled_count() == 2  # refilled, never more
        assert [s.id for s in await mgr.list()] == [first.id, custom.id]  # pool is not listed
        pool_dirs = mgr._pools.ids()
        local = mgr.instance_dir / "local-sandboxes"
        assert all((local / sandbox_id).is_dir() for sandbox_id in pool_dirs)
    # Closing removes pooled sandboxes too.
    for sandbox_id in pool_dirs:
        assert not (local / sandbox_id).exists()


async def test_a_pool_refills_for_the_tenant_that_uses_it_and_never_serves_another() -> None:
    """Pooled sandboxes started for a tenant (their guests fork from its template) go to
    that tenant alone; a pool refills for whoever made its last creates, and for anyone
    while they were several tenants; one that finds only others' ends the oldest of them."""
    from types import SimpleNamespace

    from sandlot.core.live import PoolKey
    from sandlot.core.pools import TENANT_AFTER, Pools

    limits = make_settings(Path("/nonexistent")).resolve_limits(None)
    key = PoolKey("fake", None, "python3")
    made: list[Any] = []
    stopped: list[str] = []

    def make(_: PoolKey, tenant: str | None) -> Any:
        async def close() -> None:
            pass

        async def stop(sandbox_id: str) -> None:
            stopped.append(sandbox_id)

        live = SimpleNamespace(
            id=f"sb-{len(made)}",
            info=SimpleNamespace(limits=limits),
            conn=SimpleNamespace(alive=True, close=close),
            spec=SimpleNamespace(tenant=tenant),
            backend=SimpleNamespace(stop=stop),
        )
        made.append(live)
        return live

    async def boot(live: Any) -> None:
        await asyncio.sleep(0)

    pools = Pools(limits, False, make, boot)
    pools.start({key: 2})

    def create(owner: str) -> Any:
        """What the manager does for an admitted create: take, then say who asked."""
        taken = pools.take(key, limits, False, None, owner)
        pools.asked(key, limits, False, None, owner, served=taken is not None)
        return taken

    try:
        await _until(lambda: pools.count() == 2)
        assert [live.spec.tenant for live in made] == [None, None]  # for anyone at first
        for _ in range(TENANT_AFTER + 1):  # the last takes the last one for anyone
            assert create("alice") is not None
            await _until(lambda: pools.count() == 2)
        assert made[-1].spec.tenant == "alice"
        held = {live.spec.tenant for pool in pools._pools.values() for live in pool.lives}
        assert held == {"alice"}
        # A take alone (a create then refused, or decided twice) changes nothing.
        assert pools.take(key, limits, False, None, "bob") is None
        assert pools.count() == 2 and stopped == []
        # Bob is never handed alice's: the pool ends the oldest, refills for anyone, then
        # for bob once his creates are the last few.
        assert create("bob") is None
        await _until(lambda: len(stopped) == 1)
        for _ in range(TENANT_AFTER + 1):
            await _until(lambda: pools.count() == 2)
            got = create("bob")
            assert got is None or got.spec.tenant in (None, "bob"), got
        await _until(lambda: pools.count() == 2)
        assert made[-1].spec.tenant == "bob"
        alices = create("alice")
        assert alices is None or alices.spec.tenant in (None, "alice"), alices
        # Creates of several tenants: refills are for anyone again.
        for owner in ("alice", "bob", "carol"):
            got = create(owner)
            assert got is None or got.spec.tenant in (None, owner)
            await _until(lambda: pools.count() == 2)
        assert made[-1].spec.tenant is None
    finally:
        for pool in pools._pools.values():
            for task in pool.tasks:
                task.cancel()


async def test_a_warm_pool_starts_two_at_once_and_never_more_than_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fillers that start sandboxes side by side, never more than the pool's size (issue 13).
    from types import SimpleNamespace

    from sandlot.core import pools as pools_module
    from sandlot.core.live import PoolKey
    from sandlot.core.pools import Pools
    from sandlot.errors import SandboxStartError

    monkeypatch.setattr(pools_module, "POOL_RETRY_S", 0.01)
    monkeypatch.setattr(pools_module, "REFILL_PARALLEL", 2)  # 1 by default (measured)

    limits = make_settings(Path("/nonexistent")).resolve_limits(None)
    key = PoolKey("fake", None, "python3")
    starting, most_at_once, made = 0, 0, 0

    def make(_: PoolKey, tenant: str | None) -> Any:
        nonlocal made
        made += 1
        conn = SimpleNamespace(alive=True)
        spec = SimpleNamespace(tenant=tenant)
        info = SimpleNamespace(limits=limits)
        return SimpleNamespace(id=f"sb-{made}", info=info, conn=conn, spec=spec)

    async def boot(live: Any) -> None:
        nonlocal starting, most_at_once
        if live.id == "sb-7":
            raise SandboxStartError("a refill that fails is retried, its place kept")
        starting += 1
        most_at_once = max(most_at_once, starting)
        await asyncio.sleep(0.05)
        starting -= 1

    pools = Pools(limits, False, make, boot)
    pools.start({key: 3})
    await _until(lambda: pools.count() == 3)
    assert most_at_once == 2
    taken = [pools.take(key, limits, False, None, "local") for _ in range(3)]
    assert all(t is not None for t in taken)
    await _until(lambda: pools.count() == 3)
    await asyncio.sleep(0.2)
    assert (pools.count(), made, most_at_once) == (3, 6, 2)  # refilled, never more
    assert pools.take(key, limits, False, None, "local") is not None
    await _until(lambda: pools.count() == 3)  # after one failed start (sb-7)
    assert made == 8
    for pool in pools._pools.values():  # no sandbox to stop in this fake
        for task in pool.tasks:
            task.cancel()


async def _until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


# Names a sandbox may give its artifacts that look like the host's own: a copy once went
# through ".<name>.partial" beside the kept files, and replaced an artifact of that name.
TRICKY_ARTIFACTS = {
    ".a.partial": b"the partial-named file",
    "a": b"I am a",
    "artifacts/b": b"nested b",
    "b": b"top b",
    ".staging": b"not the host's staging",
}


async def test_every_kept_artifact_is_its_own_file(data_dir: Path) -> None:
    # Failed before (red team, 2026-11-25): ".a.partial" was listed, but its file had been
    # renamed to "a", and its download was a 500.
    settings = make_settings(data_dir, backend="unsafe-local")
    async with SandboxManager(settings) as mgr:
        info = await mgr.create()
        for name, data in TRICKY_ARTIFACTS.items():
            await mgr.write_file(info.id, WriteFile(path=f"artifacts/{name}"), data)
        await mgr.destroy(info.id)
        kept = {a.path: a.size_bytes for a in await mgr.list_artifacts(info.id)}
        assert kept == {name: len(data) for name, data in TRICKY_ARTIFACTS.items()}
        for name, data in TRICKY_ARTIFACTS.items():
            assert await mgr.read_artifact(info.id, name) == data
        assert list((data_dir / "artifacts" / ".staging").iterdir()) == []
        # A record whose file is gone (removed by hand, say) is a 404, not a 500.
        (data_dir / "artifacts" / info.id / "a").unlink()
        with pytest.raises(SandboxFileNotFound):
            await mgr.read_artifact(info.id, "a")


async def test_kept_artifacts_expire(data_dir: Path) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", artifact_retention_s=1.0)
    async with SandboxManager(settings) as mgr:
        info = await mgr.create()
        await mgr.write_file(info.id, WriteFile(path="artifacts/out.txt"), b"result")
        await mgr.destroy(info.id)
        assert [a.path for a in await mgr.list_artifacts(info.id)] == ["out.txt"]
        await _until(lambda: not (data_dir / "artifacts" / info.id).exists())
        assert await mgr.list_artifacts(info.id) == []
