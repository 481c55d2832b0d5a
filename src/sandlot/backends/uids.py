"""Host uids for sandboxes: one each, allocated with advisory locks so that several managers
on one host (different data dirs, test runs) never hand out the same uid twice.

The lock of a uid is a file held with ``flock`` for the life of the sandbox; the kernel
drops it when the holder dies, so a crashed manager frees its uids without any bookkeeping.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from sandlot.errors import SandboxStartError

# Host-wide, so that every manager and backend on the host draws from one pool.
UID_LOCK_DIR = Path("/run/sandlot/uids")


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
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def acquire(self) -> tuple[int, int]:
        """Return ``(uid, lock_fd)``; keep the fd open while the uid is in use.

        Raises:
            SandboxStartError: every uid of the range is taken.
        """
        order = (self.base + (self._next + step) % self.count for step in range(self.count))
        taken = lock_first_free(self.lock_dir, order)
        if taken is not None:
            self._next = taken[0] - self.base + 1
            return taken
        raise SandboxStartError(
            f"all {self.count} sandbox uids from {self.base} are in use; "
            "raise SANDBOX_UID_COUNT or destroy sandboxes"
        )


def lock_first_free(lock_dir: Path, numbers: Iterable[int]) -> tuple[int, int] | None:
    """The first of ``numbers`` whose lock file in ``lock_dir`` no live process holds, and
    the fd that now holds it (``flock``, dropped by the kernel when its holder dies); None
    if every one is held."""
    for number in numbers:
        fd = os.open(lock_dir / f"{number}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return number, fd
    return None


def unlock(fd: int) -> None:
    """Give back what a lock fd of :func:`lock_first_free` holds."""
    with contextlib.suppress(OSError):
        os.close(fd)
