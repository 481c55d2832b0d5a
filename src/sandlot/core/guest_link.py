"""Host side of the guest protocol: length-prefixed JSON frames over the guest's stdio.

One :class:`GuestConnection` per live guest. Requests are multiplexed by id, so a file read
can run while a long command streams its output. Operation and event names come from
:mod:`sandlot.guest.ops`, the same table the guest dispatches on; the guest's protocol version
is checked when it says "ready". Every frame after the first (the key) is sealed both ways
(:mod:`sandlot.guest.seal`): a frame the sandbox's own code wrote in, took out or replayed
ends the connection with :class:`GuestChannelBroken`, never passes for an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import struct
from collections.abc import Callable
from typing import Any

from sandlot.errors import (
    GuestChannelBroken,
    GuestDied,
    GuestError,
    GuestTimeout,
    ProtocolMismatch,
    SandboxError,
    error_from_code,
)
from sandlot.guest.ops import PROTOCOL_VERSION, Event, Op
from sandlot.guest.seal import KEY_BYTES, TO_GUEST, TO_HOST, NotAuthentic, Seal
from sandlot.models import OutputCallback, Result, ResultCallback

# Told whether a call that waited its turn in the guest can run now (True) or waits (False).
TurnCallback = Callable[[bool], None]

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
# A whole frame's bytes after its header: 64 MiB through a loaded docker stream takes ~1-2 s.
BODY_TIMEOUT_S = 20.0
# How long a request nobody waits for (cancel, shutdown) waits for the guest to take it in:
# its frame is in the pipe's buffer by then, and a guest that reads nothing more is ended by
# whoever closes it, not waited on.
NOTIFY_DRAIN_S = 2.0
# How long the guest may take in nothing of what is sent to it: past it the channel is
# broken (the guest is restarted by the call that meets it). Frames go in one at a time, so
# the host holds at most one unsent: every request to a guest that read nothing (its own
# code starved it) sat whole in the pipe's buffer for the sandbox's life, ~5 MB an upload
# and ~39 MB an MCP write, 2.6 GB of the server in 35 s from one key (red team, 2026-12-07).
INPUT_STALL_S = 20.0
# The host's bound on a short call (a file request: a chunk of at most 8 MiB, a listing, a
# stat; a pid; a resize), which the guest answers in milliseconds unless the sandbox's own
# processes starve it.
SHORT_CALL_TIMEOUT_S = 120.0


class _Pending:
    __slots__ = ("future", "on_result", "on_stderr", "on_stdout", "on_turn")

    def __init__(
        self,
        future: asyncio.Future[dict[str, Any]],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_result: ResultCallback | None,
        on_turn: TurnCallback | None = None,
    ) -> None:
        self.future = future
        self.on_turn = on_turn
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_result = on_result


def _retrieved(task: asyncio.Future[None]) -> None:
    """Mark a connection's own send read: its caller may have been cancelled and gone."""
    if not task.cancelled():
        task.exception()


class GuestConnection:
    """Talks to one guest over a pair of byte streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        # A fresh key per guest start, sent before anything else (nothing in the sandbox runs
        # yet); a restarted guest gets a new one, so frames of an old channel never count.
        key = secrets.token_bytes(KEY_BYTES)
        self._to_guest = Seal(key, TO_GUEST)
        self._from_guest = Seal(key, TO_HOST)
        hello = json.dumps({"id": 0, "op": Op.HELLO, "key": key.hex()}).encode()
        writer.write(HEADER.pack(len(hello)) + hello)
        self._fatal: SandboxError | None = None
        # What ended the connection: told to requests that come after it.
        self._failure: SandboxError | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._closed = False
        self._sending = asyncio.Lock()
        self._task = asyncio.create_task(self._read_loop())
        self.info: dict[str, Any] = {}

    @property
    def alive(self) -> bool:
        return not self._closed

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the guest's "ready" frame.

        Raises:
            GuestDied: the guest exited first.
            ProtocolMismatch: it speaks another protocol version (a stale guest in an image).
            TimeoutError: it said nothing for ``timeout_s``.
        """
        self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        version = self.info.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"the sandbox's guest speaks protocol {version!r}, this host {PROTOCOL_VERSION}; "
                "rebuild the environment's image (`sandlot image build`)"
            )
        return self.info

    async def request(
        self,
        op: Op,
        payload: dict[str, Any] | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        call_id: int | None = None,
        on_turn: TurnCallback | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its result frame. ``on_turn(False)`` is called if
        the guest says the call waits its turn behind another, ``on_turn(True)`` once it
        can run.

        Raises:
            GuestDied: the guest exited before answering.
            SandboxError: the guest answered with an error frame (mapped by its code).
        """
        if self._closed:
            raise GuestDied("the sandbox's guest process is not running")
        call_id = call_id if call_id is not None else self.new_id()
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = _Pending(future, on_stdout, on_stderr, on_result, on_turn)
        message = {"id": call_id, "op": op, **(payload or {})}
        if on_stdout is not None or on_stderr is not None or on_result is not None:
            message["stream"] = True
        try:
            await self._send(message)
            return await future
        finally:
            self._pending.pop(call_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # read: a send that failed leaves it unawaited

    async def ask(self, op: Op, payload: dict[str, Any]) -> dict[str, Any]:
        """:meth:`request` of a short call, past :data:`SHORT_CALL_TIMEOUT_S` failed (its late
        answer dropped), the guest left as it is: a caller waited for good, holding its
        tenant's open request (red team, 2026-12-07).

        Raises:
            GuestTimeout: no answer in time.
        """
        within_s = SHORT_CALL_TIMEOUT_S
        try:
            async with asyncio.timeout(within_s) as deadline:
                return await self.request(op, payload)
        except TimeoutError:
            if not deadline.expired():
                raise
        raise GuestTimeout(
            f"the sandbox's guest did not answer {op.value} within {within_s:g} s: the "
            "sandbox's own processes starve it (busy loops, lowered priorities); retry once "
            "they let it run"
        )

    def new_id(self) -> int:
        return next(self._ids)

    async def notify(self, op: Op, payload: dict[str, Any]) -> bool:
        """Send a request whose answer nobody waits for (cancel, shutdown). Returns once the
        guest has taken it in, or after ``NOTIFY_DRAIN_S``: a guest whose input is full and
        unread (behind a large write it stopped reading) must not hold a destroy or a
        cancellation for good. False if the wait ran out (the frame still unsent)."""
        if self._closed or self._writer.is_closing():
            return True
        # Written now, past the send lock: behind a large frame a slow guest takes in (not
        # stalled), a cancel waited for the lock, ran out of time and was never written, and
        # the run it was to end went on after its client's 499 (red team, 2026-12-07). The
        # frame is small; the guest reads frames in order.
        self._write({"id": self.new_id(), "op": op, **payload})
        try:
            async with asyncio.timeout(NOTIFY_DRAIN_S):
                await self._writer.drain()
        except TimeoutError:
            return False
        except (ConnectionError, RuntimeError):
            pass
        return True

    def post(self, op: Op, payload: dict[str, Any]) -> None:
        """Write a small request whose answer nobody waits for, now, from the loop's thread:
        ahead of any request sent after this returns (the guest handles some in its read
        loop, in order: ``Op.STREAM``). Not waiting for the buffer to drain: for a few bytes
        at a time only."""
        if not self._closed and not self._writer.is_closing():
            self._write({"id": self.new_id(), "op": op, **payload})

    def _write(self, message: dict[str, Any]) -> None:
        # Sealed and written with no await between: frames leave in the order of their tags.
        data = self._to_guest.seal(json.dumps(message, separators=(",", ":")).encode())
        self._writer.write(HEADER.pack(len(data)) + data)

    async def _send(self, message: dict[str, Any]) -> None:
        # One frame at a time: the others wait here, unsealed, unencoded.
        await self._sending.acquire()
        if self._closed:
            self._sending.release()
            raise self._failure or GuestDied("the sandbox's guest process is not running")
        try:
            self._write(message)
        except BaseException:
            self._sending.release()
            raise
        # The wait for the guest to take the frame in is the connection's, not the caller's:
        # it keeps the lock, and the stall check, until the frame is in. A caller cancelled
        # meanwhile (its client hung up, a short call's bound) left its frame unsent in the
        # buffer and the lock free for the next: 60 hang-ups held 80 MiB, and no wait ever
        # lasted long enough to see the stall (red team, 2026-12-07).
        drained = asyncio.ensure_future(self._drain_and_release())
        drained.add_done_callback(_retrieved)
        await asyncio.shield(drained)

    async def _drain_and_release(self) -> None:
        try:
            await self._drain()
        except SandboxError:
            raise
        except (ConnectionError, RuntimeError) as exc:
            self._fail_all(GuestDied(f"the guest stopped reading its input: {exc}"))
            raise GuestDied("the sandbox's guest process is not running") from exc
        finally:
            self._sending.release()

    async def _drain(self) -> None:
        """Wait until the frame is taken in, as long as the guest takes some of it in every
        :data:`INPUT_STALL_S`."""
        transport = self._writer.transport
        left = transport.get_write_buffer_size()
        while True:
            try:
                async with asyncio.timeout(INPUT_STALL_S):
                    await self._writer.drain()
            except TimeoutError:
                now = transport.get_write_buffer_size()
                if now < left:
                    left = now
                    continue
            else:
                return
            error = GuestChannelBroken(
                f"the guest took in nothing of its input for {INPUT_STALL_S:g} s (the "
                "sandbox's own processes starve it); the guest is restarted"
            )
            self._fail_all(error)
            transport.abort()  # what is unsent goes, and the guest sees its input end
            raise error

    async def _read_loop(self) -> None:
        error: SandboxError = GuestDied("the sandbox's guest process exited")
        try:
            while True:
                header = await self._reader.readexactly(HEADER.size)
                (size,) = HEADER.unpack(header)
                if size > MAX_FRAME_BYTES:
                    # The guest clips what it sends: bytes someone else wrote into its channel.
                    error = GuestChannelBroken(
                        f"the guest's channel to the host carried a {size}-byte frame header, "
                        "over the limit: something in the sandbox wrote into it; the guest is "
                        "restarted"
                    )
                    break
                # The guest writes each frame whole: a body that does not follow its header
                # is a header someone else wrote (desynchronising the stream), not a slow guest.
                # asyncio.timeout, not wait_for: on 3.11 wait_for makes a task of every frame.
                async with asyncio.timeout(BODY_TIMEOUT_S):
                    body = await self._reader.readexactly(size)
                self._dispatch(self._open(body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except TimeoutError:
            error = GuestChannelBroken(
                f"a frame's body did not follow its header within {BODY_TIMEOUT_S:.0f} s: "
                "something in the sandbox wrote into the guest's channel; the guest is restarted"
            )
        except NotAuthentic as exc:
            error = GuestChannelBroken(
                "the guest's channel to the host failed its check: something in the sandbox "
                f"wrote into it or read from it ({exc}); the guest is restarted"
            )
        except (ValueError, KeyError, RecursionError) as exc:
            # RecursionError: JSON nested past this thread's depth (the guest's parser,
            # which read it first, has more room): malformed, not our crash.
            error = GuestError(f"guest sent a malformed frame: {exc}")
        finally:
            self._fail_all(self._fatal or error)

    def _open(self, data: bytes) -> dict[str, Any]:
        """The frame's object, if it is the next authentic frame."""
        try:
            frame: dict[str, Any] = json.loads(self._from_guest.open(data))
        except NotAuthentic:
            if self._from_guest.seq == 1:
                self._older_guest(data)
            raise
        return frame

    def _older_guest(self, data: bytes) -> None:
        """A guest older than sealing says "ready" unsealed: name the real problem."""
        with contextlib.suppress(ValueError):
            frame = json.loads(data)
            ready = isinstance(frame, dict) and frame.get("event") == Event.READY
            if ready and frame.get("protocol") != PROTOCOL_VERSION:
                self._ready.set_result(frame)  # wait_ready refuses its protocol version

    def _dispatch(self, frame: dict[str, Any]) -> None:
        event = frame.get("event")
        if frame.get("id") == 0 and event == Event.ERROR:
            # The guest's own last word (its input failed the check); it exits next.
            self._fatal = error_from_code(frame.get("code", ""), str(frame.get("message")))
            return
        if event == Event.READY:
            if not self._ready.done():
                self._ready.set_result(frame)
            return
        pending = self._pending.get(frame.get("id", -1))
        if pending is None:
            return  # an answer to a notify(), or to a call whose waiter was cancelled
        if event == Event.STDOUT and pending.on_stdout is not None:
            pending.on_stdout(frame["data"])
        elif event == Event.STDERR and pending.on_stderr is not None:
            pending.on_stderr(frame["data"])
        elif event == Event.DISPLAY and pending.on_result is not None:
            pending.on_result(Result.from_bundle(frame.get("data"), frame.get("is_main_result")))
        elif event == Event.RESULT and not pending.future.done():
            pending.future.set_result(frame["result"])
        elif event == Event.ERROR and not pending.future.done():
            pending.future.set_exception(error_from_code(frame["code"], frame["message"]))
        elif event in (Event.QUEUED, Event.STARTED) and pending.on_turn is not None:
            pending.on_turn(event == Event.STARTED)

    def _fail_all(self, error: SandboxError) -> None:
        self._closed = True
        self._failure = self._failure or error
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # mark retrieved: nobody may be waiting any more
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(error)

    async def close(self) -> None:
        """Ask the guest to exit, then stop reading."""
        taken = await self.notify(Op.SHUTDOWN, {})
        with contextlib.suppress(Exception):
            transport = self._writer.transport
            if not taken and transport.get_write_buffer_size():
                # The guest took nothing in for NOTIFY_DRAIN_S: what is left unsent is
                # dropped, which also ends any request still waiting to send its bytes.
                transport.abort()
            else:
                self._writer.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._fail_all(GuestDied("the sandbox was closed"))
