"""The docker backend: a container per sandbox, with runc or gVisor's runsc as its runtime.

Each sandbox is a container made from its environment's image (built offline, see
:mod:`sandlot.backends.docker.images`) with the seeds' hardening: no network, memory with
swap equal to it, a CPU quota, a pids limit, a read-only root with only /workspace and /tmp
writable, a host uid of its own (from ``SANDBOX_UID_BASE``, as a bubblewrap sandbox's), every
capability dropped, ``no-new-privileges`` and Docker's default seccomp profile.
/workspace and /tmp live on the same size-capped ext4 image as in the bubblewrap backend.

The container's pid 1 is a tiny shell loop that only reaps orphans; the guest agent, installed
as :mod:`sandlot.backends.launch` says and bind-mounted read-only, is started next to it with
an exec whose stdio we read through Docker's hijacked HTTP stream (:mod:`.stream`).
Restarting the guest (after a kernel that would not stop, say) kills every process of the
sandbox uid except pid 1, which costs one exec instead of a container restart.

Killing the Docker *client* does not stop a container: every container carries our labels,
:meth:`DockerBackend.stop` removes it by force and checks it is gone, and :meth:`sweep`
removes any container of this data directory the store does not know. Whether a host can
run it (daemon, runtime, images) is :mod:`sandlot.backends.docker.probe`'s to say.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import structlog

from sandlot.backends import hostnet, mountns
from sandlot.backends import volumes as host_volumes
from sandlot.backends.base import (
    GUEST_PIDS_HEADROOM,
    Check,
    GuestSpec,
    instance_of,
    require_volumes,
)
from sandlot.backends.cgroups import Cgroup, CgroupDriver
from sandlot.backends.devpts import DOCKER_OPTIONS, cap_ptys
from sandlot.backends.disk import (
    DISK_TEMPLATES,
    disk_paths,
    disk_used_bytes,
    loop_disks_available,
    make_sandbox_disk,
    remove_sandbox_disk,
)
from sandlot.backends.docker.dockerd import (
    LABEL,
    LABEL_ENVIRONMENT,
    LABEL_INSTANCE,
    LABEL_INSTANCE_DIR,
    LABEL_SANDBOX,
    RUNTIMES,
    connect,
    labelled,
    reap_abandoned,
)
from sandlot.backends.docker.images import ensure_image
from sandlot.backends.docker.network import NETWORK, SYSCTLS, ensure_network
from sandlot.backends.docker.probe import daemon_checks
from sandlot.backends.docker.stream import ExecGuest, socket_path, start_exec
from sandlot.backends.hostwide import raise_file_max
from sandlot.backends.launch import (
    GUEST_DIR_INSIDE,
    WORKSPACE_INSIDE,
    guest_argv,
    guest_env,
    install_guest,
)
from sandlot.backends.procfs import HIDDEN_DIRS, HIDDEN_FILES, SYNTHESIZED, write_proc_files
from sandlot.backends.uids import UidAllocator, release, unlock
from sandlot.config import Settings
from sandlot.environments import Environment, get_environment
from sandlot.errors import BackendUnavailable, ConfigError, SandboxError, SandboxStartError
from sandlot.models import ResourceUsage

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

log = structlog.get_logger(__name__)

# pid 1 of every container: reaps the orphans reparented to it (dash's `wait` reaps any
# child), and being pid 1 it ignores every signal from inside the container.
REAPER = 'trap "" HUP INT TERM; while :; do sleep 2147483647 & wait; done'
REAPER_PIDS = 2  # the loop and its sleep: not the user's to spend
# Docker's own default masks (setting HostConfig.MaskedPaths replaces them), then ours
# (sandlot.backends.procfs). runc binds /dev/null over a file, a read-only tmpfs over a
# directory, and skips what this kernel does not have. gVisor makes up its own /proc.
DOCKER_MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
MASKED_PATHS = sorted({*DOCKER_MASKED_PATHS, *(f"/proc/{n}" for n in HIDDEN_FILES + HIDDEN_DIRS)})
KILL_ALL = ["/bin/sh", "-c", "kill -9 -1; kill -9 -1"]  # all of the uid but pid 1 and us
# gVisor's sentry runs the whole sandbox as host threads of one process, and those count
# against the container's pids cgroup: a limit near the user's would kill the sandbox at
# start. The host limit gets this headroom; the user's limit is RLIMIT_NPROC, which gVisor
# enforces per sandbox (its uids are its own).
RUNSC_PIDS_HEADROOM = 512
# gVisor's gofer reaches a bind's files as itself (root), which an idmapped mount does not
# map: every write to a volume failed with EOVERFLOW (measured 2026-12-07, test_volumes.py).
RUNSC_VOLUMES = "gVisor (runsc) cannot write through the idmapped mount a volume needs"
# How the sentry (a Go program) exits when the host refuses it a thread: see _exit_cause.
RUNSC_THREAD_EXHAUSTED = 2
KILL_TIMEOUT_S = 10.0
END_WAIT_S = 5.0  # for Docker to notice that a container whose cgroup is gone has ended
REMOVE_ATTEMPTS = 5


@dataclass
class _Box:
    sandbox_id: str
    container_id: str
    root: Path
    workspace: Path
    runtime: str
    disk_capped: bool
    memory_bytes: int
    uid: int  # its own host uid (uids.py's pool), held by uid_lock_fd until it is gone
    uid_lock_fd: int | None = None
    cgroup: Cgroup | None = None
    guest: ExecGuest | None = None
    # Limit hits of earlier incarnations of the container (a restart resets its cgroup).
    oom_base: int = 0
    pids_base: int = 0
    # This incarnation's: the most its cgroup's counters showed (the counters vanish with
    # the cgroup when the container ends), and what its end added, once Docker has told.
    oom_seen: int = 0
    pids_seen: int = 0
    end_cause: str | None = None
    end_known: bool = False
    removed: bool = False  # the container is gone (halt): stop has its volume left to do

    def oom_kills(self) -> int:
        # Docker's OOMKilled says "an OOM kill happened in this incarnation", which the
        # cgroup's counter may already have shown: the end adds at most one.
        return self.oom_base + max(self.oom_seen, int(self.end_cause == "memory"))

    def pids_limit_hits(self) -> int:
        return self.pids_base + self.pids_seen + int(self.end_cause == "pids")

    @property
    def user(self) -> str:
        """Docker's ``user`` for its processes: the sandbox's own uid and group."""
        return f"{self.uid}:{self.uid}"


class DockerBackend:
    name: ClassVar[str] = "docker"
    any_environment: ClassVar[bool] = True
    runtimes: ClassVar[frozenset[str]] = RUNTIMES

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data_dir = settings.data_dir.resolve()
        self.instance = instance_of(self.data_dir)
        self.sandboxes_dir = self.data_dir / "docker-sandboxes"
        self._guest_dir = self.data_dir / "guest"
        self._boxes: dict[str, _Box] = {}
        self._client: docker.DockerClient | None = None
        self._runtime_args: dict[str, list[str]] = {}
        self._images_ok: set[str] = set()
        self._cgroups: CgroupDriver | None = None
        self._loop_ok = False
        self._network_lock = asyncio.Lock()
        self._network_ready = False
        # Each container runs as its own host uid, from the pool bubblewrap's sandboxes draw
        # from: the kernel counts some limits per uid (inotify instances, epoll watches,
        # message-queue bytes), and with one uid for all, one container's 127 inotify
        # instances left every other without one (red team, 2026-11-28). Made once root is
        # known (_connect): the pool's lock directory is root's.
        self._uids: UidAllocator | None = None

    @classmethod
    def probe(cls, settings: Settings, runtime: str | None = None) -> list[Check]:
        return daemon_checks(settings, runtime)

    # -- set-up

    async def _ready(self) -> docker.DockerClient:
        if self._client is None:
            self._client = await asyncio.to_thread(self._connect)
        return self._client

    def _connect(self) -> docker.DockerClient:
        if os.geteuid() != 0:
            raise BackendUnavailable(
                "the docker backend runs as root (it mounts each sandbox's size-capped "
                "workspace); run as root, or choose another backend with SANDBOX_BACKEND"
            )
        socket_path()
        client = connect()
        info = client.info()
        self._runtime_args = {
            name: list(spec.get("runtimeArgs") or []) if isinstance(spec, dict) else []
            for name, spec in (info.get("Runtimes") or {}).items()
        }
        with contextlib.suppress(BackendUnavailable):
            self._cgroups = CgroupDriver.detect()
        settings = self.settings
        self._uids = UidAllocator.for_host(self.data_dir, settings.uid_base, settings.uid_count)
        if settings.raise_file_max:
            raise_file_max()  # containers' open files share the host's table (hostwide.py)
        self._loop_ok, why = loop_disks_available()
        if not self._loop_ok:
            log.warning("disk cap not enforced", reason=why)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.sandboxes_dir.chmod(0o711)
        install_guest(self._guest_dir)
        try:
            reaped = reap_abandoned(client, self.data_dir)
        except Exception as exc:  # docker's or the host's: the containers wait for next time
            log.warning("could not look for dead managers' containers", error=repr(exc))
        else:
            if reaped:
                log.warning("removed the containers of dead managers", sandboxes=reaped)
        return client

    def _check_runtime(self, runtime: str, network: bool) -> None:
        if runtime not in RUNTIMES:
            raise ConfigError(f"unknown runtime {runtime!r}; choose one of: runc, runsc")
        if runtime not in self._runtime_args:
            raise BackendUnavailable(
                f"the Docker daemon has no {runtime!r} runtime; for gVisor install Debian's "
                "runsc and register it in /etc/docker/daemon.json (`make docker-setup` does "
                "both; see the README's backend table)"
            )
        if runtime == "runsc" and network and "--network=none" in self._runtime_args[runtime]:
            raise ConfigError(
                "the runsc runtime is registered with --network=none, so network=True cannot "
                "be honoured; use runtime='runc' for a sandbox with network"
            )

    # -- contract

    async def start(self, spec: GuestSpec) -> ExecGuest:
        client = await self._ready()
        box = self._boxes.get(spec.sandbox_id)
        if box is None:
            box = await self._provision(client, spec)
        else:
            await self._end_guest(box)
        box.guest = await self._exec_guest(client, box, spec)
        return box.guest

    async def _provision(self, client: docker.DockerClient, spec: GuestSpec) -> _Box:
        runtime = spec.runtime or self.settings.docker_runtime
        self._check_runtime(runtime, spec.network)
        if spec.volumes:
            require_volumes(self, runtime)
        env = get_environment(spec.environment, self.settings.registry_dir)
        if env.name not in self._images_ok:
            await ensure_image(env, client)
            self._images_ok.add(env.name)
        if spec.network:
            await self._ensure_network(client)
        root = self.sandboxes_dir / spec.sandbox_id
        workspace, _ = disk_paths(root)
        assert self._uids is not None  # made by _connect, which _ready ran
        uid, lock_fd = self._uids.acquire()
        box = _Box(
            spec.sandbox_id,
            "",
            root,
            workspace,
            runtime,
            self._loop_ok,
            spec.limits.memory_mb * 1024 * 1024,
            uid,
            lock_fd,
        )
        self._boxes[spec.sandbox_id] = box
        try:
            await make_sandbox_disk(
                root,
                spec.limits.disk_mb,
                uid,
                capped=self._loop_ok,
                templates=self.data_dir / DISK_TEMPLATES,
            )
            write_proc_files(root / "proc", spec.limits.memory_mb * 1024 * 1024)
            if spec.volumes:
                await asyncio.to_thread(self._mount_volumes, box, spec)
            box.container_id = await asyncio.to_thread(
                self._create_container, client, spec, env, box
            )
            await self._after_start(client, box)
        except BaseException:
            await self.stop(spec.sandbox_id)
            raise
        return box

    def volumes_available(self, runtime: str | None = None) -> tuple[bool, str]:
        """Whether this backend can attach named volumes here, and why not."""
        if (runtime or self.settings.docker_runtime) == "runsc":
            return False, RUNSC_VOLUMES
        return host_volumes.available()

    @staticmethod
    def _mount_volumes(box: _Box, spec: GuestSpec) -> None:
        """Each volume, idmapped to the sandbox's uid, on a host directory of its own that
        the container binds (``vol-<i>``, an entry of the sandbox's directory: a teardown
        finds a mount there and unmounts it before removing anything). It stays there for
        the container's restarts, until :meth:`stop`."""
        # The way to each mount point made now, the sandbox's (runc would make it root's).
        for volume in spec.volumes:
            os.close(host_volumes.open_beneath(str(box.workspace), volume.relative_path, box.uid))
        opened = host_volumes.open_all(spec.volumes, box.uid)
        try:
            for i, (fd, _) in enumerate(opened):
                point = box.root / f"vol-{i}"
                point.mkdir(mode=0o700)
                mountns.attach(fd, str(point))
        finally:
            mountns.close_all(opened)

    async def _ensure_network(self, client: docker.DockerClient) -> None:
        """The bridge networked sandboxes are attached to, and the host's walls around it
        (network.py), once per backend: Docker keeps both across its restarts."""
        async with self._network_lock:
            if not self._network_ready:
                await asyncio.to_thread(ensure_network, client)
                await hostnet.ensure_walls(self.settings)
                await hostnet.wall_docker_bridge()
                self._network_ready = True

    def _create_container(
        self, client: docker.DockerClient, spec: GuestSpec, env: Environment, box: _Box
    ) -> str:
        import docker.errors  # optional dependency
        from docker.types import LogConfig, Mount, Ulimit

        limits = spec.limits
        memory = f"{limits.memory_mb}m"
        pids = limits.pids + REAPER_PIDS
        ulimits = []
        if box.runtime == "runsc":
            ulimits.append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
            pids += RUNSC_PIDS_HEADROOM
        workspace, tmp = disk_paths(box.root)
        mounts = [
            Mount(WORKSPACE_INSIDE, str(workspace), type="bind"),
            Mount("/tmp", str(tmp), type="bind"),
            Mount(GUEST_DIR_INSIDE, str(self._guest_dir), type="bind", read_only=True),
        ]
        for i, volume in enumerate(spec.volumes):
            source = str(box.root / f"vol-{i}")
            mounts.append(Mount(volume.mount_path, source, type="bind", read_only=volume.read_only))
        if box.runtime == "runc":
            for name in SYNTHESIZED:  # runc allows exactly these (lxcfs's) under /proc
                source = str(box.root / "proc" / name)
                mounts.append(Mount(f"/proc/{name}", source, type="bind", read_only=True))
        try:
            host_config = client.api.create_host_config(
                network_mode=NETWORK if spec.network else "none",
                sysctls=SYSCTLS if spec.network else None,
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                mem_limit=memory,
                memswap_limit=memory,
                nano_cpus=int(limits.cpu_cores * 1e9),
                pids_limit=pids,
                ulimits=ulimits,
                mounts=mounts,
                runtime=box.runtime,
                log_config=LogConfig(type="none"),
            )
            # docker-py has no argument for it; the Engine API takes it as part of HostConfig.
            if box.runtime == "runc":
                host_config["MaskedPaths"] = MASKED_PATHS
            created = client.api.create_container(
                env.image,
                command=["/bin/sh", "-c", REAPER],
                name=f"sandlot-{spec.sandbox_id}",
                hostname="sandbox",
                user=box.user,
                working_dir=WORKSPACE_INSIDE,
                environment={"LANG": "C.UTF-8"},
                labels={
                    LABEL: "1",
                    LABEL_INSTANCE: self.instance,
                    LABEL_INSTANCE_DIR: str(self.data_dir),
                    LABEL_SANDBOX: spec.sandbox_id,
                    LABEL_ENVIRONMENT: env.name,
                },
                host_config=host_config,
            )
            container_id: str = created["Id"]
            client.api.start(container_id)
        except docker.errors.DockerException as exc:
            raise SandboxStartError(
                f"docker could not start the sandbox's container: {exc}"
            ) from exc
        return container_id

    async def _after_start(self, client: docker.DockerClient, box: _Box) -> None:
        """Find the (new) container's cgroup, to read its limit hits and usage."""
        container = await asyncio.to_thread(client.containers.get, box.container_id)
        pid = container.attrs.get("State", {}).get("Pid") or 0
        box.cgroup = None
        box.oom_seen = box.pids_seen = 0
        box.end_cause, box.end_known = None, False
        if self._cgroups is not None and pid:
            with contextlib.suppress(OSError, KeyError):
                box.cgroup = self._cgroups.of_process(pid)
        if box.runtime == "runc":
            # runc's devpts instance draws on the host's kernel.pty.max (gVisor's terminals
            # are its own): bounded before the guest, the first code of the sandbox's, starts.
            if not pid:
                raise SandboxStartError("docker named no process for the sandbox's container")
            await asyncio.to_thread(cap_ptys, pid, self.settings.max_ptys, DOCKER_OPTIONS)
            # So are its socket buffers on cgroup v1, which Docker leaves uncharged there
            # (gVisor's sockets are the sentry's own memory).
            if box.cgroup is not None:
                try:
                    box.cgroup.cap_socket_buffers(box.memory_bytes)
                except OSError as exc:
                    raise SandboxStartError(
                        f"could not bound the sandbox's socket buffers: {exc}"
                    ) from exc

    async def _exec_guest(
        self, client: docker.DockerClient, box: _Box, spec: GuestSpec
    ) -> ExecGuest:
        return await start_exec(
            client,
            box.container_id,
            guest_argv(),
            user=box.user,
            environment=guest_env(spec.env),
            workdir=WORKSPACE_INSIDE,
        )

    async def _end_guest(self, box: _Box) -> None:
        """Kill the guest and everything the sandbox started, keeping the container."""
        if box.guest is not None:
            box.guest.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(box.guest.wait(), 5.0)
            box.guest = None
        client = await self._ready()
        if box.runtime == "runsc":
            # The next guest's key is secret only if no process of the sandbox's is left to
            # read it off the new supervisor's stdin (gVisor lets it open /proc/<pid>/fd).
            # gVisor's kill(-1) misses a process that is forking at that moment, so chains
            # of forks outlived it (found by a red-team run); a new sentry leaves nothing.
            await self._restart_container(client, box)
            return
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self._kill_inside, client, box), KILL_TIMEOUT_S
            )
        except Exception as exc:
            # A full pids table can refuse even our exec; restarting the container is sure.
            log.info("restarting container", sandbox=box.sandbox_id, reason=repr(exc))
            await self._restart_container(client, box)
            return
        if box.cgroup is not None:
            await asyncio.to_thread(box.cgroup.wait_for_headroom, GUEST_PIDS_HEADROOM)

    def _kill_inside(self, client: docker.DockerClient, box: _Box) -> None:
        container = client.containers.get(box.container_id)
        if container.status != "running":
            raise SandboxError(f"container is {container.status}")
        created = client.api.exec_create(box.container_id, KILL_ALL, user=box.user)
        client.api.exec_start(created["Id"])
        code = client.api.exec_inspect(created["Id"]).get("ExitCode")
        if code not in (0, None):
            raise SandboxError(f"kill exited {code}")

    async def _restart_container(self, client: docker.DockerClient, box: _Box) -> None:
        await self._observe(box, ended=True)
        box.oom_base, box.pids_base = box.oom_kills(), box.pids_limit_hits()
        container = await asyncio.to_thread(client.containers.get, box.container_id)
        await asyncio.to_thread(container.restart, timeout=0)
        await self._after_start(client, box)

    async def started(self, sandbox_id: str) -> None:
        """Nothing was relaxed for the start: the container starts under its CPU quota. At the
        default 0.5 cores a start under 1 core was no faster on bubblewrap (BENCHMARKS.md),
        and a change after start would be one more call to the daemon per create."""

    async def halt(self, sandbox_id: str) -> None:
        """Removing the container is what ends its processes: it is done here, on the
        destroy's path (a kill first would be one more call to the daemon); the volume's
        directory goes in :meth:`stop`."""
        box = self._boxes.get(sandbox_id)
        if box is not None and not box.removed:
            await self._remove(box, sandbox_id)
            box.removed = True
            # Its named volumes are free once it has halted (the manager's lease ends
            # then): the container's gone, so their last mount is this one.
            self._detach_volumes(box.root)

    async def stop(self, sandbox_id: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is None or not box.removed:
            await self._remove(box, sandbox_id)
        root = box.root if box is not None else self.sandboxes_dir / sandbox_id
        self._detach_volumes(root)
        await remove_sandbox_disk(root)
        if box is not None and box.uid_lock_fd is not None:
            release(box.uid_lock_fd)  # only once nothing of the sandbox's is left
            box.uid_lock_fd = None

    @staticmethod
    def _detach_volumes(root: Path) -> None:
        """Unmount the named volumes bound from ``root`` (by name: their files are never a
        teardown's to remove)."""
        for point in root.glob("vol-*"):
            mountns.detach(str(point), missing_ok=True)

    async def _remove(self, box: _Box | None, sandbox_id: str) -> None:
        if box is not None and box.guest is not None:
            box.guest.kill()
        client = await self._ready()
        await asyncio.to_thread(self._remove_container, client, sandbox_id)

    def _remove_container(self, client: docker.DockerClient, sandbox_id: str) -> None:
        """Remove the sandbox's container by force, and make sure it is gone."""
        import docker.errors

        for attempt in range(REMOVE_ATTEMPTS):
            found = self._containers(client, sandbox_id)
            if not found:
                return
            for container in found:
                with contextlib.suppress(docker.errors.NotFound):
                    try:
                        container.remove(force=True, v=True)
                    except docker.errors.APIError as exc:  # e.g. removal already in progress
                        log.info("container removal retried", sandbox=sandbox_id, error=str(exc))
            if attempt:
                time.sleep(0.2 * attempt)
        if self._containers(client, sandbox_id):
            raise SandboxError(
                f"docker did not remove the container of {sandbox_id}; it will be swept at the "
                "next start"
            )

    def _containers(self, client: docker.DockerClient, sandbox_id: str | None) -> list[Container]:
        labels = [f"{LABEL_INSTANCE}={self.instance}"]
        if sandbox_id is not None:
            labels.append(f"{LABEL_SANDBOX}={sandbox_id}")
        return labelled(client, labels)

    async def usage(self, sandbox_id: str, *, full: bool = True) -> ResourceUsage:
        box = self._boxes.get(sandbox_id)
        if box is None:
            return ResourceUsage()
        usage = await self._observe(box, full=full)
        usage.oom_kills = box.oom_kills()
        usage.pids_limit_hits = box.pids_limit_hits()
        if full and box.disk_capped:
            usage.disk_used_bytes = disk_used_bytes(box.workspace)
        return usage

    async def _observe(
        self, box: _Box, *, full: bool = False, ended: bool = False
    ) -> ResourceUsage:
        """Read the incarnation's cgroup into the box's counters; once its guest has ended
        (or ``ended``: it is being restarted), learn from Docker how the container ended.

        Under gVisor a limit can end the whole sandbox, and its cgroup, counters and all,
        goes with it: a kill the cgroup showed before it went is kept in ``*_seen``, and
        one it never showed is Docker's ``OOMKilled`` or the sentry's exit status.
        """
        usage = ResourceUsage()
        if box.cgroup is not None:
            if full:
                usage = box.cgroup.usage()
            else:
                usage.oom_kills = box.cgroup.oom_kills()
                usage.pids_limit_hits = box.cgroup.pids_limit_hits()
            box.oom_seen = max(box.oom_seen, usage.oom_kills)
            box.pids_seen = max(box.pids_seen, usage.pids_limit_hits)
        guest_ended = box.guest is not None and box.guest.ended
        if (ended or guest_ended) and not box.end_known:
            box.end_known, box.end_cause = await self._end_of(box)
        return usage

    async def _end_of(self, box: _Box) -> tuple[bool, str | None]:
        """Whether the container has ended (as far as Docker knows yet), and which limit
        ended it, if one did.

        The guest's stream can close before Docker has seen the container exit: when its
        cgroup is already gone, the container is ending, and we wait for Docker to say so.
        """
        deadline = asyncio.get_running_loop().time() + END_WAIT_S
        while True:
            running, cause = await self._exit_cause(box)
            if not running:
                return True, cause
            cgroup_gone = box.cgroup is not None and not any(
                d.exists() for d in box.cgroup.dirs.values()
            )
            if not cgroup_gone or asyncio.get_running_loop().time() > deadline:
                return False, None
            await asyncio.sleep(0.05)

    async def _exit_cause(self, box: _Box) -> tuple[bool, str | None]:
        """Whether the container still runs, and which limit ended it if it does not.

        A memory overrun shows as ``OOMKilled``. Under gVisor (ptrace platform) every
        sandboxed process has host stub processes, which a fork bomb multiplies until the
        host pids limit refuses the sentry a thread; Go's runtime then exits with status 2
        (measured: within 2 s of `:(){ :|:& };:`, with RLIMIT_NPROC at 256 and the host
        limit 770; without a host limit the stubs passed 5,000).
        """
        client = await self._ready()
        try:
            container = await asyncio.to_thread(client.containers.get, box.container_id)
        except Exception:
            return False, None  # gone: nothing more to learn
        state = container.attrs.get("State", {})
        if state.get("Running"):
            return True, None
        if state.get("OOMKilled"):
            return False, "memory"
        if box.runtime == "runsc" and state.get("ExitCode") == RUNSC_THREAD_EXHAUSTED:
            return False, "pids"
        return False, None

    def workspace_on_host(self, sandbox_id: str) -> Path | None:
        workspace, _ = disk_paths(self.sandboxes_dir / sandbox_id)
        return workspace if workspace.is_dir() else None

    async def sweep(self, keep: Collection[str]) -> list[str]:
        client = await self._ready()
        keep_ids = set(keep) | set(self._boxes)
        containers = await asyncio.to_thread(self._containers, client, None)
        found = {c.labels.get(LABEL_SANDBOX, "") for c in containers} - {""}
        with contextlib.suppress(FileNotFoundError):
            found.update(p.name for p in self.sandboxes_dir.iterdir() if p.is_dir())
        removed = sorted(found - keep_ids)
        for sandbox_id in removed:
            await self.stop(sandbox_id)
        return removed

    async def close(self) -> None:
        for box in self._boxes.values():
            if box.guest is not None:
                box.guest.kill()
            if box.uid_lock_fd is not None:
                unlock(box.uid_lock_fd)  # as bubblewrap's: the process may live on
        self._boxes.clear()
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None
