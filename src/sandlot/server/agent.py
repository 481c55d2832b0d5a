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
import sys
import uuid
from collections.abc import Coroutine
from typing import Annotated, Any, Literal, TypeVar

import structlog
from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError
from starlette.types import Message

from sandlot._strict import problems
from sandlot.agent.agents import AGENT_NAME_PATTERN, AgentDefinition, get_agent, load_agents
from sandlot.agent.models import AgentEvent, AgentResult
from sandlot.errors import (
    AgentTimeout,
    AuthenticationError,
    ConfigError,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
)
from sandlot.models import SandboxStatus
from sandlot.server import outbox as outbox_
from sandlot.server import stream_jobs
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, caller, client_gone, refuse_upgrade, state_of
from sandlot.server.outbox import error_message
from sandlot.server.schemas import _Body

log = structlog.get_logger(__name__)
router = APIRouter(tags=["agent"])
MAX_TASK_CHARS = 20_000
SANDBOX_CHECK_S = 1.0  # how often a task looks whether its sandbox was destroyed
# Messages a `WS /stream` client sent while its task runs, kept for after it; past them the
# socket is not read until the task ends (the client's kernel holds the rest).
PENDING_MESSAGES = 4
# A task message's largest JSON: MAX_TASK_CHARS characters, each escaped to at most 12 bytes
# (a surrogate pair), and the other fields. A larger one is kept only as its size.
MAX_TASK_MESSAGE_BYTES = 12 * MAX_TASK_CHARS + 16 * 1024
T = TypeVar("T")


class AgentTaskRequest(_Body):
    task: str = Field(min_length=1, max_length=MAX_TASK_CHARS, description="What to build.")
    mode: Literal["loop", "single", "swarm"] | None = Field(
        default=None, description="loop (the default), single or swarm; else the agent's."
    )
    max_attempts: int | None = Field(default=None, ge=1, le=10)
    agent: str | None = Field(
        default=None,
        pattern=AGENT_NAME_PATTERN,
        description="A registry agent (GET /v1/agents): its mode, attempts and sandbox.",
    )


@router.get("/v1/agents", response_model=list[AgentDefinition])
async def list_agents(
    request: Request, who: Annotated[Principal, Depends(caller)]
) -> list[AgentDefinition]:
    """The registry's agents (seed 001's registry/agents): what ``"agent"`` may name."""
    return list(load_agents(state_of(request).settings.registry_dir).values())


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
    """Create the caller's sandbox, run the task in it, destroy it.

    A task holds the server's one model for its calls, on the server's own CPU, charged to
    no sandbox: it counts against its tenant's running tasks (``API_AGENT_TASKS_PER_TENANT``),
    ends past ``API_AGENT_TASK_TIMEOUT_SECONDS``, and ends within a second of its sandbox's
    destroy, by anyone (a swarm of ten attempts took 233 s of the server's CPU, and went on
    for its owner's deleted sandboxes, past their quota: red team, 2026-12-06).

    Raises:
        TooManyAgentTasks: the tenant has its most tasks running.
        AgentTimeout: the task ran past its time.
        SandboxNotRunning: its sandbox was destroyed meanwhile.
    """
    from sandlot.sandbox import AsyncSandbox

    who.require_write()
    agent = get_agent(body.agent, state.settings.registry_dir) if body.agent else None
    spec = agent.sandbox.spec() if agent is not None else None
    state.agent_tasks.acquire(who.tenant)
    try:
        runtime = _runtime(state)
        info = await state.manager.create(spec, owner=who.tenant, quota=state.quota_for(who))
        try:
            # A Ray routing manager has the manager's verbs too (the SDK needs no more).
            sandbox = await AsyncSandbox.connect(info.id, manager=state.manager)  # type: ignore[arg-type]
            # The memory recalls and keeps the caller's own tasks only.
            work = runtime.execute(
                body.task,
                mode=body.mode or (agent.mode if agent is not None else "loop"),
                on_event=on_event,
                sandbox=sandbox,
                tenant=who.tenant,
                max_attempts=body.max_attempts or (agent.max_attempts if agent else None),
            )
            timeout_s = state.settings.agent_task_timeout_s
            return await first_of(
                work, _time_out(timeout_s), _sandbox_gone(state, info.id, who.owner_filter)
            )
        finally:
            with contextlib.suppress(SandboxError):
                await state.manager.destroy(info.id, owner=who.owner_filter)
    finally:
        state.agent_tasks.release(who.tenant)


async def execute_task(body: AgentTaskRequest, request: Request, who: Principal) -> AgentResult:
    """``POST /execute``'s task: ended with its key's revocation or its client's going (a
    task whose client hung up after 90 s ran on for 14 minutes, and on for a revoked key)."""
    state = state_of(request)
    async with state.audited(request, who, "agent.execute") as audit:
        result = await first_of(
            run_task(state, who, body),
            stream_jobs.watch_key(state, request),
            _client_left(request),
        )
        audit["status"] = result.status
    return result


async def first_of(work: Coroutine[Any, Any, T], *stoppers: Coroutine[Any, Any, Any]) -> T:
    """``work``'s result, unless one of ``stoppers`` (each raises when the work must end)
    ends first: then ``work`` is cancelled (a local model's decoding stops at its next
    token, and ``run_task`` destroys the sandbox) and the stopper's error raised."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(stopper) for stopper in stoppers]
    waiting: set[asyncio.Future[Any]] = {task, *watchers}
    try:
        while task in waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                break
            for watcher in done:
                error = watcher.exception()
                if isinstance(error, SandboxError):
                    raise error  # why the work must end
                # A watcher's own fault (a store that was busy, say) ends the watching,
                # not the work.
                log.warning("an agent task's watcher failed", error=repr(error))
        return await task
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, SandboxError, WebSocketDisconnect):
                pass
            except Exception:
                log.exception("an ended agent task failed on its way out")


async def _time_out(timeout_s: float) -> None:
    await asyncio.sleep(timeout_s)
    raise AgentTimeout(
        f"the agent task ran past {timeout_s:g} s and was ended; raise "
        "API_AGENT_TASK_TIMEOUT_SECONDS or give it fewer attempts (max_attempts)"
    )


async def _sandbox_gone(state: ServerState, sandbox_id: str, owner: str | None) -> None:
    while True:
        await asyncio.sleep(SANDBOX_CHECK_S)
        try:
            info = await state.manager.get(sandbox_id, owner=owner)
        except SandboxNotFound:
            raise SandboxNotRunning(
                f"the task's sandbox {sandbox_id} is gone: the task was ended"
            ) from None
        except SandboxError as exc:  # a node that did not answer: look again next time
            log.warning("could not look at an agent task's sandbox", error=repr(exc))
            continue
        if info.status != SandboxStatus.RUNNING:
            raise SandboxNotRunning(
                f"the task's sandbox {sandbox_id} was destroyed ({info.end_reason}): the task "
                "was ended"
            )


def _client_went_away() -> InvalidRequest:
    return InvalidRequest("the client went away before the task ended: the task was ended")


async def _client_left(request: Request) -> None:
    await client_gone(request)
    raise _client_went_away()


class _Inbox:
    """A `WS /stream` client's messages, read while its task runs too: a hang-up ends the
    task at once. Before, nothing read the socket during a task, so a client that left was
    seen only at the task's next event, after a model call of up to minutes (red team,
    2026-12-06). At most :data:`PENDING_MESSAGES` wait for the task; with that many waiting,
    a hang-up is again seen at the task's next event."""

    def __init__(self, websocket: WebSocket) -> None:
        self.gone = asyncio.Event()
        self._pending: asyncio.Queue[Message] = asyncio.Queue(PENDING_MESSAGES)
        self._reader = asyncio.ensure_future(self._read(websocket))

    async def _read(self, websocket: WebSocket) -> None:
        while True:
            try:
                message = await websocket.receive()
            except Exception:  # the socket broke: for us, the client went away
                message = {"type": "websocket.disconnect", "code": 1006}
            if message["type"] == "websocket.disconnect":
                self.gone.set()
                await self._pending.put(message)
                return
            # In memory, not in characters: text of emoji takes 4 bytes a character.
            size = sys.getsizeof(message.get("text") or message.get("bytes") or b"")
            if size > MAX_TASK_MESSAGE_BYTES:
                # Not kept while it waits: 4 MiB messages held 41 MiB a socket (red team).
                message = {"type": "websocket.receive", "oversize": size}
            await self._pending.put(message)

    async def get(self) -> Message:
        return await self._pending.get()

    async def hung_up(self) -> None:
        await self.gone.wait()
        raise _client_went_away()

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


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
    inbox: _Inbox | None = None
    try:
        await websocket.accept()
        inbox = _Inbox(websocket)
        while True:
            try:
                message = await outbox_.read_message(await inbox.get(), pace)
            except InvalidRequest as exc:
                await outbox_.send_or_gone(websocket, error_message(exc))
                continue
            await _one_task(websocket, state, message, inbox)
    except WebSocketDisconnect:
        return
    finally:
        if inbox is not None:
            await inbox.close()
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


def _task_of(message: Any) -> AgentTaskRequest:
    if not isinstance(message, dict):
        raise ConfigError("each message must be a JSON object with a 'task'")
    try:
        return AgentTaskRequest.model_validate(message)
    except ValidationError as exc:
        # Without the input (a 4 MiB task came back in a 4 MiB error), and at most ten
        # problems (one a key: 25,000 keys took the loop 400 ms; red team, 2026-12-06).
        errors = exc.errors(include_url=False, include_input=False)
        raise ConfigError(f"invalid task message: {problems(errors)}") from exc


async def _one_task(websocket: WebSocket, state: ServerState, message: Any, inbox: _Inbox) -> None:
    async def send_event(event: AgentEvent) -> None:
        # The client left: WebSocketDisconnect ends the task (its sandbox is destroyed on
        # the way out).
        await outbox_.send_or_gone(
            websocket, {"type": "event", "event": event.model_dump(mode="json")}
        )

    # Every task is a request: the key is checked (revoked?) and rate-limited again.
    who = await _authenticate(websocket, state)
    try:
        result = await first_of(
            run_task(state, who, _task_of(message), on_event=send_event),
            stream_jobs.watch_key(state, websocket),
            inbox.hung_up(),
        )
        await outbox_.send_or_gone(
            websocket, {"type": "result", "result": result.model_dump(mode="json")}
        )
    except SandboxError as exc:
        if inbox.gone.is_set():
            raise WebSocketDisconnect(1001) from exc  # nobody to tell
        await outbox_.send_or_gone(websocket, error_message(exc))
        if isinstance(exc, AuthenticationError):
            with contextlib.suppress(RuntimeError, OSError):
                await websocket.close(code=1008)
            raise WebSocketDisconnect(1008) from exc
    except (WebSocketDisconnect, asyncio.CancelledError):
        raise
    except Exception:
        # A fault of ours is the one task's: the socket stays, typed, for the next (it was
        # dropped with an ASGI traceback and no close frame: red team, 2026-12-06).
        log.exception("agent task failed", request_id=websocket.state.request_id)
        await outbox_.send_or_gone(
            websocket,
            {
                "type": "error",
                "error": {
                    "code": "internal_error",
                    "message": "internal error; the request id is in the server log",
                },
            },
        )
