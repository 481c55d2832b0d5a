"""Host uids for sandboxes: one each, allocated with advisory locks so that several managers
on one host (different data dirs, test runs) never hand out the same uid twice.

The lock of a uid is a file held with ``flock`` for the life of the sandbox; the kernel
drops it when the holder dies, so a crashed manager frees its uids without any bookkeeping.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from sandlot.errors import SandboxStartError


class UidAllocator:
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
        for step in range(self.count):
            index = (self._next + step) % self.count
            uid = self.base + index
            fd = os.open(
                self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = index + 1
            return uid, fd
        raise SandboxStartError(
            f"all {self.count} sandbox uids from {self.base} are in use; "
            "raise SANDBOX_UID_COUNT or destroy sandboxes"
        )

    @staticmethod
    def release(fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)
