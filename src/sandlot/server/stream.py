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
    {"type": "error", "error": {"code": "...", "message": "..."}}

A client that disconnects mid-run does not leak it: the run is cancelled inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from sandlot.errors import ConfigError, SandboxError
from sandlot.models import ExecResult
from sandlot.requests import RunCode, RunCommand
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState

log = structlog.get_logger(__name__)
router = APIRouter(tags=["streaming"])
STREAM_QUEUE_MAX_BYTES = 8 << 20


@router.websocket("/v1/sandboxes/{sandbox_id}/stream")
async def stream(websocket: WebSocket, sandbox_id: str) -> None:
    state: ServerState = websocket.app.state.sandbox
    websocket.state.request_id = websocket.headers.get("x-request-id") or uuid.uuid4().hex
    await websocket.accept()
    try:
        who = state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
        await state.manager.get(sandbox_id, owner=who.owner_filter)
    except SandboxError as exc:
        await _send_error(websocket, exc)
        await websocket.close(code=1008)
        return
    try:
        while True:
            message = await websocket.receive_json()
            await _one_run(websocket, state, who, sandbox_id, message)
    except WebSocketDisconnect:
        return


async def _one_run(
    websocket: WebSocket, state: ServerState, who: Principal, sandbox_id: str, message: Any
) -> None:
    outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    budget = _Budget()
    stdin: asyncio.Queue[bytes | None] | None = None
    try:
        if not isinstance(message, dict):
            raise ConfigError("each message must be a JSON object with a 'type'")
        # Every run is a request: the key is checked (revoked?) and rate-limited again.
        who = state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
        who.require_write()
        kind = message.get("type")
        fields = {k: v for k, v in message.items() if k not in ("type", "stdin")}
        if kind == "run_code":
            call = state.manager.run_code(
                sandbox_id,
                RunCode.model_validate(fields),
                owner=who.owner_filter,
                on_stdout=_put(outbox, "stdout", budget),
                on_stderr=_put(outbox, "stderr", budget),
            )
        elif kind == "command":
            command = RunCommand.model_validate(fields)
            stdin = asyncio.Queue() if message.get("stdin") else None
            call = state.manager.run_command(
                sandbox_id,
                command,
                stdin=stdin,
                owner=who.owner_filter,
                on_stdout=_put(outbox, "stdout", budget),
                on_stderr=_put(outbox, "stderr", budget),
            )
        else:
            raise ConfigError(f"unknown message type {kind!r}; send run_code or command")
    except ValidationError as exc:
        await _send_error(websocket, ConfigError(f"invalid message: {exc.errors()[0]['msg']}"))
        return
    except SandboxError as exc:
        await _send_error(websocket, exc)
        return

    run = asyncio.create_task(call)
    sender = asyncio.create_task(_drain(websocket, outbox, budget))
    listener = asyncio.create_task(_listen(websocket, stdin))
    try:
        async with state.audited(websocket, who, f"stream.{kind}", sandbox_id):
            done, _ = await asyncio.wait({run, listener}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                # The client went away mid-run: stop the run inside the sandbox.
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, SandboxError):
                    await run
                raise WebSocketDisconnect(code=1001)
            result: ExecResult = run.result()
        outbox.put_nowait({"type": "result", "result": result.model_dump(mode="json")})
    except SandboxError as exc:
        outbox.put_nowait(_error_message(exc))
    finally:
        listener.cancel()
        outbox.put_nowait(None)
        with contextlib.suppress(Exception):
            await sender


class _Budget:
    """Bytes of streamed output queued for a client that has not taken them yet."""

    def __init__(self) -> None:
        self.queued = 0
        self.dropped = False


def _put(outbox: asyncio.Queue[dict[str, Any] | None], stream: str, budget: _Budget) -> Any:
    def put(text: str) -> None:
        # A client that does not read must not make the server hold its output: past the
        # cap, chunks are dropped (the final result still carries head and tail).
        if budget.queued + len(text) > STREAM_QUEUE_MAX_BYTES:
            if not budget.dropped:
                budget.dropped = True
                outbox.put_nowait(
                    {
                        "type": "notice",
                        "message": "stream output dropped: the client reads too slowly",
                    }
                )
            return
        budget.queued += len(text)
        outbox.put_nowait({"type": stream, "data": text})

    return put


async def _drain(
    websocket: WebSocket, outbox: asyncio.Queue[dict[str, Any] | None], budget: _Budget
) -> None:
    # One writer keeps chunks in the order they were produced, with the result last.
    while (item := await outbox.get()) is not None:
        await websocket.send_json(item)
        budget.queued -= len(item.get("data", ""))


async def _listen(websocket: WebSocket, stdin: asyncio.Queue[bytes | None] | None) -> None:
    """Read the client's messages during a run: stdin, or its disconnect."""
    while True:
        message = await websocket.receive_json()
        if stdin is None or not isinstance(message, dict):
            continue
        if message.get("type") == "stdin":
            stdin.put_nowait(str(message.get("data", "")).encode())
        elif message.get("type") == "stdin_eof":
            stdin.put_nowait(None)


def _error_message(exc: SandboxError) -> dict[str, Any]:
    return {"type": "error", "error": {"code": exc.code, "message": exc.message}}


async def _send_error(websocket: WebSocket, exc: SandboxError) -> None:
    with contextlib.suppress(Exception):
        await websocket.send_json(_error_message(exc))
