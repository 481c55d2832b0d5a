"""Seed 002's agent endpoints: ``POST /execute {"task": ...}`` and ``WS /stream``.

The agent works through the SDK like any client: the server creates the sandbox for the
caller (their quota, their audit trail), hands the agent an :class:`AsyncSandbox` attached
to it, and destroys it when the task is done. ``POST /execute`` with seed 004's body
(``session_id`` and ``command``) still runs a command; see :mod:`.compat`.

``WS /stream``, client -> server, once per task::

    {"task": "...", "mode": "loop" | "single" | "swarm", "max_attempts": 3}

server -> client: ``{"type": "event", "event": {AgentEvent}}`` for each step (generate, code,
execute, critique, vote), then ``{"type": "result", "result": {AgentResult}}``, or
``{"type": "error", "error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine
from typing import Any, Literal

import structlog
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from sandlot.agent.models import AgentEvent, AgentResult
from sandlot.errors import AuthenticationError, ConfigError, InvalidRequest, SandboxError
from sandlot.server import outbox as outbox_
from sandlot.server import stream_jobs
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, refuse_upgrade, state_of
from sandlot.server.outbox import error_message
from sandlot.server.schemas import _Body

log = structlog.get_logger(__name__)
router = APIRouter(tags=["agent"])
MAX_TASK_CHARS = 20_000


class AgentTaskRequest(_Body):
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS, description="What to build.")
    mode: Literal["loop", "single", "swarm"] = "loop"
    max_attempts: int | None = Field(default=None, ge=1, le=10)


def _runtime(state: ServerState) -> Any:
    from sandlot.agent.runtime import AgentRuntime

    # One runtime (and so one loaded model, one memory) per server; attempts are per
    # request. A second runtime for a request's max_attempts opened a second embedded
    # memory, which its folder's lock refuses.
    runtime = state.agent_runtime
    if runtime is None:
        runtime = state.agent_runtime = AgentRuntime()
    return runtime


async def run_task(
    state: ServerState,
    who: Principal,
    body: AgentTaskRequest,
    on_event: Any = None,
) -> AgentResult:
    """Create the caller's sandbox, run the task in it, destroy it."""
    from sandlot.sandbox import AsyncSandbox

    who.require_write()
    runtime = _runtime(state)
    info = await state.manager.create(owner=who.tenant, quota=state.quota_for(who))
    try:
        # A Ray routing manager has the manager's verbs too (the SDK needs no more).
        sandbox = await AsyncSandbox.connect(info.id, manager=state.manager)  # type: ignore[arg-type]
        # The memory recalls and keeps the caller's own tasks only.
        result: AgentResult = await runtime.execute(
            body.task,
            mode=body.mode,
            on_event=on_event,
            sandbox=sandbox,
            tenant=who.tenant,
            max_attempts=body.max_attempts,
        )
        return result
    finally:
        with contextlib.suppress(SandboxError):
            await state.manager.destroy(info.id, owner=who.owner_filter)


async def execute_task(body: AgentTaskRequest, request: Request, who: Principal) -> AgentResult:
    state = state_of(request)
    async with state.audited(request, who, "agent.execute") as audit:
        result = await run_task(state, who, body)
        audit["status"] = result.status
    return result


@router.websocket("/stream")
async def stream(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.sandbox
    websocket.state.request_id = websocket.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        who = state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
        # The socket counts against its tenant's open requests until it closes.
        state.open_requests.acquire(who.tenant)
    except SandboxError as exc:
        # The key before the upgrade: a socket without one was kept open, answered
        # "unauthenticated" per message (a client with no key held thousands), and later,
        # closed after the upgrade, held for ~10 s waiting for the client's close reply
        # (red team, 2026-11-25 and 2026-12-06).
        await refuse_upgrade(websocket, exc)
        return
    pace = state.stream_pace(who)
    try:
        await websocket.accept()
        while True:
            try:
                message = await outbox_.receive_message(websocket, pace)
            except InvalidRequest as exc:
                await websocket.send_json(error_message(exc))
                continue
            await _one_task(websocket, state, message)
    except WebSocketDisconnect:
        return
    finally:
        state.open_requests.release(who.tenant)


async def _authenticate(websocket: WebSocket, state: ServerState) -> Principal:
    """The caller, or the socket closed (1008) with the typed error sent first."""
    try:
        return state.authenticate(websocket.headers, websocket.query_params.get("api_key"))
    except SandboxError as exc:
        with contextlib.suppress(RuntimeError, OSError):
            await websocket.send_json(error_message(exc))
            await websocket.close(code=1008)
        raise WebSocketDisconnect(1008) from exc


async def _one_task(websocket: WebSocket, state: ServerState, message: Any) -> None:
    async def send_event(event: AgentEvent) -> None:
        try:
            await websocket.send_json({"type": "event", "event": event.model_dump(mode="json")})
        except (RuntimeError, OSError) as exc:
            # The client left: end the task (its sandbox is destroyed on the way out).
            raise WebSocketDisconnect(1001) from exc

    # Every task is a request: the key is checked (revoked?) and rate-limited again.
    who = await _authenticate(websocket, state)
    try:
        if not isinstance(message, dict):
            raise ConfigError("each message must be a JSON object with a 'task'")
        try:
            body = AgentTaskRequest.model_validate(message)
        except ValidationError as exc:
            raise ConfigError(f"invalid task message: {exc.errors(include_url=False)}") from exc
        result = await _watched(websocket, state, run_task(state, who, body, on_event=send_event))
        await websocket.send_json({"type": "result", "result": result.model_dump(mode="json")})
    except SandboxError as exc:
        await websocket.send_json(error_message(exc))
        if isinstance(exc, AuthenticationError):
            with contextlib.suppress(RuntimeError, OSError):
                await websocket.close(code=1008)
            raise WebSocketDisconnect(1008) from exc


async def _watched(
    websocket: WebSocket, state: ServerState, work: Coroutine[Any, Any, AgentResult]
) -> AgentResult:
    """``work``, ended (and its sandbox with it) if the key is revoked meanwhile: a task
    runs up to ten attempts of model calls and sandbox time, and went on to its end for a
    revoked key (red team, 2026-12-06).

    Raises:
        AuthenticationError: the key was revoked.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(stream_jobs.watch_key(state, websocket))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        error = stream_jobs.revoked(watcher)
        if error is not None:
            raise error
        return await task
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandboxError, WebSocketDisconnect):
                await task
