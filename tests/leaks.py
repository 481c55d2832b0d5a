"""Leak accounting for the hostile suite: what sandboxes leave behind on the host.

A snapshot counts, for one manager (one instance of a data directory, whose backends keep
their state in ``<data_dir>/instances/<id>``, ``manager.instance_dir``):

- processes run by a sandbox uid (any of real/effective/saved/fs uid >= ``uid_base``), except
  those provably inside another manager's cgroups (other test runs may share this host);
- the sandbox cgroups of this manager (``<controller>/<cgroup_root>/<instance>/*``);
- the sandbox directories under ``<instance dir>/sandboxes``;
- the mounts below the instance directory, and the loop devices backed by a file in it.

After the sandboxes of a test are destroyed every count must return to its baseline. The kernel
(and the host's init, which inherits each sandbox's pid 1 when it dies) may need a moment to
reap, so :func:`wait_for_baseline` polls for a few seconds before it reports.

Zombies show in the root cgroup, so a zombie handed to the host's init is attributed by uid and
start time instead: a uid belongs to one sandbox at a time (uids are locked while in use), so a
process of uid U that started while one of our sandboxes held U is ours (:class:`UidRecorder`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sandlot import SandboxManager, Settings
from sandlot.backends.base import instance_of
from sandlot.backends.bubblewrap import launchns
from sandlot.backends.docker.dockerd import labelled

CGROUP_FS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "cpu", "cpuacct")
REAP_WAIT_S = 3.0
PF_EXITING = 0x4  # task flag: the process is in do_exit()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def boot_time_s() -> float:
    """Now, on the clock /proc uses for process start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Watched(Protocol):
    """What the snapshot helpers read of a manager: a live :class:`SandboxManager`, or
    :class:`Outside` for one in another process."""

    @property
    def settings(self) -> Settings: ...

    @property
    def instance_dir(self) -> Path: ...


@dataclass
class Outside:
    """A manager of another process (gone, or never in this one), seen from outside: what the
    snapshot helpers read of a manager, for the instance directory that process used."""

    settings: Settings
    instance_dir: Path


def instance_dirs(data_dir: Path) -> list[Path]:
    """The instances (managers, live or dead and not yet recovered) of a data directory."""
    root = data_dir / "instances"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def cgroup_instance_dirs(manager: Watched) -> list[Path]:
    """``<hierarchy>/<cgroup_root>/<instance>`` in every hierarchy (v1 controllers or v2)."""
    return cgroup_dirs_of(manager.settings.cgroup_root, manager.instance_dir)


def cgroup_dirs_of(cgroup_root: str, instance_dir: Path) -> list[Path]:
    """The cgroup directories of the backends whose data dir is ``instance_dir``."""
    parts = (cgroup_root, instance_of(instance_dir))
    v1 = [CGROUP_FS / c for c in V1_CONTROLLERS if (CGROUP_FS / c).is_dir()]
    roots = v1 or [CGROUP_FS]
    return [root.joinpath(*parts) for root in roots]


def sandbox_cgroup_dirs(manager: SandboxManager, sandbox_id: str) -> list[Path]:
    cgroup = docker_cgroup(manager, sandbox_id)
    if cgroup is not None:
        return cgroup_dirs(cgroup)
    return [d / sandbox_id for d in cgroup_instance_dirs(manager)]


def pids_cgroup_dir(manager: SandboxManager, sandbox_id: str) -> Path:
    """The cgroup directory holding the sandbox's ``pids.*`` files."""
    cgroup = docker_cgroup(manager, sandbox_id)
    if cgroup is not None:
        for d in cgroup_dirs(cgroup):
            if (d / "pids.max").exists():
                return d
    instance = instance_of(manager.instance_dir)
    for base in (CGROUP_FS / "pids", CGROUP_FS):
        candidate = base / manager.settings.cgroup_root / instance / sandbox_id
        if (candidate / "pids.max").exists():
            return candidate
    raise AssertionError(f"no pids cgroup for {sandbox_id}")


def sandbox_root(manager: SandboxManager, sandbox_id: str) -> Path:
    base = manager.instance_dir.resolve()
    docker_root = base / "docker-sandboxes" / sandbox_id
    return docker_root if docker_root.exists() else base / "sandboxes" / sandbox_id


# ---------------------------------------------------------------------- docker sandboxes

DOCKER_TESTED = "docker" in os.environ.get("TEST_BACKENDS", "")
_DOCKER: list[Any] = []


def _docker() -> Any:
    if not _DOCKER:
        from sandlot.backends.docker.dockerd import connect

        _DOCKER.append(connect())
    return _DOCKER[0]


def our_containers(manager: Watched) -> list[str]:
    """Names of the containers (running or not) of this manager's data directory."""
    if not DOCKER_TESTED:
        return []
    label = f"sandlot.instance={instance_of(manager.instance_dir)}"
    found = labelled(_docker(), [label])
    return sorted(c.name or str(c.id) for c in found)


def docker_cgroup(manager: SandboxManager, sandbox_id: str) -> str | None:
    """The cgroup path (as /proc shows it) of a docker sandbox's container, else None."""
    if not DOCKER_TESTED:
        return None
    label = f"sandlot.sandbox={sandbox_id}"
    found = labelled(_docker(), [label])
    if not found:
        return None
    pid = found[0].attrs["State"]["Pid"]
    return _pids_cgroup_path(pid) if pid else None


def docker_container(manager: SandboxManager, sandbox_id: str) -> tuple[str, dict[str, Any]]:
    """The id and Docker's ``State`` of a docker sandbox's container."""
    label = f"sandlot.sandbox={sandbox_id}"
    found = labelled(_docker(), [label])
    assert len(found) == 1, f"{len(found)} containers for {sandbox_id}"
    container_id = found[0].id
    assert container_id is not None
    return container_id, dict(found[0].attrs["State"])


def procs_of_container(container_id: str) -> list[Proc]:
    """Host processes in any cgroup of a container (docker names its cgroups by its id)."""
    return [p for p in all_procs() if container_id in p.cgroup]


def wait_until_container_empty(container_id: str, timeout_s: float = REAP_WAIT_S) -> list[Proc]:
    """Poll until no host process is left in the cgroups of an ended container."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = procs_of_container(container_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def status_fields(pid: int) -> dict[str, str] | None:
    """/proc/<pid>/status as a dict of stripped values, or None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {
        k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
    }


def cgroup_dirs(cgroup: str) -> list[Path]:
    v1 = [CGROUP_FS / c for c in V1_CONTROLLERS if (CGROUP_FS / c).is_dir()]
    return [root / cgroup.lstrip("/") for root in (v1 or [CGROUP_FS])]


def procs_in_cgroup(cgroup: str) -> list[Proc]:
    return [p for p in all_procs() if p.cgroup == cgroup]


def sandbox_processes(manager: SandboxManager, sandbox_id: str) -> list[Proc]:
    """The host's view of a sandbox's processes: its cgroup's (docker) or its uid's."""
    cgroup = docker_cgroup(manager, sandbox_id)
    if cgroup is not None:
        return procs_in_cgroup(cgroup)
    return procs_of_uid(host_uid(manager, sandbox_id))


def host_uid(manager: SandboxManager, sandbox_id: str) -> int:
    """The host uid a sandbox runs as (the owner of its workspace)."""
    return (sandbox_root(manager, sandbox_id) / "workspace").stat().st_uid


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]  # supplementary
    state: str
    cgroup: str
    name: str
    flags: int
    started_s: float  # on the boot_time_s() clock

    @property
    def exiting(self) -> bool:
        """Dead or dying: the kernel already shows such a task in the root cgroup."""
        return self.state in ("Z", "X") or bool(self.flags & PF_EXITING)

    @property
    def orphan_zombie(self) -> bool:
        """Dead, and handed to the host's init, which has yet to reap it."""
        return self.state == "Z" and self.ppid == 1

    def __str__(self) -> str:
        return (
            f"pid {self.pid} {self.name!r} state {self.state} ppid {self.ppid} "
            f"uids {self.uids} in {self.cgroup or '?'}"
        )


def _pids_cgroup_path(pid: int) -> str:
    """The process's path in the pids hierarchy (v1) or the unified one (v2)."""
    text = Path(f"/proc/{pid}/cgroup").read_text()
    unified = ""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie: a killed sandbox's first process is the
    host init's to reap once bwrap, its parent, is gone, and that may take a moment."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def read_proc(pid: int) -> Proc | None:
    """What /proc says about ``pid``, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cgroup = _pids_cgroup_path(pid)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        flags, started = int(stat[6]), int(stat[19]) / CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return Proc(
        pid=pid,
        ppid=int(fields.get("PPid", "0")),
        uids=tuple(int(v) for v in fields.get("Uid", "").split()),
        gids=tuple(int(v) for v in fields.get("Gid", "").split()),
        groups=tuple(int(v) for v in fields.get("Groups", "").split()),
        state=fields.get("State", "?").strip()[:1],
        cgroup=cgroup,
        name=fields.get("Name", "?").strip(),
        flags=flags,
        started_s=started,
    )


def all_procs() -> list[Proc]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                found.append(proc)
    return found


def cmdlines_holding(needle: bytes) -> dict[int, bytes]:
    """Every host process whose command line holds ``needle``: what any host user can read."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                if needle in cmdline:
                    found[int(name)] = cmdline
    return found


def procs_of_uid(uid: int) -> list[Proc]:
    """Every process (zombies included) with ``uid`` as any of its uids."""
    return [p for p in all_procs() if uid in p.uids]


def running_in_uids(first: int, count: int) -> list[Proc]:
    """Every process but a zombie with any of its uids in ``first .. first + count - 1``
    (a manager's sandbox uids: ``uid_base``, ``uid_count``)."""
    return [
        p
        for p in all_procs()
        if p.state != "Z" and any(first <= uid < first + count for uid in p.uids)
    ]


OrphanFilter = Callable[[Proc], bool]


def no_orphans(proc: Proc) -> bool:
    return False


def sandbox_procs(manager: Watched, *, orphans: OrphanFilter | None = None) -> list[Proc]:
    """Processes of sandbox uids that may belong to this manager.

    Those inside another manager's cgroup subtree are someone else's; live processes outside
    every sandbox cgroup (escaped ones) count. Zombies already handed to the host's init count
    if ``orphans`` says they are ours, or always if it is None.
    """
    base = manager.settings.uid_base
    prefix = "/" + manager.settings.cgroup_root.strip("/") + "/"
    ours = prefix + instance_of(manager.instance_dir) + "/"
    found = []
    for proc in all_procs():
        if not any(u >= base for u in proc.uids):
            continue
        if proc.cgroup.startswith(prefix) and not proc.cgroup.startswith(ours):
            continue
        if proc.orphan_zombie and orphans is not None and not orphans(proc):
            continue
        found.append(proc)
    return found


@dataclass
class Snapshot:
    procs: list[Proc] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    sandbox_dirs: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    loop_devices: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "containers": len(self.containers),
            "processes": len(self.procs),
            "cgroups": len(self.cgroups),
            "sandbox_dirs": len(self.sandbox_dirs),
            "mounts": len(self.mounts),
            "loop_devices": len(self.loop_devices),
        }

    def excess_over(self, baseline: Snapshot) -> dict[str, list[str]]:
        """What this snapshot holds beyond ``baseline``, for every count that grew."""
        before_pids = {p.pid for p in baseline.procs}
        new_items = {
            "processes": [str(p) for p in self.procs if p.pid not in before_pids],
            "cgroups": sorted(set(self.cgroups) - set(baseline.cgroups)),
            "sandbox_dirs": sorted(set(self.sandbox_dirs) - set(baseline.sandbox_dirs)),
            "mounts": sorted(set(self.mounts) - set(baseline.mounts)),
            "loop_devices": sorted(set(self.loop_devices) - set(baseline.loop_devices)),
            "containers": sorted(set(self.containers) - set(baseline.containers)),
        }
        now, then = self.counts(), baseline.counts()
        return {
            key: items or [f"{now[key]} now, {then[key]} before"]
            for key, items in new_items.items()
            if now[key] > then[key]
        }


def mounts_below(root: Path, *, pins: bool = False) -> list[str]:
    """Mounts at or below ``root``; without ``pins``, not a live instance's launch namespace
    pin (launchns.py: one per instance, made by its first create and removed at its close;
    test_launchns.py checks that)."""
    prefix = str(root.resolve())
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            point = line.split()[1].replace("\\040", " ")
            if not pins and Path(point).name == launchns.PIN:
                continue
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


def loop_devices_below(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            target = backing.read_text().strip()
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(f"{backing.parent.parent.name} -> {target}")
    return found


def snapshot(manager: Watched, *, orphans: OrphanFilter | None = None) -> Snapshot:
    data_dir = manager.instance_dir.resolve()
    cgroups = []
    for d in cgroup_instance_dirs(manager):
        if d.is_dir():
            cgroups += [str(c) for c in d.iterdir() if c.is_dir()]
    dirs = []
    for sandboxes in (data_dir / "sandboxes", data_dir / "docker-sandboxes"):
        dirs += sorted(p.name for p in sandboxes.iterdir()) if sandboxes.is_dir() else []
    return Snapshot(
        procs=sandbox_procs(manager, orphans=orphans),
        cgroups=sorted(cgroups),
        sandbox_dirs=dirs,
        mounts=mounts_below(data_dir),
        loop_devices=loop_devices_below(data_dir),
        containers=our_containers(manager),
    )


def wait_for_baseline(
    manager: Watched,
    baseline: Snapshot,
    *,
    orphans: OrphanFilter | None = None,
    timeout_s: float = REAP_WAIT_S,
) -> dict[str, list[str]]:
    """Poll until nothing exceeds ``baseline``; return what still does after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        excess = snapshot(manager, orphans=orphans).excess_over(baseline)
        if not excess or time.monotonic() > deadline:
            return excess
        time.sleep(0.05)


def wait_until_gone(
    manager: Watched, uid: int, *, started_before_s: float, timeout_s: float = REAP_WAIT_S
) -> list[Proc]:
    """Poll until no process of ``uid`` started before ``started_before_s`` (the moment the
    sandbox was destroyed and its uid freed for reuse) remains, zombies included."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            p for p in sandbox_procs(manager) if uid in p.uids and p.started_s <= started_before_s
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_until_cgroup_empty(cgroup: str, timeout_s: float = REAP_WAIT_S) -> list[Proc]:
    """Poll until no process is left in a (docker) sandbox's cgroup; return what is."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = procs_in_cgroup(cgroup)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


class UidRecorder:
    """Records when each sandbox a manager creates holds its uid; :meth:`owns` a process if
    it ran as one of those uids and started while our sandbox held it.

    Uses the manager's listener hook. Without one, :attr:`enabled` is False and every orphaned
    zombie of a sandbox uid is counted (correct, but noisy when other runs share the host).
    """

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self.active = True
        self.spans: dict[str, tuple[int, float, float | None]] = {}  # id -> uid, start, end
        add_listener = getattr(manager, "add_listener", None)
        self.enabled = add_listener is not None
        if add_listener is not None:
            add_listener(self._on_event)

    def _on_event(self, event: str, fields: dict[str, Any]) -> None:
        info = fields.get("info")
        if not self.active or info is None:
            return
        if event == "created":
            with contextlib.suppress(OSError):
                root = sandbox_root(self.manager, info.id)
                # The sandbox directory is made before its first process starts.
                age_s = time.time() - root.stat().st_ctime
                uid = host_uid(self.manager, info.id)
                self.spans[info.id] = (uid, boot_time_s() - age_s - 0.05, None)
        elif event == "destroyed" and info.id in self.spans:
            uid, start, _ = self.spans[info.id]
            self.spans[info.id] = (uid, start, boot_time_s())

    def owns(self, proc: Proc) -> bool:
        for uid, start, end in self.spans.values():
            if uid in proc.uids and start <= proc.started_s <= (end or float("inf")):
                return True
        return False

    def filter(self) -> OrphanFilter | None:
        return self.owns if self.enabled else None
