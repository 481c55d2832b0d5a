"""A WebSocket's outbox: every frame queued for one writer, bounded in bytes (a client that
does not read holds nothing past the cap), shared by runs (``stream.py``) and background jobs
and terminals (``stream_jobs.py``).

Every frame counts against one budget per run, and is paid back once it is written (the runs
of a socket follow one another, the next once this one's last frame is written: the budget is
the socket's):

- streamed output (:func:`offer`) past the cap is dropped, with one ``output_dropped``
  notice: a sandbox that prints faster than its client reads costs the host a bounded amount,
  and the run goes on;
- the frames a client's own messages cause (:func:`notify`: a notice for refused stdin, for a
  bad resize or input) have no such way out: the client sends more of them the less it reads.
  Past the cap the socket is cut (:func:`cut`, close code :data:`CUT_CODE`): before, a client
  that never read and sent one-byte stdin to a full backlog grew the server by ~20 MB a
  second, one queued notice per message;
- a run's last frame (:func:`final`: its result or error) is counted but always queued: there
  is one per run, and the next run waits until it has been written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from typing import Any

import structlog
from fastapi import WebSocket, WebSocketDisconnect
from starlette.types import Message

from sandlot.errors import InvalidRequest, SandboxError
from sandlot.guest.wire import MAX_JSON_DEPTH, nests_within
from sandlot.models import Result
from sandlot.server.limits import Pace

log = structlog.get_logger(__name__)

STREAM_QUEUE_MAX_BYTES = 8 << 20
# What one queued chunk costs the server beyond its bytes (the message dict, the str object):
# counted so that a flood of 1-byte chunks is bounded like one big chunk.
CHUNK_OVERHEAD_BYTES = 256
# A client's message costs its tenant's stream pace one turn, and one more for each this
# many bytes of it.
PACE_BYTES = 16 << 10
# Kept free of output for the frames that must still go out once output fills the queue (a
# few notices, the result), so that a client reading a flood of output slowly is not cut by
# the first notice its input causes.
CONTROL_RESERVE_BYTES = 256 << 10
# The close frame of a cut waits behind what is queued in the transport: a client that reads
# nothing within this is dropped (its connection aborted) instead.
CUT_WAIT_S = 5.0
CUT_CODE = 1008  # policy violation
CUT_REASON = "stream queue cap reached: the client does not read what it is sent"
# The ASGI scope extension through which :func:`cut` aborts a connection (``transport.py``).
ABORT_EXTENSION = "sandlot.abort"

Outbox = asyncio.Queue[dict[str, Any] | None]


class QueueCapReached(Exception):
    """Frames a client's own messages caused reached the queue cap: the socket is to be cut."""


class Shared:
    """Bytes queued on all the streams of one tenant, at most ``cap_bytes`` of streamed output
    (``API_STREAM_QUEUE_MB_PER_TENANT``): each stream's own cap is 8 MiB, and 200 sockets
    that never read, attached to one terminal, took the server to 1.78 GB in 3 s (red team,
    2026-12-06)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.queued = 0


class Budget:
    """Bytes of frames queued for a client that has not taken them yet; counted in its
    tenant's :class:`Shared` too, where it has one."""

    def __init__(self, shared: Shared | None = None) -> None:
        self.queued = 0
        self.dropped = False
        self.cut = False  # set once: nothing is queued after it, and the socket is cut
        self.shared = shared
        self._costs: deque[int] = deque()  # of the queued frames, oldest first

    def fits(self, cost: int) -> bool:
        """Whether streamed output of ``cost`` may be queued: within this stream's cap (less
        what is kept for the frames that must still go out) and its tenant's."""
        if self.queued + cost > STREAM_QUEUE_MAX_BYTES - CONTROL_RESERVE_BYTES:
            return False
        return self.shared is None or self.shared.queued + cost <= self.shared.cap_bytes

    def add(self, outbox: Outbox, item: dict[str, Any], cost: int) -> None:
        self.queued += cost
        if self.shared is not None:
            self.shared.queued += cost
        self._costs.append(cost)
        outbox.put_nowait(item)

    def taken(self) -> None:
        """The oldest queued frame has been written."""
        if self._costs:
            self._paid(self._costs.popleft())

    def clear(self, outbox: Outbox) -> None:
        """Forget everything still queued (a cut socket, or one gone, will never take it)."""
        while not outbox.empty():
            outbox.get_nowait()
        self._costs.clear()
        self._paid(self.queued)

    def _paid(self, cost: int) -> None:
        self.queued -= cost
        if self.shared is not None:
            self.shared.queued -= cost


def put_text(outbox: Outbox, stream: str, budget: Budget) -> Any:
    def put(text: str) -> None:
        offer(outbox, budget, {"type": stream, "data": text}, cost(text))

    return put


def put_result(outbox: Outbox, budget: Budget) -> Any:
    def put(result: Result) -> None:
        # Bounded per cell by the output cap already; counted against the same queue cap as
        # text so that a client that does not read holds nothing more.
        item = {"type": "display", "result": result.model_dump(mode="json")}
        offer(outbox, budget, item, item_cost(item))

    return put


def offer(outbox: Outbox, budget: Budget, item: dict[str, Any], cost: int) -> None:
    """Queue a streamed item unless that would pass the cap. A client that does not read must
    not make the server hold its output: past the cap, items are dropped (the final result
    still carries the output's head and tail, and every rich result), with one notice."""
    if budget.cut:
        return
    if budget.fits(cost):
        budget.add(outbox, item, cost)
    elif not budget.dropped:
        budget.dropped = True
        dropped = notice("output_dropped", "stream output dropped: the client reads too slowly")
        budget.add(outbox, dropped, item_cost(dropped))


def notify(outbox: Outbox, budget: Budget, item: dict[str, Any], cost: int | None = None) -> None:
    """Queue a frame that a client's message caused (a notice, its run's "started").

    Raises:
        QueueCapReached: it would pass the cap; ``budget.cut`` is set and nothing is queued.
    """
    if budget.cut:
        raise QueueCapReached(CUT_REASON)
    cost = item_cost(item) if cost is None else cost
    if budget.queued + cost > STREAM_QUEUE_MAX_BYTES:
        budget.cut = True
        raise QueueCapReached(CUT_REASON)
    budget.add(outbox, item, cost)


def final(outbox: Outbox, budget: Budget, item: dict[str, Any]) -> None:
    """Queue a run's last frame (its result or error), counted but never refused: one per run,
    and the next run waits until it has been written."""
    if not budget.cut:
        budget.add(outbox, item, item_cost(item))


def item_cost(item: dict[str, Any]) -> int:
    if "data_b64" in item:  # a terminal's output
        return len(item["data_b64"]) + CHUNK_OVERHEAD_BYTES
    if "data" in item:
        return cost(item["data"])
    if item.get("type") == "display":
        return len(json.dumps(item["result"])) + CHUNK_OVERHEAD_BYTES
    # A notice, an error, a result, "started": counted as the JSON it is sent as.
    return len(json.dumps(item, separators=(",", ":"))) + CHUNK_OVERHEAD_BYTES


async def drain(websocket: WebSocket, outbox: Outbox, budget: Budget) -> None:
    # One writer keeps chunks in the order they were produced, with the result last.
    while (item := await outbox.get()) is not None:
        await websocket.send_json(item)
        budget.taken()


async def finish(
    websocket: WebSocket,
    outbox: Outbox,
    budget: Budget,
    sender: asyncio.Task[Any],
    listener: asyncio.Task[Any],
) -> None:
    """End a run's stream: stop reading the client, then let the writer send what is queued
    (the result last), or cut the socket if its client let the queue reach the cap."""
    listener.cancel()
    if listener.done() and not listener.cancelled():
        listener.exception()  # a disconnect, a revoked key or a cut: the caller's to handle
    if budget.cut:
        await cut(websocket, outbox, budget, sender)
        return
    outbox.put_nowait(None)
    with contextlib.suppress(Exception):
        await sender
    budget.clear(outbox)  # what a writer that failed left: its tenant's share is freed


async def cut(
    websocket: WebSocket, outbox: Outbox, budget: Budget, sender: asyncio.Task[Any]
) -> None:
    """Close the socket of a client that let its queue reach the cap.

    The writer stops and what it had queued is freed at once; the close frame (:data:`CUT_CODE`,
    :data:`CUT_REASON`) then waits for the transport to take it, at most :data:`CUT_WAIT_S`:
    a client that still reads nothing is dropped at the transport (it would otherwise hold the
    connection, and the bytes already in its buffer, for as long as it liked), where the server
    offers :data:`ABORT_EXTENSION` (``transport.py``; elsewhere the connection closes once the
    bytes already handed to the transport drain)."""
    budget.cut = True
    sender.cancel()
    await asyncio.wait({sender})  # its end, not its CancelledError: this task goes on
    if not sender.cancelled():
        sender.exception()  # a send that failed: the socket is being cut anyway
    log.warning("stream cut: the client does not read", queued_bytes=budget.queued)
    budget.clear(outbox)
    closed = False
    with contextlib.suppress(Exception):
        await asyncio.wait_for(websocket.close(code=CUT_CODE, reason=CUT_REASON), CUT_WAIT_S)
        closed = True
    abort = websocket.scope.get("extensions", {}).get(ABORT_EXTENSION)
    if abort is None:
        return
    if closed:
        # The close frame was handed over, but it waits behind what the transport holds: a
        # client that reads nothing would keep the connection. Dropped if still there then
        # (an abort of a connection already closed does nothing).
        asyncio.get_running_loop().call_later(CUT_WAIT_S, abort["abort"])
    else:
        abort["abort"]()


async def send_or_gone(websocket: WebSocket, data: Any) -> None:
    """Send a JSON frame, or raise WebSocketDisconnect where the socket is already closed
    (the server closes one whose client missed its pings: sending then raised a
    RuntimeError, an ASGI traceback in the log; red team, 2026-12-06)."""
    try:
        await websocket.send_json(data)
    except (RuntimeError, OSError) as exc:
        raise WebSocketDisconnect(1006) from exc


async def receive_message(websocket: WebSocket, pace: Pace) -> Any:
    """The client's next message, parsed, once its tenant's ``pace`` gives it its turn: every
    message, a bad one too (answered with an error frame, 36,000-50,000 of them a second
    skipped the pace and slowed another tenant's requests from 20 ms to 1.1 s: red team,
    2026-12-06).

    Raises:
        WebSocketDisconnect: the client went away.
        InvalidRequest: it was not JSON text nested at most MAX_JSON_DEPTH deep: a binary
            frame, text that is not JSON, ``"[" * 100000`` each ended the socket with an
            unhandled exception and a traceback in the log (red team, 2026-12-06); the
            caller answers with a typed error and reads on.
    """
    return await read_message(await websocket.receive(), pace)


async def read_message(message: Message, pace: Pace) -> Any:
    """:func:`receive_message` for a message already received (read ahead by a reader, which
    may have put an ``oversize`` mark, its size, in place of a text too large to keep)."""
    size = len(message.get("text") or message.get("bytes") or b"") or message.get("oversize", 0)
    # Paced by its size too: parsing is the cost, and 37 messages a second of 4 MiB, far
    # under the pace's count, took 98% of a core and another tenant's listing from 1 ms to
    # 1.1 s (red team, 2026-12-06).
    await pace.wait(1 + size // PACE_BYTES)
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    if "oversize" in message:
        raise InvalidRequest(
            f"a message of {message['oversize']} bytes is larger than this stream takes"
        )
    text = message.get("text")
    if text is None:
        raise InvalidRequest("send each message as a JSON text frame, not a binary one")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"a message is not JSON: {str(exc)[:200]}") from None
    if not nests_within(value, MAX_JSON_DEPTH):
        raise InvalidRequest(f"a message nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def cost(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass")) + CHUNK_OVERHEAD_BYTES


def notice(code: str, message: str) -> dict[str, Any]:
    """A notice frame: something was dropped or refused, and the stream goes on."""
    return {"type": "notice", "code": code, "message": message}


def error_message(exc: SandboxError) -> dict[str, Any]:
    return {"type": "error", "error": {"code": exc.code, "message": exc.message}}
