"""The embedded default backend: bubblewrap + one cgroup + seccomp + a loop-mounted workspace.

Each sandbox gets:
- its own host uid (never root): bwrap is started *unprivileged* as that uid, so even an
  escape from every namespace lands in an account that owns nothing but its own workspace;
- user, pid, mount, net, ipc, uts and cgroup namespaces (``--unshare-all``), with user
  namespaces then disabled inside (``--disable-userns``) and the root remounted read-only;
  with ``network=True``, a network namespace of its own still (:mod:`.netns`), never the host's;
- a ``/proc`` that hides what is host-wide (:mod:`sandlot.backends.procfs`);
- a seccomp filter (:mod:`sandlot.backends.bubblewrap.seccomp`);
- a cgroup with memory (+swap), pids and CPU limits (:mod:`sandlot.backends.cgroups`);
- a workspace that is an ext4 image of the requested size (:mod:`sandlot.backends.disk`);
- the guest agent, installed and started as :mod:`sandlot.backends.launch` says.

Whether a host can run all this is :mod:`sandlot.backends.bubblewrap.probe`'s to say.

Run by an ordinary user (no root), it is *rootless* (:mod:`.rootless`): one host uid for all
the user's sandboxes, limits from a delegated cgroup v2 subtree or else rlimits, a workspace
that is a plain directory, and no ``network=True``.

The flag set is the one DESIGN.md lists as having passed every probe here; ``--unshare-all``
alone, run as root, was escapable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Collection
from pathlib import Path
from typing import ClassVar

import structlog

from sandlot.backends import hostnet
from sandlot.backends import volumes as host_volumes
from sandlot.backends.base import (
    GUEST_PIDS_HEADROOM,
    Check,
    Guest,
    GuestSpec,
    instance_of,
    require_volumes,
)
from sandlot.backends.bubblewrap import netns
from sandlot.backends.bubblewrap.argv import (
    BWRAP,
    NSENTER,
    Argvs,
)
from sandlot.backends.bubblewrap.box import Box
from sandlot.backends.bubblewrap.launching import START_TIMEOUT_S, Launching
from sandlot.backends.bubblewrap.probe import host_checks
from sandlot.backends.bubblewrap.rootless import (
    PRLIMIT,
    SETPRIV,
    NoCgroup,
    NoCgroupDriver,
    network_refused,
    nproc_per_namespace,
    warn_degraded_once,
)
from sandlot.backends.bubblewrap.seccomp import build_filter
from sandlot.backends.bubblewrap.template import (
    Templates,
)
from sandlot.backends.cgroups import Cgroup, CgroupDriver, CgroupLimits
from sandlot.backends.delegation import find_delegated, prepare
from sandlot.backends.disk import (
    DISK_TEMPLATES,
    disk_paths,
    disk_used_bytes,
    loop_disks_available,
    make_sandbox_disk,
    remove_sandbox_disk,
    remove_sandbox_disk_now,
)
from sandlot.backends.hostwide import raise_file_max
from sandlot.backends.launch import (
    identity_files,
    install_guest,
)
from sandlot.backends.procfs import (
    HIDDEN_DIRS,
    HIDDEN_FILES,
    present,
    write_proc_files,
)
from sandlot.backends.rootfs import bubblewrap_mode, missing_tree_error
from sandlot.backends.uids import UidAllocator, release, unlock
from sandlot.config import Settings
from sandlot.environments import get_environment
from sandlot.errors import BackendUnavailable, SandboxStartError
from sandlot.models import ResourceUsage

log = structlog.get_logger(__name__)

NET_LOCK_DIR = Path("/run/sandlot/nets")  # a networked sandbox's /30, host-wide (netns.py)
# The CPU quota (cores) a new sandbox's guest starts under when its own is smaller, until it
# says ready (``started``): a supervisor start is ~30 ms of CPU, which a 0.05-core quota
# stretched to ~550 ms of wall per create. Only our guest runs in that window (``-I -S``, no
# site or workspace code), and at most START_TIMEOUT_S.
START_CPU_CORES = 1.0
# The synthesized /proc files say only a sandbox's memory limit (and the host's CPU count): the
# sandboxes of one limit and one tenant share one set, written once into the instance's
# directory and bound read-only, instead of six files made and deleted a lifecycle. One
# tenant's, never two: inotify and flock act on the inode, not the mount, so sandboxes that
# share a file can see each other open it and can signal through its locks (a red team's find;
# as with the guest templates, SANDBOX_GUEST_TEMPLATE_SCOPE=system shares across tenants).
# Root's backend only (rootless, the files would be the sandboxes' own uid's); none for a
# pooled sandbox not yet claimed. Past this many sets a sandbox gets its own again, so asking
# for many sizes cannot fill the data directory.
PROC_SETS_DIR = "proc-files"
MAX_PROC_SETS = 16


def _traversable_by_others(path: Path) -> Path | None:
    """The first ancestor of ``path`` that other uids cannot enter, if any."""
    for parent in [path, *path.parents]:
        with contextlib.suppress(FileNotFoundError):
            if not parent.stat().st_mode & stat.S_IXOTH:
                return parent
    return None


class BubblewrapBackend(Launching):
    name: ClassVar[str] = "bubblewrap"
    any_environment: ClassVar[bool] = True
    runtimes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.data_dir.resolve()
        self.instance = instance_of(self.data_dir)
        self.sandboxes_dir = self.data_dir / "sandboxes"
        self._boxes: dict[str, Box] = {}
        self._checked = False
        self.rootless = os.geteuid() != 0
        self._cgroups: CgroupDriver | NoCgroupDriver | None = None
        # Below each hierarchy's root (root), or below the delegated subtree (rootless).
        self._cgroup_prefix: tuple[str, ...] = (settings.cgroup_root,)
        self._nproc = nproc_per_namespace(os.uname().release)
        self._uids: UidAllocator | None = None
        self._loop_ok = False
        self._guest_dir = self.data_dir / "guest"
        self._etc = self.data_dir / "rootfs" / "etc"
        self._argvs = Argvs(self._etc, self._guest_dir, self.rootless)
        self._hidden_files = present(HIDDEN_FILES)
        self._hidden_dirs = present(HIDDEN_DIRS)
        self._routing_ready = False
        self._launch_ns: Path | None = None  # launchns.py's pin, once made
        # (whose sandboxes share it, _sharers; memory limit in bytes): a shared /proc set
        self._proc_sets: dict[tuple[str, int], str] = {}
        self._launch_ns_failed = False
        self._routing_lock = asyncio.Lock()
        # One template per system ("host", or a tree's path), started on first use
        # (template.py); a system whose template would not start starts guests afresh.
        self._templates = Templates(START_TIMEOUT_S, settings.max_guest_templates)

    @classmethod
    def probe(cls, settings: Settings, runtime: str | None = None) -> list[Check]:
        return host_checks(settings)

    # -- set-up

    def _check(self) -> None:
        if self._checked:
            return
        # Rootless, prlimit sets the rlimits (RLIMIT_FSIZE in every mode) and setpriv ties
        # bwrap to us; as root, nsenter enters the launch and net namespaces and drops to the
        # sandbox uid (setpriv does where there is no namespace to enter).
        tools = (BWRAP, SETPRIV, PRLIMIT) if self.rootless else (BWRAP, SETPRIV, NSENTER)
        for tool in tools:
            if not Path(tool).is_file():
                raise BackendUnavailable(
                    f"`{tool}` is not installed: apt-get install -y bubblewrap util-linux"
                )
        build_filter(False)  # fail now, with a clear message, if libseccomp is missing
        if self.rootless:
            self._choose_rootless_cgroups()
        else:
            self._cgroups = CgroupDriver.detect()
            if self.settings.raise_file_max:
                raise_file_max()
            self._loop_ok, why = loop_disks_available()
            if not self._loop_ok:
                log.warning("disk cap not enforced", reason=why)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        # Rootless, bwrap runs as this very user: nobody else needs to enter the data dir.
        for d in (self.data_dir, self.sandboxes_dir):
            d.chmod(0o700 if self.rootless else 0o711)
        if not self.rootless:
            blocked = _traversable_by_others(self.sandboxes_dir)
            if blocked is not None:
                raise BackendUnavailable(
                    f"{blocked} is not searchable by other users, so sandbox uids cannot "
                    f"reach their workspace under {self.sandboxes_dir}; set SANDLOT_DATA_DIR "
                    "to a directory whose parents are mode o+x (such as /var/lib/sandlot)"
                )
            self._uids = UidAllocator.for_host(
                self.data_dir, self.settings.uid_base, self.settings.uid_count
            )
        self._install_guest_files()
        self._checked = True

    def _net_lock_dir(self) -> Path:
        return NET_LOCK_DIR if Path("/run").is_dir() else self.data_dir / "nets"

    def _choose_rootless_cgroups(self) -> None:
        delegated, why = find_delegated(os.getuid(), configured=self.settings.cgroup_root)
        if delegated is not None:
            self._cgroups = prepare(delegated)
            self._cgroup_prefix = () if delegated.configured else (self.settings.cgroup_root,)
            log.info("rootless: limits in a delegated cgroup", cgroup=why)
        elif self.settings.require_limits:
            raise BackendUnavailable(
                f"rootless with no delegated cgroup v2 subtree ({why}), and "
                "SANDBOX_REQUIRE_LIMITS=true refuses rlimits alone; see `sandlot doctor`"
            )
        else:
            self._cgroups = NoCgroupDriver(why)

    def _install_guest_files(self) -> None:
        install_guest(self._guest_dir)
        self._etc.mkdir(parents=True, exist_ok=True)
        for d in (self._etc.parent, self._etc):
            d.chmod(0o755)
        for name, content in identity_files().items():
            path = self._etc / name
            path.write_text(content)
            path.chmod(0o644)

    @property
    def cgroups(self) -> CgroupDriver | NoCgroupDriver:
        self._check()
        assert self._cgroups is not None
        return self._cgroups

    @property
    def degraded(self) -> bool:
        """Rootless with no cgroup: rlimits only."""
        return isinstance(self.cgroups, NoCgroupDriver)

    def _cgroup_parts(self, sandbox_id: str) -> tuple[str, ...]:
        return (*self._cgroup_prefix, self.instance, sandbox_id)

    # -- contract

    async def start(self, spec: GuestSpec) -> Guest:
        self._check()
        box = self._boxes.get(spec.sandbox_id)
        if box is None:
            box = await self._provision(spec)
        else:
            await self._end_guest(box)
            # A guest that never said ready left the start's quota: a restart runs under
            # the sandbox's own.
            self._lower_cpu(box)
            # Only a restart re-enters the cgroup (after a fork bomb, say): leave the fresh
            # guest room to start its interpreter and run a command.
            await asyncio.to_thread(box.cgroup.wait_for_headroom, GUEST_PIDS_HEADROOM)
            box.emptied = False  # the launch chain enters the cgroup from here on
            box.guest = await self._spawn(box, spec)
        assert box.guest is not None
        return box.guest

    def _system_root(self, environment: str) -> Path | None:
        """The tree bound as the sandbox's ``/``, or None for the host's /usr (the default
        environment while it has no tree: a fresh machine runs without building one).

        Raises:
            BackendUnavailable: the environment's tree is not built, or (rootless) not
                readable by this user.
        """
        env = get_environment(environment, self.settings.registry_dir)
        mode, tree = bubblewrap_mode(env, self.settings.rootfs_dir)
        if mode == "missing":
            raise missing_tree_error(env)
        if tree is not None and self.rootless and not os.access(tree, os.R_OK | os.X_OK):
            raise BackendUnavailable(f"the tree {tree} is not readable by this user")
        return tree

    def volumes_available(self, runtime: str | None = None) -> tuple[bool, str]:
        """Whether this backend can attach named volumes here, and why not."""
        if self.rootless:
            return False, "rootless bubblewrap has no loop devices to hold a volume's cap"
        return host_volumes.available()

    async def _provision(self, spec: GuestSpec) -> Box:
        if spec.volumes:
            require_volumes(self, spec.runtime)
        system = self._system_root(spec.environment)
        # Before anything is held (a uid, a cgroup): a failed write leaves nothing to undo.
        shared_proc = self._proc_set(spec.tenant, spec.limits.memory_mb * 1024 * 1024)
        uid: int
        lock_fd: int | None
        if self.rootless:
            if spec.network:
                raise network_refused()
            cgroups = self.cgroups
            if isinstance(cgroups, NoCgroupDriver):
                warn_degraded_once(cgroups.reason, nproc=self._nproc)
            uid, lock_fd = os.getuid(), None
        else:
            assert self._uids is not None
            uid, lock_fd = self._uids.acquire()
        root = self.sandboxes_dir / spec.sandbox_id
        workspace, _ = disk_paths(root)
        limits = CgroupLimits(
            memory_bytes=spec.limits.memory_mb * 1024 * 1024,
            pids_max=spec.limits.pids,
            cpu_cores=max(spec.limits.cpu_cores, START_CPU_CORES),
        )
        try:
            cgroup = await self._make_cgroup(spec.sandbox_id, limits)
        except BaseException:
            # A create cancelled here too (it leaked a uid lock a cancellation: the red
            # team's find); a cgroup made meanwhile goes with the next sweep.
            if lock_fd is not None:
                release(lock_fd)  # nothing of it started yet
            raise
        box = Box(spec.sandbox_id, root, workspace, uid, lock_fd, cgroup, self._loop_ok)
        box.volumes = spec.volumes
        box.system = system
        box.proc_files = shared_proc if shared_proc is not None else f"{root}/proc/"
        if spec.limits.cpu_cores < START_CPU_CORES and isinstance(cgroup, Cgroup):
            box.cpu_cores_after_start = spec.limits.cpu_cores
        self._boxes[spec.sandbox_id] = box
        if spec.network:
            try:
                box.net, box.net_lock_fd = netns.plan(
                    self.instance, box.sandbox_id, box.uid, self._net_lock_dir()
                )
            except BaseException:
                await self.stop(spec.sandbox_id)
                raise

        async def make_files() -> None:
            await make_sandbox_disk(
                root,
                spec.limits.disk_mb,
                uid,
                capped=self._loop_ok,
                templates=self.data_dir / DISK_TEMPLATES,
                traverse_gid=uid,
            )
            if shared_proc is None:
                write_proc_files(root / "proc", limits.memory_bytes)

        try:
            box.guest = await self._spawn(
                box,
                spec,
                # bwrap starts in the sandbox's network namespace: it must exist before.
                before_go=(lambda: self._make_network(box)) if spec.network else None,
                files=make_files,
            )
        except BaseException:
            await self.stop(spec.sandbox_id)
            raise
        return box

    async def _make_cgroup(self, sandbox_id: str, limits: CgroupLimits) -> Cgroup | NoCgroup:
        driver = self.cgroups
        parts = self._cgroup_parts(sandbox_id)
        if isinstance(driver, NoCgroupDriver):
            return driver.create(parts, limits)
        try:
            return await asyncio.to_thread(driver.create, parts, limits)
        except OSError as exc:
            raise SandboxStartError(f"could not create the sandbox's cgroup: {exc}") from exc

    async def _make_network(self, box: Box) -> None:
        async with self._routing_lock:
            if not self._routing_ready:
                await hostnet.ensure_walls(self.settings)
                self._routing_ready = True
        assert box.net is not None  # planned before the launcher's argv named its path
        await netns.create(box.net)

    def _proc_set(self, tenant: str | None, memory_bytes: int) -> str | None:
        """The shared directory of the synthesized /proc files of ``tenant``'s sandboxes of
        ``memory_bytes`` (written on its first use), or None: rootless, a pooled sandbox not
        yet claimed, or past MAX_PROC_SETS sets."""
        sharers = self._sharers(tenant)
        if self.rootless or sharers is None:
            return None
        key = (sharers, memory_bytes)
        found = self._proc_sets.get(key)
        if found is None and len(self._proc_sets) < MAX_PROC_SETS:
            sets = self.data_dir / PROC_SETS_DIR
            sets.mkdir(mode=0o755, exist_ok=True)
            # Written under a fresh name and renamed: never a partial set under the real one.
            # Named by a counter, not the tenant: the path shows in the sandbox's mountinfo.
            directory = sets / str(len(self._proc_sets))
            partial = sets / f".{directory.name}-{secrets.token_hex(4)}"
            try:
                write_proc_files(partial, memory_bytes)
                partial.rename(directory)
            except OSError as exc:
                shutil.rmtree(partial, ignore_errors=True)
                raise SandboxStartError(f"could not write the /proc files: {exc}") from exc
            found = self._proc_sets[key] = f"{directory}/"
        return found

    async def _end_guest(self, box: Box) -> bool:
        """Kill the guest and everything in the cgroup; False if the cgroup did not empty."""
        if box.guest is not None:
            box.guest.kill()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await box.guest.wait()
            box.guest = None
        elif box.emptied:
            return True
        # Usually empty by now (the guest was pid 1 of the sandbox's pid namespace, which the
        # kernel empties before its init is gone).
        box.emptied = await self._empty_cgroup(box)
        return box.emptied

    async def started(self, sandbox_id: str) -> None:
        box = self._boxes.get(sandbox_id)
        if box is not None:
            self._lower_cpu(box)

    @staticmethod
    def _lower_cpu(box: Box) -> None:
        """Give the sandbox its own CPU quota, if it still has the start's. One write: on
        the loop, not a thread's round trip."""
        if box.cpu_cores_after_start is None or not isinstance(box.cgroup, Cgroup):
            return
        try:
            box.cgroup.set_cpu(box.cpu_cores_after_start)
        except OSError as exc:
            raise SandboxStartError(f"could not set the sandbox's CPU quota: {exc}") from exc
        box.cpu_cores_after_start = None

    async def halt(self, sandbox_id: str) -> None:
        box = self._boxes.get(sandbox_id)
        if box is not None and not await self._end_guest(box):
            # Processes the kernel would not kill in 5 s (stuck in uninterruptible sleep,
            # frozen and never thawed): the teardown's stop tries again; say so loudly.
            log.error("sandbox processes outlived the kill", sandbox=sandbox_id)

    async def stop(self, sandbox_id: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is None:
            await self._remove_leftovers(sandbox_id)
            return
        await self._end_guest(box)
        if box.net is None:
            # The rest in one thread's turn: each turn costs the event loop a wakeup and a
            # future's callbacks, ~3 of them a destroy before.
            await asyncio.to_thread(self._release_now, box)
            return
        await asyncio.to_thread(box.cgroup.remove)
        await netns.remove(box.net.name, box.net.veth)
        # Its flows too, before the /30 can be another sandbox's (hostnet.forget_flows).
        forgotten = await hostnet.forget_flows(str(box.net.address))
        if box.net_lock_fd is not None:
            if forgotten:
                netns.mark_clean(box.net_lock_fd)
            unlock(box.net_lock_fd)  # only once the network is gone
        await asyncio.to_thread(self._release_volume_now, box)

    @classmethod
    def _release_now(cls, box: Box) -> None:
        """A stopped box's cgroup, then its volume and uid (blocking)."""
        box.cgroup.remove()
        cls._release_volume_now(box)

    @staticmethod
    def _release_volume_now(box: Box) -> None:
        remove_sandbox_disk_now(box.root)
        if box.uid_lock_fd is not None:
            release(box.uid_lock_fd)  # only once nothing of the sandbox's is left

    async def _remove_leftovers(self, sandbox_id: str) -> None:
        cgroup = self.cgroups.path(*self._cgroup_parts(sandbox_id))
        await asyncio.to_thread(cgroup.kill_all)
        await asyncio.to_thread(cgroup.remove)
        await netns.remove(netns.netns_prefix(self.instance) + sandbox_id)
        root = self.sandboxes_dir / sandbox_id
        if root.exists():
            await remove_sandbox_disk(root)

    async def usage(self, sandbox_id: str, *, full: bool = True) -> ResourceUsage:
        box = self._boxes.get(sandbox_id)
        if box is None:
            return ResourceUsage()
        if not full:
            return ResourceUsage(
                oom_kills=box.cgroup.oom_kills(), pids_limit_hits=box.cgroup.pids_limit_hits()
            )
        # A handful of small cgroupfs reads: cheaper inline than the hop to a thread, and
        # this runs twice per exec call.
        usage = box.cgroup.usage()
        if box.disk_capped:
            usage.disk_used_bytes = disk_used_bytes(box.workspace)
        return usage

    def workspace_on_host(self, sandbox_id: str) -> Path | None:
        workspace, _ = disk_paths(self.sandboxes_dir / sandbox_id)
        return workspace if workspace.is_dir() else None

    async def sweep(self, keep: Collection[str]) -> list[str]:
        self._check()
        keep_ids = set(keep) | set(self._boxes)
        found = set(self.cgroups.children(*self._cgroup_prefix, self.instance))
        with contextlib.suppress(FileNotFoundError):
            found.update(p.name for p in self.sandboxes_dir.iterdir() if p.is_dir())
        found.update(netns.leftovers(self.instance))
        removed = sorted(found - keep_ids)
        for sandbox_id in removed:
            await self._remove_leftovers(sandbox_id)
        if not keep_ids:
            # A crashed manager's pin, or ours with nothing left to launch.
            await asyncio.to_thread(self._drop_launch_ns)
        return removed

    async def close(self) -> None:
        for box in list(self._boxes.values()):
            for fd in (box.uid_lock_fd, box.net_lock_fd):
                if fd is not None:
                    unlock(fd)
        self._boxes.clear()
        await self._templates.close()
        if self._launch_ns is not None:
            await asyncio.to_thread(self._drop_launch_ns)
        if self._checked:
            # Our instance's parent cgroup; rmdir fails harmlessly while sandboxes remain.
            parent = self.cgroups.path(*self._cgroup_prefix, self.instance)
            await asyncio.to_thread(parent.remove, 0)
