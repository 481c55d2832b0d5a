"""What the managers of other data directories on this host reserve, for one host capacity.

A data directory's managers count each other's sandboxes through its store; a manager of
another data directory on the same host counted none of them, so two data directories each
admitted 2 x 128 MB against a capacity of 300 MB (red team, 2026-12-07). Each manager (as
root) keeps a file in ``SANDBOX_HOST_LEDGER_DIR`` (``/run/sandlot/reserved``) with what its own
sandboxes reserve (live, starting, pooled, being torn down), holding an exclusive ``flock``
on it for its life: a file whose lock can be taken is a dead manager's, and is removed. A
create reads the other data directories' files and writes its own under one host-wide lock,
so two creates anywhere on the host cannot both take the last room. Disk counts only between
data directories on one file system (the capacity is a share of its free space). A manager
of the same data directory counts another's sandboxes from their store, and from its line
only those the store does not show (pooled ones). Where ``/run/sandlot`` cannot be kept
(rootless), the ledger lives in the data directory: its managers still count each other's
pools, and the other data directories are not seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
        self._data_dir = str(data_dir.resolve())
        with contextlib.suppress(OSError):
            self.publish([], [])  # its data directory named from the start (its volumes)

    @classmethod
    def open(cls, root: Path, data_dir: Path, instance: str) -> HostLedger | None:
        """The ledger, or None where it cannot be kept (not root: ``/run/sandlot`` is
        root's), and then only this data directory is counted."""
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            info = root.stat()
            if info.st_uid != os.geteuid() or info.st_mode & 0o022:
                # Anyone else who may write there could write a line: it must be ours alone.
                raise PermissionError(
                    f"{root} is not this user's alone (owner {info.st_uid}, mode "
                    f"{info.st_mode & 0o777:o})"
                )
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

    def publish(self, held: Iterable[Reservation], unstored: Iterable[Reservation]) -> None:
        """Write what this manager's sandboxes reserve (call within :meth:`turn`): ``held``
        (those its store records show) and ``unstored`` (those it does not: pooled, and one
        starting for a pool), which its data directory's other managers count from here;
        and where its data directory is, whose named volumes the others read for themselves
        (:meth:`volumes_elsewhere`)."""
        outside = list(unstored)  # summed twice: an iterator would be spent by the first
        line: dict[str, object] = {"device": self._device, **_summed([*held, *outside])}
        line["unstored"] = _summed(outside)
        line["data_dir"] = self._data_dir
        data = json.dumps(line).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def read(self) -> LedgerView:
        """Every live manager's line, this one's too, read once (call within :meth:`turn`)
        for all a decision asks of them; a dead manager's line is removed."""
        lines = []
        for entry in os.scandir(self._root):
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            line = _live_line(Path(entry.path))
            if line is not None:
                lines.append((entry.name, line))
        return LedgerView(lines, self._device, self._prefix, self._path.name)

    def elsewhere(self) -> list[Reserved]:
        """:meth:`LedgerView.elsewhere` of the lines now."""
        return self.read().elsewhere()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._path.unlink()
        os.close(self._fd)


@dataclass(frozen=True)
class LedgerView:
    """The live managers' lines as one turn read them (:meth:`HostLedger.read`)."""

    lines: list[tuple[str, dict[str, Any]]]  # each line's file name, and what it says
    device: int  # the reader's data directory's file system
    prefix: str  # the reader's data directory's lines start with it
    own: str  # the reader's own line's file name

    def elsewhere(self) -> list[Reserved]:
        """What the other live managers reserve: all of it for another data directory's,
        only what its store does not show for one of this data directory's (its pools: two
        managers on one data directory each filled a pool against the same room, red team
        2026-12-07)."""
        found = []
        for name, line in self.lines:
            if name == self.own:
                continue
            part = line
            if name.startswith(self.prefix):
                unstored = line.get("unstored")
                part = unstored if isinstance(unstored, dict) else {}
            same_disk = line.get("device") == self.device
            try:
                values = [_amount(part.get(k, 0)) for k in ("memory_mb", "cpu_cores", "pids")]
                disk_mb = _amount(part.get("disk_mb", 0)) if same_disk else 0.0
            except (TypeError, ValueError):
                # Not a line any sandlot wrote (it writes finite amounts): its directory is
                # its own user's alone, so it is ours, broken): counted as nothing, and said.
                log.warning("host ledger: a line is not amounts, skipped", path=name)
                continue
            memory_mb, cpu_cores, pids = values
            found.append(Reserved(memory_mb, cpu_cores, int(pids), disk_mb))
        return found

    def disk_reserved_mb(self) -> float:
        """The disk every live manager's sandboxes reserve on this data directory's file
        system, the reader's own and its data directory's other managers' included: what a
        new named volume shares the disk with."""
        total = 0.0
        for name, line in self.lines:
            if line.get("device") != self.device:
                continue
            try:
                total += _amount(line.get("disk_mb", 0))
            except (TypeError, ValueError):
                log.warning("host ledger: a line is not amounts, skipped", path=name)
        return total

    def volumes_elsewhere(
        self, totals: Callable[[Path], tuple[float, float]]
    ) -> tuple[float, float]:
        """The named volumes of the other data directories on this file system:
        ``totals(data_dir)``, read now from each live manager's data directory, each once. A
        volume of another data directory and a disk of this one fill the same disk (red
        team, 2026-12-07: counted by neither, they corrupted a volume); totals each manager
        kept of its own went stale when another manager of its data directory made a volume
        and ended (the next round)."""
        found: set[str] = set()
        for name, line in self.lines:
            if name.startswith(self.prefix) or line.get("device") != self.device:
                continue
            data_dir = line.get("data_dir")
            if isinstance(data_dir, str) and data_dir.startswith("/"):
                found.add(data_dir)
        full = unwritten = 0.0
        for data_dir in sorted(found):
            size, left = totals(Path(data_dir))
            full, unwritten = full + size, unwritten + left
        return full, unwritten


def _amount(value: object) -> float:
    """A line's amount: a finite number, not negative (a NaN or a negative one would let
    every create through, an infinite ``pids`` failed every create with a 500: red team).

    Raises:
        TypeError, ValueError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(value)
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        raise ValueError(value) from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(value)
    return number


def _summed(items: Iterable[Reservation]) -> dict[str, float]:
    listed = list(items)
    return {
        "memory_mb": sum(r.memory_mb for r in listed),
        "cpu_cores": sum(r.cpu_cores for r in listed),
        "pids": sum(r.pids for r in listed),
        "disk_mb": sum(r.disk_mb for r in listed),
    }


def _live_line(path: Path) -> dict[str, Any] | None:
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
