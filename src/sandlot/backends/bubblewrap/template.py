"""The host's side of the template guest (:mod:`sandlot.guest.template`, whose docstring says
what a forked guest keeps of the walls): one template process per system (the host's ``/usr``
or an environment's tree), asked for a guest per sandbox, and the guest it gives.

A template is started as root by bwrap, without a user namespace (it must be able to join
the sandboxes' and make a procfs for each one's pid namespace) and with every capability,
in a mount namespace that holds only the sandbox's system, read-only, and the guest's files
at the path sandboxes see them: the modules it imports are the ones a guest started by bwrap
would import, and the paths they know (``/opt/sandlot``) are the sandbox's. It dies with the
manager (bwrap's ``--die-with-parent``, and the EOF of its socket), and its guests with it.

It also starts each of its sandboxes' bwrap (``forks.launch_bwrap``; what it forks for a
sandbox, and how the manager holds each, is :mod:`sandlot.backends.bubblewrap.forks`): a fork
of a process that
is already running costs less than the manager's spawn of ``sh`` and ``nsenter`` (two execs
of dynamically linked programs, ~0.5-1.3 ms of CPU each on this VM: BENCHMARKS.md, issue 13),
and the fork enters the sandbox's cgroup before bwrap runs, as ``sh`` did.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import structlog

from sandlot.backends.base import STDERR_TAIL_BYTES, kill_by_pidfd, open_child_pidfd
from sandlot.errors import SandboxStartError
from sandlot.guest.template import MAX_FDS, MAX_MESSAGE

log = structlog.get_logger(__name__)

MAX_REPORTED_EXITS = 256  # kept for exit_of (Template._reported)

# The template's program: its socket is the fd named in argv[1].
LAUNCHER = (
    "import sys, socket; sys.path.insert(0, %r); import template; "
    "template.serve(socket.socket(fileno=int(sys.argv[1])))"
)


class Chain(Protocol):
    """A sandbox's launcher (bwrap, started by a template's launcher, :class:`TemplateChain`;
    or sh, then nsenter or setpriv, then bwrap: :class:`~sandlot.backends.base.GuestProcess`):
    what a templated guest needs of it."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...

    def close_stdin(self) -> None: ...

    def detach(self) -> None:
        """Never to be killed by us again: its pidfd is closed (one fd less a sandbox)."""

    def stderr_tail(self) -> str: ...


class TemplateGone(SandboxStartError):
    """The template process ended (or never said ready): its system starts guests afresh."""


class Template:
    """One running template process and the requests in flight to it.

    ``identity`` names what it was started from (the tree's directory, or the host's python
    binary, as :func:`system_identity` reads them); once ``identity_now()`` says otherwise (a
    rebuilt tree, an upgraded python) it is stale: it forks no more guests, and it closes
    when its last guest has ended (closing kills them), so that it no longer holds the old
    tree, which the rootfs store removes once nothing runs on it."""

    def __init__(
        self,
        name: str,
        identity: str = "",
        identity_now: Callable[[], str] | None = None,
        system: str = "",
    ) -> None:
        self.name = name  # for logs: the system it serves (and in the tenant scope, whom)
        self.system = system
        self.identity = identity
        self._identity_now = identity_now
        self.retired = False
        # Its last Templates.get or guest's end: the cap closes the one unused the longest.
        self.used_at_s = time.monotonic()
        self._holders = 0  # creates between Templates.get and the end of their spawn
        self._closing: asyncio.Task[None] | None = None
        self._process: asyncio.subprocess.Process | None = None
        # Killed through this, never by asyncio's Process.kill(), which polls (waitpid) first
        # and takes the exit status from asyncio's own watcher: "exit status already read",
        # returncode 255 (CI, 2026-12-06: a manager's close as its template was exiting).
        self._pidfd: int | None = None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[tuple[dict[str, Any], list[int]]]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        # Exits reported before anyone asked for them (exit_of): a child that ends at once is
        # reported right behind its reply, often in the same read, before its spawn's caller
        # runs again (its status was lost to a -SIGKILL: the red team's find). Bounded: a
        # caller cancelled between the two never asks.
        self._reported: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._ready: asyncio.Future[None] | None = None
        self.alive = False

    async def start(self, argv_before_fd: list[str], timeout_s: float) -> None:
        """Start ``argv_before_fd`` + [its socket's fd] and wait for it to say ready.

        Raises:
            TemplateGone: it did not start or say ready within ``timeout_s``.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv_before_fd,
                str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._pidfd = open_child_pidfd(self._process.pid)
        ours.setblocking(False)
        self._sock = ours
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        self.alive = True
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except asyncio.CancelledError:
            # The create that started it was cancelled: that says nothing of the template,
            # and the cancellation goes on (as a TemplateGone it marked the system failed,
            # and the cancelled create went on afresh: the red team's find).
            self._closing = asyncio.ensure_future(self.close())
            raise
        except BaseException as exc:
            why = await self._stderr()
            await self.close()
            raise TemplateGone(f"the guest template did not start: {why or exc!r}") from None

    async def _stderr(self) -> str:
        if self._process is None or self._process.stderr is None:
            return ""
        with contextlib.suppress(Exception):
            self._kill()
            data = await asyncio.wait_for(self._process.stderr.read(STDERR_TAIL_BYTES), 2.0)
            return data.decode("utf-8", "replace").strip()
        return ""

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, MAX_FDS)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._gone()
                return
            try:
                message = json.loads(data)
            except ValueError:
                message = {}
            self._dispatch(message, fds)

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        if message.get("ready") and self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        elif "exit" in message:
            self.used_at_s = time.monotonic()
            pid, status = int(message["exit"]), int(message.get("status", -1))
            future = self._exits.pop(pid, None)
            if future is not None and not future.done():
                future.set_result(status)
            self._reported[pid] = status
            while len(self._reported) > MAX_REPORTED_EXITS:
                self._reported.popitem(last=False)
            self._close_if_done()
        elif "id" in message:
            # Its exit is watched from here, before the next message is read: the template
            # reports a guest killed at once right behind its reply, often in the same read,
            # and a report with no future waiting for it was dropped (a retired template
            # then never closed: the red team's find).
            if isinstance(message.get("pid"), int):
                self._exits[message["pid"]] = asyncio.get_running_loop().create_future()
                self._reported.pop(message["pid"], None)  # an earlier process of that pid
            reply = self._replies.pop(int(message["id"] or 0), None)
            if reply is not None and not reply.done():
                reply.set_result((message, fds))
                return
        for fd in fds:  # nobody is waiting for them
            os.close(fd)

    def _gone(self) -> None:
        """The template ended: every request and every guest's wait is answered."""
        if not self.alive:
            return
        self.alive = False
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        error = TemplateGone(f"the guest template ({self.name}) ended")
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error)
        self._replies.clear()
        # Its guests died with it (their death signal).
        for future in self._exits.values():
            if not future.done():
                future.set_result(-signal.SIGKILL)
        self._exits.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            # Read here: a start cancelled or timed out has nobody left waiting on it, and
            # asyncio logged each such error, traceback and all (the red team's find).
            self._ready.exception()

    def retire(self) -> None:
        """Fork no more guests; close once the last one has ended."""
        self.retired = True
        self._close_if_done()

    def _close_if_done(self) -> None:
        if not self.idle or not self.alive or self._closing is not None:
            return
        if not self.retired and self._identity_now is not None:
            self.retired = self._identity_now() != self.identity
        if self.retired:
            self._closing = asyncio.ensure_future(self.close())

    async def spawn(self, request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        """Ask for one guest; return its pid and a pidfd of it (the caller closes it).

        Raises:
            TemplateGone: the template ended.
            SandboxStartError: the template could not fork the guest.
        """
        if not self.alive or self._sock is None:
            raise TemplateGone(f"the guest template ({self.name}) ended")
        call_id = next(self._ids)
        encoded = json.dumps({**request, "id": call_id}).encode()
        if len(encoded) > MAX_MESSAGE:
            # Read cut short by the template, which could not answer its id: refused here.
            raise SandboxStartError(
                f"the request to the guest template is {len(encoded)} bytes, over the "
                f"{MAX_MESSAGE} it reads"
            )
        reply: asyncio.Future[tuple[dict[str, Any], list[int]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._replies[call_id] = reply
        try:
            await self._send(encoded, fds)
            message, got = await reply
        except BaseException:
            # Cancelled, say: a reply still to come finds nobody waiting, and _dispatch
            # closes its pidfd; one already here is closed now. (The guest it names ends by
            # itself: its stdin is closed with the cancelled join.)
            self._replies.pop(call_id, None)
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                for fd in reply.result()[1]:
                    os.close(fd)
            raise
        if "error" in message or len(got) != 1 or not isinstance(message.get("pid"), int):
            for fd in got:
                os.close(fd)
            raise SandboxStartError(f"the guest template could not fork: {message.get('error')}")
        return message["pid"], got[0]

    @property
    def idle(self) -> bool:
        """No guest of its alive, no request under way, no create holding it."""
        return not (self._exits or self._replies or self._holders)

    def hold(self) -> None:
        """A create is on its way to :meth:`spawn`: not closed on retirement before it is
        done (:meth:`release`). A create that took a template moments before another one
        retired it failed, the template closed under it (the red team's find)."""
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        self._close_if_done()

    async def _send(self, message: bytes, fds: list[int]) -> None:
        """Send one request; a full socket is waited out. Only an error that says the
        template is gone ends it: one request that cannot be sent (too large, bad fds) fails
        alone (a create whose message was too long once took every sandbox of the system
        down with the template: the red team's find)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.alive or self._sock is None:
                raise TemplateGone(f"the guest template ({self.name}) ended")
            try:
                socket.send_fds(self._sock, [message], fds)
            except BlockingIOError:
                await self._writable(loop)
                continue
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
                self._gone()
                raise TemplateGone(f"the guest template ({self.name}) is gone: {exc}") from exc
            except OSError as exc:
                raise SandboxStartError(f"could not ask the guest template: {exc}") from exc
            return

    async def _writable(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
        writable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not writable.done():
                writable.set_result(None)

        fd = self._sock.fileno()
        loop.add_writer(fd, ready)
        try:
            await writable
        finally:
            loop.remove_writer(fd)

    def exit_of(self, pid: int) -> asyncio.Future[int]:
        future = self._exits.get(pid)
        if future is None:  # reported already, or the template is gone
            future = asyncio.get_running_loop().create_future()
            future.set_result(self._reported.pop(pid, -signal.SIGKILL))
        return future

    async def close(self) -> None:
        self._gone()
        if self._process is not None:
            self._kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._process.wait(), 5.0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _kill(self) -> None:
        if self._pidfd is not None:
            kill_by_pidfd(self._pidfd)


class Templates:
    """The running templates, each started on its first use for its ``key`` (a system, a
    tree's path or "host", and in the tenant scope an owner: backend.py); one whose system
    changed since (``identity_now``) is retired and a new one started. A template that would
    not start, of a system none has started on, marks that system failed for its identity
    (said once, in the log: guests start afresh); where one of its system runs, the failure
    is taken as passing, and only that key waits ``RETRY_AFTER_S`` before a new try.

    At most ``max_running`` run or start at once: past it, a template idle (no live guest)
    for ``evict_idle_s`` is closed, the least recently used first, and with none such the
    caller's guest starts afresh: closing one in use a moment ago to start another cost
    three times the CPU of starting afresh when more tenants were busy than the cap (the red
    team's find). Starts of different keys run side by side; a create that finds its key's
    template starting waits for it."""

    RETRY_AFTER_S = 60.0

    def __init__(self, timeout_s: float, max_running: int = 16) -> None:
        self.running: dict[str, Template] = {}
        self.retired: list[Template] = []  # superseded, closing once their guests end
        self.failed: set[str] = set()
        self.max_running = max_running
        self.evict_idle_s = 30.0
        self._timeout_s = timeout_s
        self._starting: dict[str, asyncio.Future[None]] = {}
        self._retry_at: dict[str, float] = {}
        self._said_full = False

    async def get(
        self,
        key: str,
        system: str,
        identity_now: Callable[[], str],
        argv: Callable[[], list[str]],
    ) -> Template | None:
        """The template for ``key``, of ``system``, held (:meth:`Template.hold`): the caller
        releases it once its spawn is done, whatever happened."""
        identity = identity_now()
        while (starting := self._starting.get(key)) is not None:
            await asyncio.shield(starting)  # another create starts it; a cancel ends our wait
        if not identity or f"{system}@{identity}" in self.failed:
            return None
        template = self.running.pop(key, None)
        if template is not None:
            if template.alive and template.identity == identity:
                self.running[key] = template
                template.used_at_s = time.monotonic()
                template.hold()
                return template
            self._retire(template)
        if time.monotonic() < self._retry_at.get(key, 0.0) or not self._room():
            return None
        return await self._start(Template(key, identity, identity_now, system), argv)

    async def _start(self, template: Template, argv: Callable[[], list[str]]) -> Template | None:
        key, system = template.name, template.system
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._starting[key] = started
        try:
            await template.start(argv(), self._timeout_s)
        except (TemplateGone, OSError) as exc:
            proven = any(t.alive and t.system == system for t in self.running.values())
            log.warning(
                "no guest template: guests start afresh",
                system=key,
                error=str(exc),
                retry_after_s=self.RETRY_AFTER_S if proven else None,
            )
            if proven:
                self._retry_at[key] = time.monotonic() + self.RETRY_AFTER_S
            else:
                self.failed.add(f"{system}@{template.identity}")
            return None
        finally:
            del self._starting[key]
            started.set_result(None)
        self._retry_at.pop(key, None)
        self.running[key] = template
        template.hold()
        return template

    def _retire(self, template: Template) -> None:
        template.retire()  # closed once its last guest has ended
        self.retired = [t for t in self.retired if t.alive] + [template]

    def _room(self) -> bool:
        """Room for one more template: the least recently used of those idle for
        ``evict_idle_s`` is closed if need be. Without any, False (said once until there is
        room again)."""
        while len(self.running) + len(self._starting) >= self.max_running:
            quiet_since = time.monotonic() - self.evict_idle_s
            idle = [
                k
                for k, t in self.running.items()
                if not t.alive or (t.idle and t.used_at_s <= quiet_since)
            ]
            if not idle:
                if not self._said_full:
                    log.info(
                        "guest templates at their cap, none idle: guests start afresh",
                        max=self.max_running,
                    )
                    self._said_full = True
                return False
            oldest = min(idle, key=lambda k: self.running[k].used_at_s)
            self._retire(self.running.pop(oldest))
        self._said_full = False
        return True

    async def close(self) -> None:
        for template in [*self.running.values(), *self.retired]:
            await template.close()
        self.running.clear()
        self.retired.clear()


def system_identity(tree: Path | None, python: str) -> str:
    """What a template of this system was started from: the tree's directory (a rebuild
    puts a new one in its place), or, for the host's ``/usr``, its python binary (an
    upgrade replaces it). "" where it cannot be read (no template is then started)."""
    try:
        st = tree.stat() if tree is not None else Path(python).resolve().stat()
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}"
