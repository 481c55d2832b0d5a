"""What a guest template forks for one sandbox, as the manager holds it: the sandbox's bwrap
(:func:`launch_bwrap`, held as a :class:`TemplateChain`) and its guest (:func:`join_guest`, a
:class:`TemplateGuest`), and the fds handed over with each request (sealed memfds, the
namespaces of bwrap's blocked child). The template processes themselves are
:mod:`sandlot.backends.bubblewrap.template`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import select
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sandlot.backends.base import StderrTail, kill_by_pidfd
from sandlot.backends.bubblewrap.template import Chain, Template
from sandlot.backends.mountns import parent_of
from sandlot.backends.pipes import PipeReader, PipeWriter
from sandlot.errors import SandboxStartError
from sandlot.guest.template import NS_NAMES


class TemplateGuest:
    """A guest forked by a template: its stdio are pipes the manager made, its end is told
    by the template (its parent), and it is killed through a pidfd the template opened."""

    def __init__(
        self,
        template: Template,
        pid: int,
        pidfd: int,
        stdin_w: int,
        stdout_r: int,
        stderr_r: int,
        chain: Chain,
        blocked: int,
    ) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._exit = template.exit_of(pid)
        self._chain = chain  # bwrap (the template's launcher, or sh and nsenter before it)
        self._blocked: int | None = blocked  # a pidfd of bwrap's child, at its --block-fd
        self._stdin_w, self._stdout_r, self._stderr_r = stdin_w, stdout_r, stderr_r
        self._stderr = StderrTail()
        self._stderr_task: asyncio.Task[None] | None = None
        self._pipes: list[PipeReader | PipeWriter] = []
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    def connect(self) -> None:
        """The stream pair over the guest's pipes, and its stderr's collector. Each pipe is
        owned by its transport once made (:mod:`sandlot.backends.pipes`: closed once, on the
        loop, whatever the loop), and closed here if the rest fails."""
        fds = [self._stdout_r, self._stdin_w, self._stderr_r]
        try:
            self.reader = asyncio.StreamReader(limit=1 << 20)
            self._pipes.append(PipeReader(self._stdout_r, self.reader))
            protocol = asyncio.streams.FlowControlMixin()
            write = PipeWriter(self._stdin_w, protocol)
            self._pipes.append(write)
            self.writer = asyncio.StreamWriter(write, protocol, None, asyncio.get_running_loop())
            stderr = asyncio.StreamReader(limit=1 << 16)
            self._pipes.append(PipeReader(self._stderr_r, stderr))
        except BaseException:
            self._close_pipes()
            for fd in fds[len(self._pipes) :]:
                os.close(fd)
            raise
        self._stderr_task = asyncio.create_task(self._stderr.collect(stderr))

    def _close_pipes(self) -> None:
        """Its stdio closed: the guest is gone, and nothing is left for a collector."""
        for pipe in self._pipes:
            if isinstance(pipe, PipeWriter):
                pipe.abort()
            else:
                pipe.close()

    def stderr_tail(self) -> str:
        return self._stderr.text()

    def kill(self) -> None:
        if self._pidfd is not None:
            kill_by_pidfd(self._pidfd)  # kept open: wait() watches it, and closes it
        self._chain.kill()
        self.release_bwrap()

    def release_bwrap(self) -> None:
        """bwrap's child, blocked since it made the namespaces, is killed (and bwrap ends with
        it): the guest holds them now. Its stdin is closed too."""
        if self._blocked is not None:
            kill_by_pidfd(self._blocked)
            os.close(self._blocked)
            self._blocked = None
        self._chain.close_stdin()
        # bwrap ends with its child; what is left of it is in the sandbox's cgroup, which a
        # destroy empties: its pidfd is not held for the sandbox's life.
        self._chain.detach()

    async def wait(self) -> int:
        """Its exit status, as the template (its parent) reports it; once the guest is gone
        by its pidfd, the report is given a second more, and -SIGKILL stands in if it never
        comes: a report lost would otherwise hang a create that waits for its guest with no
        deadline (``core/live.py``)."""
        try:
            try:
                code = await _ended(self._exit, self._pidfd)
            finally:
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
            self.release_bwrap()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await self._chain.wait()
            if self._stderr_task is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await self._stderr_task
        finally:
            self._close_pipes()  # a wait cut short by its caller's deadline too
        return code


async def _ended(exit_report: asyncio.Future[int], pidfd: int | None) -> int:
    """A template's child's exit status, once it is gone: as the template reports it, or,
    once its ``pidfd`` is readable, the report given a second more and -SIGKILL standing in
    if it never comes."""
    if not exit_report.done() and pidfd is not None:
        await _gone(exit_report, pidfd)
    if not exit_report.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exit_report), 1.0)
    return exit_report.result() if exit_report.done() else -signal.SIGKILL


async def _gone(exit_report: asyncio.Future[int], pidfd: int) -> None:
    """Until the template reports the child's end or its ``pidfd`` is readable."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[int] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(0)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait({exit_report, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(pidfd)


class TemplateChain:
    """A sandbox's bwrap, forked by a template as its launcher (``launcher`` in the guest's
    template.py) instead of started by the manager through sh and nsenter: its end is told
    by the template (its parent), it is killed through a pidfd the template opened, and its
    stderr is read only when asked (a failure's reason), not watched."""

    def __init__(
        self, template: Template, pid: int, pidfd: int, stdin_w: int, stderr_r: int
    ) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._exit = template.exit_of(pid)
        self._stdin_w: int | None = stdin_w  # bwrap's --block-fd: its child goes on at EOF
        self._stderr_r: int | None = stderr_r
        os.set_blocking(stderr_r, False)
        self._stderr = StderrTail()

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    def kill(self) -> None:
        if self._pidfd is not None:
            kill_by_pidfd(self._pidfd)

    def close_stdin(self) -> None:
        if self._stdin_w is not None:
            os.close(self._stdin_w)
            self._stdin_w = None

    def detach(self) -> None:
        """Its pidfd and its stderr closed: nothing of it is held for the sandbox's life
        (admission counts a sandbox's fds)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._stderr_r is not None:
            os.close(self._stderr_r)
            self._stderr_r = None

    def stderr_tail(self) -> str:
        """What it wrote to stderr so far (at most :data:`STDERR_TAIL_BYTES` kept)."""
        while self._stderr_r is not None:
            try:
                chunk = os.read(self._stderr_r, 4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._stderr.add(chunk)
        return self._stderr.text()

    async def wait(self) -> int:
        try:
            return await _ended(self._exit, self._pidfd)
        finally:
            self.stderr_tail()  # kept for a caller that asks after the end
            self.detach()
            self.close_stdin()


@contextlib.contextmanager
def handed_over(mine: list[int], theirs: list[int]) -> Iterator[None]:
    """The fds made for one request: ``theirs`` (sent with it) are closed once it is sent or
    has failed; ``mine`` (the ends kept) only if it failed."""
    try:
        yield
    except BaseException:
        for fd in mine:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)


async def join_guest(
    template: Template,
    chain: Chain,
    pid: int,
    config: dict[str, Any],
    enter_files: list[Path],
    timeout_s: float,
) -> TemplateGuest:
    """Ask ``template`` for a sandbox's guest, joined into the namespaces of bwrap's
    blocked child ``pid`` (the child of ``chain``'s bwrap), given ``config`` (sealed in a
    memfd) and the cgroup's ``enter_files``; return once it has attached its /proc (the
    host's masks go over it next). Its stdio are pipes made here.

    Raises:
        SandboxStartError: it could not be asked, or ended before it joined (the reason it
            gave on stderr).
    """
    mine: list[int] = []  # the ends the manager keeps: stdin_w, stdout_r, stderr_r, notify_r
    theirs: list[int] = []  # the ends the guest gets, closed here once sent
    with handed_over(mine, theirs):
        namespaces, blocked = namespace_fds(pid, chain.pid)
        theirs += namespaces
        mine.append(blocked)  # bwrap's child, checked to be chain's: killed once the guest is in
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        mine.append(stdin_w)
        theirs.append(stdin_r)
        for _ in range(3):  # stdout, stderr, notify: the guest writes, the manager reads
            r, w = os.pipe2(os.O_CLOEXEC)
            mine.append(r)
            theirs.append(w)
        theirs.append(sealed_config(config))
        _open_into(theirs, enter_files, os.O_WRONLY, "the sandbox's guest could not join it")
        guest_pid, pidfd = await template.spawn({"cgroup_files": len(enter_files)}, theirs)
    blocked, stdin_w, stdout_r, stderr_r, notify_r = mine
    guest = TemplateGuest(template, guest_pid, pidfd, stdin_w, stdout_r, stderr_r, chain, blocked)
    try:
        try:
            guest.connect()
        except BaseException:
            os.close(notify_r)
            raise
        await _joined(guest, notify_r, timeout_s)
    except BaseException:
        # Nobody else holds it: it is waited for here, which closes its pidfd (a create
        # cancelled while its guest joined left one open each time: a red team's side
        # find). In this task, as the launcher is, not in a task of its own that could
        # outlive the create and its event loop.
        guest.kill()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await guest.wait()
        raise
    return guest


async def launch_bwrap(
    template: Template,
    argv: list[str],
    env: dict[str, str],
    uid: int,
    launch_ns: str,
    net_ns: str | None,
    enter_files: list[Path],
    seccomp_r: int,
    info_w: int,
) -> TemplateChain:
    """Start a sandbox's bwrap (``argv``, whose seccomp and info fds are
    :data:`LAUNCH_SECCOMP_FD` and :data:`LAUNCH_INFO_FD`) from ``template``: its launcher
    enters the cgroup (``enter_files``), the network namespace ``net_ns`` if any and the mount
    namespace ``launch_ns``, drops to ``uid`` and execs it with ``env``. ``seccomp_r`` and
    ``info_w`` are handed over (closed here). bwrap's child waits at its --block-fd until
    :meth:`TemplateChain.close_stdin`.

    Raises:
        SandboxStartError: it could not be asked, or could not fork.
    """
    mine: list[int] = []  # the ends the manager keeps: bwrap's stdin_w and stderr_r
    theirs: list[int] = [seccomp_r, info_w]  # closed here once sent
    with handed_over(mine, theirs):
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        mine.append(stdin_w)
        theirs.append(stdin_r)
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        mine.append(stderr_r)
        theirs.append(stderr_w)
        launch = sealed_config({"uid": uid, "argv": argv, "env": env})
        theirs.append(launch)
        failed = "the sandbox's launcher failed"
        namespaces = [launch_ns] + ([net_ns] if net_ns is not None else [])
        mnt, *net = _open_into(theirs, namespaces, os.O_RDONLY, failed)
        # The order the launcher reads (guest/template.py LAUNCH_FDS).
        fds = [mnt, stdin_r, stderr_w, seccomp_r, info_w, launch, *net]
        fds += _open_into(theirs, enter_files, os.O_WRONLY, failed)
        request = {"launch": True, "net": net_ns is not None, "cgroup_files": len(enter_files)}
        pid, pidfd = await template.spawn(request, fds)
    return TemplateChain(template, pid, pidfd, stdin_w, stderr_r)


def _open_into(
    theirs: list[int], paths: Iterable[str | Path], flags: int, failed: str
) -> list[int]:
    """``paths`` opened (``flags``, close-on-exec), each fd put in ``theirs`` as it is
    opened, so that a later failure closes it (``handed_over``); the fds, in order.

    Raises:
        SandboxStartError: one could not be opened (``failed``, then why).
    """
    opened = []
    for path in paths:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxStartError(f"{failed}: {exc}") from exc
        theirs.append(fd)
        opened.append(fd)
    return opened


async def _joined(guest: TemplateGuest, notify_r: int, timeout_s: float) -> None:
    """Wait for the guest's byte on ``notify_r`` (closed here, whatever comes).

    Raises:
        SandboxStartError: it ended first; the reason it gave on stderr.
    """
    if await _notified(notify_r, timeout_s):
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(guest.wait(), 2.0)
    why = guest.stderr_tail() or "it ended"
    raise SandboxStartError(f"the sandbox's guest could not join it: {why}")


async def _notified(fd: int, timeout_s: float) -> bool:
    """Whether a byte came on ``fd`` within ``timeout_s`` (False: EOF, or nothing); closes it.
    Watched by the event loop: a thread's turn to poll it cost more than the wait."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(fd, ready)
    try:
        async with asyncio.timeout(timeout_s):
            await readable
        return os.read(fd, 1) == b"1"  # readable: a byte, or EOF, at once
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def sealed_config(config: dict[str, Any]) -> int:
    """A memfd holding ``config`` as JSON (:func:`sealed_memfd`): the guest's config travels
    beside the request, never in it, so the template never holds it (template.py)."""
    return sealed_memfd("sandlot-guest-config", json.dumps(config).encode())


def sealed_memfd(name: str, data: bytes) -> int:
    """A memfd holding ``data``, sealed against any change, read from its start by whoever
    gets it. The caller closes the fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)  # the offset is shared with the fd's receivers
    except BaseException:
        os.close(fd)
        raise
    return fd


def namespace_fds(pid: int, parent: int) -> tuple[list[int], int]:
    """Open ``pid``'s namespaces (:data:`NS_NAMES` order); ``pid`` must be ``parent``'s child
    and still alive once they are open, so the files are its and not a reused pid's. Also
    returns the pidfd that check was made through (the caller closes it): a pidfd opened
    later by pid could name another process.

    Raises:
        SandboxStartError: it is not, or is gone.
    """
    pidfd = os.pidfd_open(pid)
    fds: list[int] = []
    try:
        _check_parent(pid, parent)
        for name in NS_NAMES:
            fds.append(os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        _check_alive(pidfd, pid)
    except BaseException:
        for fd in fds:
            os.close(fd)
        os.close(pidfd)
        raise
    return fds, pidfd


def _check_parent(pid: int, parent: int) -> None:
    if parent_of(pid) != parent:
        raise SandboxStartError(f"process {pid} is not the sandbox's first process")


def _check_alive(pidfd: int, pid: int) -> None:
    """A pidfd is readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if poller.poll(0):
        raise SandboxStartError(f"the sandbox's first process {pid} exited")
