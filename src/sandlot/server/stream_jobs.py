"""The WebSocket's long-lived runs: terminals and background commands (see ``stream.py``).

Client -> server, the first message of such a run::

    {"type": "pty", "cols": 80, "rows": 24, "command": null, "cwd": null, "env": {}}
    {"type": "pty", "pid": N}                       attach to a terminal opened before
    {"type": "command", "command": "...", "background": true, ...}
    {"type": "attach", "pid": N}                    a background command started before

(an attach may name the ``command_id`` too: then only that command, never a later one that
took its pid after a guest restart)

then, while it runs::

    {"type": "input", "data_b64": "..."}            a terminal's keystrokes, raw bytes
    {"type": "resize", "cols": 120, "rows": 40}
    {"type": "stdin", "data": "text"}  {"type": "stdin_eof"}    a background command's

Server -> client::

    {"type": "started", "info": {CommandInfo}}      first: its pid
    {"type": "output", "data_b64": "..."}           a terminal's output, raw bytes
    {"type": "stdout"|"stderr", "data": "..."}      a background command's
    {"type": "notice", ...}  then  {"type": "result", "result": {ExecResult}} once it ends

A client that goes away only detaches: the terminal or command runs on (its pid takes the
REST verbs; it counts against the sandbox's cap and ends with the sandbox). Output queued for
a slow client is capped as any run's is (:data:`outbox_.STREAM_QUEUE_MAX_BYTES`), and a client
whose input, resizes or stdin keep queueing notices it does not read is cut at that cap (close
code 1008): it only detaches, as a client that goes away does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from starlette.requests import HTTPConnection

from sandlot.errors import (
    AuthenticationError,
    ConfigError,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
)
from sandlot.models import CommandInfo, DataCallback, OutputCallback
from sandlot.requests import CommandInput, OpenPty, PtyInput, PtySize, RunCommand
from sandlot.server import outbox as outbox_
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState

# A bound on the size of a "started" frame (a CommandInfo), counted against the queue cap
# before it is known.
STARTED_COST_BYTES = 4096
COMMAND_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as REST's ?command_id= (routes.py)
INPUT_WAIT_S = 5.0  # input for a program that does not read is refused after this
KEY_RECHECK_S = 1.0  # how often a long stream's input checks that its key is still valid


async def watch_key(state: ServerState, connection: HTTPConnection) -> None:
    """Return never; raise once the key of a stream (or of a long request: an agent task)
    is revoked (checked every :data:`KEY_RECHECK_S`): a stream's output and input both stop
    with its key, not only at the client's next message (a revoked key kept typing into a
    command and reading a background command's output for as long as they ran: red team,
    2026-12-06).

    Raises:
        AuthenticationError: the key is no longer valid.
    """
    while True:
        await asyncio.sleep(KEY_RECHECK_S)
        state.recheck(connection.headers, connection.query_params.get("api_key"))


def revoked(watcher: asyncio.Task[None]) -> AuthenticationError | None:
    """The revocation :func:`watch_key`'s task ended with, if it has."""
    if watcher.done() and not watcher.cancelled():
        error = watcher.exception()
        if isinstance(error, AuthenticationError):
            return error
    return None


def is_job(message: dict[str, Any]) -> bool:
    kind = message.get("type")
    return kind in ("pty", "attach") or (kind == "command" and bool(message.get("background")))


async def run_job(
    websocket: WebSocket,
    state: ServerState,
    who: Principal,
    sandbox_id: str,
    message: dict[str, Any],
) -> None:
    """Start or attach to a terminal or background command and stream it until it ends."""
    outbox: outbox_.Outbox = asyncio.Queue()
    budget = state.stream_budget(who)
    manager = state.manager
    owner = who.owner_filter
    kind = message["type"]
    on_stdout = outbox_.put_text(outbox, "stdout", budget)
    on_stderr = outbox_.put_text(outbox, "stderr", budget)

    def on_data(data: bytes) -> None:
        item = {"type": "output", "data_b64": base64.b64encode(data).decode("ascii")}
        outbox_.offer(outbox, budget, item, outbox_.item_cost(item))

    info = await _start(
        state, who, sandbox_id, message, (on_stdout, on_stderr), on_data, outbox, budget
    )
    pid, command_id = info.pid, info.command_id
    cut = False
    run = asyncio.create_task(
        manager.wait_command(sandbox_id, pid, owner=owner, command_id=command_id)
    )
    sender = asyncio.create_task(outbox_.drain(websocket, outbox, budget))
    listener = asyncio.create_task(_listen(websocket, state, who, sandbox_id, info, outbox, budget))
    watcher = asyncio.create_task(watch_key(state, websocket))
    try:
        async with state.audited(websocket, who, f"stream.{kind}", sandbox_id, pid=pid):
            done, _ = await asyncio.wait(
                {run, listener, watcher}, return_when=asyncio.FIRST_COMPLETED
            )
            if run not in done:
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, SandboxError):
                    await run
                error = revoked(watcher)
                if error is not None:
                    raise error
                # Detached: it runs on (a client cut for not reading is detached too).
                raise WebSocketDisconnect(code=outbox_.CUT_CODE if budget.cut else 1001)
            if run.cancelled():
                # Its sandbox was destroyed meanwhile (by its owner, its TTL, an admin): the
                # wait's CancelledError reached the server as an unhandled exception, and
                # the socket closed with no frame (red team, 2026-12-06).
                raise SandboxNotFound(f"sandbox {sandbox_id} ended while this streamed")
            result = run.result()
        outbox_.final(outbox, budget, {"type": "result", "result": result.model_dump(mode="json")})
    except SandboxError as exc:
        outbox_.final(outbox, budget, outbox_.error_message(exc))
        if isinstance(exc, AuthenticationError):
            cut = True
    finally:
        watcher.cancel()
        if info.pty:
            manager.disconnect_pty(sandbox_id, pid, on_data, command_id=command_id)
        manager.disconnect_command(sandbox_id, pid, on_stdout, on_stderr, command_id=command_id)
        await outbox_.finish(websocket, outbox, budget, sender, listener)
    if budget.cut:
        raise WebSocketDisconnect(code=outbox_.CUT_CODE)
    if cut:
        # The key was revoked during the stream: the job runs on, this socket does not.
        with contextlib.suppress(RuntimeError):
            await websocket.close(code=1008)
        raise WebSocketDisconnect(code=1008)


async def _start(
    state: ServerState,
    who: Principal,
    sandbox_id: str,
    message: dict[str, Any],
    callbacks: tuple[OutputCallback, OutputCallback],
    on_data: DataCallback,
    outbox: outbox_.Outbox,
    budget: outbox_.Budget,
) -> CommandInfo:
    """Open, start or attach to what ``message`` names; its "started" message goes first, in
    a slot queued before anything could produce output (counted at a bound of its size)."""
    started: dict[str, Any] = {}
    outbox_.notify(outbox, budget, started, STARTED_COST_BYTES)
    try:
        return await _open(state, who, sandbox_id, message, callbacks, on_data, started)
    except BaseException:
        # Its "started" slot was counted in the tenant's share: given back, or each failed
        # attach kept 4 KiB of it for good (344 of them silenced a 1 MiB share: red team,
        # 2026-12-06).
        budget.clear(outbox)
        raise


async def _open(
    state: ServerState,
    who: Principal,
    sandbox_id: str,
    message: dict[str, Any],
    callbacks: tuple[OutputCallback, OutputCallback],
    on_data: DataCallback,
    started: dict[str, Any],
) -> CommandInfo:
    manager = state.manager
    owner = who.owner_filter
    kind = message["type"]
    fields = {k: v for k, v in message.items() if k not in ("type", "pid", "command_id")}
    pid = message.get("pid")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        raise ConfigError("pid must be an integer")
    command_id = message.get("command_id")
    if command_id is not None and not (
        isinstance(command_id, str) and COMMAND_ID.fullmatch(command_id)
    ):
        raise ConfigError("command_id must be 1-64 letters, digits, '-' or '_'")
    before = b""
    if kind == "pty" and pid is not None:
        # What it wrote before, then what comes: nothing runs between the two (no await
        # yields to the loop that delivers output), so no chunk is lost or sent twice.
        window = await manager.pty_output(sandbox_id, pid, 0, owner=owner, command_id=command_id)
        info = await manager.connect_pty(
            sandbox_id, pid, on_data, owner=owner, command_id=command_id
        )
        before = base64.b64decode(window.data_b64)
    elif kind == "pty":
        request = OpenPty.model_validate(fields)
        info = await manager.start_pty(sandbox_id, request, on_data=on_data, owner=owner)
    elif kind == "attach":
        if pid is None:
            raise ConfigError("attach needs the pid of a background command")
        info = await manager.connect_command(
            sandbox_id,
            pid,
            on_stdout=callbacks[0],
            on_stderr=callbacks[1],
            owner=owner,
            command_id=command_id,
        )
    else:
        command = RunCommand.model_validate(fields)
        info = await manager.start_command(
            sandbox_id, command, on_stdout=callbacks[0], on_stderr=callbacks[1], owner=owner
        )
    started.update(type="started", info=info.model_dump(mode="json"))
    if before:
        on_data(before)
    return info


async def _listen(
    websocket: WebSocket,
    state: ServerState,
    who: Principal,
    sandbox_id: str,
    info: CommandInfo,
    outbox: outbox_.Outbox,
    budget: outbox_.Budget,
) -> None:
    """The client's messages while it runs: input, resize; returns when it disconnects.

    Raises:
        QueueCapReached: the notices its messages caused reached the queue cap unread.
    """
    manager = state.manager
    pace = state.stream_pace(who)
    while True:
        try:
            message = await outbox_.receive_message(websocket, pace)
        except (WebSocketDisconnect, RuntimeError):
            return
        except InvalidRequest as exc:
            outbox_.notify(outbox, budget, outbox_.notice(exc.code, exc.message))
            continue
        if not isinstance(message, dict):
            continue
        kind = message.get("type")
        if _empty(message):
            continue  # nothing to type or send: not a request to the guest
        # Each notice below counts against the queue cap (outbox_.notify): a client that
        # sends bad input or resizes in a loop and reads nothing is cut there.
        try:
            if kind == "resize" and info.pty:
                size = PtySize.model_validate({k: message.get(k) for k in ("cols", "rows")})
                await manager.resize_pty(
                    sandbox_id, info.pid, size, owner=who.owner_filter, command_id=info.command_id
                )
            elif kind in ("input", "stdin", "stdin_eof"):
                await asyncio.wait_for(_input(state, who, sandbox_id, info, message), INPUT_WAIT_S)
        except TimeoutError:
            unread = "input dropped: the program has not read what came before"
            outbox_.notify(outbox, budget, outbox_.notice("stdin_backlog_full", unread))
        except (SandboxError, ValueError) as exc:
            error = exc if isinstance(exc, SandboxError) else InvalidRequest(str(exc))
            outbox_.notify(outbox, budget, outbox_.notice(error.code, error.message))


def _empty(message: dict[str, Any]) -> bool:
    """Input or stdin with no bytes in it (not an end of input): nothing to do."""
    kind = message.get("type")
    if kind not in ("input", "stdin"):
        return False
    value = message.get("data_b64" if kind == "input" else "data", "")
    return isinstance(value, str) and not value


async def _input(
    state: ServerState, who: Principal, sandbox_id: str, info: CommandInfo, message: Any
) -> None:
    kind = message.get("type")
    if kind == "input":
        # send_pty_input refuses a command that is not a terminal.
        data = PtyInput.model_validate({"data_b64": message.get("data_b64", "")}).data()
        await state.manager.send_pty_input(
            sandbox_id, info.pid, data, owner=who.owner_filter, command_id=info.command_id
        )
        return
    if info.pty:
        raise InvalidRequest("a terminal takes input (data_b64), not stdin")
    # The same checks as REST's stdin body (size, type).
    chunk = CommandInput.model_validate({"data": message.get("data", "")})
    data = chunk.data.encode("utf-8", "surrogatepass")
    eof = kind == "stdin_eof"
    await state.manager.send_command_stdin(
        sandbox_id, info.pid, data, eof=eof, owner=who.owner_filter, command_id=info.command_id
    )
