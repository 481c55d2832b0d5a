"""``WS /v1/sandboxes/{id}/stream``: output as it is produced, then the result.

Client -> server, one run at a time::

    {"type": "run_code", "code": "...", "timeout_s": 5}
    {"type": "command", "command": "...", "session": "default", "env": {}, "cwd": null,
     "timeout_s": 5, "stdin": true}
    {"type": "stdin", "data": "text"}          (while a command started with stdin=true runs)
    {"type": "stdin_eof"}

Server -> client::

    {"type": "stdout", "data": "..."}  {"type": "stderr", "data": "..."}   in the order produced
    {"type": "result", "result": {ExecResult}}
    {"type": "notice", "code": "...", "message": "..."}   output or stdin dropped; the run goes on
    {"type": "error", "error": {"code": "...", "message": "..."}}

A client that disconnects mid-run does not leak it: the run is cancelled inside the sandbox.
Everything queued for the client counts against one byte cap (``outbox.py``): output past it
is dropped, but a client whose own messages (stdin refused, stdin after ``stdin_eof``) keep
queueing notices it does not read is cut there, as if it had disconnected (close code 1008).

Terminals (``{"type": "pty"}``) and background commands (``"background": true``, or
``{"type": "attach", "pid": N}``) stream until they end; see ``stream_jobs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine
from typing import Any, NamedTuple

import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from sandlot.core.background import StdinQueue
from sandlot.errors import AuthenticationError, ConfigError, InvalidRequest, SandboxError
from sandlot.models import ExecResult
from sandlot.requests import RunCode, RunCommand
from sandlot.server import outbox as outbox_
from sandlot.server import stream_jobs
from sandlot.server.auth import Principal
from sandlot.server.deps import SandboxId, ServerState, refuse_upgrade
from sandlot.server.limits import Pace

log = structlog.get_logger(__name__)
router = APIRouter(tags=["streaming"])


@router.websocket("/v1/sandboxes/{sandbox_id}/stream")
async def stream(websocket: WebSocket, sandbox_id: SandboxId) -> None:
    state: ServerState = websocket.app.state.sandbox
    websocket.state.request_id = websocket.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        who = state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
        await state.manager.get(sandbox_id, owner=who.owner_filter)
        # The socket counts against its tenant's open requests until it closes.
        state.open_requests.acquire(who.tenant)
    except SandboxError as exc:
        # Refused before the upgrade, as a typed HTTP error: an upgraded socket with no key
        # was held ~10 s waiting for the client's close reply, out of reach of eviction, and
        # 40 of them renewed held the whole connection cap (red team, 2026-12-06).
        await refuse_upgrade(websocket, exc)
        return
    pace = state.stream_pace(who)
    try:
        await websocket.accept()
        while True:
            try:
                message = await outbox_.receive_message(websocket, pace)
            except InvalidRequest as exc:
                await _send_error(websocket, exc)
                continue
            await _one_run(websocket, state, who, sandbox_id, message)
    except WebSocketDisconnect:
        return
    finally:
        state.open_requests.release(who.tenant)


async def _one_run(
    websocket: WebSocket, state: ServerState, who: Principal, sandbox_id: str, message: Any
) -> None:
    outbox: outbox_.Outbox = asyncio.Queue()
    budget = state.stream_budget(who)
    try:
        prepared = await _prepare(websocket, state, sandbox_id, message, outbox, budget)
    except ValidationError as exc:
        await _send_error(websocket, ConfigError(f"invalid message: {exc.errors()[0]['msg']}"))
        return
    except SandboxError as exc:
        await _send_error(websocket, exc)
        return
    if prepared is not None:
        await _stream_run(websocket, state, sandbox_id, prepared, outbox, budget)


class TenantStdin(StdinQueue):
    """A foreground run's stdin from its client, held to the stream's backlog and counted in
    its tenant's stream share (``outbox.Shared``) until the guest has it: a backlog per
    stream alone let 90 streams of one tenant hold 433 MiB of the server's memory (red team,
    2026-12-06)."""

    def __init__(self, max_bytes: int, shared: outbox_.Shared | None) -> None:
        super().__init__(max_bytes, chunk_overhead_bytes=STDIN_CHUNK_OVERHEAD_BYTES)
        self.shared = shared
        self.charged_bytes = 0
        self.taken_bytes = 0

    def _cost(self, item: bytes | None) -> int:
        return len(item or b"") + self.chunk_overhead_bytes

    def has_room(self, size: int) -> bool:
        if not super().has_room(size):
            return False
        shared = self.shared
        return (
            shared is None or shared.queued + size + self.chunk_overhead_bytes <= shared.cap_bytes
        )

    def _put(self, item: bytes | None) -> None:
        self._charge(self._cost(item))
        super()._put(item)

    def _get(self) -> bytes | None:
        item = super()._get()
        self.taken_bytes += self._cost(item)  # still held: by the feeder, until the guest has it
        return item

    async def get(self) -> bytes | None:
        # The feeder (execution._feed_stdin) asks for the next chunk only once the guest has
        # answered for the last one: that one is the guest's now.
        self._charge(-self.taken_bytes)
        self.taken_bytes = 0
        return await super().get()

    def _charge(self, cost: int) -> None:
        self.charged_bytes += cost
        if self.shared is not None:
            self.shared.queued += cost

    def release(self) -> None:
        """The run has ended: what its command never took is dropped and given back."""
        while not self.empty():
            self.get_nowait()
        self._charge(-self.charged_bytes)
        self.taken_bytes = 0


class _Run(NamedTuple):
    who: Principal
    kind: str
    call: Coroutine[Any, Any, ExecResult]
    stdin: TenantStdin | None


async def _prepare(
    websocket: WebSocket,
    state: ServerState,
    sandbox_id: str,
    message: Any,
    outbox: outbox_.Outbox,
    budget: outbox_.Budget,
) -> _Run | None:
    """The run ``message`` asks for, not started; None for a terminal or a background
    command, which ``stream_jobs`` has streamed to its end."""
    if not isinstance(message, dict):
        raise ConfigError("each message must be a JSON object with a 'type'")
    # Every run is a request: the key is checked (revoked?) and rate-limited again.
    who = state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
    who.require_write()
    kind = message.get("type")
    fields = {k: v for k, v in message.items() if k not in ("type", "stdin")}
    if stream_jobs.is_job(message):
        # A terminal or a background command: its own loop (stream_jobs.py).
        await stream_jobs.run_job(websocket, state, who, sandbox_id, message)
        return None
    on_stdout = outbox_.put_text(outbox, "stdout", budget)
    on_stderr = outbox_.put_text(outbox, "stderr", budget)
    if kind == "run_code":
        call = state.manager.run_code(
            sandbox_id,
            RunCode.model_validate(fields),
            owner=who.owner_filter,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=outbox_.put_result(outbox, budget),
        )
        return _Run(who, kind, call, None)
    if kind == "command":
        command = RunCommand.model_validate(fields)
        backlog = state.settings.ws_stdin_backlog_kb * 1024
        stdin = TenantStdin(backlog, budget.shared) if message.get("stdin") else None
        call = state.manager.run_command(
            sandbox_id,
            command,
            stdin=stdin,
            owner=who.owner_filter,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )
        return _Run(who, kind, call, stdin)
    raise ConfigError(f"unknown message type {kind!r}; send run_code, command, pty or attach")


async def _stream_run(
    websocket: WebSocket,
    state: ServerState,
    sandbox_id: str,
    prepared: _Run,
    outbox: outbox_.Outbox,
    budget: outbox_.Budget,
) -> None:
    """Run it, its output and then its result to the client, its stdin from the client."""
    run = asyncio.create_task(prepared.call)
    sender = asyncio.create_task(outbox_.drain(websocket, outbox, budget))
    pace = state.stream_pace(prepared.who)
    listener = asyncio.create_task(_listen(websocket, prepared.stdin, outbox, budget, pace))
    watcher = asyncio.create_task(stream_jobs.watch_key(state, websocket))
    cut = False
    try:
        action = f"stream.{prepared.kind}"
        async with state.audited(websocket, prepared.who, action, sandbox_id):
            done, _ = await asyncio.wait(
                {run, listener, watcher}, return_when=asyncio.FIRST_COMPLETED
            )
            if run not in done:
                # The client went away mid-run, was cut for not reading what its messages
                # caused, or its key was revoked: stop the run inside the sandbox.
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, SandboxError):
                    await run
                error = stream_jobs.revoked(watcher)
                if error is not None:
                    raise error
                raise WebSocketDisconnect(code=outbox_.CUT_CODE if budget.cut else 1001)
            result: ExecResult = run.result()
        outbox_.final(outbox, budget, {"type": "result", "result": result.model_dump(mode="json")})
    except SandboxError as exc:
        outbox_.final(outbox, budget, outbox_.error_message(exc))
        cut = isinstance(exc, AuthenticationError)
    finally:
        watcher.cancel()
        if prepared.stdin is not None:
            prepared.stdin.release()
        await outbox_.finish(websocket, outbox, budget, sender, listener)
    if budget.cut:
        raise WebSocketDisconnect(code=outbox_.CUT_CODE)
    if cut:
        # The key was revoked during the run: it was stopped, and this socket closes.
        with contextlib.suppress(RuntimeError):
            await websocket.close(code=1008)
        raise WebSocketDisconnect(code=1008)


async def _listen(
    websocket: WebSocket,
    stdin: StdinQueue | None,
    outbox: outbox_.Outbox,
    budget: outbox_.Budget,
    pace: Pace,
) -> None:
    """Read the client's messages during a run: stdin, or its disconnect.

    Raises:
        QueueCapReached: the notices its messages caused reached the queue cap unread.
    """
    closed = False  # stdin_eof was sent: nothing takes from the queue after it
    while True:
        try:
            message = await outbox_.receive_message(websocket, pace)
        except InvalidRequest as exc:
            outbox_.notify(outbox, budget, outbox_.notice(exc.code, exc.message))
            continue
        if stdin is None or not isinstance(message, dict):
            continue
        kind = message.get("type")
        if kind not in ("stdin", "stdin_eof"):
            continue
        if closed:
            # Queued after the end, it would wait for good: refused, with a notice that
            # counts against the cap like any other.
            outbox_.notify(outbox, budget, STDIN_CLOSED)
            continue
        if kind == "stdin_eof":
            closed = True
            stdin.put_nowait(None)
            continue
        data = str(message.get("data", "")).encode("utf-8", "surrogatepass")
        if not data:
            continue  # nothing to send: not a request to the guest
        if not stdin.offer(data):
            # The command is not reading: refuse more instead of holding it for it. A
            # notice, not an error: the run goes on and its result still comes.
            full = outbox_.notice(
                "stdin_backlog_full",
                f"stdin dropped: {stdin.queued_bytes} bytes already wait for the command to "
                "read them; raise API_WS_STDIN_BACKLOG_KB to allow more",
            )
            outbox_.notify(outbox, budget, full)


STDIN_CLOSED = outbox_.notice("invalid_request", "stdin dropped: stdin_eof was sent already")
# What one queued stdin chunk costs beyond its bytes (the bytes object, its queue slot):
# counted against the backlog (StdinQueue), so that a flood of one-byte chunks is bounded
# like one big one.
STDIN_CHUNK_OVERHEAD_BYTES = 64


async def _send_error(websocket: WebSocket, exc: SandboxError) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_json(outbox_.error_message(exc))
