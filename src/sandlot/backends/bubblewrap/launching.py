"""How the bubblewrap backend starts a sandbox's bwrap and guest: afresh, through the chain
of ``sh`` (into the cgroup, then the wait for "go"), nsenter or setpriv and bwrap; or forked
by the system's guest template (template.py, forks.py), which execs bwrap itself and forks the
guest into its namespaces. Either way, where it can, the manager makes the disk while bwrap
starts and attaches it and /proc's masks inside (``_mount_inside``), in the launch namespace
(launchns.py) that keeps every other sandbox's mounts out of bwrap's way. A mixin of
:class:`~sandlot.backends.bubblewrap.backend.BubblewrapBackend`, which holds the state named
below."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from sandlot.backends import hostnet, mountns
from sandlot.backends import volumes as host_volumes
from sandlot.backends.base import Guest, GuestProcess, GuestSpec
from sandlot.backends.bubblewrap import launchns
from sandlot.backends.bubblewrap.argv import (
    BWRAP,
    ETC_BINDS,
    ETC_NETWORK_BINDS,
    HOST_ENV,
    HOST_LINKS,
    Argvs,
    env_args,
    mask_binds,
    seccomp_pipe,
)
from sandlot.backends.bubblewrap.box import SANDBOX_UID, Box
from sandlot.backends.bubblewrap.forks import TemplateGuest, join_guest, launch_bwrap
from sandlot.backends.bubblewrap.rootless import NoCgroupDriver, rlimit_argv
from sandlot.backends.bubblewrap.seccomp import build_filter
from sandlot.backends.bubblewrap.template import Chain, Template, Templates, system_identity
from sandlot.backends.cgroups import Cgroup, CgroupDriver
from sandlot.backends.devpts import (
    BWRAP_OPTIONS,
    read_child_pid,
    remounter,
    wait_for_block,
    wait_for_exec,
)
from sandlot.backends.launch import GUEST_PYTHON, WORKSPACE_INSIDE, guest_env
from sandlot.backends.procfs import EMPTY_DIR, EMPTY_FILE, SYNTHESIZED
from sandlot.config import Settings
from sandlot.errors import SandboxStartError
from sandlot.guest.template import LAUNCH_INFO_FD, LAUNCH_SECCOMP_FD

log = structlog.get_logger(__name__)

# bwrap's set-up before the guest's exec: namespaces and ~60 mounts, a few ms on a quiet host.
START_TIMEOUT_S = 15.0


async def kill_all(*guests: Guest | Chain | None) -> None:
    for guest in guests:
        if guest is not None:
            guest.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(guest.wait(), 5.0)


class Launching:
    """The launch steps; the backend's state they use is declared here."""

    settings: Settings
    data_dir: Path
    rootless: bool
    _argvs: Argvs
    _templates: Templates
    _cgroups: CgroupDriver | NoCgroupDriver | None
    _nproc: bool  # RLIMIT_NPROC counts per user namespace (rootless.py)
    _loop_ok: bool
    _launch_ns: Path | None
    _launch_ns_failed: bool
    _hidden_files: list[str]
    _hidden_dirs: list[str]

    def _sharers(self, tenant: str | None) -> str | None:
        """Whose sandboxes a sandbox of ``tenant`` may share a template or a file with: the
        tenant's own (its name), everyone's (``""``, SANDBOX_GUEST_TEMPLATE_SCOPE=system), or
        nobody's (None: a pooled sandbox not yet claimed, in the tenant scope)."""
        if self.settings.guest_template_scope == "system":
            return ""
        return tenant

    def _rlimits(self, spec: GuestSpec) -> list[str]:
        """prlimit's options for a rootless sandbox's bwrap; none as root (its cgroup)."""
        if not self.rootless:
            return []
        degraded = isinstance(self._cgroups, NoCgroupDriver)  # no cgroup: rlimits only
        return rlimit_argv(spec.limits, degraded=degraded, nproc=self._nproc)

    def _masks(self, box: Box) -> list[mountns.Mask]:
        """Binds over the host-wide entries of ``/proc`` (:mod:`sandlot.backends.procfs`)."""
        # Strings, not paths: ~40 of them a create, and pathlib's joins cost ~10 µs each.
        files = box.proc_files
        empty_file, empty_dir = files + EMPTY_FILE, files + EMPTY_DIR
        masks = [mountns.Mask(empty_file, f"/proc/{n}") for n in self._hidden_files]
        masks += [mountns.Mask(empty_dir, f"/proc/{n}") for n in self._hidden_dirs]
        masks += [mountns.Mask(files + n, f"/proc/{n}") for n in SYNTHESIZED]
        return masks

    async def _spawn(
        self,
        box: Box,
        spec: GuestSpec,
        *,
        before_go: Callable[[], Awaitable[None]] | None = None,
        files: Callable[[], Awaitable[None]] | None = None,
    ) -> Guest:
        """Start the sandbox's bwrap and its guest. ``before_go`` runs before bwrap starts
        (the network it starts in); ``files`` makes the sandbox's disk and /proc files:
        while bwrap starts, where the manager mounts them itself (root, with the mount API),
        else before (bwrap binds them). Where the system has a template (:meth:`_template`),
        the template forks bwrap's launcher and the guest (:meth:`_launch_templated`), and is
        held until then, so that a retirement does not close it under this create; else the
        chain of :meth:`_launch` starts the guest afresh."""
        # As root, the manager masks /proc and bounds the sandbox's terminals once bwrap has
        # made its own mounts; where this kernel has the mount API (Linux >= 5.12) it also
        # attaches the disk then. Else bwrap makes the masks and binds the disk itself.
        manager_mounts = not self.rootless and mountns.supported()
        template = await self._template(box, spec) if manager_mounts else None
        if template is None:
            return await self._launch(box, spec, manager_mounts, before_go=before_go, files=files)
        try:
            return await self._launch_templated(
                box, spec, template, before_go=before_go, files=files
            )
        finally:
            template.release()

    async def _launch(
        self,
        box: Box,
        spec: GuestSpec,
        manager_mounts: bool,
        *,
        before_go: Callable[[], Awaitable[None]] | None,
        files: Callable[[], Awaitable[None]] | None,
    ) -> Guest:
        """The chain (sh into the cgroup, then the wait for "go" until ``before_go`` has
        run, nsenter or setpriv, bwrap and the guest), where guests start afresh."""
        read_fd = seccomp_pipe(spec.network)
        # As root, bwrap says on this pipe which pid is the sandbox's first (_spawn).
        info_r, info_w = (-1, -1) if self.rootless else os.pipe()
        info_fd = None if self.rootless else info_w
        env_fd = env_args(guest_env(spec.env))
        argv = self._argvs.chain(
            box,
            spec,
            read_fd,
            info_fd,
            env_fd=env_fd,
            manager_mounts=manager_mounts,
            # Made here on the first create: a launcher built before the pin existed started
            # bwrap in the manager's namespace.
            pin=self._launch_pin() if manager_mounts else None,
            proc_masks=[] if manager_mounts else mask_binds(self._masks(box)),
            rlimits=self._rlimits(spec),
        )
        passed = [fd for fd in (read_fd, info_fd, env_fd) if fd is not None]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=passed,
                env=HOST_ENV,
                limit=1 << 20,
            )
        except BaseException:
            if info_fd is not None:
                os.close(info_r)  # nobody will read it: bwrap never ran
            raise
        finally:
            for fd in passed:
                os.close(fd)
        try:
            guest = GuestProcess(process)
        except BaseException:
            process.kill()  # never given "go": it runs nothing of the sandbox's
            if info_fd is not None:
                os.close(info_r)
            raise
        # Where the manager mounts, the files are made while bwrap starts; else bwrap binds
        # them, so they are made first.
        before = (before_go,) if manager_mounts else (before_go, files)
        try:
            await self._go_after(before, guest, None if info_fd is None else info_r)
            if manager_mounts:
                await self._mount_while_bwrap_starts(guest, info_r, box, files)
            elif info_fd is not None:
                await asyncio.to_thread(self._finish_namespace, info_r, process.pid, box)
        except BaseException:
            # The cgroup is emptied first: a killed bwrap's child can outlive it and hold the
            # launcher's pipes, and the launcher's wait (which waits for them to close) then
            # ran to its 5 s deadline.
            await self._empty_cgroup(box, timeout_s=1.0)
            await kill_all(guest)
            raise
        return guest

    async def _launch_templated(
        self,
        box: Box,
        spec: GuestSpec,
        template: Template,
        *,
        before_go: Callable[[], Awaitable[None]] | None,
        files: Callable[[], Awaitable[None]] | None,
    ) -> Guest:
        """:meth:`_spawn`'s work where ``template`` forks the launcher (``launch_bwrap``: no
        sh, no nsenter) and then the guest. The network (``before_go``) comes first, as bwrap
        starts in it; the disk is made while bwrap starts."""
        if before_go is not None:
            await before_go()
        argv = self._argvs.bwrap(
            box, spec, LAUNCH_SECCOMP_FD, LAUNCH_INFO_FD, manager_mounts=True, templated=True
        )
        # Where no launch namespace could be made, the manager's own, as setpriv's chain.
        pin = self._launch_pin()
        net = str(box.net.path) if box.net is not None else None
        read_fd = seccomp_pipe(spec.network)
        try:
            info_r, info_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            os.close(read_fd)
            raise
        assert isinstance(box.cgroup, Cgroup)
        joined: TemplateGuest | None = None
        chain: Chain | None = None

        async def join(pid: int) -> None:
            nonlocal joined
            assert chain is not None
            joined = await self._join(template, box, spec, chain, pid)

        try:
            try:
                chain = await launch_bwrap(
                    template,
                    argv,
                    HOST_ENV,
                    box.uid,
                    str(pin) if pin is not None else "/proc/self/ns/mnt",
                    net,
                    box.cgroup.enter_files,
                    read_fd,
                    info_w,
                )
            except BaseException:
                os.close(info_r)
                raise
            await self._mount_while_bwrap_starts(chain, info_r, box, files, join)
        except BaseException:
            # The cgroup is emptied first: it holds the launcher, bwrap and its child (the
            # launcher entered it before bwrap ran), even where the template forked the
            # launcher after this create gave up on it.
            await self._empty_cgroup(box, timeout_s=1.0)
            await kill_all(joined, chain)
            raise
        assert joined is not None
        joined.release_bwrap()  # the guest holds every namespace now
        return joined

    async def _template(self, box: Box, spec: GuestSpec) -> Template | None:
        """The running template of the box's system, in the tenant scope (the default) the
        one of the sandbox's owner too (``Templates.get``); None where guests start afresh:
        rootless, ``SANDBOX_GUEST_TEMPLATE=false``, a sandbox pooled for anyone in the tenant
        scope (pools.py), or no template here. Forks of one template share its
        memory layout and Python's hash secret (SECURITY.md): never two tenants'."""
        if self.rootless or not self.settings.guest_template:
            return None
        sharers = self._sharers(spec.tenant)
        if sharers is None:
            return None
        system = str(box.system) if box.system is not None else "host"
        key = f"{system} for {sharers}" if sharers else system
        return await self._templates.get(
            key,
            system,
            lambda: system_identity(box.system, GUEST_PYTHON),
            lambda: self._argvs.template(box.system),
        )

    async def _join(
        self, template: Template, box: Box, spec: GuestSpec, chain: Chain, pid: int
    ) -> TemplateGuest:
        """The sandbox's guest, from ``template``, joined into the namespaces of bwrap's
        blocked child ``pid`` (template.py's ``join_guest``)."""
        assert isinstance(box.cgroup, Cgroup)
        config = {
            "uid": SANDBOX_UID,
            "gid": SANDBOX_UID,
            "env": guest_env(spec.env),
            "seccomp": build_filter(spec.network).hex(),
            "workspace": WORKSPACE_INSIDE,
        }
        return await join_guest(
            template, chain, pid, config, box.cgroup.enter_files, START_TIMEOUT_S
        )

    async def _go_after(
        self,
        steps: tuple[Callable[[], Awaitable[None]] | None, ...],
        guest: GuestProcess,
        info_r: int | None,
    ) -> None:
        """Run ``steps``, then let the launcher go on; if either fails, close ``info_r``
        (bwrap never ran: nobody will read it)."""
        try:
            for step in steps:
                if step is not None:
                    await step()
            await self._go(guest)
        except BaseException:
            if info_r is not None:
                os.close(info_r)
            raise

    async def _mount_while_bwrap_starts(
        self,
        chain: Chain,
        info_r: int,
        box: Box,
        files: Callable[[], Awaitable[None]] | None,
        join: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """Make the disk while bwrap makes the namespace (the ~4 ms of the disk were on
        every create's path), then attach it and the masks there. The guest starts its
        interpreter meanwhile; it runs nothing of the sandbox's before the host's key, which
        comes after this returns, and it enters /workspace only then (supervisor.py). With
        ``join``, bwrap's child waits at its block-fd, and a template's guest joins it (its pid)
        and makes the /proc the masks go over, before they are attached."""
        first = asyncio.ensure_future(
            asyncio.to_thread(self._first_pid, info_r, blocked=join is not None)
        )
        try:
            if files is not None:
                await files()
        except BaseException:
            chain.kill()  # bwrap's end closes the pipe the thread reads
            with contextlib.suppress(BaseException):
                await first
            raise
        try:
            pid = await first
        except SandboxStartError:
            # A launcher that ended before bwrap named the sandbox's first process (it could
            # not enter its cgroup, say) says why on stderr.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await chain.wait()
            if chain.returncode is None:
                raise
            raise self._launcher_failed(chain) from None
        if join is not None:
            await join(pid)
        await asyncio.to_thread(self._mount_inside, pid, chain.pid, box, manager_mounts=True)

    @staticmethod
    async def _go(guest: GuestProcess) -> None:
        """Let the launcher go on to bwrap; a launcher already gone (it could not enter its
        cgroup, say) says why on stderr, which the error carries."""
        try:
            guest.writer.write(b"go\n")
            await guest.writer.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await guest.wait()
            raise Launching._launcher_failed(guest) from exc

    @staticmethod
    def _launcher_failed(chain: Chain) -> SandboxStartError:
        why = chain.stderr_tail() or f"exit status {chain.returncode}"
        return SandboxStartError(f"the sandbox's launcher failed: {why}")

    @staticmethod
    def _first_pid(info_fd: int, *, blocked: bool = False) -> int:
        """The sandbox's first pid, once bwrap has made its mounts and exec'd the guest (or,
        ``blocked``, waits at its --block-fd for a template's guest: PLACEHOLDER)."""
        try:
            pid = read_child_pid(info_fd, START_TIMEOUT_S)
        finally:
            os.close(info_fd)
        if blocked:
            wait_for_block(pid, START_TIMEOUT_S)
        else:
            wait_for_exec(pid, "bwrap", START_TIMEOUT_S)
        return pid

    def _finish_namespace(self, info_fd: int, bwrap_pid: int, box: Box) -> None:
        """Where bwrap made the masks and bound the disk: bound the terminals only."""
        pid = self._first_pid(info_fd)
        self._mount_inside(pid, bwrap_pid, box, manager_mounts=False)

    def _mount_inside(self, pid: int, bwrap_pid: int, box: Box, *, manager_mounts: bool) -> None:
        """In the sandbox's mount namespace (``pid``'s, bwrap's child), attach the disk
        (/workspace and /tmp, nosuid and nodev as bwrap's binds) and /proc's masks, if
        ``manager_mounts``, its named volumes under /workspace, and cap its devpts instance.
        The guest runs no code of the sandbox's before the host sends its key, which comes
        after this returns."""
        max_ptys = self.settings.max_ptys
        remount = remounter(max_ptys, BWRAP_OPTIONS)
        mounts = []
        if manager_mounts:
            mounts = [
                mountns.Mask(str(box.workspace), WORKSPACE_INSIDE),
                mountns.Mask(str(box.tmp), "/tmp"),
            ]
        try:
            clones = mountns.clone_all(self._masks(box) if manager_mounts else [])
            try:
                clones += mountns.clone_all(mounts, writable=True)
            except BaseException:
                mountns.close_all(clones)
                raise
        except OSError as exc:
            raise SandboxStartError(f"could not prepare the sandbox's mounts: {exc}") from exc
        # Named volumes (only where the manager mounts: _provision refuses them elsewhere),
        # each a detached mount idmapped to this sandbox's uid, over its workspace's.
        try:
            first, box.volumes_attached = not box.volumes_attached, bool(box.volumes)
            volumes = host_volumes.open_all(box.volumes, box.uid, sandbox_pid=pid, first=first)
        except BaseException:
            mountns.close_all(clones)
            raise

        def work() -> None:
            mountns.attach_all(clones)
            host_volumes.attach_all(volumes, WORKSPACE_INSIDE, box.uid)
            remount()

        try:
            # The launchers before bwrap (sh, setpriv, nsenter) exec it: our child is bwrap.
            mountns.run_inside(pid, work, parent=bwrap_pid)
        except OSError as exc:
            # The sandbox must not run without its disk and volumes, with /proc unmasked or with its
            # terminals unbounded.
            raise SandboxStartError(
                f"could not mount the sandbox's disk and volumes, mask its /proc and bound its "
                f"terminals (devpts max={max_ptys}): {exc}"
            ) from exc
        finally:
            mountns.close_all(clones)
            mountns.close_all(volumes)

    @staticmethod
    async def _empty_cgroup(box: Box, timeout_s: float = 5.0) -> bool:
        """Kill everything in the box's cgroup; False if it did not empty. A look on the
        loop, a thread only to kill."""
        if box.cgroup.empty():
            return True
        return await asyncio.to_thread(box.cgroup.kill_all, timeout_s)

    def _launch_pin(self) -> Path | None:
        """The launch namespace's pin (made on the first call), or None where the launchers
        start in the manager's own namespace (rootless, or no mount API, or no loop disks:
        then the host has no per-sandbox mounts to leave out either)."""
        if self._launch_ns is None and not self._launch_ns_failed:
            if self.rootless or not self._loop_ok or not mountns.supported():
                self._launch_ns_failed = True
                return None
            pin = self.data_dir / launchns.PIN
            try:
                # All the instances' sandboxes of the data directory (ours: data_dir/..).
                data_root = self.data_dir.parent.parent
                launchns.make(pin, data_root, self._launch_needs(data_root))
            except OSError as exc:
                log.warning(
                    "no launch namespace: creates slow down as sandboxes add up", error=str(exc)
                )
                self._launch_ns_failed = True
                return None
            self._launch_ns = pin
        return self._launch_ns

    def _launch_needs(self, data_root: Path) -> list[str]:
        """Every host path the launchers in the launch namespace use: bwrap (run from /usr),
        the sources of its binds (_bwrap_argv) and what it reads itself (/proc, /dev's
        device nodes); as they are spelled and as their links resolve."""
        paths = [
            "/proc",
            "/dev",
            "/usr",
            BWRAP,
            *HOST_LINKS,
            *ETC_BINDS,
            *ETC_NETWORK_BINDS,
            str(hostnet.RESOLV_CONF),
            str(hostnet.UPSTREAM_RESOLV_CONF),
            str(data_root),
            str(self.settings.rootfs_dir),
        ]
        return sorted({p for path in paths for p in (path, os.path.realpath(path))})

    def _drop_launch_ns(self) -> None:
        launchns.drop(self.data_dir / launchns.PIN)
        self._launch_ns = None
        self._launch_ns_failed = False
