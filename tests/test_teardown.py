"""A destroy returns once nothing of the sandbox runs; the rest is torn down after it.

What must hold (core/teardown.py): no process of the sandbox outlives the destroy's return;
its disk, cgroup and directory go soon after; until they do, the sandbox still counts
against its owner's quota, and a create refused for that room waits for the teardown instead
of failing; a teardown that fails costs no caller anything and is swept at close.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.errors import QuotaExceeded, SandboxNotRunning
from sandlot.models import Quota, SandboxStatus
from sandlot.requests import RunCode, SandboxSpec
from tests import leaks
from tests.conftest import make_settings

BLOCKED_S = 0.3  # how long a test looks at a held teardown
ONE_SANDBOX = Quota(max_sandboxes=1, max_memory_mb=100_000)
HOLD_LIMIT_S = 5.0  # a held stop goes on by itself after this: a failing test never hangs
SLEEPER = "import subprocess; subprocess.Popen(['sleep', '60'], start_new_session=True)"


class HeldStops:
    """Makes the backend's ``stop`` wait until released: a teardown caught in the middle."""

    def __init__(self, mgr: SandboxManager, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0
        real = type(mgr._backend(backend)).stop

        async def stop(this: object, sandbox_id: str) -> None:
            self.calls += 1
            self.entered.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), HOLD_LIMIT_S)
            await real(this, sandbox_id)  # type: ignore[arg-type]

        monkeypatch.setattr(type(mgr._backend(backend)), "stop", stop)


async def _unclosed_manager(data_dir: Path) -> SandboxManager:
    """A started manager on the fake backend that the test itself closes."""
    mgr = SandboxManager(make_settings(data_dir, backend="unsafe-local"))
    await mgr.start()
    return mgr


@pytest.fixture
async def local_manager(
    data_root: Path, request: pytest.FixtureRequest
) -> AsyncIterator[SandboxManager]:
    data_dir = data_root / f"teardown-{request.node.name}"
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        yield mgr


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_destroy_returns_with_nothing_running_and_the_disk_follows(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = data_root / "teardown-bubblewrap"
    async with SandboxManager(make_settings(data_dir)) as mgr:
        info = await mgr.create(SandboxSpec())
        # A child that would outlive its parent, in its own session.
        await mgr.run_code(
            info.id,
            RunCode(
                code="import subprocess; subprocess.Popen(['sleep', '60'], start_new_session=True)"
            ),
        )
        uid = leaks.host_uid(mgr, info.id)
        assert len(leaks.procs_of_uid(uid)) >= 3  # the guest, its kernel, the sleep
        root = leaks.sandbox_root(mgr, info.id)
        cgroups = leaks.sandbox_cgroup_dirs(mgr, info.id)
        held = HeldStops(mgr, "bubblewrap", monkeypatch)
        # Returns while its teardown is held (before: the destroy waited for all of it).
        await asyncio.wait_for(mgr.destroy(info.id), HOLD_LIMIT_S / 2)
        await asyncio.wait_for(held.entered.wait(), 5.0)
        # Nothing of it runs once destroy has returned (its uid is still its own: the uid
        # is freed by the teardown). Zombies wait for their reaper, and run nothing.
        running = [
            p
            for p in leaks.procs_of_uid(uid)
            if (leaks.status_fields(p.pid) or {}).get("State", "Z")[:1] != "Z"
        ]
        assert running == [], running
        assert (root / "volume").is_mount()  # its disk is still there, being torn down
        held.release.set()
        await mgr.settle()
        assert not root.exists()
        assert not any(c.exists() for c in cgroups), cgroups
        assert leaks.mounts_below(data_dir) == []
        assert leaks.loop_devices_below(data_dir) == []


@pytest.mark.asyncio
async def test_a_teardown_holds_its_quota_until_it_ends_and_a_create_waits_for_it(
    local_manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = local_manager
    quota = ONE_SANDBOX
    first = await mgr.create(SandboxSpec(), owner="t1", quota=quota)
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(first.id, owner="t1")
    assert (await mgr.get(first.id)).status.value == "destroyed"
    # At a full quota, destroy then create at once: the create waits for the teardown
    # (it held the slot), then is admitted. It failed with QuotaExceeded without the wait.
    create = asyncio.create_task(mgr.create(SandboxSpec(), owner="t1", quota=quota))
    await asyncio.sleep(BLOCKED_S)
    assert not create.done()
    held.release.set()
    second = await asyncio.wait_for(create, 10.0)
    assert second.id != first.id
    # Really over the quota is still refused, teardowns or not.
    with pytest.raises(QuotaExceeded):
        await mgr.create(SandboxSpec(), owner="t1", quota=quota)
    await mgr.destroy(second.id)


@pytest.mark.asyncio
async def test_a_failed_teardown_costs_the_caller_nothing_and_close_sweeps_it(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = data_root / "teardown-failed"
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        info = await mgr.create(SandboxSpec())
        backend = mgr._backend("unsafe-local")
        workspace = backend.workspace_on_host(info.id)
        assert workspace is not None

        async def broken_stop(sandbox_id: str) -> None:
            backend._guests.pop(sandbox_id, None)  # as the real one starts
            raise OSError("the disk would not unmount")

        monkeypatch.setattr(backend, "stop", broken_stop)
        ended = await mgr.destroy(info.id)
        assert ended.status.value == "destroyed"
        await mgr.settle()  # logged, not raised
        assert workspace.exists()  # left behind by the failed teardown...
        monkeypatch.undo()
    assert not workspace.exists()  # ...and swept at close


@pytest.mark.asyncio
async def test_close_waits_for_the_teardowns_under_way(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = await _unclosed_manager(data_root / "teardown-close")
    info = await mgr.create(SandboxSpec())
    workspace = mgr._backend("unsafe-local").workspace_on_host(info.id)
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(info.id)
    closing = asyncio.create_task(mgr.close())
    await asyncio.sleep(BLOCKED_S)
    assert not closing.done()  # held by the teardown
    held.release.set()
    await asyncio.wait_for(closing, 10.0)
    assert held.calls == 1
    assert workspace is not None and not workspace.exists()


async def test_a_refusal_waits_only_for_teardowns_that_could_change_it(
    local_manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The red team's find: a tenant's refused create waited for every other tenant's
    # teardowns (which a sandbox can make slow), with no bound.
    mgr = local_manager
    quota = ONE_SANDBOX
    await mgr.create(SandboxSpec(), owner="a", quota=quota)
    other = await mgr.create(SandboxSpec(), owner="b")
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(other.id)  # b's teardown, held
    started = asyncio.get_running_loop().time()
    with pytest.raises(QuotaExceeded):
        await mgr.create(SandboxSpec(), owner="a", quota=quota)
    assert asyncio.get_running_loop().time() - started < BLOCKED_S  # not held by b's
    held.release.set()


async def test_released_is_said_when_the_teardown_ends_not_at_the_destroy(
    local_manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster's quota ledger frees a sandbox's slot on "released" (ray/node.py): on
    # "destroyed" a tenant could hold its quota live plus every teardown under way.
    mgr = local_manager
    said: list[tuple[str, str]] = []
    mgr.add_listener(lambda event, fields: said.append((event, fields["info"].id)))
    info = await mgr.create(SandboxSpec())
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(info.id)
    await asyncio.wait_for(held.entered.wait(), 5.0)
    assert ("destroyed", info.id) in said and ("released", info.id) not in said
    held.release.set()
    await mgr.settle(info.id)
    assert said[-1] == ("released", info.id)


async def test_a_create_waiting_for_room_gives_up_when_the_manager_closes(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The red team's find: it woke after close had begun and failed on a closed store (a
    # server error) or started a sandbox that close then killed.
    mgr = await _unclosed_manager(data_root / "teardown-closing")
    quota = ONE_SANDBOX
    first = await mgr.create(SandboxSpec(), owner="t", quota=quota)
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(first.id)
    waiting = asyncio.create_task(mgr.create(SandboxSpec(), owner="t", quota=quota))
    await asyncio.sleep(BLOCKED_S)
    closing = asyncio.create_task(mgr.close())
    await asyncio.sleep(0.05)
    held.release.set()
    with pytest.raises(SandboxNotRunning, match="closing"):
        await asyncio.wait_for(waiting, 10.0)
    await asyncio.wait_for(closing, 10.0)


async def _destroyed_and_held(mgr: SandboxManager, monkeypatch: pytest.MonkeyPatch) -> HeldStops:
    """Owner "t"'s one sandbox, made and destroyed in ``mgr``, its teardown held."""
    info = await mgr.create(SandboxSpec(), owner="t", quota=ONE_SANDBOX)
    held = HeldStops(mgr, "unsafe-local", monkeypatch)
    await mgr.destroy(info.id)
    await held.entered.wait()
    return held


@pytest.mark.asyncio
async def test_another_process_counts_a_teardown_and_waits_for_it(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two managers on one data directory (API_WORKERS > 1): the other one counts a
    sandbox destroyed here until its teardown has released it, and its create refused for
    that room waits for the release instead of taking the room at once (it did, before)."""
    data_dir = data_root / "teardown-elsewhere"
    here = await _unclosed_manager(data_dir)
    there = await _unclosed_manager(data_dir)
    try:
        held = await _destroyed_and_held(here, monkeypatch)
        released_at: list[float] = []

        async def release_later() -> None:
            await asyncio.sleep(BLOCKED_S)
            released_at.append(asyncio.get_running_loop().time())
            held.release.set()

        releasing = asyncio.create_task(release_later())
        other = await there.create(SandboxSpec(), owner="t", quota=ONE_SANDBOX)
        admitted_at = asyncio.get_running_loop().time()
        await releasing
        assert released_at and admitted_at >= released_at[0]
        await there.destroy(other.id)
    finally:
        for mgr in (there, here):
            await mgr.close()


@pytest.mark.asyncio
async def test_a_destroy_cancelled_mid_halt_still_ends_the_record(data_root: Path) -> None:
    """Cancelled while the guest is being halted, the destroy still tears the sandbox down
    and records it as destroyed: left "running", the other processes of the data directory
    counted it against its owner for the rest of this one's life."""
    data_dir = data_root / "teardown-cancelled-halt"
    here = await _unclosed_manager(data_dir)
    there = await _unclosed_manager(data_dir)
    try:
        info = await here.create(SandboxSpec(), owner="t", quota=ONE_SANDBOX)
        backend = here._backend("unsafe-local")
        real = backend.halt

        async def slow_halt(sandbox_id: str) -> None:
            await asyncio.sleep(BLOCKED_S)
            await real(sandbox_id)

        backend.halt = slow_halt  # type: ignore[method-assign]
        destroying = asyncio.create_task(here.destroy(info.id))
        await asyncio.sleep(BLOCKED_S / 3)
        destroying.cancel()
        await asyncio.gather(destroying, return_exceptions=True)
        await here.settle()
        assert (await there.get(info.id)).status == SandboxStatus.DESTROYED
        other = await there.create(SandboxSpec(), owner="t", quota=ONE_SANDBOX)
        await there.destroy(other.id)
    finally:
        for mgr in (there, here):
            await mgr.close()


@pytest.mark.asyncio
async def test_a_create_waiting_for_another_process_gives_up_at_close(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = data_root / "teardown-elsewhere-close"
    here = await _unclosed_manager(data_dir)
    there = await _unclosed_manager(data_dir)
    try:
        held = await _destroyed_and_held(there, monkeypatch)
        creating = asyncio.create_task(here.create(SandboxSpec(), owner="t", quota=ONE_SANDBOX))
        await asyncio.sleep(BLOCKED_S)
        assert not creating.done()  # it waits for the other process's teardown
        await here.close()
        with pytest.raises(SandboxNotRunning, match="closing"):
            await asyncio.wait_for(creating, HOLD_LIMIT_S)
        held.release.set()
    finally:
        for mgr in (there, here):
            await mgr.close()


@pytest.mark.asyncio
async def test_a_destroy_the_store_cannot_record_still_frees_the_sandbox(
    local_manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the store cannot write. The destroy that frees the disk is no error,
    its teardown goes on, and the record is saved once it has (a red team's full disk made
    every destroy raise, 2026-12-07)."""
    import sqlite3

    mgr = local_manager
    info = await mgr.create(SandboxSpec())
    real_save = type(mgr._store).save
    failures = []

    def save(this: object, record: object, *, held: bool = False) -> None:
        if held and not failures:  # the destroy's record, once
            failures.append(record)
            raise sqlite3.OperationalError("database or disk is full")
        real_save(this, record, held=held)  # type: ignore[arg-type]

    monkeypatch.setattr(type(mgr._store), "save", save)
    ended = await mgr.destroy(info.id)
    assert failures and ended.status == SandboxStatus.DESTROYED
    await mgr.settle()
    assert (await mgr.get(info.id)).status == SandboxStatus.DESTROYED
    assert not mgr._unsaved
