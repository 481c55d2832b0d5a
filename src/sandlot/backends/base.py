"""The backend contract: how to start, talk to, measure and destroy one isolated guest.

A backend knows nothing of TTLs, owners, pools or persistence; that is the manager's job.
Every backend runs the same guest agent (``sandlot/guest/``, started as :mod:`.launch` says)
and hands back its stdio as a :class:`GuestProcess`; each says through :meth:`Backend.probe`
whether this host can run it (``sandlot doctor`` and the test suite ask every backend so).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import signal
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

from sandlot.config import Settings
from sandlot.errors import BackendUnavailable
from sandlot.models import VOLUME_ROOT, ResolvedLimits, ResourceUsage

STDERR_TAIL_BYTES = 8192
# Process slots a restarted guest needs free in its pids cgroup to start and run a command.
GUEST_PIDS_HEADROOM = 32


# An instance directory's lock file, held exclusively by its manager for its life
# (core/instances.py); here so that a backend can tell a dead instance's leftovers.
INSTANCE_LOCK = "lock"


def lock_held(fd: int) -> bool:
    """Whether a process holds the ``flock`` of the file open at ``fd`` (probed with a
    shared lock, which ``fd``'s close gives back)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def instance_dead(instance_dir: Path) -> bool:
    """Whether the manager of ``instance_dir`` is known to be dead: its lock file is there
    and no process holds it. False where it is held, or where there is no lock to look at
    (a path of another host or mount namespace, an instance being removed): not ours to
    judge."""
    try:
        fd = os.open(instance_dir / INSTANCE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not lock_held(fd)
    finally:
        os.close(fd)


def instance_of(data_dir: Path) -> str:
    """A short name for a data directory: what marks its sandboxes' cgroups and containers."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Check:
    """One finding about the host: what was looked at, whether it is there, and why it matters."""

    name: str
    ok: bool
    detail: str
    why: str
    required: bool = True  # its backend cannot run without it


@dataclass(frozen=True)
class AttachedVolume:
    """A named volume for a backend to attach: its image on the host (``core/volumes.py``
    holds it for this sandbox alone) and where it goes inside."""

    image: Path
    mount_path: str  # absolute, under /workspace (models.VolumeMount)
    read_only: bool = False

    @property
    def relative_path(self) -> str:
        return self.mount_path.removeprefix(VOLUME_ROOT + "/")


@dataclass(frozen=True)
class GuestSpec:
    """What the manager asks a backend for."""

    sandbox_id: str
    limits: ResolvedLimits
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    environment: str = "python3"  # a name from the YAML registry (sandlot.environments)
    runtime: str | None = None  # the OCI runtime, for backends that have a choice (docker)
    # Whose sandbox it is: its owner, or None for a pooled one not yet claimed. What it may
    # share with other sandboxes is bounded by it (the bubblewrap backend's guest templates).
    tenant: str | None = None
    volumes: tuple[AttachedVolume, ...] = ()


def require_volumes(backend: Backend, runtime: str | None) -> None:
    """Raise unless ``backend`` (with ``runtime``) can attach named volumes on this host.

    Raises:
        BackendUnavailable: it cannot, saying why.
    """
    ok, why = backend.volumes_available(runtime)
    if not ok:
        raise BackendUnavailable(
            f"named volumes are not available on the {backend.name} backend here: {why}"
        )


class Guest(Protocol):
    """A running guest: the stream pair the framed protocol runs over, and its end."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def kill(self) -> None:
        """Cut the guest off now (idempotent); the backend's stop/start ends what is inside."""
        ...

    async def wait(self) -> int:
        """Its exit status once it has ended."""
        ...

    def stderr_tail(self) -> str:
        """The last few KiB it wrote to stderr: why it failed to start, if it did."""
        ...


def kill_by_pidfd(pidfd: int) -> None:
    """SIGKILL to the process ``pidfd`` names. One that has exited, collected or not, cannot
    be signalled, and a pidfd never names another: nothing to do then."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


class StderrTail:
    """The last :data:`STDERR_TAIL_BYTES` a guest wrote to stderr: why it failed to start,
    if it did (kept small: for that only)."""

    def __init__(self) -> None:
        self._tail = bytearray()

    async def collect(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(4096):
            self.add(chunk)

    def add(self, chunk: bytes) -> None:
        self._tail += chunk
        del self._tail[:-STDERR_TAIL_BYTES]

    def text(self) -> str:
        return self._tail.decode("utf-8", "replace").strip()


class GuestProcess:
    """A running guest reached through a local subprocess's stdio (bwrap, docker exec, ...).

    asyncio's child watcher must be the only one to collect its exit status: ``Popen.kill()``
    polls (``waitpid``) first, and a status collected there is lost to asyncio, which then
    logs "Unknown child process" or "exit status already read" and reports 255. So it is
    signalled through a pidfd opened at spawn, which never reaps and, unlike a pid, cannot
    name another process once the guest is gone.
    """

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.reader: asyncio.StreamReader = process.stdout
        self.writer: asyncio.StreamWriter = process.stdin
        self._pidfd = open_child_pidfd(process.pid)
        self._stderr = StderrTail()
        self._stderr_task = (
            asyncio.create_task(self._stderr.collect(process.stderr))
            if process.stderr is not None
            else None
        )

    def stderr_tail(self) -> str:
        return self._stderr.text()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def close_stdin(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    def detach(self) -> None:
        self._close_pidfd()

    def kill(self) -> None:
        if self._pidfd is None:
            return
        kill_by_pidfd(self._pidfd)
        # SIGKILL cannot be caught, so one is enough: the fd is not needed any more.
        self._close_pidfd()

    async def wait(self) -> int:
        code = await self.process.wait()
        self._close_pidfd()
        if self._stderr_task is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._stderr_task
        return code

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def open_child_pidfd(pid: int) -> int | None:
    """A pidfd for our child ``pid``, or None if it has already been collected.

    The child may have exited, and asyncio's watcher may have collected it, before this runs
    (bwrap failing at once, say); its pid may then be someone else's already. ``waitid`` on
    the pidfd with WNOWAIT (which collects nothing) answers only for a child of ours that is
    not yet collected, so the pidfd is kept only if it names the guest.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        os.close(pidfd)
        return None
    return pidfd


@runtime_checkable
class Backend(Protocol):
    """The few verbs every isolation backend implements."""

    name: ClassVar[str]
    # Whether the backend can give a sandbox any registry environment (an image), or only
    # the host's own root file system (the "python3" environment).
    any_environment: ClassVar[bool]
    # OCI runtimes it can be asked for; empty when it has no such choice.
    runtimes: ClassVar[frozenset[str]]

    def __init__(self, settings: Settings) -> None:
        """Cheap: no host check or set-up happens before the first call that needs it."""
        ...

    @classmethod
    def probe(cls, settings: Settings, runtime: str | None = None) -> list[Check]:
        """Whether this host can run the backend (with ``runtime``, or the default one), as
        checks; starts no sandbox and needs no instance."""
        ...

    async def start(self, spec: GuestSpec) -> Guest:
        """Provision the sandbox if new, end any previous guest of it, start a fresh guest.

        The workspace survives a restart of the guest; only a :meth:`stop` removes it.

        Raises:
            BackendUnavailable: this host cannot run the backend.
            SandboxStartError: the guest could not be started.
        """
        ...

    async def started(self, sandbox_id: str) -> None:
        """The guest :meth:`start` gave said it is ready: put in place what was relaxed for
        its start (a CPU quota). Called before the sandbox gets any request.

        Raises:
            SandboxStartError: the sandbox could not be given its limits (it must then be
                stopped, not used).
        """
        ...

    async def halt(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox now: none of its code runs once this returns.

        What it holds (its files, cgroup, network) stays until :meth:`stop`, which the
        manager runs after a destroy has returned (:mod:`sandlot.core.teardown`). A backend
        whose removal is one step may do it all here.
        """
        ...

    async def stop(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox and remove all it had (idempotent)."""
        ...

    async def usage(self, sandbox_id: str, *, full: bool = True) -> ResourceUsage:
        """Current resource use and limit hits (OOM kills, pids-limit hits) so far.

        With ``full=False`` only ``oom_kills`` and ``pids_limit_hits`` need be filled: the
        manager reads those after every call, so they must be cheap.
        """
        ...

    async def sweep(self, keep: Collection[str]) -> list[str]:
        """Remove every sandbox of this backend instance not in ``keep``; return their ids."""
        ...

    def volumes_available(self, runtime: str | None = None) -> tuple[bool, str]:
        """Whether this backend (with ``runtime``) can attach named volumes on this host,
        and why not (``GuestSpec.volumes``; a backend that cannot refuses a spec with any)."""
        ...

    def workspace_on_host(self, sandbox_id: str) -> Path | None:
        """Where the sandbox's /workspace lies on the host while its files are still there
        (a crashed manager's orphan, before the sweep), or None. The caller reads it as
        hostile: no symlink followed, regular files only."""
        ...

    async def close(self) -> None:
        """Release what the backend holds itself (not the sandboxes)."""
        ...
