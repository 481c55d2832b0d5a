"""Real HTTP servers on loopback for wire-format tests: an ASGI app run by uvicorn in a thread.

``serve(app)`` starts uvicorn on ``127.0.0.1`` on a port the kernel picks (the socket is bound
before the thread starts, so there is no race for the port), records every request that reaches
the app, and stops the server on exit. The client under test talks real HTTP/1.1 to it:
chunked streaming, keep-alive, time-outs and dropped connections behave as against the real
service, which an in-process transport would not show.

Bounds: only loopback addresses; start-up and shutdown each wait a bounded time; at most
``MAX_RECORDED`` requests are kept and a body over ``MAX_BODY_BYTES`` is answered with 413.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_RECORDED = 1000
MAX_BODY_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it. Header names are lower-case."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    raw_body: bytes

    @property
    def json(self) -> Any:
        """The body parsed as JSON (None when empty)."""
        return json.loads(self.raw_body) if self.raw_body else None


@dataclass
class WireServer:
    url: str
    _requests: list[RecordedRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of what was recorded so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            if len(self._requests) >= MAX_RECORDED:
                raise RuntimeError(f"more than {MAX_RECORDED} requests recorded; clear() between")
            self._requests.append(request)


class _Recorder:
    """ASGI middleware: read the whole body, record the request, replay the body to the app."""

    def __init__(self, app: ASGIApp, server: WireServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _reply_413(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.server._record(
            RecordedRequest(
                method=scope["method"],
                path=scope["path"],
                query=dict(parse_qsl(scope["query_string"].decode("latin-1"))),
                headers={k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
                raw_body=body,
            )
        )
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the client to go away

        await self.app(scope, replay, send)


async def _reply_413(send: Send) -> None:
    await send({"type": "http.response.start", "status": 413, "headers": []})
    await send({"type": "http.response.body", "body": b"request body too large"})


class _Running:
    """One uvicorn server in its own thread, on a socket bound before the thread starts."""

    def __init__(self, app: ASGIApp, host: str) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"wire servers listen on loopback only, not {host}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.port: int = self.sock.getsockname()[1]
        shown_host = f"[{host}]" if family == socket.AF_INET6 else host
        self.server = WireServer(url=f"http://{shown_host}:{self.port}")
        config = uvicorn.Config(
            _Recorder(app, self.server),
            log_level="error",
            access_log=False,
            lifespan="off",
            ws="none",
            # A handler still running when the server stops is cancelled after this long.
            timeout_graceful_shutdown=1,
        )
        self.runner = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.runner.run,
            kwargs={"sockets": [self.sock]},
            name=f"wire-server-{self.port}",
            daemon=True,
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.runner.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"wire server on port {self.port} did not start")
            time.sleep(0.005)

    def ask_to_stop(self) -> None:
        self.runner.should_exit = True

    def wait_stopped(self) -> None:
        if self.thread.ident is not None:
            self.thread.join(SHUTDOWN_TIMEOUT_S)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError(f"wire server on port {self.port} did not stop")


@contextmanager
def serve_all(
    apps: Mapping[str, ASGIApp], *, host: str = "127.0.0.1"
) -> Iterator[dict[str, WireServer]]:
    """Run each app on its own free port of ``host`` (loopback only) until the block ends.

    All are stopped together, so that shutting down N servers costs one shutdown's time.
    """
    running: dict[str, _Running] = {}
    try:
        for name, app in apps.items():
            running[name] = _Running(app, host)
            running[name].start()
        yield {name: each.server for name, each in running.items()}
    finally:
        for each in running.values():
            each.ask_to_stop()
        for each in running.values():
            each.wait_stopped()


@contextmanager
def serve(app: ASGIApp, *, host: str = "127.0.0.1") -> Iterator[WireServer]:
    """Run ``app`` on a free port of ``host`` (loopback only) until the block ends."""
    with serve_all({"app": app}, host=host) as servers:
        yield servers["app"]
