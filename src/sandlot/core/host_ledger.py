"""What the managers of other data directories on this host reserve, for one host capacity.

A data directory's managers count each other's sandboxes through its store; a manager of
another data directory on the same host counted none of them, so two data directories each
admitted 2 x 128 MB against a capacity of 300 MB (red team, 2026-12-07). Each manager (as
root) keeps a file in ``SANDBOX_HOST_LEDGER_DIR`` (``/run/sandlot/reserved``) with what its own
sandboxes reserve (live, starting, pooled, being torn down), holding an exclusive ``flock``
on it for its life: a file whose lock can be taken is a dead manager's, and is removed. A
create reads the other data directories' files and writes its own under one host-wide lock,
so two creates anywhere on the host cannot both take the last room. Disk counts only between
data directories on one file system (the capacity is a share of its free space).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

TURN = ".turn"


class Reservation(Protocol):
    """What a sandbox reserves of the host (a ``ResolvedLimits`` is one)."""

    @property
    def memory_mb(self) -> int | float: ...

    @property
    def cpu_cores(self) -> float: ...

    @property
    def pids(self) -> int: ...

    @property
    def disk_mb(self) -> int | float: ...


@dataclass(frozen=True)
class Reserved:
    """Another data directory's managers' reservations, as one."""

    memory_mb: float
    cpu_cores: float
    pids: int
    disk_mb: float


class HostLedger:
    """This manager's line in the host's ledger, and its reading of the others'."""

    def __init__(self, root: Path, data_dir: Path, instance: str) -> None:
        info = data_dir.stat()
        self._root = root
        self._device = info.st_dev
        # The data directory's identity, so that its own managers (counted by its store)
        # are not counted twice.
        self._prefix = f"{info.st_dev:x}-{info.st_ino:x}-"
        self._path = root / f"{self._prefix}{instance}.json"
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    @classmethod
    def open(cls, root: Path, data_dir: Path, instance: str) -> HostLedger | None:
        """The ledger, or None where it cannot be kept (not root: ``/run/sandlot`` is
        root's), and then only this data directory is counted."""
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            return cls(root, data_dir, instance)
        except OSError as exc:
            log.info("host ledger not kept: capacity is this data directory's", error=str(exc))
            return None

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the host-wide turn: read the others' lines and write ours within it."""
        fd = os.open(self._root / TURN, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # the lock goes with it

    def publish(self, held: Iterable[Reservation]) -> None:
        """Write what this manager's sandboxes reserve (call within :meth:`turn`)."""
        items = list(held)
        line = {
            "device": self._device,
            "memory_mb": sum(r.memory_mb for r in items),
            "cpu_cores": sum(r.cpu_cores for r in items),
            "pids": sum(r.pids for r in items),
            "disk_mb": sum(r.disk_mb for r in items),
        }
        data = json.dumps(line).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def elsewhere(self) -> list[Reserved]:
        """What the live managers of other data directories reserve (call within
        :meth:`turn`); a dead manager's line is removed."""
        found = []
        for entry in os.scandir(self._root):
            if entry.name.startswith((".", self._prefix)) or not entry.name.endswith(".json"):
                continue
            line = _live_line(Path(entry.path))
            if line is not None:
                same_disk = line.get("device") == self._device
                found.append(
                    Reserved(
                        memory_mb=float(line.get("memory_mb", 0)),
                        cpu_cores=float(line.get("cpu_cores", 0)),
                        pids=int(line.get("pids", 0)),
                        disk_mb=float(line.get("disk_mb", 0)) if same_disk else 0.0,
                    )
                )
        return found

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._path.unlink()
        os.close(self._fd)


def _live_line(path: Path) -> dict[str, float] | None:
    """A live manager's line; None (and the file removed) where its manager is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its manager lives
            data = os.pread(fd, 4096, 0)
            try:
                line = json.loads(data) if data else {}
            except ValueError:
                return {}
            return line if isinstance(line, dict) else {}
        with contextlib.suppress(OSError):
            path.unlink()  # its manager died without closing
        return None
    finally:
        os.close(fd)
