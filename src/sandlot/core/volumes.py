"""Named volumes: a tenant's files that outlive its sandboxes.

A volume is a directory under ``<data dir>/volumes/<tenant's digest>/<name>/``: its ext4
image (``disk.img``, sparse, capped at its size by being that size), its record
(``volume.json``) and its lock file. It is attached, at a path inside ``/workspace`` (the
backend mounts it: ``backends/volumes.py``), to one live sandbox that may write it, or to
any number that mount it read-only, never both: two mounts of one ext4 where one writes
would corrupt it. Two bounds on *in use*, both needed:

- the lock file's ``flock``, held by the manager that attached it for the sandbox's life (and
  dropped by the kernel if that manager dies), exclusive for a writer and a delete, shared
  by readers: managers on one data directory never attach a volume to a writer beside
  anyone;
- the loop devices the kernel keeps for the image while any mount of it lives
  (:func:`~sandlot.backends.volumes.attached`; a reader's is read-only): a sandbox its dead
  manager left running (a docker container) still holds its volume, and a destroyed sandbox
  holds it until its last process has gone.

Bounds: a volume's size (``SANDBOX_MAX_VOLUME_MB``), a tenant's volumes and their total size
(the quota's ``max_volumes``, ``max_volume_mb``), and the host's disk, shared with the
sandboxes' disks (the manager's count, ``admission``); and a volume is made only where the
data directory's file system has room for it and for every existing volume's unwritten part,
past a reserve.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends import volumes as host_volumes
from sandlot.backends.base import AttachedVolume
from sandlot.errors import (
    BackendUnavailable,
    CapacityExhausted,
    ConfigError,
    QuotaExceeded,
    SandboxError,
    VolumeExists,
    VolumeInUse,
    VolumeNotFound,
)
from sandlot.models import (
    MIN_VOLUME_MB,
    VOLUME_NAME_PATTERN,
    Quota,
    VolumeInfo,
    VolumeMount,
)

VOLUMES_DIR = "volumes"
IMAGE = "disk.img"
RECORD = "volume.json"
LOCK = "lock"
DIR_LOCK = ".lock"  # a tenant's directory's, and the volumes root's
# A share of the data directory's file system no volume may take: the store, the sandboxes'
# own disks and the host's other files live there too.
DISK_RESERVE_FRACTION = 0.10
_NAME = re.compile(VOLUME_NAME_PATTERN)


def tenant_dir_name(tenant: str) -> str:
    """A tenant's directory: a digest, since a tenant's name may be any text."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:24]


def _made_error(exc: OSError) -> SandboxError:
    """Why a volume could not be made, typed: the host's disk is full, or the host cannot
    make one (mkfs.ext4 failed)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityExhausted(f"no room on the host's disk for the volume: {exc}")
    return BackendUnavailable(f"this host could not make the volume: {exc}")


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"volume name {name!r}: 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass
class Lease:
    """The volumes one sandbox holds: their lock files, open and flocked, until released."""

    volumes: tuple[AttachedVolume, ...]
    fds: list[int]

    def release(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class VolumeStore:
    def __init__(self, data_dir: Path, *, max_volume_mb: int) -> None:
        self.root = data_dir / VOLUMES_DIR
        self.max_volume_mb = max_volume_mb

    # ------------------------------------------------------------------ records

    def _dir(self, tenant: str, name: str) -> Path:
        return self.root / tenant_dir_name(tenant) / check_name(name)

    @contextlib.contextmanager
    def _tenant_lock(self, tenant: str) -> Iterator[Path]:
        """The tenant's directory, under its lock: one create, delete or lease of its at a
        time, across every process of the data directory (its quota is checked under it)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        tenant_dir = self.root / tenant_dir_name(tenant)
        tenant_dir.mkdir(mode=0o700, exist_ok=True)
        with _flocked(tenant_dir / DIR_LOCK):
            yield tenant_dir

    def _info(self, directory: Path, in_use: set[bytes] | None = None) -> VolumeInfo | None:
        image = directory / IMAGE
        try:
            info = VolumeInfo.model_validate_json((directory / RECORD).read_bytes())
            info.used_bytes = image.stat().st_blocks * 512
        except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
            return None  # being made or deleted (or a record no sandlot wrote)
        if in_use is None:
            in_use = host_volumes.backing_files()
        info.attached = os.fsencode(os.path.realpath(image)) in in_use
        return info

    def list(self, tenant: str) -> list[VolumeInfo]:
        return self._list(tenant, host_volumes.backing_files())

    def _list(self, tenant: str, in_use: set[bytes]) -> builtins.list[VolumeInfo]:
        """The tenant's volumes; ``attached`` from ``in_use`` (the loop devices' files)."""
        tenant_dir = self.root / tenant_dir_name(tenant)
        try:
            entries = sorted(tenant_dir.iterdir())
        except FileNotFoundError:
            return []
        found = [self._info(e, in_use) for e in entries if _NAME.fullmatch(e.name)]
        return [info for info in found if info is not None]

    def get(self, tenant: str, name: str) -> VolumeInfo:
        info = self._info(self._dir(tenant, name))
        if info is None:
            raise VolumeNotFound(f"no volume {name!r}")
        return info

    def totals_mb(self) -> tuple[float, float]:
        """The volumes' full size and their unwritten part, in MB (one look at each)."""
        return volume_totals_mb(self.root.parent)

    def written_mb(self) -> float:
        """What the volumes' images take of the disk now."""
        return sum(st.st_blocks * 512 for st in _images(self.root)) / (1 << 20)

    # ------------------------------------------------------------------ create, delete

    def create(
        self,
        tenant: str,
        name: str,
        size_mb: int,
        quota: Quota | None,
        room: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
    ) -> VolumeInfo:
        """Make an empty volume of ``size_mb`` (blocking: mkfs.ext4, a few ms).

        Raises:
            ConfigError: a bad name, or a size under MIN_VOLUME_MB or over
                SANDBOX_MAX_VOLUME_MB.
            VolumeExists: the tenant has one of that name.
            QuotaExceeded: the tenant's volumes or their total size would pass its quota.
            CapacityExhausted: the data directory's disk has no room for it, or ``room``
                refused it (the manager's: the sandboxes' disks and the other volumes).
            BackendUnavailable: this host could not make it (mkfs.ext4 failed).

        ``room(size_mb)`` is entered around the check and the make: it refuses a volume
        the host's disk cannot hold beside everything else committed to it, and holds the
        host's turn (no sandbox admitted meanwhile) until the volume's image exists.
        """
        check_name(name)
        if not MIN_VOLUME_MB <= size_mb <= self.max_volume_mb:
            raise ConfigError(
                f"size_mb={size_mb}: a volume is {MIN_VOLUME_MB} to {self.max_volume_mb} MB "
                "(SANDBOX_MAX_VOLUME_MB)"
            )
        with self._tenant_lock(tenant) as tenant_dir:
            directory = tenant_dir / name
            if directory.exists():
                raise VolumeExists(f"a volume {name!r} exists already")
            self._check_quota(tenant, size_mb, quota)
            # Every tenant's volumes share the disk: one check and make at a time, across the
            # data directory's processes, or two could pass the check for the same room.
            with (
                _flocked(self.root / DIR_LOCK),
                room(size_mb) if room is not None else contextlib.nullcontext(),
            ):
                self._check_disk(size_mb)
                self._make(tenant_dir, name, size_mb)
        return self.get(tenant, name)

    @staticmethod
    def _make(tenant_dir: Path, name: str, size_mb: int) -> None:
        partial = tenant_dir / f".new-{name}-{secrets.token_hex(4)}"
        partial.mkdir(mode=0o700)
        try:
            try:
                host_volumes.mkfs_volume(partial / IMAGE, size_mb)
            except OSError as exc:
                raise _made_error(exc) from exc
            (partial / LOCK).touch(mode=0o600)
            info = VolumeInfo(name=name, size_mb=size_mb, created_at=time.time())
            record = info.model_dump(include={"name", "size_mb", "created_at"})
            (partial / RECORD).write_text(json.dumps(record))
            partial.rename(tenant_dir / name)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _check_quota(self, tenant: str, size_mb: int, quota: Quota | None) -> None:
        if quota is None:
            return
        held = self._list(tenant, set())  # sizes and a count: no look at the loop devices
        if quota.max_volumes is not None and len(held) + 1 > quota.max_volumes:
            raise QuotaExceeded(
                f"volume quota reached: {len(held)} of {quota.max_volumes} volumes; "
                "delete one first"
            )
        total = sum(v.size_mb for v in held) + size_mb
        if quota.max_volume_mb is not None and total > quota.max_volume_mb:
            raise QuotaExceeded(
                f"volume quota reached: {total} MB of volumes asked, {quota.max_volume_mb} MB "
                "allowed"
            )

    def _check_disk(self, size_mb: int) -> None:
        """Room on the data directory's disk for the new volume and for every volume's
        unwritten part (they may all fill up), past :data:`DISK_RESERVE_FRACTION`."""
        fs = os.statvfs(self.root)
        free_bytes = fs.f_bavail * fs.f_frsize
        reserve_bytes = int(DISK_RESERVE_FRACTION * fs.f_blocks * fs.f_frsize)
        unwritten_bytes = int(self.totals_mb()[1] * (1 << 20))
        left_bytes = free_bytes - reserve_bytes - unwritten_bytes
        if size_mb * 1024 * 1024 > left_bytes:
            raise CapacityExhausted(
                f"no room on the host's disk for a {size_mb} MB volume: "
                f"{max(0, left_bytes) // (1024 * 1024)} MB left for volumes"
            )

    def delete(self, tenant: str, name: str) -> None:
        """Delete a volume and its files (blocking).

        Raises:
            ConfigError: a bad name.
            VolumeNotFound: no such volume.
            VolumeInUse: a live sandbox has it attached.
        """
        # Its lock taken like a lease's (no sandbox can take it after), then the wait for a
        # sandbox destroyed a moment ago to let go of its mount, outside the tenant's lock
        # (its other creates, deletes and leases go on meanwhile).
        fd, directory = self._locked(tenant, name)
        try:
            if not host_volumes.wait_detached(directory / IMAGE, host_volumes.DETACH_WAIT_S):
                raise VolumeInUse(f"volume {name!r} is attached to a sandbox")
            with self._tenant_lock(tenant) as tenant_dir:
                doomed = tenant_dir / f".deleted-{name}-{secrets.token_hex(4)}"
                directory.rename(doomed)
        finally:
            os.close(fd)
        shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------ attach

    @staticmethod
    def _lock(directory: Path, name: str, *, shared: bool = False) -> int:
        """The volume's lock: shared by the sandboxes that mount it read-only, exclusive
        for one that writes it (and for a delete)."""
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            held = "read-write to another sandbox" if shared else "to another sandbox"
            raise VolumeInUse(f"volume {name!r} is attached {held}") from None
        return fd

    def lease(self, tenant: str, mounts: Sequence[VolumeMount]) -> Lease:
        """Take ``mounts``' volumes for one sandbox of ``tenant`` (blocking: may wait up to
        ``DETACH_WAIT_S`` for a volume's last sandbox to end).

        Raises:
            ConfigError: a bad name.
            VolumeNotFound: the tenant has no volume of a name.
            VolumeInUse: a volume is attached to another sandbox (for a read-only mount:
                to one that writes it).
        """
        lease = Lease((), [])
        try:
            for mount in mounts:
                fd, volume = self._take(tenant, mount)
                lease.fds.append(fd)
                lease.volumes += (volume,)
        except BaseException:
            lease.release()
            raise
        return lease

    def _locked(self, tenant: str, name: str, *, shared: bool = False) -> tuple[int, Path]:
        """The volume's lock, taken (an fd to close), and its directory. Found and locked
        under the tenant's lock, which a delete holds while it renames a volume away: a lock
        file opened here is the volume's own, never one a delete (and a create of the same
        name) replaced meanwhile, whose flock would guard nothing (red team: a second lease
        of one image)."""
        with self._tenant_lock(tenant) as tenant_dir:
            directory = tenant_dir / check_name(name)
            if not (directory / RECORD).exists():
                raise VolumeNotFound(f"no volume {name!r}")
            return self._lock(directory, name, shared=shared), directory

    def _take(self, tenant: str, mount: VolumeMount) -> tuple[int, AttachedVolume]:
        shared = mount.read_only
        fd, directory = self._locked(tenant, mount.name, shared=shared)
        image = directory / IMAGE
        # Its last writer (or, for a writer, its last sandbox) may still be ending (its
        # mount namespace not yet released).
        if not host_volumes.wait_detached(image, host_volumes.DETACH_WAIT_S, writers_only=shared):
            os.close(fd)
            raise VolumeInUse(f"volume {mount.name!r} is attached to another sandbox")
        return fd, AttachedVolume(image, mount.mount_path, mount.read_only)


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """``path`` (made if missing) exclusively locked, for the block's length."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def volume_totals_mb(data_dir: Path) -> tuple[float, float]:
    """A data directory's named volumes: their full size and unwritten part, in MB."""
    full = unwritten = 0
    for st in _images(data_dir / VOLUMES_DIR):
        full += st.st_size
        unwritten += max(0, st.st_size - st.st_blocks * 512)
    return full / (1 << 20), unwritten / (1 << 20)


def _images(root: Path) -> Iterator[os.stat_result]:
    """Every volume image under ``root``, every tenant's, those being made or deleted too
    (each may still fill to its size)."""
    try:
        tenants = list(os.scandir(root))
    except FileNotFoundError:
        return
    for tenant in tenants:
        if not tenant.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError):
            for entry in os.scandir(tenant.path):
                with contextlib.suppress(OSError):
                    yield (Path(entry.path) / IMAGE).lstat()
