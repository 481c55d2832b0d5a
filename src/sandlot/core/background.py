"""Background commands: exec calls that are started and not awaited by their caller.

A background command is an ordinary ``exec_shell`` call (same timeout, output caps, kill
reasons and result) run as a host task; the caller gets its pid and a ``command_id`` back at
once, and later waits for, feeds, or kills it by them. The guest runs it outside its session's
lock, so a long server never blocks the session's next command. Each sandbox holds at most
``SANDBOX_MAX_BACKGROUND_COMMANDS`` running at once; destroy kills every one.

A pid alone does not name one command: pids start again at 1 when the guest restarts (which
sandboxed code can force) and wrap within one guest. So each command gets an id drawn here,
the table is keyed by it, and a verb given the id acts on that command or raises
:class:`CommandNotFound`, never on a later one that holds its pid (a handle once waited on a
command and got the next guest's command's output and exit code: red team, 2026-12-06). A
verb given only the pid (E2B's clients) acts on the newest command with that pid.

A terminal (``pty.create``) is one more kind of background command, counted against the same
cap: a ``pty_open`` call whose output is raw bytes. The host keeps its newest
:data:`SCROLLBACK_BYTES` (what REST polls by offset); a listener is called per chunk, so a
flood costs the host that window and nothing more.

Each command or terminal that a caller got a handle to is told once to ``on_ended`` when it
ends, whatever ended it (:class:`CommandEnded`: the manager's "command_ended" event, which
the REST server turns into a webhook). A command's :class:`Webhook` is kept here, on the
host: the guest's payload (``execution.command_payload``) never carries it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sandlot.core import execution
from sandlot.core.guest_link import GuestConnection
from sandlot.core.live import Live
from sandlot.errors import (
    BackgroundLimitReached,
    CommandNotFound,
    CommandStillRunning,
    ConfigError,
    GuestError,
    InvalidRequest,
    SandboxError,
    StdinBacklogFull,
    TooManyListeners,
)
from sandlot.guest.ops import Op
from sandlot.models import CommandInfo, DataCallback, ExecResult, OutputCallback, PtyOutput
from sandlot.requests import MAX_TTL_S, OpenPty, PtySize, RunCommand

STDIN_QUEUE_ITEMS = 64  # input not yet taken by the command: send_stdin waits past this
# ...and refuses past this many bytes of it, for all of one sandbox's commands and terminals
# together: items alone let a client park 64 x its largest message (4 MiB on the WebSocket)
# per command that never reads, and 4 MiB per command let one tenant park 640 MiB of the
# server's memory (16 commands x 10 sandboxes, counted in no quota: red team, 2026-12-06).
# One largest input (1 Mi characters, up to 4 bytes each in UTF-8) still fits.
STDIN_BACKLOG_BYTES = 4 << 20
COMMAND_ID_BYTES = 8  # random: a command's id cannot be guessed from another's
KILL_WAIT_S = 5.0
SCROLLBACK_BYTES = 256 << 10  # a terminal's output kept on the host, newest first
# Output the results of one sandbox's ended background commands may hold on the host together.
ENDED_OUTPUT_BYTES = 16 << 20
# Clients one terminal or command streams to at once. Each output chunk is encoded and sent
# once per listener on the server's one event loop, and the guest's 8 MiB/s budget counts
# it once: 90 WebSockets attached to one 0.5-core terminal running `cat /dev/urandom` took
# 0.8 of a core and another tenant's GET from 9 to 544 ms median (red team, 2026-12-06).
MAX_LISTENERS_PER_JOB = 4
# The kill_reason of a command that ended without a result of its own: its sandbox was
# destroyed under it (a kill the destroy sent counts as the destroy's), or its guest was lost
# (restarted under it, or failed).
ENDED_BY_DESTROY = "sandbox_destroyed"
ENDED_WITH_GUEST = "guest_lost"


@dataclass(frozen=True)
class Webhook:
    """Where the REST server tells of a background command's end. Host side only."""

    url: str
    secret: str | None = field(default=None, repr=False)  # never in a log line


@dataclass(frozen=True)
class CommandEnded:
    """A background command or terminal that has ended, as :class:`BackgroundCommands`
    tells its ``on_ended``: its info as it ended, its result (None where it left none: see
    :data:`ENDED_BY_DESTROY`), why it was stopped, and its webhook if it had one."""

    info: CommandInfo
    result: ExecResult | None
    kill_reason: str | None
    webhook: Webhook | None


EndedCallback = Callable[[CommandEnded], None]


class StdinQueue(asyncio.Queue[bytes | None]):
    """Input for a running command, counting the bytes not yet taken by the command (the
    foreground WebSocket run and background commands share it)."""

    def __init__(self, max_bytes: int, maxsize: int = 0, chunk_overhead_bytes: int = 0) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        # What each queued chunk costs beyond its bytes, counted against ``max_bytes``: with
        # no ``maxsize``, a flood of one-byte chunks is then bounded like one big chunk.
        self.chunk_overhead_bytes = chunk_overhead_bytes

    def _put(self, item: bytes | None) -> None:
        self.queued_bytes += len(item or b"")
        super()._put(item)

    def _get(self) -> bytes | None:
        item: bytes | None = super()._get()
        self.queued_bytes -= len(item or b"")
        return item

    def has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes, in one more chunk, stay within the cap."""
        overhead = (self.qsize() + 1) * self.chunk_overhead_bytes
        return self.queued_bytes + size + overhead <= self.max_bytes

    def offer(self, data: bytes) -> bool:
        """Queue ``data`` unless that would pass the backlog cap; say whether it was."""
        if not self.has_room(len(data)):
            return False
        self.put_nowait(data)
        return True


class StdinBudget:
    """The input that one sandbox's background commands and terminals have not taken yet, all
    of them together: what the host holds for it, whichever command it waits for."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0


class JobStdin(StdinQueue):
    """A background command's input, charged to its sandbox's :class:`StdinBudget` from the
    moment it is accepted until the guest has written it to the command (the chunk the feeder
    took is held here until then: the guest writes it into a pipe the command may never read,
    so counting only the queue would leave one uncounted chunk of up to 4 MiB per command), or
    until the command ends."""

    def __init__(self, budget: StdinBudget) -> None:
        super().__init__(budget.max_bytes, STDIN_QUEUE_ITEMS)
        self.budget = budget
        self.charged_bytes = 0  # reserved, queued and taken by the feeder, not yet written
        self.taken_bytes = 0  # taken by the feeder, not yet written by the guest
        self.closed = False

    def has_room(self, size: int) -> bool:
        return self.budget.held_bytes + size <= self.budget.max_bytes

    def reserve(self, size: int) -> None:
        """Charge ``size`` bytes about to be queued (in the same step as :meth:`has_room`, so
        that requests to several commands waiting together cannot all pass the check)."""
        self.charged_bytes += size
        self.budget.held_bytes += size

    def refund(self, size: int) -> None:
        """Give back ``size`` charged bytes: the guest has written them to the command, or a
        reserved chunk was not queued after all (it ended, or its request went away)."""
        if not self.closed:  # else release() has given everything back already
            self.charged_bytes -= size
            self.budget.held_bytes -= size

    def _put(self, item: bytes | None) -> None:
        if self.closed:
            return  # the command has ended: nothing would ever take it (nor free it)
        super()._put(item)

    def _get(self) -> bytes | None:
        item = super()._get()
        self.taken_bytes += len(item or b"")
        return item

    async def get(self) -> bytes | None:
        # The feeder (execution._feed_stdin) asks for the next chunk only once the guest has
        # answered for the last one: that one has been written to the command.
        self.refund(self.taken_bytes)
        self.taken_bytes = 0
        return await super().get()

    def release(self) -> None:
        """The command has ended: nothing takes its input any more; free it, and give its
        bytes back to the sandbox's budget."""
        self.closed = True
        while not self.empty():
            self.get_nowait()
        self.budget.held_bytes -= self.charged_bytes
        self.charged_bytes = self.taken_bytes = 0


@dataclass
class _Job:
    info: CommandInfo
    stdin: JobStdin
    task: asyncio.Task[ExecResult] | None = None
    call: tuple[GuestConnection, int] | None = None
    stdin_closed: bool = False
    listeners: list[tuple[OutputCallback | None, OutputCallback | None]] = field(
        default_factory=list
    )
    data_listeners: list[DataCallback] = field(default_factory=list)
    scrollback: bytearray = field(default_factory=bytearray)
    written_bytes: int = 0  # a terminal's output so far; the scrollback is its tail
    kept_bytes: int = 0  # the memory its result's output holds, once it has ended
    # Whether the guest streams its output: a command's only while someone listens (each
    # chunk costs this process's one event loop; its result keeps head and tail anyway).
    streaming: bool = True
    webhook: Webhook | None = None
    kept: bool = False  # its caller has its handle (a failed start is nobody's to be told of)
    told: bool = False  # on_ended has been called for it

    def listened(self) -> bool:
        return any(cb is not None for pair in self.listeners for cb in pair)

    def room_for_listener(self) -> None:
        """Refuse one more client past :data:`MAX_LISTENERS_PER_JOB`.

        Raises:
            TooManyListeners: it streams to that many already.
        """
        if len(self.listeners) + len(self.data_listeners) >= MAX_LISTENERS_PER_JOB:
            what = "terminal" if self.info.pty else "command"
            raise TooManyListeners(
                f"this {what} already streams to {MAX_LISTENERS_PER_JOB} clients; detach one "
                "first (its output is also kept: GET .../output for a terminal, wait for a "
                "command's result)"
            )

    def emit(self, index: int, text: str) -> None:
        for pair in self.listeners:
            callback = pair[index]
            if callback is not None:
                callback(text)

    def emit_data(self, encoded: str) -> None:
        """A terminal's chunk (base64 from the guest): kept in the window, passed on."""
        try:
            data = base64.b64decode(encoded, validate=True)
        except ValueError:
            return  # the guest shares a uid with sandboxed code: garbage is dropped
        self.written_bytes += len(data)
        self.scrollback += data
        if len(self.scrollback) > SCROLLBACK_BYTES:
            del self.scrollback[: len(self.scrollback) - SCROLLBACK_BYTES]
        for callback in self.data_listeners:
            callback(data)

    def output(self, offset: int) -> PtyOutput:
        first = self.written_bytes - len(self.scrollback)
        start = min(max(offset, first), self.written_bytes)
        data = bytes(self.scrollback[start - first :])
        return PtyOutput(
            data_b64=base64.b64encode(data).decode("ascii"),
            offset=start,
            next_offset=self.written_bytes,
            dropped_bytes=max(0, start - max(offset, 0)),
        )


class BackgroundCommands:
    """One sandbox's background commands, by the id drawn for each (and by pid: the newest
    command with each pid)."""

    def __init__(self, limit: int, on_ended: EndedCallback | None = None) -> None:
        self.limit = limit
        self._on_ended = on_ended
        self._jobs: dict[str, _Job] = {}  # by command_id, oldest first
        self._by_pid: dict[int, str] = {}  # pid -> the newest command with it
        self._starting = 0
        self._closed = False
        self.stdin_budget = StdinBudget(STDIN_BACKLOG_BYTES)

    def _new_job(self, info: CommandInfo) -> _Job:
        while True:
            command_id = secrets.token_hex(COMMAND_ID_BYTES)
            if command_id not in self._jobs:
                break
        info.command_id = command_id
        return _Job(info, JobStdin(self.stdin_budget))

    def _running(self) -> int:
        return sum(1 for job in self._jobs.values() if job.info.running)

    async def start(
        self,
        live: Live,
        request: RunCommand,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandInfo:
        """Start ``request`` and return once its process exists.

        Raises:
            BackgroundLimitReached: ``limit`` commands already run in this sandbox.
            ConfigError: ``fresh`` was asked for (it would kill the other commands).
        """
        if request.fresh:
            raise ConfigError("a background command cannot be fresh (it would kill the others)")
        info = CommandInfo(pid=0, command=request.command, started_at=time.time())
        job = self._new_job(info)
        if request.webhook_url is not None:
            job.webhook = Webhook(request.webhook_url, request.webhook_secret)
        job.listeners.append((on_stdout, on_stderr))
        job.streaming = job.listened()
        op, payload = execution.command_payload(request, streams_stdin=True)
        # Every background command may spill its output: together they keep to the quarter
        # of the disk one call may fill.
        payload.update(background=True, output_spill_limit=live.disk_bytes // 4 // self.limit)
        payload.update(stream_paused=not job.streaming)
        timeout_s = request.timeout_s or float(MAX_TTL_S)  # destroy or expiry ends it anyway
        return await self._admit(live, job, op, payload, timeout_s)

    async def start_pty(
        self, live: Live, request: OpenPty, on_data: DataCallback | None = None
    ) -> CommandInfo:
        """Open a terminal and return once its process exists (same cap and errors as
        :meth:`start`)."""
        command = request.command or "(interactive shell)"
        info = CommandInfo(pid=0, command=command, started_at=time.time(), pty=True)
        job = self._new_job(info)
        if on_data is not None:
            job.data_listeners.append(on_data)
        payload: dict[str, Any] = {"cols": request.cols, "rows": request.rows}
        payload.update(env=request.env or {}, command=request.command, cwd=request.cwd)
        timeout_s = request.timeout_s or float(MAX_TTL_S)
        return await self._admit(live, job, Op.PTY_OPEN, payload, timeout_s)

    async def _admit(
        self, live: Live, job: _Job, op: Op, payload: dict[str, Any], timeout_s: float
    ) -> CommandInfo:
        if self._closed:
            raise InvalidRequest("the sandbox is being destroyed")
        if self._running() + self._starting >= self.limit:
            raise BackgroundLimitReached(
                f"{self.limit} background commands and terminals already run in this "
                "sandbox (SANDBOX_MAX_BACKGROUND_COMMANDS); wait for or kill one"
            )
        self._starting += 1
        try:
            return await self._start(live, job, op, payload, timeout_s)
        finally:
            self._starting -= 1

    async def _start(
        self, live: Live, job: _Job, op: Op, payload: dict[str, Any], timeout_s: float
    ) -> CommandInfo:
        info = job.info
        called: asyncio.Future[tuple[GuestConnection, int]] = (
            asyncio.get_running_loop().create_future()
        )

        def on_call(conn: GuestConnection, call_id: int) -> None:
            job.call = (conn, call_id)  # a guest restarted under it: the retry's call
            if not called.done():
                called.set_result(job.call)
            elif not info.pty:
                # The retry went out as the first did: streaming as listeners were then.
                job.streaming = not payload.get("stream_paused", False)
                self._sync_stream(job)

        on_stdout: OutputCallback = job.emit_data if info.pty else lambda text: job.emit(0, text)
        job.task = asyncio.create_task(
            execution.execute(
                live,
                op,
                payload,
                timeout_s,
                on_stdout,
                lambda text: job.emit(1, text),
                stdin=job.stdin,
                on_call=on_call,
            )
        )
        job.task.add_done_callback(lambda task: self._ended(job, task))
        try:
            info.pid = await self._pid_of(job, called)
        except BaseException:
            job.task.cancel()  # nobody holds a handle to it: it must not run on
            raise
        self._remember(job)
        return info.model_copy()

    @staticmethod
    async def _pid_of(job: _Job, called: asyncio.Future[tuple[GuestConnection, int]]) -> int:
        assert job.task is not None
        waiting: set[asyncio.Future[Any]] = {called, job.task}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not called.done():
            await job.task  # it failed before reaching the guest: raise why
            raise GuestError("the background command ended before it was sent")
        conn, call_id = called.result()
        answer = await conn.ask(Op.PID, {"target": call_id})
        pid = answer.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise GuestError(f"the sandbox's guest sent an invalid pid: {pid!r}")
        return pid

    def _ended(self, job: _Job, task: asyncio.Task[ExecResult]) -> None:
        job.info.running = False
        job.stdin.release()
        if not task.cancelled() and task.exception() is None:
            result = task.result()
            job.info.exit_code = result.exit_code
            # Bytes held, not characters: a string with one character past U+FFFF is stored
            # at 4 bytes each (review, 2026-12-06).
            held = (result.stdout, result.stderr, result.text or "")
            job.kept_bytes = sum(sys.getsizeof(text) for text in held)
        self._forget_old()
        if job.kept:
            self._tell_ended(job, task)

    def _tell_ended(self, job: _Job, task: asyncio.Task[ExecResult]) -> None:
        """Call ``on_ended`` for ``job``, once, after it has ended and its caller has its
        handle (whichever comes last: a quick command may end before its pid is known)."""
        if self._on_ended is None or job.told:
            return
        job.told = True
        result = None if task.cancelled() or task.exception() is not None else task.result()
        kill_reason: str | None
        if result is None:
            kill_reason = ENDED_BY_DESTROY if self._closed else ENDED_WITH_GUEST
        elif self._closed and result.kill_reason == "killed":
            kill_reason = ENDED_BY_DESTROY  # the destroy's own kill (close())
        else:
            kill_reason = result.kill_reason
        self._on_ended(CommandEnded(job.info.model_copy(), result, kill_reason, job.webhook))

    def _remember(self, job: _Job) -> None:
        info = job.info
        assert info.command_id is not None  # drawn by _new_job
        old = self._jobs.get(self._by_pid.get(info.pid, ""))
        if old is not None and old.info.running and old.task is not None:
            # Its pid is another process's now, so its own is gone (its guest restarted
            # under it). It stays kept under its id, ended: its pid names the new one.
            old.task.cancel()
        self._jobs[info.command_id] = job
        self._by_pid[info.pid] = info.command_id
        job.kept = True
        self._forget_old()
        if not info.running and job.task is not None:  # _ended() has run already
            self._tell_ended(job, job.task)

    def _forget_old(self) -> None:
        """Ended ones stay for wait(), the newest first: at most ``limit`` of them, whose
        results hold at most :data:`ENDED_OUTPUT_BYTES` of output together (the newest is
        kept whatever its size). Each result holds up to its output cap per stream, in the
        server's memory, not the sandbox's: 16 of them held 417 MiB for one 128 MiB sandbox
        (red team, 2026-12-06)."""
        ended = [key for key, j in self._jobs.items() if not j.info.running]
        kept_bytes = 0
        for n, key in enumerate(reversed(ended)):
            job = self._jobs[key]
            kept_bytes += job.kept_bytes
            if n >= self.limit or (n and kept_bytes > ENDED_OUTPUT_BYTES):
                del self._jobs[key]
                if self._by_pid.get(job.info.pid) == key:
                    del self._by_pid[job.info.pid]

    def _job(self, pid: int, command_id: str | None = None) -> _Job:
        """The command ``command_id`` if given (it must have this pid), else the newest with
        ``pid``.

        Raises:
            CommandNotFound: no such command, or no longer kept (naming the command that
                holds its pid now, if one does).
        """
        newest = self._jobs.get(self._by_pid.get(pid, ""))
        if command_id is None:
            if newest is None:
                raise CommandNotFound(f"no background command with pid {pid} in this sandbox")
            return newest
        job = self._jobs.get(command_id)
        if job is not None and job.info.pid == pid:
            return job
        if job is not None:
            raise CommandNotFound(
                f"background command {command_id} has pid {job.info.pid}, not {pid}"
            )
        if newest is not None:
            raise CommandNotFound(
                f"background command {command_id} (pid {pid}) is no longer kept in this "
                f"sandbox; pid {pid} is now background command {newest.info.command_id}"
            )
        raise CommandNotFound(
            f"no background command {command_id} with pid {pid} in this sandbox (an ended "
            "one is kept for wait() while it is among the newest ended ones)"
        )

    def _lookup(self, pid: int, command_id: str | None) -> _Job | None:
        try:
            return self._job(pid, command_id)
        except CommandNotFound:
            return None

    def list(self) -> list[CommandInfo]:
        """The background commands still running."""
        return [job.info.model_copy() for job in self._jobs.values() if job.info.running]

    def info(self, pid: int, command_id: str | None = None) -> CommandInfo:
        return self._job(pid, command_id).info.model_copy()

    def listen(
        self,
        pid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        command_id: str | None = None,
    ) -> CommandInfo:
        """Stream a running command's further output to these callbacks too; with none, only
        its info (a poll adds nothing: a caller polling forever must not grow the list that
        every output chunk walks)."""
        job = self._job(pid, command_id)
        if on_stdout is not None or on_stderr is not None:
            job.room_for_listener()
            job.listeners.append((on_stdout, on_stderr))
            self._sync_stream(job)
        return job.info.model_copy()

    def unlisten(
        self,
        pid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        command_id: str | None = None,
    ) -> None:
        """Stop streaming to callbacks :meth:`listen` or :meth:`start` added (a WebSocket
        client went away)."""
        job = self._lookup(pid, command_id)
        if job is not None and (on_stdout, on_stderr) in job.listeners:
            job.listeners.remove((on_stdout, on_stderr))
            self._sync_stream(job)

    @staticmethod
    def _sync_stream(job: _Job) -> None:
        """Tell the guest to stream a command's output while it has a listener, and only
        then (a terminal's always streams: its window is kept here)."""
        wanted = job.listened()
        if job.info.pty or job.call is None or not job.info.running or wanted == job.streaming:
            return
        job.streaming = wanted
        conn, call_id = job.call
        # Written before this returns, so before any input a listener sends next: the guest
        # turns the stream on before it reads that input (supervisor.py), and the output the
        # input causes reaches the listener.
        conn.post(Op.STREAM, {"target": call_id, "on": wanted})

    def listen_pty(
        self, pid: int, on_data: DataCallback, command_id: str | None = None
    ) -> CommandInfo:
        """Pass a terminal's further output to ``on_data`` too."""
        job = self._pty(pid, command_id)
        job.room_for_listener()
        job.data_listeners.append(on_data)
        return job.info.model_copy()

    def unlisten_pty(self, pid: int, on_data: DataCallback, command_id: str | None = None) -> None:
        job = self._lookup(pid, command_id)
        if job is not None and on_data in job.data_listeners:
            job.data_listeners.remove(on_data)

    def pty_output(self, pid: int, offset: int = 0, command_id: str | None = None) -> PtyOutput:
        """A terminal's output from ``offset`` on, as far as the window still holds it."""
        return self._pty(pid, command_id).output(offset)

    async def send_pty_input(self, pid: int, data: bytes, command_id: str | None = None) -> None:
        """Type ``data`` into a terminal (waits while its program does not read)."""
        job = self._pty(pid, command_id)
        await self.send_stdin(pid, data, command_id=job.info.command_id)

    async def resize_pty(self, pid: int, size: PtySize, command_id: str | None = None) -> None:
        """Resize a running terminal (its foreground programs get SIGWINCH).

        Raises:
            InvalidRequest: it has ended.
        """
        job = self._pty(pid, command_id)
        if not job.info.running or job.call is None:
            raise InvalidRequest(f"terminal {pid} has ended")
        conn, call_id = job.call
        resize = {"target": call_id, "cols": size.cols, "rows": size.rows}
        await conn.ask(Op.PTY_RESIZE, resize)

    def _pty(self, pid: int, command_id: str | None = None) -> _Job:
        job = self._job(pid, command_id)
        if not job.info.pty:
            raise InvalidRequest(f"background command {pid} is not a terminal")
        return job

    async def wait(
        self, pid: int, timeout_s: float | None = None, command_id: str | None = None
    ) -> ExecResult:
        """Its result once it ends.

        Raises:
            CommandNotFound: no such command, or one that ended without a result (its guest
                was gone when its pid went to another command).
            CommandStillRunning: it did not end within ``timeout_s`` (it runs on).
        """
        job = self._job(pid, command_id)
        assert job.task is not None  # remembered only once started
        if job.task.cancelled():
            raise CommandNotFound(
                f"background command {pid} ({job.info.command_id}) ended with its guest and "
                "left no result"
            )
        try:
            return await asyncio.wait_for(asyncio.shield(job.task), timeout_s)
        except TimeoutError:
            raise CommandStillRunning(
                f"background command {pid} still runs after {timeout_s} s"
            ) from None

    async def send_stdin(
        self, pid: int, data: bytes, *, eof: bool = False, command_id: str | None = None
    ) -> None:
        """Queue ``data`` for its stdin (waits while the command does not read); ``eof``
        closes its stdin after.

        Raises:
            InvalidRequest: the command has ended (before or while this waited), or its stdin
                was closed.
            StdinBacklogFull: this sandbox's commands and terminals have not read
                :data:`STDIN_BACKLOG_BYTES` of what came before, together.
        """
        job = self._job(pid, command_id)
        if not job.info.running:
            raise InvalidRequest(f"background command {pid} has ended")
        if job.stdin_closed:
            raise InvalidRequest(f"the stdin of background command {pid} is closed")
        budget = self.stdin_budget
        if not job.stdin.has_room(len(data)):
            raise StdinBacklogFull(
                f"this sandbox's background commands and terminals have not read "
                f"{budget.held_bytes} bytes of their input; at most {budget.max_bytes} wait "
                "for them together"
            )
        job.stdin.reserve(len(data))  # no await since the check: none can pass it meanwhile
        job.stdin_closed = eof  # input sent after this would never be read
        for item in ([data] if data else []) + ([None] if eof else []):
            await self._put_stdin(job, item)

    @staticmethod
    async def _put_stdin(job: _Job, item: bytes | None) -> None:
        """Queue ``item`` (its bytes reserved), waiting for room while the command runs, no
        longer: once it ends, nothing takes from the queue, and a waiting request would hang
        for good. Not queued (it ended, or the request went away): its reservation goes back.

        Raises:
            InvalidRequest: it ended first.
        """
        assert job.task is not None
        put = asyncio.ensure_future(job.stdin.put(item))
        queued = False
        try:
            await asyncio.wait({put, job.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A put cancelled here may not show it yet, but it can no longer queue the item.
            queued = put.done() and not put.cancelled() and put.exception() is None
            if not put.done():
                put.cancel()
            if not queued:
                job.stdin.refund(len(item or b""))
        if not queued:
            raise InvalidRequest(f"background command {job.info.pid} has ended")

    async def kill(self, pid: int, command_id: str | None = None) -> bool:
        """Kill it (and the processes it started); whether it was still running."""
        job = self._job(pid, command_id)
        if not job.info.running:
            return False
        await self._cancel(job)
        assert job.task is not None
        with contextlib.suppress(TimeoutError, asyncio.CancelledError, SandboxError):
            await asyncio.wait_for(asyncio.shield(job.task), KILL_WAIT_S)
        return True

    @staticmethod
    async def _cancel(job: _Job) -> None:
        if job.call is not None:
            conn, call_id = job.call
            await conn.notify(Op.CANCEL, {"target": call_id})

    async def close(self) -> None:
        """The sandbox is being destroyed: cancel every command; the backend's stop ends
        their processes, whatever they forked."""
        self._closed = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        for job in self._jobs.values():
            if job.info.running:
                await self._cancel(job)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
