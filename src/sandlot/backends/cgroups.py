"""One cgroup per sandbox for memory, pids and CPU, on cgroup v1 and v2.

A shared cgroup would not do: a pid namespace leaves ``pids.current`` one too high for a
second or two after it exits, and OOM counters must be read per sandbox to name the
``kill_reason``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from sandlot.errors import BackendUnavailable
from sandlot.models import ResourceUsage

log = structlog.get_logger(__name__)

CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
REQUIRED = ("memory", "pids", "cpu")
# The least a sandbox's sockets may buffer on cgroup v1 (tcp_share() of a small sandbox).
SOCKET_BUFFERS_FLOOR_BYTES = 1 << 20


@functools.cache
def tcp_share() -> float:
    """The host's TCP buffer pool (``net.ipv4.tcp_mem``'s hard limit, one for the whole host,
    every network namespace's sockets together) as a fraction of its RAM: ~9% by default.

    A sandbox's socket buffers get that fraction of its memory limit (cgroup v1): the host's
    admission keeps the sandboxes' memory limits within its RAM, so their buffers together stay
    within the pool, and the host's own sockets keep theirs."""
    try:
        pages = int(Path("/proc/sys/net/ipv4/tcp_mem").read_text().split()[2])
        with open("/proc/meminfo") as f:
            total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.05
    return min(1.0, pages * os.sysconf("SC_PAGE_SIZE") / (total_kb * 1024))


@functools.cache
def _warn_uncapped_sockets() -> None:
    log.warning(
        "this kernel's cgroup v1 has no memory.kmem.tcp.limit_in_bytes: sandboxes' socket "
        "buffers are not charged to them, and together can fill the host's TCP pool"
    )


def socket_buffers_bytes(memory_bytes: int) -> int:
    """What a sandbox of ``memory_bytes`` may hold in socket buffers on cgroup v1."""
    return max(SOCKET_BUFFERS_FLOOR_BYTES, int(memory_bytes * tcp_share()))


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    pids_max: int
    cpu_cores: float


# v1 says "no limit" with the largest page-aligned long (9223372036854771712).
UNLIMITED_BYTES = 1 << 62


def _read(path: Path) -> str:
    return path.read_text().strip()


def _read_int(path: Path) -> int | None:
    try:
        return int(_read(path))
    except (OSError, ValueError):
        return None


def _keyed(path: Path, key: str) -> int:
    """Value of ``key`` in a flat-keyed file such as memory.events or pids.events."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mountpoint, fstype, options) of every cgroup mount."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                found.append((parts[1], parts[2], set(parts[3].split(","))))
    return found


class Cgroup:
    """One sandbox's cgroup, in every hierarchy that holds one of its controllers."""

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version = version
        self.dirs = dirs  # controller (or "unified") -> directory

    @property
    def procs_files(self) -> list[Path]:
        """The cgroup.procs files listing its processes (one per hierarchy)."""
        unique = set(self.dirs.values())  # canonical: the driver's roots are resolved
        return [d / "cgroup.procs" for d in sorted(unique)]

    @property
    def enter_files(self) -> list[Path]:
        """The files a single-threaded process writes ``0`` to, to move itself in (one per
        hierarchy). On v1 that is its thread's entry, ``tasks``: Linux (6.0 on) moves the
        calling thread alone without the global lock whose every take after a quiet spell
        waits out an RCU grace period (7-20 ms of each create's wall time here, measured),
        where a write to cgroup.procs always takes it. A process of one thread is moved
        whole either way. v2 moves processes only through cgroup.procs."""
        name = "cgroup.procs" if self.version == 2 else "tasks"
        return [d / name for d in sorted(set(self.dirs.values()))]

    def _dir(self, controller: str) -> Path:
        return self.dirs["unified"] if self.version == 2 else self.dirs[controller]

    def apply(self, limits: CgroupLimits) -> None:
        if self.version == 2:
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(limits.memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(limits.pids_max))
            self.set_cpu(limits.cpu_cores)
            return
        mem = self.dirs["memory"]
        (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # only with swap accounting; memsw == limit means no swap on top
            memsw.write_text(str(limits.memory_bytes))
        with contextlib.suppress(OSError):
            (mem / "memory.swappiness").write_text("0")
        self.cap_socket_buffers(limits.memory_bytes)
        (self.dirs["pids"] / "pids.max").write_text(str(limits.pids_max))
        self.set_cpu(limits.cpu_cores)

    def cap_socket_buffers(self, memory_bytes: int) -> None:
        """Charge and cap the cgroup's socket buffers (TCP and UDP) on v1, which charges them
        only once this limit is set (v2 always does, to memory.max): without it a 256 MB
        sandbox queued 2.2 GB unread on its loopback, all of TCP's host-wide pool
        (net.ipv4.tcp_mem), which starves every socket of the host's, the server's included
        (2026-11-28). Sockets made before it are not charged: set it before the sandbox's
        code runs."""
        if self.version == 2:
            return
        tcp = self.dirs["memory"] / "memory.kmem.tcp.limit_in_bytes"
        if tcp.exists():
            tcp.write_text(str(socket_buffers_bytes(memory_bytes)))
        else:
            _warn_uncapped_sockets()

    def set_cpu(self, cpu_cores: float) -> None:
        """Set the CPU quota (takes effect at once, for the processes already inside)."""
        quota_us = max(1000, int(cpu_cores * CPU_PERIOD_US))
        if self.version == 2:
            (self.dirs["unified"] / "cpu.max").write_text(f"{quota_us} {CPU_PERIOD_US}")
            return
        cpu = self.dirs["cpu"]
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))

    def cpu_quota_us(self) -> int | None:
        """The CPU quota in force per period (None: no limit)."""
        if self.version == 2:
            quota = _read(self.dirs["unified"] / "cpu.max").split()[0]
            return None if quota == "max" else int(quota)
        quota_us = int(_read(self.dirs["cpu"] / "cpu.cfs_quota_us"))
        return None if quota_us < 0 else quota_us

    def oom_kills(self) -> int:
        if self.version == 2:
            return _keyed(self.dirs["unified"] / "memory.events", "oom_kill")
        return _keyed(self.dirs["memory"] / "memory.oom_control", "oom_kill")

    def pids_limit_hits(self) -> int:
        return _keyed(self._dir("pids") / "pids.events", "max")

    def usage(self) -> ResourceUsage:
        if self.version == 2:
            d = self.dirs["unified"]
            usec = _keyed(d / "cpu.stat", "usage_usec")
            return ResourceUsage(
                memory_bytes=_read_int(d / "memory.current"),
                memory_peak_bytes=_read_int(d / "memory.peak"),
                pids=_read_int(d / "pids.current"),
                cpu_s=usec / 1e6,
                oom_kills=self.oom_kills(),
                pids_limit_hits=self.pids_limit_hits(),
            )
        cpu_ns = (
            _read_int(self.dirs["cpuacct"] / "cpuacct.usage") if "cpuacct" in self.dirs else None
        )
        return ResourceUsage(
            memory_bytes=_read_int(self.dirs["memory"] / "memory.usage_in_bytes"),
            memory_peak_bytes=_read_int(self.dirs["memory"] / "memory.max_usage_in_bytes"),
            pids=_read_int(self.dirs["pids"] / "pids.current"),
            cpu_s=cpu_ns / 1e9 if cpu_ns is not None else None,
            oom_kills=self.oom_kills(),
            pids_limit_hits=self.pids_limit_hits(),
        )

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in procs.read_text().split())
        return sorted(found)

    def empty(self) -> bool:
        """True only if every procs file was read (or is gone with its cgroup) and listed
        nobody: an unreadable one is no proof of an empty cgroup. A few reads of the
        cgroup file system: cheap enough for the event loop."""
        for procs in self.procs_files:
            try:
                if procs.read_text().split():
                    return False
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return True

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup until it is empty; True if it emptied.

        Killing one pid at a time races a fork bomb (each death frees a slot it refills), so
        the whole group is stopped first: cgroup.kill on v2, the freezer on v1.
        """
        # Usually empty already (a destroy kills the guest first, and the sandbox's pid
        # namespace dies with it): v1's freeze and its poll cost ~3 ms for nothing then. An
        # empty cgroup stays empty: only a process inside can fork into it.
        if self.empty():
            return True
        if self.version == 2:
            kill_file = self.dirs["unified"] / "cgroup.kill"
            if kill_file.exists():
                with contextlib.suppress(OSError):
                    kill_file.write_text("1")
        elif "freezer" in self.dirs:
            self._kill_frozen()
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def wait_for_headroom(self, slots: int, timeout_s: float = 3.0) -> bool:
        """Wait until ``slots`` processes fit under pids.max: killed tasks stay counted for a
        moment after they leave cgroup.procs, and a guest started meanwhile finds no slot."""
        current = self._dir("pids") / "pids.current"
        limit = _read_int(self._dir("pids") / "pids.max") or 0  # "max" (no limit) reads as 0
        slots = min(slots, limit // 2)  # a small pids limit cannot spare the full headroom
        deadline = time.monotonic() + timeout_s
        while limit and (_read_int(current) or 0) + slots > limit:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _kill_frozen(self) -> None:
        state = self.dirs["freezer"] / "freezer.state"
        try:
            state.write_text("FROZEN")
            deadline = time.monotonic() + 1.0
            while _read(state) != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.002)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                state.write_text("THAWED")  # the killed tasks die as they thaw

    def remove(self, timeout_s: float = 3.0) -> bool:
        """rmdir the cgroup, retrying while the kernel still counts exiting tasks."""
        deadline = time.monotonic() + timeout_s
        remaining = set(self.dirs.values())
        while remaining:
            for d in list(remaining):
                try:
                    d.rmdir()
                    remaining.discard(d)
                except FileNotFoundError:
                    remaining.discard(d)
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                        return False
            if remaining:
                self.kill_all(timeout_s=0.2)
                time.sleep(0.02)
        return True


def memory_ceiling_mb(cgroup_root: str) -> float | None:
    """The lowest memory limit over the cgroups sandboxes are made in: the hierarchy's root as
    this process sees it (a container's or pod's own cgroup) and each level of
    ``cgroup_root`` below it. A pod's limit is the memory its sandboxes share, and
    ``/proc/meminfo`` shows the machine's. None where no level sets one, or no hierarchy offers
    the controllers."""
    try:
        driver = CgroupDriver.detect()
    except BackendUnavailable:
        return None
    v1 = driver.version == 1
    current = driver.roots["memory" if v1 else "unified"]
    limits: list[int] = []
    for part in ("", *Path(cgroup_root).parts):
        current = current / part if part else current
        value = _read_int(current / ("memory.limit_in_bytes" if v1 else "memory.max"))
        if value is not None and value < UNLIMITED_BYTES:  # v2's "max" reads as None
            limits.append(value)
    return min(limits) / (1 << 20) if limits else None


class CgroupDriver:
    """Finds the cgroup hierarchies of this host and makes per-sandbox cgroups in them."""

    def __init__(self, version: int, roots: dict[str, Path]) -> None:
        self.version = version
        # controller (or "unified") -> mountpoint, resolved once: where two controllers share
        # a hierarchy (cpu,cpuacct and its links) their cgroups are then one path, with no
        # resolve() per create, write and removal (~1 ms of the manager's CPU a lifecycle).
        self.roots = {name: root.resolve() for name, root in roots.items()}

    @classmethod
    def detect(cls, mounts: list[tuple[str, str, set[str]]] | None = None) -> CgroupDriver:
        """Prefer v1 controllers where they are mounted (hybrid hosts), else v2.

        Raises:
            BackendUnavailable: neither hierarchy offers memory, pids and cpu.
        """
        mounts = _mounts() if mounts is None else mounts
        v1: dict[str, Path] = {}
        for mountpoint, fstype, options in mounts:
            if fstype == "cgroup":
                for controller in V1_CONTROLLERS:
                    if controller in options:
                        v1.setdefault(controller, Path(mountpoint))
        if all(c in v1 for c in REQUIRED):
            return cls(1, v1)
        for mountpoint, fstype, _ in mounts:
            if fstype == "cgroup2":
                controllers_file = Path(mountpoint) / "cgroup.controllers"
                with contextlib.suppress(OSError):
                    available = set(controllers_file.read_text().split())
                    if all(c in available for c in REQUIRED):
                        return cls(2, {"unified": Path(mountpoint)})
        raise BackendUnavailable(
            "no cgroup hierarchy offers the memory, pids and cpu controllers; "
            "limits cannot be enforced (see `sandlot doctor`)"
        )

    def describe(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in sorted(self.roots.items()))
        return f"cgroup v{self.version} ({where})"

    def path(self, *parts: str) -> Cgroup:
        """The cgroup at ``parts`` below each hierarchy's root (not created)."""
        dirs = {name: root.joinpath(*parts) for name, root in self.roots.items()}
        return Cgroup(self.version, dirs)

    def of_process(self, pid: int) -> Cgroup:
        """The cgroup ``pid`` is in (a container made by someone else, such as dockerd).

        Raises:
            OSError: the process is gone.
        """
        dirs: dict[str, Path] = {}
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if self.version == 2 and controllers == "":
                dirs["unified"] = self.roots["unified"] / relative
            for controller in controllers.split(","):
                if controller in self.roots:
                    dirs[controller] = self.roots[controller] / relative
        return Cgroup(self.version, dirs)

    def create(self, parts: tuple[str, ...], limits: CgroupLimits) -> Cgroup:
        """Create the cgroup (and its parents), apply ``limits``, return it."""
        if self.version == 2:
            self._enable_v2_controllers(parts[:-1])
        cgroup = self.path(*parts)
        for d in set(cgroup.dirs.values()):
            d.mkdir(parents=True, exist_ok=True)
        cgroup.apply(limits)
        return cgroup

    def _enable_v2_controllers(self, parents: tuple[str, ...]) -> None:
        # In v2 a controller reaches a child only if every ancestor lists it in subtree_control.
        current = self.roots["unified"]
        for part in ("", *parents):
            current = current / part if part else current
            current.mkdir(exist_ok=True)
            # Only the hierarchy's root as we see it (a container's cgroup namespace root, a
            # delegated subtree) is ours to empty; a busy cgroup named below it is someone
            # else's (a systemd unit): refused, never emptied behind its manager's back.
            _enable_controllers(current, may_evacuate=not part)

    def children(self, *parts: str) -> list[str]:
        """Names of the cgroups directly below ``parts`` in any hierarchy."""
        names: set[str] = set()
        for root in self.roots.values():
            d = root.joinpath(*parts)
            with contextlib.suppress(OSError):
                names.update(p.name for p in d.iterdir() if p.is_dir())
        return sorted(names)

    def probe(self, parent: str) -> str:
        """Create a real cgroup below ``parent`` with every limit applied, then remove it: the
        only proof that sandboxes can get one here (reading ``cgroup.controllers`` is not: in a
        container on v2 the controllers are listed, yet cannot be enabled for children).

        Raises:
            BackendUnavailable: the cgroup cannot be made, limited or removed.
        """
        parts = (parent, f"probe-{os.getpid()}-{time.monotonic_ns()}")
        limits = CgroupLimits(memory_bytes=64 << 20, pids_max=16, cpu_cores=0.5)
        try:
            cgroup = self.create(parts, limits)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot create a cgroup with limits under {parent} ({exc})"
            ) from exc
        if not cgroup.remove(timeout_s=1.0):
            raise BackendUnavailable(f"a probe cgroup under {parent} could not be removed")
        return f"{self.describe()}: made and removed a limited cgroup under {parent}/"


# Where a cgroup's own processes go so that controllers can be enabled for its children.
# docker-in-docker's entrypoint does the same, under the same name.
EVACUATION_LEAF = "init"
EVACUATION_ROUNDS = 5


def _enable_controllers(cgroup_dir: Path, *, may_evacuate: bool) -> None:
    """Enable the required controllers for ``cgroup_dir``'s children.

    cgroup v2's "no internal processes" rule refuses (EBUSY) while the cgroup itself holds
    processes, unless it is the root of the whole hierarchy. Inside a container with its own
    cgroup namespace (Docker's and Kubernetes' default on v2) the namespace's root is such a
    cgroup, holding our own process and the container's others: they are moved into a leaf
    child first, as docker-in-docker does. A cgroup we made ourselves never holds processes.

    Raises:
        BackendUnavailable: the controllers cannot be enabled.
    """
    control = cgroup_dir / "cgroup.subtree_control"
    wanted = " ".join(f"+{c}" for c in REQUIRED)
    for _ in range(EVACUATION_ROUNDS):
        if all(c in _read(control).split() for c in REQUIRED):
            return
        try:
            control.write_text(wanted)
        except OSError as exc:
            if exc.errno != errno.EBUSY or not may_evacuate:
                raise _cannot_enable(control, wanted, exc) from exc
            last = exc
        else:
            return
        # New processes can be forked into it while we move the others: a few rounds.
        moved = evacuate(cgroup_dir, EVACUATION_LEAF)
        log.warning(
            "moved processes out of a cgroup so its children can have limits",
            cgroup=str(cgroup_dir),
            to=EVACUATION_LEAF,
            moved=moved,
        )
    raise _cannot_enable(control, wanted, last) from last


def evacuate(cgroup_dir: Path, leaf_name: str) -> int:
    """Move every process of ``cgroup_dir`` into its leaf child ``leaf_name`` (made if there is
    any); return how many moved.

    Raises:
        OSError: the leaf cannot be made, or a process cannot be moved there.
    """
    pids = _read(cgroup_dir / "cgroup.procs").split()
    if not pids:
        return 0
    leaf = cgroup_dir / leaf_name
    leaf.mkdir(exist_ok=True)
    moved = 0
    for pid in pids:
        try:
            (leaf / "cgroup.procs").write_text(pid)
            moved += 1
        except ProcessLookupError:  # it exited meanwhile
            continue
    return moved


def _cannot_enable(control: Path, wanted: str, exc: OSError) -> BackendUnavailable:
    return BackendUnavailable(
        f"cannot enable {wanted} in {control}: {exc}. Run sandlot where it may manage a "
        "cgroup v2 subtree: as root in a container with its own cgroup namespace, or with "
        "SANDBOX_CGROUP_ROOT naming a cgroup delegated to this user (see `sandlot doctor`)"
    )
