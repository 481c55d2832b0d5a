"""Host uids for sandboxes: one each, allocated with advisory locks so that several managers
on one host (different data dirs, test runs) never hand out the same uid twice.

The lock of a uid is a file held with ``flock`` for the life of the sandbox; the kernel
drops it when the holder dies, so a crashed manager frees its uids without any bookkeeping.

A lock's death does not prove the uid idle, though: a docker container outlives a killed
manager, and a manager that closes with live sandboxes leaves their processes running. A
next holder of that uid would share the kernel's per-uid counts with them (processes,
inotify instances, message-queue bytes, pipe pages), so one sandbox's leftovers could starve
another. So a holder marks the lock file while it holds the uid, and clears the mark only
once nothing of the sandbox is left (:func:`release`); a lock found free but still marked
was dropped by a death or a close, and its uid is handed out again only while no process on
the host runs as it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from sandlot.errors import SandboxStartError

log = structlog.get_logger(__name__)

# Host-wide, so that every manager and backend on the host draws from one pool.
UID_LOCK_DIR = Path("/run/sandlot/uids")
# Written into a uid's lock file while a sandbox holds the uid; emptied by :func:`release`.
HELD_MARK = b"held\n"
# How long a look at the host's processes answers "busy" for. A "busy" answer can only go
# stale the safe way (the uid's processes ended since). An "idle" one is trusted only from
# a look taken after this manager took the lock: before that, another manager may have held
# the uid, run a process as it, and died (red team, 2026-12-06: a cached look handed out a
# uid whose process ran, 0.05 s after its holder died). Once the lock is ours, no new
# process of the uid can appear but from one already there.
BUSY_UIDS_TTL_S = 1.0


class UidAllocator:
    @classmethod
    def for_host(cls, data_dir: Path, base: int, count: int) -> UidAllocator:
        """The host's pool (:data:`UID_LOCK_DIR`), or the data directory's without /run."""
        lock_dir = UID_LOCK_DIR if Path("/run").is_dir() else data_dir / "uids"
        return cls(lock_dir, base, count)

    def __init__(self, lock_dir: Path, base: int, count: int) -> None:
        self.lock_dir = lock_dir
        self.base = base
        self.count = count
        self._next = 0
        self._busy: frozenset[int] = frozenset()
        self._busy_at = -BUSY_UIDS_TTL_S
        self._warned: set[int] = set()
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def acquire(self) -> tuple[int, int]:
        """Return ``(uid, lock_fd)``; keep the fd open while the uid is in use.

        Raises:
            SandboxStartError: every uid of the range is taken.
        """
        order = (self.base + (self._next + step) % self.count for step in range(self.count))
        taken = lock_first_free(self.lock_dir, order, idle=self._idle)
        if taken is not None:
            self._next = taken[0] - self.base + 1
            return taken
        raise SandboxStartError(
            f"all {self.count} sandbox uids from {self.base} are in use (some may be held by "
            "processes of a manager that was killed or closed with live sandboxes); "
            "raise SANDBOX_UID_COUNT or destroy sandboxes"
        )

    def _idle(self, uid: int) -> bool:
        """Whether no process on the host runs as ``uid`` (asked only of a marked lock,
        once it is held)."""
        if not (uid in self._busy and time.monotonic() - self._busy_at < BUSY_UIDS_TTL_S):
            self._busy, self._busy_at = busy_uids(), time.monotonic()
        if uid in self._busy:
            if uid not in self._warned:  # once: every create past it would say it again
                self._warned.add(uid)
                log.warning(
                    "uid_left_running",
                    uid=uid,
                    hint="a process of a manager killed or closed with live sandboxes "
                    "(a docker container runs on until a manager starts on its data dir)",
                )
            return False
        return True


def lock_first_free(
    lock_dir: Path, numbers: Iterable[int], *, idle: Callable[[int], bool] | None = None
) -> tuple[int, int] | None:
    """The first of ``numbers`` whose lock file in ``lock_dir`` no live process holds, and
    the fd that now holds it (``flock``, dropped by the kernel when its holder dies); None
    if every one is held.

    With ``idle``, the lock is also marked held (:data:`HELD_MARK`), and a lock found still
    marked is taken only where ``idle(number)`` says so.
    """
    for number in numbers:
        fd = os.open(lock_dir / f"{number}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if idle is not None:
                if os.pread(fd, len(HELD_MARK), 0) and not idle(number):
                    os.close(fd)  # still marked: asked again at a later look
                    continue
                os.pwrite(fd, HELD_MARK, 0)
        except BlockingIOError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return number, fd
    return None


def unlock(fd: int) -> None:
    """Give back what a lock fd of :func:`lock_first_free` holds, its mark left: for a holder
    that may leave processes behind (a close with live sandboxes)."""
    with contextlib.suppress(OSError):
        os.close(fd)


def release(fd: int) -> None:
    """Give back a lock fd once nothing of its holder's is left: the mark cleared, so that
    the next holder takes it without looking at the host's processes."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    unlock(fd)


def busy_uids(proc: Path = Path("/proc")) -> frozenset[int]:
    """Every uid (real, effective, saved or filesystem) of a process on the host, zombies
    included: they count against their uid's process limit until reaped. The owner of
    ``/proc/<pid>``'s files is not enough: an undumpable process's are root's."""
    found: set[int] = set()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"Uid:"):
                        found.update(int(v) for v in line.split()[1:])
                        break
        except OSError:  # gone meanwhile
            continue
    return frozenset(found)
