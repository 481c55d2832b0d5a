"""Admission: whether a new sandbox may start, given what its owner and the host already hold.

Two bounds, both on what sandboxes *reserve* (their limits), not on what they use now, since
any of them may grow to its limit at any moment:

- the tenant's quota, on every resource a sandbox reserves: sandboxes, memory, pids, CPU and
  disk (kept artifacts are bounded when they are kept, see ``artifacts.py``);
- the host's capacity, measured when the manager starts: memory (RAM times an overcommit
  factor), CPU (cores times a factor), pids (a share of the kernel's process table) and disk
  (a share of the space free in the data directory, which the sandboxes' disks and the named
  volumes share, each counted at its full size). A sandbox the host cannot hold is refused
  with :class:`CapacityExhausted`, never started into a host crash;
- this process's file descriptors (``RLIMIT_NOFILE``): the manager holds a few per sandbox,
  so a create that would leave too few is refused with :class:`FileDescriptorsExhausted`
  before anything starts (the manager raises the soft limit to the hard one at start).

Checked with no await between the check and the sandbox's registration, so concurrent creates
cannot both slip under a bound.
"""

from __future__ import annotations

import errno
import math
import os
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pydantic_core
import structlog

from sandlot.backends import cgroups
from sandlot.config import Settings
from sandlot.core.host_ledger import Reservation
from sandlot.errors import CapacityExhausted, ConfigError, FileDescriptorsExhausted, QuotaExceeded
from sandlot.models import Quota, ResolvedLimits, SandboxInfo

log = structlog.get_logger(__name__)

# File descriptors the manager holds for each live sandbox, counted in /proc/self/fd before
# and after 20 creates: bubblewrap 5 (the guest's stdin, stdout and stderr pipes, its pidfd,
# its uid lock), unsafe-local 4, docker 2.85 (the exec's socket and the wait for the
# container's stop; docker-py pools its connections).
FDS_PER_SANDBOX = {"bubblewrap": 5, "unsafe-local": 4, "docker": 3}
# Held at once while one sandbox starts (the pipes of mkfs, mount and the spawn itself).
FDS_TO_START = 16
# Left for the process's own work whatever the sandboxes hold: the store, server
# connections, uploads, artifact copies, and a few sandboxes starting at once.
FDS_RESERVE = 64
# Open descriptors are counted (not estimated from the sandboxes held) once fewer than this
# many would be left.
FDS_LISTING_MARGIN = 1024


@dataclass(frozen=True)
class HostCapacity:
    """What all sandboxes together may reserve on this host."""

    memory_mb: float
    cpu_cores: float
    pids: int
    disk_mb: float
    # File descriptors the process held before any sandbox (None: not checked).
    fds_at_start: int | None = None
    # What the disk keeps free of every commitment, whatever else writes to it (kept
    # artifacts, the store, other programs): the share of the start's free space that
    # SANDBOX_HOST_DISK_FRACTION leaves out (check_disk_now).
    disk_slack_mb: float = 0.0

    @classmethod
    def measure(cls, settings: Settings, volumes_written_mb: float = 0.0) -> HostCapacity:
        """``volumes_written_mb``: what the named volumes' images take of the data
        directory's disk now. Volumes are counted at their full size against the disk
        (:func:`check_host`), so the part of them already written, which the free space
        leaves out, is given back here, or it would be counted twice."""
        stat = os.statvfs(settings.data_dir)
        free_mb = stat.f_bavail * stat.f_frsize / (1 << 20)
        return cls(
            memory_mb=host_memory_mb(settings),
            cpu_cores=(os.cpu_count() or 1) * settings.host_cpu_overcommit,
            pids=int(_kernel_tasks_max() * settings.host_pids_fraction),
            disk_mb=(free_mb + volumes_written_mb) * settings.host_disk_fraction,
            fds_at_start=open_fds(),
            disk_slack_mb=free_mb * (1 - settings.host_disk_fraction),
        )


def check_host(
    reserved: Iterable[Reservation],
    new: ResolvedLimits,
    host: HostCapacity,
    *,
    held_here: int,
    volumes_mb: float = 0.0,
) -> None:
    """Raise if the host cannot hold one more sandbox of ``new`` beside ``reserved`` (every
    process's on this data directory, and the other data directories' managers' totals:
    :mod:`~sandlot.core.host_ledger`) and the named volumes' ``volumes_mb`` (their full
    sizes: a volume and a sandbox's disk are sparse files on the same disk, either may fill
    up; counted apart, the two filled the disk and corrupted a volume, red team
    2026-12-07), and this process one more beside the ``held_here`` it holds (file
    descriptors are per process: other processes' sandboxes hold none here).

    Raises:
        CapacityExhausted: a resource would be over the host's capacity (the message names
            the setting that changes it).
    """
    held = list(reserved)
    if host.fds_at_start is not None:
        check_fds(held_here, host.fds_at_start)
    bounds = (
        ("memory_mb", host.memory_mb, "SANDBOX_HOST_MEMORY_OVERCOMMIT (or SANDBOX_HOST_MEMORY_MB)"),
        ("cpu_cores", host.cpu_cores, "SANDBOX_HOST_CPU_OVERCOMMIT"),
        ("pids", host.pids, "SANDBOX_HOST_PIDS_FRACTION"),
        ("disk_mb", host.disk_mb, "SANDBOX_HOST_DISK_FRACTION"),
    )
    for name, capacity, setting in bounds:
        total = sum(getattr(limits, name) for limits in held) + getattr(new, name)
        volumes = ""
        if name == "disk_mb" and volumes_mb:
            total += volumes_mb
            volumes = f" and named volumes {volumes_mb:g}"
        if total > capacity:
            raise CapacityExhausted(
                f"this host has no room for {name}={getattr(new, name)} more: live sandboxes"
                f"{volumes} reserve {total - getattr(new, name):g} of {capacity:g}; retry when "
                f"some end, ask for less, or raise {setting}"
            )


# Below this share of its inodes free, the data directory's disk takes no new sandbox or
# volume (what is left is the store's and the live sandboxes').
INODE_RESERVE_FRACTION = 0.05


def disk_room_now_mb(
    data_dir: Path,
    unwritten_mb: float,
    host: HostCapacity,
    *,
    want_mb: float = 0.0,
    written_mb: Callable[[], float] | None = None,
) -> float:
    """What the data directory's disk can still take now beside ``unwritten_mb`` promised
    and the slack, in MB (infinite where it cannot be measured: a test's manager that never
    started). ``written_mb``: what the live disks counted at full size in ``unwritten_mb``
    have written, which the free space already leaves out; asked for (a look at each disk)
    only where the room is less than ``want_mb``."""
    try:
        stat = os.statvfs(data_dir)
    except OSError:
        return math.inf
    return _room_mb(stat, unwritten_mb, host, want_mb, written_mb)


def _room_mb(
    stat: os.statvfs_result,
    unwritten_mb: float,
    host: HostCapacity,
    want_mb: float,
    written_mb: Callable[[], float] | None,
) -> float:
    room_mb = _free_mb(stat) - host.disk_slack_mb - unwritten_mb
    if room_mb < want_mb and written_mb is not None:
        room_mb += written_mb()
    return room_mb


def _free_mb(stat: os.statvfs_result) -> float:
    return stat.f_bavail * stat.f_frsize / (1 << 20)


def check_disk_now(
    data_dir: Path,
    unwritten_mb: float,
    new_mb: float,
    host: HostCapacity,
    written_mb: Callable[[], float] | None = None,
) -> None:
    """Raise CapacityExhausted unless the data directory's disk, as free as it is now, holds
    ``new_mb`` more beside ``unwritten_mb`` (what the live sandboxes' disks and the volumes
    may still write; ``written_mb`` as :func:`disk_room_now_mb`'s) and the slack, and has
    inodes past its reserve. The count against the start's free space (:func:`check_host`)
    misses what was written since outside it: kept artifacts, the store, other data
    directories' volumes, other programs; a tenant's kept artifacts alone took the room a
    disk was then admitted to, and the disk's fill corrupted another tenant's volume (red
    team, 2026-12-07)."""
    try:
        stat = os.statvfs(data_dir)
    except OSError:
        return  # no data directory to measure (a test's manager that was never started)
    if stat.f_files and stat.f_favail < stat.f_files * INODE_RESERVE_FRACTION:
        raise CapacityExhausted(
            f"the host's disk is out of inodes: {stat.f_favail} of {stat.f_files} free; "
            "retry when sandboxes end, or delete kept artifacts or volumes"
        )
    room_mb = _room_mb(stat, unwritten_mb, host, new_mb, written_mb)
    if new_mb > room_mb:
        free_mb = _free_mb(stat)
        promised_mb = free_mb - host.disk_slack_mb - room_mb
        raise CapacityExhausted(
            f"the host's disk has no room for {new_mb:g} MB more: {free_mb:.0f} MB free now, "
            f"{promised_mb:.0f} MB of it promised to live sandboxes' disks and named volumes, "
            f"{host.disk_slack_mb:.0f} MB kept free; retry when some end, delete volumes or "
            "kept artifacts, or free disk space"
        )


def check_volume_room(
    sandboxes_disk_mb: float, volumes_mb: float, size_mb: int, host: HostCapacity
) -> None:
    """Raise CapacityExhausted if a new volume of ``size_mb`` does not fit the disk beside
    the sandboxes' disks (every live manager's on this file system) and the other volumes
    (their full sizes), the same bound :func:`check_host` holds a sandbox's disk to."""
    committed = sandboxes_disk_mb + volumes_mb
    if committed + size_mb > host.disk_mb:
        raise CapacityExhausted(
            f"no room on the host's disk for a {size_mb} MB volume: sandboxes' disks "
            f"({sandboxes_disk_mb:g} MB) and volumes ({volumes_mb:g} MB) are {committed:g} MB "
            f"of {host.disk_mb:g}; delete a volume, retry when sandboxes end, or raise "
            "SANDBOX_HOST_DISK_FRACTION"
        )


# ---------------------------------------------------------------------- file descriptors


def open_fds() -> int:
    """File descriptors this process has open now."""
    # The listing holds one of its own while it reads.
    return len(os.listdir("/proc/self/fd")) - 1  # noqa: PTH208 - no Path per entry: a create reads it


def nofile_limits() -> tuple[int, int]:
    """RLIMIT_NOFILE's soft and hard limits, an unlimited one as the kernel's own bound."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = _nr_open()
    return (
        most if soft == resource.RLIM_INFINITY else soft,
        most if hard == resource.RLIM_INFINITY else hard,
    )


def raise_nofile_limit() -> int:
    """Raise the soft open-file limit to the hard one; return the soft limit now in force.

    A login shell's or a service's soft limit (often 1024) allowed ~200 sandboxes, while the
    hard one, which any process may raise its soft limit to, is usually far higher. Children
    inherit it; sandboxed code could raise its own soft limit to the hard one anyway.
    """
    soft, hard = nofile_limits()
    if soft >= hard:
        return soft
    try:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit", soft=soft, hard=hard, error=str(exc))
        return soft
    log.info("open-file limit raised", soft_before=soft, soft=hard, hard=hard)
    return hard


def sandboxes_allowed(limit: int, fds_at_start: int) -> int:
    """How many sandboxes ``limit`` file descriptors hold beside the process's own."""
    per_sandbox = max(FDS_PER_SANDBOX.values())
    return max(0, (limit - fds_at_start - FDS_RESERVE) // per_sandbox)


def check_fds(held: int, fds_at_start: int) -> None:
    """Raise unless one more sandbox beside ``held`` fits in the open-file limit.

    Two bounds: by count (what ``held`` sandboxes will hold once started, so sandboxes
    starting at once cannot all slip under it) and by what is open now (fds the process holds
    for anything else, connections say).

    Raises:
        FileDescriptorsExhausted: it would not (the message names the limit and how to raise it).
    """
    soft, hard = nofile_limits()
    allowed = sandboxes_allowed(soft, fds_at_start)
    # Listing /proc/self/fd costs ~1.3 us a descriptor (3.8 ms with 600 sandboxes live, on
    # every create): done only where what the sandboxes hold leaves less than a margin. A
    # process holding more than the margin for anything else fails its start with EMFILE,
    # which fds_exhausted_error still names.
    held_fds = fds_at_start + held * max(FDS_PER_SANDBOX.values())
    used = held_fds if soft - held_fds > FDS_LISTING_MARGIN else open_fds()
    if held + 1 > allowed or soft - used < FDS_TO_START + FDS_RESERVE:
        raise FileDescriptorsExhausted(
            f"no file descriptors for one more sandbox: this process has {used} of its "
            f"{soft} open (RLIMIT_NOFILE, hard limit {hard}), room for {allowed} sandboxes "
            f"of about {max(FDS_PER_SANDBOX.values())} each and {held} are held; destroy "
            f"some, or raise the limit ({how_to_raise(soft, hard)})"
        )


def fds_exhausted_error(exc: BaseException) -> FileDescriptorsExhausted | None:
    """The typed error for a start that failed for want of file descriptors, else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
            soft, hard = nofile_limits()
            if cause.errno == errno.ENFILE:
                return FileDescriptorsExhausted(
                    "the host's file table is full (ENFILE): raise fs.file-max (sysctl) or "
                    "end what holds open files"
                )
            return FileDescriptorsExhausted(
                f"the sandbox ran out of file descriptors while starting: this process may "
                f"open {soft} (RLIMIT_NOFILE, hard limit {hard}); destroy sandboxes, or raise "
                f"the limit ({how_to_raise(soft, hard)})"
            )
        cause = cause.__cause__ or cause.__context__
    return None


def how_to_raise(soft: int, hard: int) -> str:
    """What raises the open-file limit, for a message."""
    if soft < hard:
        return f"the soft limit can go up to {hard}: ulimit -n {hard}"
    return (
        "the hard limit: `ulimit -Hn N` as root before starting, LimitNOFILE=N in a systemd "
        "unit, or `docker run --ulimit nofile=N:N`"
    )


def _nr_open() -> int:
    """The kernel's bound on any process's open-file limit."""
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


# ---------------------------------------------------------------------- quotas


def check_quota(
    live: Iterable[SandboxInfo], owner: str, limits: ResolvedLimits, quota: Quota
) -> None:
    """Raise if ``owner`` cannot start one more sandbox of ``limits`` within ``quota``.

    Raises:
        QuotaExceeded: the owner's live sandboxes, with this one, would be over the quota
            (the message names the setting that raises it).
    """
    mine = [info.limits for info in live if info.owner == owner]
    if len(mine) >= quota.max_sandboxes:
        raise QuotaExceeded(
            f"{owner!r} has {len(mine)} live sandboxes, its quota is {quota.max_sandboxes}; "
            "destroy one, or raise TENANT_MAX_SANDBOXES"
        )
    bounds = (
        ("memory_mb", quota.max_memory_mb, "TENANT_MAX_MEMORY_MB"),
        ("pids", quota.max_pids, "TENANT_MAX_PIDS"),
        ("cpu_cores", quota.max_cpu_cores, "TENANT_MAX_CPU_CORES"),
        ("disk_mb", quota.max_disk_mb, "TENANT_MAX_DISK_MB"),
    )
    for name, most, setting in bounds:
        if most is None:
            continue
        used = sum(getattr(held, name) for held in mine)
        wanted = getattr(limits, name)
        if used + wanted > most:
            raise QuotaExceeded(
                f"{owner!r} holds {name}={used:g} in live sandboxes; {wanted:g} more is over "
                f"its quota of {most:g}; ask for less, destroy a sandbox, or raise {setting}"
            )


def check_metadata(metadata: dict[str, str] | None, max_bytes: int) -> None:
    """Raise if ``metadata`` (keys and values) is over ``max_bytes`` as the store holds it:
    each string as JSON writes it (:func:`stored_bytes`). Counted as UTF-8 before, a control
    character took 6 bytes of the store for 1 of the cap: 16,000 of them made a record of
    94 KiB, 10,000 records a store of 985 MB (red team, 2026-12-06). (The quotes, colons and
    commas are not counted: 6 bytes an entry, at most ``MAX_METADATA_KEYS``.)

    Raises:
        ConfigError: it is (the message names SANDBOX_MAX_METADATA_BYTES).
    """
    size = sum(stored_bytes(k) + stored_bytes(v) for k, v in (metadata or {}).items())
    if size > max_bytes:
        raise ConfigError(
            f"metadata of {size} bytes (as stored, in JSON: a control character takes 6, a "
            f"quote or backslash 2) is over {max_bytes}; send less, or raise "
            "SANDBOX_MAX_METADATA_BYTES"
        )


def stored_bytes(text: str) -> int:
    """The bytes ``text`` takes in a stored record: its JSON string as pydantic writes it
    (UTF-8, ``\\u0001`` for a control character), less the two quotes."""
    return len(pydantic_core.to_json(text)) - 2


def host_memory_mb(settings: Settings) -> float:
    """What all sandboxes together may reserve of memory: the machine's, or the memory cgroup
    they are made in where that is lower (a pod's limit: counted at the machine's, 256 GiB of
    sandboxes were admitted into a 64 GiB pod, red team 2026-12-07), times the overcommit;
    at most ``SANDBOX_HOST_MEMORY_MB`` where set."""
    memory_mb = physical_memory_mb(settings) * settings.host_memory_overcommit
    if settings.host_memory_mb is not None:
        memory_mb = min(memory_mb, settings.host_memory_mb)
    return memory_mb


def physical_memory_mb(settings: Settings) -> float:
    """The memory the sandboxes share: the machine's, or their memory cgroup's limit."""
    ceiling = cgroups.memory_ceiling_mb(settings.cgroup_root)
    total = _mem_total_mb()
    return total if ceiling is None else min(total, ceiling)


def _mem_total_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _kernel_tasks_max() -> int:
    """The most processes and threads the kernel will hold (pid_max and threads-max)."""
    values = []
    for name in ("pid_max", "threads-max"):
        try:
            values.append(int(Path(f"/proc/sys/kernel/{name}").read_text()))
        except (OSError, ValueError):
            continue
    return min(values) if values else 32768
