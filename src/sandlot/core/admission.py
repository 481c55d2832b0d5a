"""Admission: whether a new sandbox may start, given what its owner and the host already hold.

Two bounds, both on what sandboxes *reserve* (their limits), not on what they use now, since
any of them may grow to its limit at any moment:

- the tenant's quota, on every resource a sandbox reserves: sandboxes, memory, pids, CPU and
  disk (kept artifacts are bounded when they are kept, see ``artifacts.py``);
- the host's capacity, measured when the manager starts: memory (RAM times an overcommit
  factor), CPU (cores times a factor), pids (a share of the kernel's process table) and disk
  (a share of the space free in the data directory). A sandbox the host cannot hold is
  refused with :class:`CapacityExhausted`, never started into a host crash.

Checked with no await between the check and the sandbox's registration, so concurrent creates
cannot both slip under a bound.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandlot.config import Settings
from sandlot.errors import CapacityExhausted, ConfigError, QuotaExceeded
from sandlot.models import Quota, ResolvedLimits, SandboxInfo


@dataclass(frozen=True)
class HostCapacity:
    """What all sandboxes together may reserve on this host."""

    memory_mb: float
    cpu_cores: float
    pids: int
    disk_mb: float

    @classmethod
    def measure(cls, settings: Settings) -> HostCapacity:
        stat = os.statvfs(settings.data_dir)
        return cls(
            memory_mb=_mem_total_mb() * settings.host_memory_overcommit,
            cpu_cores=(os.cpu_count() or 1) * settings.host_cpu_overcommit,
            pids=int(_kernel_tasks_max() * settings.host_pids_fraction),
            disk_mb=stat.f_bavail * stat.f_frsize / (1 << 20) * settings.host_disk_fraction,
        )


def check_host(reserved: Iterable[ResolvedLimits], new: ResolvedLimits, host: HostCapacity) -> None:
    """Raise if the host cannot hold one more sandbox of ``new`` beside ``reserved``.

    Raises:
        CapacityExhausted: a resource would be over the host's capacity (the message names
            the setting that changes it).
    """
    held = list(reserved)
    bounds = (
        ("memory_mb", host.memory_mb, "SANDBOX_HOST_MEMORY_OVERCOMMIT"),
        ("cpu_cores", host.cpu_cores, "SANDBOX_HOST_CPU_OVERCOMMIT"),
        ("pids", host.pids, "SANDBOX_HOST_PIDS_FRACTION"),
        ("disk_mb", host.disk_mb, "SANDBOX_HOST_DISK_FRACTION"),
    )
    for name, capacity, setting in bounds:
        total = sum(getattr(limits, name) for limits in held) + getattr(new, name)
        if total > capacity:
            raise CapacityExhausted(
                f"this host has no room for {name}={getattr(new, name)} more: live sandboxes "
                f"reserve {total - getattr(new, name):g} of {capacity:g}; retry when some "
                f"end, ask for less, or raise {setting}"
            )


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
    """Raise if ``metadata`` (keys and values, UTF-8) is over ``max_bytes``.

    Raises:
        ConfigError: it is (the message names SANDBOX_MAX_METADATA_BYTES).
    """
    size = sum(len(k.encode()) + len(v.encode()) for k, v in (metadata or {}).items())
    if size > max_bytes:
        raise ConfigError(
            f"metadata of {size} bytes is over {max_bytes}; send less, or raise "
            "SANDBOX_MAX_METADATA_BYTES"
        )


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
