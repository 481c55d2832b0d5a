"""Instances: many processes on one data directory, each manager its own instance.

::

    <data dir>/
      sandlot.db            shared by every instance (SQLite, WAL): records, keys, artifacts index
      artifacts/<id>/       shared: what ended sandboxes kept
      manager.lock          held shared by every live manager: a sandlot from before instances
                            takes it exclusively, so the two never run on one data dir at once
      instances/
        .recovery           held exclusively by the one process recovering dead instances
        <instance>/lock     held exclusively by its manager for its life; its pid and start time
        <instance>/backends the backends it started, one name a line (what recovery sweeps)
        <instance>/...      its backends' state: they get a Settings whose data_dir is this
                            directory, so cgroups, docker labels and netns names are per instance

An instance whose lock can be taken has lost its process; the next manager to start recovers
it (keeps its sandboxes' artifacts, sweeps its backends, ends its records, removes it).
``flock`` locks go when their holder dies, so a ``kill -9`` frees them with no bookkeeping.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandlot._fs import remove_tree
from sandlot.backends.base import INSTANCE_LOCK, lock_held
from sandlot.backends.disk import DISK_IMAGE, mounted_below
from sandlot.config import Settings
from sandlot.core.store import Elsewhere, Store
from sandlot.errors import ConfigError, SandboxHeldElsewhere, SandboxNotRunning
from sandlot.models import SandboxInfo

INSTANCES = "instances"
LOCK = INSTANCE_LOCK
BACKENDS = "backends"
# The settings that name where its backends make things outside the data directory, as this
# instance ran with them: its recovery sweeps there, not under the recovering manager's own
# (a manager started with another SANDBOX_CGROUP_ROOT swept the dead one's cgroups under its
# own root, and they stayed for good: red team, 2026-12-07).
MADE_UNDER = "made-under.json"
MADE_UNDER_SETTINGS = ("cgroup_root",)
LEGACY_LOCK = "manager.lock"
# The data dir's top-level entries a sandlot from before instances kept its backends' state in.
LEGACY_STATE = ("sandboxes", "docker-sandboxes", "local-sandboxes", "guest", "rootfs", "uids")
# A directory with no lock file is one being made; past this age its maker died making it.
UNBORN_GRACE_S = 60.0
# A liveness probe holds a dead instance's lock for microseconds: retry before calling it live.
TAKE_TRIES = 5
TAKE_PAUSE_S = 0.02


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) an instance: from its lock file."""

    instance: str
    pid: int | None
    started_at: float | None
    alive: bool


class Instance:
    """This process's instance: its directory and its lock, held until :meth:`release`."""

    def __init__(self, data_dir: Path, instance_id: str, lock_fd: int, fence_fd: int) -> None:
        self.data_dir = data_dir
        self.id = instance_id
        self.dir = data_dir / INSTANCES / instance_id
        self._lock_fd: int | None = lock_fd
        self._fence_fd: int | None = fence_fd

    def settings(self, base: Settings) -> Settings:
        """``base`` with this instance's directory as the backends' data directory."""
        return base.model_copy(update={"data_dir": self.dir})

    def note_backend(self, name: str, settings: Settings) -> None:
        """Record that this instance starts ``name`` (before it makes anything), and the
        settings it makes things under."""
        made_under = self.dir / MADE_UNDER
        if not made_under.exists():
            wanted = {key: getattr(settings, key) for key in MADE_UNDER_SETTINGS}
            made_under.write_text(json.dumps(wanted))
        if name not in backends_of(self.dir):
            with open(self.dir / BACKENDS, "a") as f:
                f.write(name + "\n")

    def release(self, *, remove: bool) -> None:
        """Drop the lock; with ``remove``, delete the directory first unless something is still
        mounted below it (then the next start recovers it as a dead instance)."""
        if self._lock_fd is None:
            return
        if remove:
            remove_dir(self.dir)
        for fd in (self._lock_fd, self._fence_fd):
            if fd is not None:
                os.close(fd)
        self._lock_fd = self._fence_fd = None


def claim(data_dir: Path) -> Instance:
    """Make a new instance under ``data_dir`` and hold its lock.

    Raises:
        ConfigError: a sandlot from before instances (one manager per data dir) runs on it.
    """
    root = data_dir / INSTANCES
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    # Sandbox uids reach their workspaces through these: searchable, not listable.
    for d in (data_dir, root):
        d.chmod(0o711)
    fence = _fence(data_dir)
    instance_id = secrets.token_hex(6)
    directory = root / instance_id
    directory.mkdir(mode=0o711)
    directory.chmod(0o711)
    # Locked before it has its name, so no scan ever sees the lock file free while we live.
    fresh = directory / ".lock-new"
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "started_at": time.time()}).encode())
    fresh.rename(directory / LOCK)
    return Instance(data_dir, instance_id, fd, fence)


def _fence(data_dir: Path) -> int:
    fd = os.open(data_dir / LEGACY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"data directory {data_dir} is in use by an older sandlot process (pid {holder}) "
            "that allows one process per data directory; stop it, or upgrade it"
        ) from None
    return fd


def holder(data_dir: Path, instance_id: str) -> Holder:
    """Who holds ``instance_id``, and whether that process is alive (its lock is held)."""
    try:
        fd = os.open(data_dir / INSTANCES / instance_id / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return Holder(instance_id, None, None, alive=False)
    try:
        pid, started_at = _read_owner(fd)
        return Holder(instance_id, pid, started_at, alive=lock_held(fd))
    finally:
        os.close(fd)


def live_elsewhere(store: Store, data_dir: Path) -> list[SandboxInfo]:
    """The live sandboxes of the other live instances of the data directory (their warm pools
    are never stored, so they are not among them)."""
    found = store.live_elsewhere()
    return alive(found, gone_of(found, data_dir))


def gone_of(found: Elsewhere, data_dir: Path) -> set[str]:
    """Of the instances with live records, those whose process is gone (the next recovery
    ends their records). A lock probe each: done outside any transaction of the store."""
    return {instance for instance in found if not instance or not holder(data_dir, instance).alive}


def alive(found: Elsewhere, gone: set[str]) -> list[SandboxInfo]:
    """Other instances' live records but the ``gone`` ones'; an instance not probed (new
    since) counts as alive."""
    return [info for instance, infos in found.items() if instance not in gone for info in infos]


def not_here(store: Store, data_dir: Path, sandbox_id: str) -> SandboxNotRunning:
    """The error for a live record this manager does not run: another instance's.

    SandboxHeldElsewhere when another live process runs it (the message names its pid);
    SandboxNotRunning when the process that ran it is gone (its record is ended when the
    next manager starts).
    """
    instance = store.instance_of(sandbox_id) or ""
    held = holder(data_dir, instance) if instance and instance != store.instance else None
    if held is not None and held.alive:
        return SandboxHeldElsewhere(
            f"sandbox {sandbox_id} runs in another process on this data directory "
            f"(pid {held.pid}); call it from that process (or its server)",
            pid=held.pid,
        )
    pid = f" (pid {held.pid})" if held is not None and held.pid else ""
    return SandboxNotRunning(
        f"sandbox {sandbox_id} ran in a process that ended{pid}; its record is ended when "
        "the next manager starts; create a new one"
    )


def _read_owner(fd: int) -> tuple[int | None, float | None]:
    try:
        owner = json.loads(os.pread(fd, 256, 0))
        return int(owner["pid"]), float(owner["started_at"])
    except (ValueError, KeyError, TypeError):
        return None, None


@dataclass
class Dead:
    """A dead instance, its lock held by us until :meth:`remove`."""

    holder: Holder
    dir: Path
    lock_fd: int

    def backends(self) -> set[str]:
        return backends_of(self.dir)

    def settings(self, base: Settings) -> Settings:
        """``base`` as this dead instance's backends ran: its directory, and what it made
        things under (an instance from before that was noted ran under ``base``'s)."""
        update: dict[str, Any] = {"data_dir": self.dir}
        try:
            made_under = json.loads((self.dir / MADE_UNDER).read_text())
        except (OSError, ValueError):
            made_under = {}
        if isinstance(made_under, dict):
            for key in MADE_UNDER_SETTINGS:
                if isinstance(made_under.get(key), str):
                    update[key] = made_under[key]
        return base.model_copy(update=update)

    def remove(self, *, sweep_ok: bool) -> None:
        """Delete the directory (only after a full sweep) and drop its lock."""
        if sweep_ok:
            remove_dir(self.dir)
        os.close(self.lock_fd)


def lock_recovery(data_dir: Path) -> int:
    """Wait for, then hold (until the fd is closed), the right to recover dead instances: one
    process at a time sweeps them, the others wait and then find nothing left to do."""
    fd = os.open(data_dir / INSTANCES / ".recovery", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def dead(data_dir: Path, mine: str) -> list[Dead]:
    """Every instance but ``mine`` whose process is gone, each with its lock now ours.

    Call holding :func:`lock_recovery`. Directories left by a maker that died before its lock
    file had its name are removed here (no backend ever ran in them).
    """
    found = []
    for directory in sorted((data_dir / INSTANCES).iterdir()):
        if directory.name.startswith(".") or directory.name == mine or not directory.is_dir():
            continue
        taken = _take(directory / LOCK)
        if taken is not None:
            pid, started_at = _read_owner(taken)
            found.append(Dead(Holder(directory.name, pid, started_at, False), directory, taken))
        elif not (directory / LOCK).exists() and _age_s(directory) > UNBORN_GRACE_S:
            remove_dir(directory)
    return found


def any_dead(data_dir: Path, mine: str) -> bool:
    """Whether an instance but ``mine`` lost its process (its lock is free): a look, without
    :func:`lock_recovery`, that a running manager takes now and then (recovery.DeadPeers)."""
    try:
        directories = sorted((data_dir / INSTANCES).iterdir())
    except FileNotFoundError:
        return False
    for directory in directories:
        if directory.name.startswith(".") or directory.name == mine:
            continue
        taken = _take(directory / LOCK)
        if taken is not None:
            os.close(taken)
            return True
    return False


def _take(lock: Path) -> int | None:
    """The lock's fd, held exclusively, if its holder is gone; None if it is alive or gone."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    for attempt in range(TAKE_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if attempt + 1 < TAKE_TRIES:
                time.sleep(TAKE_PAUSE_S)
            continue
        # Its owner may have removed it, and closed, between our open and our flock.
        with contextlib.suppress(FileNotFoundError):
            if lock.stat().st_ino == os.fstat(fd).st_ino:
                return fd
        break
    os.close(fd)
    return None


def legacy_leftovers(data_dir: Path) -> bool:
    """Whether the data dir holds a pre-instance sandlot's backend state (it is dead: we hold
    the fence it would need)."""
    return any((data_dir / name).exists() for name in LEGACY_STATE)


def remove_legacy(data_dir: Path) -> None:
    if not mounted_below(data_dir / "sandboxes") and not mounted_below(
        data_dir / "docker-sandboxes"
    ):
        for name in LEGACY_STATE:
            remove_tree(data_dir / name)


def backends_of(directory: Path) -> set[str]:
    try:
        return set((directory / BACKENDS).read_text().split())
    except FileNotFoundError:
        return set()


def remove_dir(directory: Path) -> bool:
    """Delete an instance directory unless something is mounted below it (a sandbox's disk a
    sweep could not unmount: deleting through it would empty a live filesystem)."""
    if mounted_below(directory):
        return False
    return remove_tree(directory)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


# Where each backend keeps a sandbox's directory, under its instance's (its disk image is
# DISK_IMAGE there).
SANDBOX_DIRS = ("sandboxes", "docker-sandboxes")


def disks_written_mb(data_dir: Path, ids: set[str]) -> float:
    """What the disk images of the sandboxes ``ids`` (any instance's of ``data_dir``) hold
    now, in MB: the part of their reservations the disk's free space already leaves out."""
    if not ids:
        return 0.0
    written = 0
    try:
        instances = list(os.scandir(data_dir / INSTANCES))
    except OSError:
        return 0.0
    for instance in instances:
        for kind in SANDBOX_DIRS:
            try:
                entries = list(os.scandir(Path(instance.path) / kind))
            except OSError:
                continue
            for entry in entries:
                if entry.name not in ids:
                    continue
                with contextlib.suppress(OSError):
                    st = (Path(entry.path) / DISK_IMAGE).lstat()
                    written += min(st.st_size, st.st_blocks * 512)
    return written / (1 << 20)
