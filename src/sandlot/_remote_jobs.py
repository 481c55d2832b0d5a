"""The remote client's streamed background runs: a terminal's output, a background command's
stdout and stderr, over the server's WebSocket (``server/stream_jobs.py``).

One WebSocket per watched run. It is opened by the start itself (the server adds the
callbacks before the process exists, so no early output is missed) and read by a task on the
client's loop until the run ends or the client is closed; the callbacks run on that loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
from typing import TYPE_CHECKING, Any

from sandlot.errors import SandboxError, TooManyConnections, error_from_code
from sandlot.models import CommandInfo, DataCallback, OutputCallback

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

MAX_MESSAGE_BYTES = 16 << 20
# A request or handshake turned away at the server's connection cap (429
# ``too_many_connections``: nothing of it was read) is sent again this many times.
TURNED_AWAY_RETRIES = 12


def turned_away_wait_s(turn: int) -> float:
    """How long to wait before the ``turn``-th resend: up to 0.05 s, doubled each turn, at
    most 1 s (~6 s over all the turns), drawn at random to spread a burst's clients out."""
    return random.uniform(0.5, 1.0) * min(0.05 * (1 << turn), 1.0)  # noqa: S311 (jitter)


async def open_stream(url: str, headers: dict[str, str], max_size: int) -> ClientConnection:
    """A WebSocket to ``url``. A handshake the server refused raises its typed error; one
    turned away at its connection cap is tried again (nothing of it was read).

    Raises:
        SandboxError: the server refused the handshake (a bad key, no such sandbox).
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    for turn in range(TURNED_AWAY_RETRIES + 1):
        try:
            return await connect(url, additional_headers=headers, max_size=max_size)
        except InvalidStatus as exc:
            error = upgrade_refused(exc)
            if not isinstance(error, TooManyConnections) or turn == TURNED_AWAY_RETRIES:
                raise error from None
        await asyncio.sleep(turned_away_wait_s(turn))
    raise AssertionError("unreachable: the last turn returns or raises")


class JobStreams:
    """The WebSockets of one client's watched runs."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self._ws_base = base_url.replace("http", "ws", 1)
        self._headers = {k: v for k, v in headers.items() if k == "Authorization"}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(
        self,
        sandbox_id: str,
        message: dict[str, Any],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_data: DataCallback | None = None,
    ) -> CommandInfo:
        """Send ``message`` (a "pty", "command" with background, or "attach"); return the
        run's info once the server says it started, and stream on in a task.

        Raises:
            SandboxError: the server refused it (its typed error: the cap, no such pid).
        """
        url = f"{self._ws_base}/v1/sandboxes/{sandbox_id}/stream"
        ws = await open_stream(url, self._headers, MAX_MESSAGE_BYTES)
        try:
            await ws.send(json.dumps(message))
            first = json.loads(await ws.recv())
        except BaseException:
            await ws.close()
            raise
        if first.get("type") != "started":
            await ws.close()
            error = first.get("error") or {}
            raise error_from_code(str(error.get("code")), str(error.get("message", first)))
        task = asyncio.create_task(self._read(ws, on_stdout, on_stderr, on_data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return CommandInfo.model_validate(first["info"])

    @staticmethod
    async def _read(
        ws: Any,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_data: DataCallback | None,
    ) -> None:
        try:
            async for raw in ws:
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "output" and on_data is not None:
                    on_data(base64.b64decode(event["data_b64"]))
                elif kind == "stdout" and on_stdout is not None:
                    on_stdout(event["data"])
                elif kind == "stderr" and on_stderr is not None:
                    on_stderr(event["data"])
                elif kind in ("result", "error"):
                    return  # wait() fetches the result over REST
        except Exception:  # closed, reset, garbage: wait() says what became of the run
            return
        finally:
            with contextlib.suppress(Exception):
                await ws.close()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def typed_error(status: int | str, body: bytes) -> SandboxError:
    """Our exception for a server's error answer: its typed body (``{"error": {"code",
    "message"}}``), or a plain one naming the status."""
    try:
        detail = json.loads(body)["error"]
        return error_from_code(str(detail["code"]), str(detail["message"]))
    except (ValueError, KeyError, TypeError):
        return SandboxError(f"HTTP {status}: {body.decode(errors='replace')[:500]}")


def upgrade_refused(exc: Exception) -> SandboxError:
    """Our exception for a WebSocket handshake the server answered with an HTTP error (a
    bad key, a sandbox not found: refused before the upgrade, with its typed body)."""
    response = getattr(exc, "response", None)
    return typed_error(getattr(response, "status_code", "?"), getattr(response, "body", b"") or b"")
