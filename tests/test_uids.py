"""The host-wide uid pool (``backends/uids.py``): a uid whose lock died with its holder is
handed out again only while no process on the host runs as it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.backends import uids
from sandlot.backends.uids import HELD_MARK, UidAllocator, busy_uids, release, unlock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other uids")

# Far from every test run's SANDBOX_UID_BASE, so no sandbox of another suite holds them.
BASE = 3_700_000 + (os.getpid() % 1000) * 8


def _run_as(uid: int, code: str = "import time; time.sleep(60)") -> subprocess.Popen[bytes]:
    """A process of ``uid`` (as a killed manager's container or sandbox would leave)."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    proc = subprocess.Popen([*argv, sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # it has dropped to uid and said so
    return proc


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def leftover() -> Iterator[subprocess.Popen[bytes]]:
    proc = _run_as(BASE, "print(flush=True); import time; time.sleep(60)")
    yield proc
    _end(proc)


def _mark_as_left_by_a_dead_holder(lock_dir: Path, uid: int) -> None:
    """What a holder killed mid-sandbox leaves: the lock free, the mark still there."""
    (lock_dir / f"{uid}.lock").write_bytes(HELD_MARK)


def test_a_uid_still_run_by_a_dead_holders_process_is_not_handed_out(
    tmp_path: Path, leftover: subprocess.Popen[bytes]
) -> None:
    # Failed before: a manager killed with a docker sandbox left its container running as
    # that uid, and the next manager gave the uid to a new sandbox, which then shared the
    # kernel's per-uid counts (processes, inotify, mqueue bytes, pipe pages) with it.
    _mark_as_left_by_a_dead_holder(tmp_path, BASE)
    pool = UidAllocator(tmp_path, BASE, 4)
    uid, fd = pool.acquire()
    assert uid == BASE + 1
    assert (tmp_path / f"{uid}.lock").read_bytes() == HELD_MARK  # marked while held
    release(fd)
    _end(leftover)
    # Once nothing runs as it, a later look hands it out (a new pool: no cached look).
    uid, fd = UidAllocator(tmp_path, BASE, 4).acquire()
    assert uid == BASE
    unlock(fd)


def test_a_cleanly_released_uid_is_taken_without_a_look_at_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = UidAllocator(tmp_path, BASE, 2)
    uid, fd = pool.acquire()
    release(fd)
    assert (tmp_path / f"{uid}.lock").read_bytes() == b""

    def no_look() -> frozenset[int]:
        raise AssertionError("a clean lock needs no look at /proc")

    monkeypatch.setattr(uids, "busy_uids", no_look)
    again, fd = UidAllocator(tmp_path, BASE, 2).acquire()
    assert again == uid
    unlock(fd)
    # unlock (a close that may leave processes) keeps the mark: the next holder looks.
    assert (tmp_path / f"{uid}.lock").read_bytes() == HELD_MARK


def test_every_uid_busy_says_so(tmp_path: Path, leftover: subprocess.Popen[bytes]) -> None:
    _mark_as_left_by_a_dead_holder(tmp_path, BASE)
    with pytest.raises(Exception, match="killed or closed with live sandboxes"):
        UidAllocator(tmp_path, BASE, 1).acquire()


def test_busy_uids_sees_an_undumpable_process_and_a_zombie() -> None:
    # An undumpable process's /proc/<pid>/ files are root's: its status still names its uids.
    undumpable = _run_as(
        BASE + 2,
        "import ctypes; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); print(flush=True); "
        "import time; time.sleep(60)",
    )
    zombie = _run_as(BASE + 3, "print(flush=True)")
    try:
        deadline = time.monotonic() + 5
        while Path(f"/proc/{zombie.pid}/status").read_text().find("State:\tZ") < 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert Path(f"/proc/{undumpable.pid}/status").stat().st_uid == 0
        busy = busy_uids()
        assert {BASE + 2, BASE + 3} <= busy
    finally:
        _end(undumpable)
        _end(zombie)
    assert not {BASE + 2, BASE + 3} & busy_uids()


def test_a_uid_left_running_just_after_a_look_is_not_handed_out(
    tmp_path: Path, leftover: subprocess.Popen[bytes]
) -> None:
    # Failed before (red team, 2026-12-06): a look at the host's processes was cached for
    # 1 s, so a uid whose holder ran a process as it and died just after the look was
    # handed out as idle, its process still running.
    _mark_as_left_by_a_dead_holder(tmp_path, BASE)
    pool = UidAllocator(tmp_path, BASE, 6)
    uid, first = pool.acquire()
    assert uid == BASE + 1  # BASE is busy: the pool has looked
    later = _run_as(BASE + 2, "print(flush=True); import time; time.sleep(60)")
    try:
        _mark_as_left_by_a_dead_holder(tmp_path, BASE + 2)
        uid, second = pool.acquire()
        assert uid == BASE + 3
    finally:
        _end(later)
    release(first)
    release(second)
