"""A WebSocket's outbox: streamed items queued for one writer, bounded in bytes (a client
that does not read holds nothing past the cap), shared by runs (``stream.py``) and background
jobs and terminals (``stream_jobs.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import WebSocket

from sandlot.errors import SandboxError
from sandlot.models import Result

STREAM_QUEUE_MAX_BYTES = 8 << 20
# What one queued chunk costs the server beyond its bytes (the message dict, the str object):
# counted so that a flood of 1-byte chunks is bounded like one big chunk.
CHUNK_OVERHEAD_BYTES = 256


class Budget:
    """Bytes of streamed output queued for a client that has not taken them yet."""

    def __init__(self) -> None:
        self.queued = 0
        self.dropped = False


def put_text(outbox: asyncio.Queue[dict[str, Any] | None], stream: str, budget: Budget) -> Any:
    def put(text: str) -> None:
        offer(outbox, budget, {"type": stream, "data": text}, cost(text))

    return put


def put_result(outbox: asyncio.Queue[dict[str, Any] | None], budget: Budget) -> Any:
    def put(result: Result) -> None:
        # Bounded per cell by the output cap already; counted against the same queue cap as
        # text so that a client that does not read holds nothing more.
        item = {"type": "display", "result": result.model_dump(mode="json")}
        offer(outbox, budget, item, item_cost(item))

    return put


def offer(
    outbox: asyncio.Queue[dict[str, Any] | None], budget: Budget, item: dict[str, Any], cost: int
) -> None:
    """Queue a streamed item unless that would pass the cap. A client that does not read must
    not make the server hold its output: past the cap, items are dropped (the final result
    still carries the output's head and tail, and every rich result), with one notice."""
    if budget.queued + cost <= STREAM_QUEUE_MAX_BYTES:
        budget.queued += cost
        outbox.put_nowait(item)
    elif not budget.dropped:
        budget.dropped = True
        outbox.put_nowait(
            {
                "type": "notice",
                "code": "output_dropped",
                "message": "stream output dropped: the client reads too slowly",
            }
        )


def item_cost(item: dict[str, Any]) -> int:
    if "data_b64" in item:  # a terminal's output
        return len(item["data_b64"]) + CHUNK_OVERHEAD_BYTES
    if "data" in item:
        return cost(item["data"])
    return len(json.dumps(item["result"])) + CHUNK_OVERHEAD_BYTES


async def drain(
    websocket: WebSocket, outbox: asyncio.Queue[dict[str, Any] | None], budget: Budget
) -> None:
    # One writer keeps chunks in the order they were produced, with the result last.
    while (item := await outbox.get()) is not None:
        await websocket.send_json(item)
        if item.get("type") in ("stdout", "stderr", "display", "output"):
            budget.queued -= item_cost(item)


def cost(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass")) + CHUNK_OVERHEAD_BYTES


def error_message(exc: SandboxError) -> dict[str, Any]:
    return {"type": "error", "error": {"code": exc.code, "message": exc.message}}
