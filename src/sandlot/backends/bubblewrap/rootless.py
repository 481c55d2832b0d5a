"""Rootless mode: the bubblewrap backend run by an ordinary user.

bwrap is started by the user directly, in an unprivileged user namespace: every sandbox of
that user runs as the user's one host uid (65534 inside). What keeps sandboxes apart from each
other and from the user's files is then the namespaces alone (own pid namespace: no other
sandbox or host process can be seen, signalled or traced; own mount namespace: nothing of the
host but ``/usr``, a few ``/etc`` files and the sandbox's own directory), with user namespaces
disabled inside and the same seccomp filter. A kernel escape lands in the user's account.

Limits come from a delegated cgroup v2 subtree (:mod:`sandlot.backends.delegation`) when there
is one; otherwise from rlimits (the *degraded* mode), set by ``prlimit`` inside the sandbox
before the guest starts:

- ``RLIMIT_NPROC`` = the pids limit. Since Linux 5.14 the kernel counts it per user namespace
  and uid (ucounts), so set inside the sandbox's namespace it caps that sandbox's processes
  and threads alone; on older kernels it would count every process of the user, so it is not
  set there and the pids wall is missing.
- ``RLIMIT_DATA`` = the memory limit, per process: a sandbox's processes together may use
  pids times as much, and nothing is accounted (no ``kill_reason`` for memory). Not
  ``RLIMIT_AS``: it counts address space merely reserved (V8's code range, Go's arenas,
  glibc's 64 MiB per-thread malloc arenas), and ``node`` died at start under 256 MiB of it;
  ``RLIMIT_DATA`` counts private writable mappings only. Reservations that are writable still
  count: numpy's OpenBLAS needed 384 MiB for a 1000x1000 matmul on 2 threads here (under
  256 MiB it spins until the call times out; ``OPENBLAS_NUM_THREADS=1`` fits).
- ``RLIMIT_FSIZE`` = the disk limit, per file: the workspace is a plain directory, so many files
  (or /tmp) can still fill the user's disk.
- ``RLIMIT_NOFILE``: bounds the kernel memory held by open files, per process.
- no ``RLIMIT_CPU``: it caps CPU seconds for the life of a process, not a rate, and the
  guest's kernel lives as long as the sandbox; there is no CPU quota without a cgroup.

Networking (``network=True``) needs a veth pair made by root; rootless, it is refused rather
than given the host's network namespace.
"""

from __future__ import annotations

import re
import threading
import warnings
from pathlib import Path

from sandlot.backends.cgroups import CgroupLimits
from sandlot.errors import ConfigError
from sandlot.models import ResolvedLimits, ResourceUsage

PRLIMIT = "/usr/bin/prlimit"
SETPRIV = "/usr/bin/setpriv"  # util-linux too: drops to a uid (root), sets a death signal
SANDBOX_NOFILE = 1024
NPROC_PER_NAMESPACE_SINCE = (5, 14)
MIB = 1024 * 1024


class DegradedIsolationWarning(UserWarning):
    """Sandboxes run without a cgroup: some limits are per process or missing."""


def nproc_per_namespace(release: str) -> bool:
    """Whether this kernel counts RLIMIT_NPROC per user namespace (``uname -r`` ``release``)."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= NPROC_PER_NAMESPACE_SINCE


def rlimit_argv(limits: ResolvedLimits, *, degraded: bool, nproc: bool) -> list[str]:
    """``prlimit`` and its options, to run the guest under; soft = hard, so that sandboxed code
    cannot raise them (raising a hard limit needs CAP_SYS_RESOURCE on the host)."""
    values = {"fsize": limits.disk_mb * MIB}  # no loop disk in any rootless mode
    if degraded:
        values |= {"data": limits.memory_mb * MIB, "nofile": SANDBOX_NOFILE}
        if nproc:
            values["nproc"] = limits.pids
    return [PRLIMIT, *(f"--{name}={v}:{v}" for name, v in values.items()), "--"]


def missing_walls(*, nproc: bool) -> list[str]:
    """What the degraded mode cannot do, as the warning and doctor say it."""
    walls = [
        "memory accounting (RLIMIT_DATA caps each process, not the sandbox; no OOM kill_reason)",
        "CPU quota (none)",
        "disk cap (RLIMIT_FSIZE bounds one file, not the workspace)",
    ]
    if not nproc:
        walls.insert(0, "pids cap (this kernel counts RLIMIT_NPROC for all of your processes)")
    return walls


_warned = threading.Event()


def warn_degraded_once(reason: str, *, nproc: bool) -> None:
    """One warning per process, at the first sandbox made without a cgroup."""
    if _warned.is_set():
        return
    _warned.set()
    warnings.warn(
        f"sandlot runs rootless without a cgroup ({reason}); missing walls: "
        f"{'; '.join(missing_walls(nproc=nproc))}. Set SANDBOX_REQUIRE_LIMITS=true to refuse "
        "this mode, or run under a delegated cgroup v2 subtree (see `sandlot doctor`)",
        DegradedIsolationWarning,
        stacklevel=2,
    )


def network_refused() -> ConfigError:
    return ConfigError(
        "network=True needs root in the bubblewrap backend: each networked sandbox gets a "
        "network namespace with a veth pair, which an ordinary user cannot make, and sandlot "
        "never hands a sandbox the host's network namespace. Run the manager as root (or "
        "`sandlot serve` as root and use the SDK remotely), or use the docker backend"
    )


class NoCgroup:
    """A sandbox's stand-in for a cgroup in degraded mode.

    Nothing to kill here: the guest is pid 1 of the sandbox's pid namespace and bwrap runs it
    with ``--die-with-parent``, so ending the guest's bwrap ends every process of the sandbox
    (the kernel kills a pid namespace with its init).
    """

    version = 0

    @property
    def procs_files(self) -> list[Path]:
        return []

    @property
    def enter_files(self) -> list[Path]:
        return []  # nothing to be placed in: the sandbox runs where its bwrap was started

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        return True

    def empty(self) -> bool:
        return True

    def wait_for_headroom(self, slots: int, timeout_s: float = 3.0) -> bool:
        return True

    def remove(self, timeout_s: float = 3.0) -> bool:
        return True

    def oom_kills(self) -> int:
        return 0

    def pids_limit_hits(self) -> int:
        return 0

    def usage(self) -> ResourceUsage:
        return ResourceUsage()


class NoCgroupDriver:
    """The :class:`~sandlot.backends.cgroups.CgroupDriver` calls the backend makes, cgroup-less."""

    version = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def describe(self) -> str:
        return f"no cgroup ({self.reason}); rlimits only"

    def create(self, parts: tuple[str, ...], limits: CgroupLimits) -> NoCgroup:
        return NoCgroup()

    def path(self, *parts: str) -> NoCgroup:
        return NoCgroup()

    def children(self, *parts: str) -> list[str]:
        return []
