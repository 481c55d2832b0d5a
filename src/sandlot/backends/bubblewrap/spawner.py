"""The manager's side of the spawner (``spawner_server.py``): bwrap started without a shell.

As root with the mount API and a guest template (the default), a create's launcher was
``sh`` (into the cgroup, then a wait for "go"), ``nsenter`` (into the launch and network
namespaces, down to the sandbox's uid) and bwrap, a subprocess of the manager's. Now one
long-lived root process, the spawner, forks and does the same steps in its child, which execs
bwrap: two execs fewer a create, and the manager's event loop no longer runs a subprocess's
machinery (a watcher thread, three pipe transports) for it. The client is the template's
(:class:`~sandlot.backends.bubblewrap.template.Template`: the same protocol, a fork per
request, replies and exits); the chain it starts is a :class:`SpawnedChain`.

Where the spawner cannot start (no python for it, say), creates go on with the launchers
(``backend.py``), once warned.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
from pathlib import Path

import structlog

from sandlot.backends.base import StderrTail
from sandlot.backends.bubblewrap.spawner_server import MAX_MESSAGE
from sandlot.backends.bubblewrap.template import Template
from sandlot.errors import SandboxStartError

log = structlog.get_logger(__name__)

SERVER = Path(__file__).with_name("spawner_server.py")
START_TIMEOUT_S = 15.0
# The spawner could not be started for now, not for good: the next create tries again.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})
STDERR_EOF_WAIT_S = 1.0


class Spawner:
    """One spawner process per backend, started on first use."""

    def __init__(self) -> None:
        self._client: Template | None = None
        self._failed = False
        self._lock = asyncio.Lock()

    async def get(self) -> Template | None:
        """The running spawner, or None where it could not start (the launchers then)."""
        if self._client is not None and self._client.alive:
            return self._client
        async with self._lock:
            if self._failed:
                return None
            if self._client is None or not self._client.alive:
                client = Template("spawner", max_message=MAX_MESSAGE, called="the spawner")
                # -I -S: nothing of the environment's or of site-packages runs as root.
                argv = [sys.executable, "-I", "-S", str(SERVER), str(os.getpid())]
                try:
                    await client.start(argv, START_TIMEOUT_S)
                except (SandboxStartError, OSError) as exc:
                    # An interpreter gone (a venv rebuilt under a running manager) or none to
                    # name (an embedded one) for good; a process or fd short for this create.
                    transient = isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS
                    log.warning(
                        "no spawner: sandboxes start through sh and nsenter",
                        error=str(exc),
                        retried=transient,
                    )
                    self._failed = not transient
                    return None
                self._client = client
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class SpawnedChain:
    """bwrap, the spawner's child: killed by a pidfd, its end told by the spawner, its stdin
    a pipe of ours (bwrap's child waits at ``--block-fd 0`` until it is killed; at our EOF,
    the manager gone, it runs the placeholder and ends), its stderr's tail kept."""

    def __init__(self, spawner: Template, pid: int, pidfd: int, stdin_w: int, stderr_r: int):
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._stdin_w: int | None = stdin_w
        self._exit = spawner.exit_of(pid)
        self._stderr = StderrTail()
        self._stderr_r: int | None = stderr_r
        loop = asyncio.get_running_loop()
        self._stderr_eof: asyncio.Future[None] = loop.create_future()
        os.set_blocking(stderr_r, False)
        loop.add_reader(stderr_r, self._read_stderr)

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    def stderr_tail(self) -> str:
        return self._stderr.text()

    def _read_stderr(self) -> None:
        assert self._stderr_r is not None
        try:
            chunk = os.read(self._stderr_r, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._stderr.add(chunk)
            return
        self._close_stderr()

    def _close_stderr(self) -> None:
        if self._stderr_r is not None:
            asyncio.get_running_loop().remove_reader(self._stderr_r)
            os.close(self._stderr_r)
            self._stderr_r = None
        if not self._stderr_eof.done():
            self._stderr_eof.set_result(None)

    def go(self) -> None:
        """Nothing to let go: the spawner's child runs on at once (its steps before bwrap
        are done by the time the request is sent)."""

    def close_stdin(self) -> None:
        if self._stdin_w is not None:
            os.close(self._stdin_w)
            self._stdin_w = None

    def kill(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self.detach()

    def detach(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def wait(self) -> int:
        code = await asyncio.shield(self._exit)
        self.detach()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STDERR_EOF_WAIT_S):
                await asyncio.shield(self._stderr_eof)
        self._close_stderr()
        self.close_stdin()
        return code


async def spawn_chain(
    spawner: Template,
    argv: list[str],
    *,
    env: dict[str, str],
    cgroup_files: list[Path],
    namespaces: dict[str, int],
    passed: dict[int, int],
    uid: int,
) -> SpawnedChain:
    """Ask ``spawner`` for ``argv`` run in the cgroup of ``cgroup_files``, in ``namespaces``
    (name -> fd: "mnt", "net"), as ``uid`` (its group too), with ``passed`` (fd number in
    ``argv`` -> our fd) and fresh pipes for stdin and stderr (stdout: /dev/null). The
    caller closes the fds it passed.

    Raises:
        TemplateGone: the spawner ended.
        SandboxStartError: it could not fork.
    """
    mine: list[int] = []
    theirs: list[int] = []
    try:
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        mine.append(stdin_w)
        theirs.append(stdin_r)
        theirs.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        mine.append(stderr_r)
        theirs.append(stderr_w)
        request = {
            "argv": argv,
            "env": env,
            "cgroup_files": [str(p) for p in cgroup_files],
            "ns": list(namespaces),
            "uid": uid,
            "gid": uid,
            "targets": list(passed),
        }
        pid, pidfd = await spawner.spawn(request, [*theirs, *namespaces.values(), *passed.values()])
    except BaseException:
        for fd in mine:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return SpawnedChain(spawner, pid, pidfd, stdin_w, stderr_r)
