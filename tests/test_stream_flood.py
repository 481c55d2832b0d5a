"""A keyed WebSocket client that floods input and never reads (red-team finding).

Every frame the server queues for a client counts against the stream's byte cap
(``server/outbox.py``); the frames a client's own messages cause (notices for refused stdin,
stdin after its end, bad resizes) get the socket cut there, with close code 1008. Failed
before: a client that filled a command's stdin backlog, then sent ``{"type": "stdin", "data":
"x"}`` in a loop and read nothing, grew the server from 100 MB to 966 MB in 40 s, one queued
notice per message outside the cap; bad resizes to a terminal did the same through
``stream_jobs``; and each ``{"type": "stdin", "data": ""}`` became a request to the guest.

The server is a real ``sandlot serve`` on a free port (bubblewrap), started through a wrapper
that counts the guest's stdin requests with no bytes in them. The flooding client is a raw
socket, so that "never reads" means exactly that.
"""

from __future__ import annotations

import base64
import json
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot.server.auth import AuthStore
from tests.conftest import skip_reason, start_server, stop_server

pytestmark = pytest.mark.hostile

# The server, with every guest stdin request that carries no bytes and no end counted (one
# byte each) in $FLOOD_EMPTY_STDIN_COUNT.
WRAPPER = """
import os, sys
from sandlot.core import guest_link
from sandlot.guest.ops import Op

_request = guest_link.GuestConnection.request
_count = os.environ["FLOOD_EMPTY_STDIN_COUNT"]

async def request(self, op, payload=None, **kwargs):
    if op == Op.STDIN and payload and not payload.get("data") and not payload.get("eof"):
        with open(_count, "a") as f:
            f.write("x")
    return await _request(self, op, payload, **kwargs)

guest_link.GuestConnection.request = request
sys.argv = ["sandlot", *sys.argv[1:]]
from sandlot.cli import app
app()
"""
FLOOD_S = 15.0  # a client not cut by then is not going to be
RSS_GROWTH_MAX_MIB = 64


@dataclass
class Server:
    url: str
    pid: int
    key: str
    log: Path
    empty_stdin_count: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def logged(self, marker: str) -> int:
        return self.log.read_text(errors="replace").count(marker)

    def empty_stdin_requests(self) -> int:
        return len(self.empty_stdin_count.read_text()) if self.empty_stdin_count.exists() else 0

    def sandbox(self) -> str:
        created = httpx.post(f"{self.url}/v1/sandboxes", json={}, headers=self.headers, timeout=60)
        assert created.status_code == 201, created.text
        sandbox_id: str = created.json()["id"]
        return sandbox_id

    def destroy(self, sandbox_id: str) -> None:
        httpx.delete(f"{self.url}/v1/sandboxes/{sandbox_id}", headers=self.headers, timeout=60)

    def command(self, sandbox_id: str, command: str) -> dict[str, Any]:
        answer = httpx.post(
            f"{self.url}/v1/sandboxes/{sandbox_id}/commands",
            json={"command": command},
            headers=self.headers,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result


@pytest.fixture(scope="module")
def server(data_root: Path) -> Iterator[Server]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    data_dir = data_root / "stream-flood"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    key = store.create_key("acme", "user")[1]
    store.close()
    count = data_dir / "empty-stdin-requests"
    env = {
        "FLOOD_EMPTY_STDIN_COUNT": str(count),
        # Read as fast as they come (their pace: test_trust_server.py), so that a notice
        # flood reaches the queue cap here; a tenant's streams share 24 MiB of queue.
        "API_STREAM_MESSAGES_PER_SECOND": "1000000",
        "API_STREAM_QUEUE_MB_PER_TENANT": "24",
    }
    process, url, log = start_server(data_dir, env, launcher=("-c", WRAPPER))
    try:
        yield Server(url, process.pid, key, log, count)
    finally:
        stop_server(process)


# ------------------------------------------------------------------ a raw WebSocket client


def _masked(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def frame(message: dict[str, Any], *, opcode: int = 0x1, payload: bytes | None = None) -> bytes:
    """One masked frame, as a client sends it: ``message`` as text, or ``payload`` raw."""
    payload = json.dumps(message).encode() if payload is None else payload
    n = len(payload)
    if n < 126:
        head = struct.pack(">BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack(">BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack(">BBQ", 0x80 | opcode, 0x80 | 127, n)
    mask = os.urandom(4)
    return head + mask + _masked(payload, mask)


class RawWs:
    """A WebSocket by hand: it reads only when told to."""

    def __init__(self, server: Server, sandbox_id: str) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        # A small receive window: what the client leaves unread backs up into the server soon.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        self.sock.settimeout(10)
        self.sock.connect((host, int(port)))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /v1/sandboxes/{sandbox_id}/stream HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {server.key}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(4096)
            assert chunk, "the server closed during the handshake"
            self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert b" 101 " in head.split(b"\r\n", 1)[0], head

    def send(self, message: dict[str, Any]) -> None:
        self.sock.settimeout(10)
        self.sock.sendall(frame(message))

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return taken

    def recv_frame(self, timeout: float) -> tuple[int, bytes]:
        """The next frame from the server: (opcode, payload)."""
        self.sock.settimeout(timeout)
        first, second = self._take(2)
        n = second & 0x7F
        if n == 126:
            (n,) = struct.unpack(">H", self._take(2))
        elif n == 127:
            (n,) = struct.unpack(">Q", self._take(8))
        return first & 0x0F, self._take(n)

    def recv_json(self, timeout: float = 30) -> dict[str, Any]:
        opcode, payload = self.recv_frame(timeout)
        assert opcode == 0x1, (opcode, payload[:200])
        event: dict[str, Any] = json.loads(payload)
        return event

    def flood(self, frames: bytes, server: Server, marker: str = "stream cut") -> Flood:
        """Send ``frames`` over and over and read nothing, until the server logs ``marker``
        (a cut), resets the connection, or :data:`FLOOD_S` passes."""
        cuts = server.logged(marker)
        rss_before = server.rss_mib()
        rss_most = rss_before
        self.sock.setblocking(False)
        pending = memoryview(frames)
        sent = 0
        started = checked = time.monotonic()
        stopped = "timeout"
        while time.monotonic() - started < FLOOD_S:
            if time.monotonic() - checked >= 0.1:
                checked = time.monotonic()
                rss_most = max(rss_most, server.rss_mib())
                if server.logged(marker) > cuts:
                    stopped = "cut"
                    break
            if not select.select([], [self.sock], [], 0.1)[1]:
                continue
            try:
                n = self.sock.send(pending)
            except BlockingIOError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                stopped = "reset"
                break
            sent += n
            pending = pending[n:] or memoryview(frames)
        rss_most = max(rss_most, server.rss_mib())
        return Flood(stopped, sent, rss_most - rss_before, time.monotonic() - started)

    def close_code(self, within_s: float = 10) -> tuple[int, str] | str:
        """Read what the server sent until its close frame: (code, reason); "reset" or "eof"
        for a connection that ended without one; "open" if it is still open after that."""
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                opcode, payload = self.recv_frame(max(0.1, deadline - time.monotonic()))
                if opcode == 0x8:
                    code = struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else 1005
                    return code, payload[2:].decode()
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
        except EOFError:
            return "eof"
        except TimeoutError:
            pass
        return "open"

    def close(self) -> None:
        self.sock.close()


@dataclass
class Flood:
    stopped: str  # "cut" (the server logged it), "reset" or "timeout"
    sent_bytes: int
    rss_growth_mib: float
    seconds: float

    def __str__(self) -> str:
        return (
            f"flood stopped by {self.stopped} after {self.seconds:.1f} s and "
            f"{self.sent_bytes / 1e6:.1f} MB sent; the server grew {self.rss_growth_mib:.0f} MiB"
        )


def _assert_cut(ws: RawWs, flood: Flood) -> None:
    assert flood.stopped in ("cut", "reset"), f"not cut: {flood}"
    assert flood.rss_growth_mib < RSS_GROWTH_MAX_MIB, str(flood)
    if flood.stopped == "cut":
        # Read from now on: what was in flight, then the close frame.
        ending = ws.close_code()
        assert isinstance(ending, tuple), f"{ending}, {flood}"
        code, reason = ending
        assert code == 1008 and "does not read" in reason, ending


# ------------------------------------------------------------------ the floods


@pytest.mark.parametrize("flood_with", ["backlog_full", "after_eof"])
def test_a_stdin_notice_flood_from_a_client_that_never_reads_is_cut(
    server: Server, flood_with: str
) -> None:
    """Refused stdin (the backlog full, or stdin after ``stdin_eof``) answers a notice per
    message: a client that never reads them is cut at the queue cap, and the run stops.
    Failed before: no cut in 15 s, the server grew by hundreds of MiB (every notice was
    queued outside the cap; stdin after its end queued for good, unread)."""
    sandbox_id = server.sandbox()
    ws = RawWs(server, sandbox_id)
    try:
        ws.send({"type": "command", "command": "sleep 60", "stdin": True, "timeout_s": 60})
        if flood_with == "backlog_full":
            chunk = {"type": "stdin", "data": "x" * 65536}
            for _ in range(40):  # 2.5 MiB: the backlog (1 MiB) is full, the rest refused
                ws.send(chunk)
            message = {"type": "stdin", "data": "x"}
        else:
            ws.send({"type": "stdin_eof"})
            message = {"type": "stdin_eof"}
        flood = ws.flood(frame(message) * 2000, server)
        _assert_cut(ws, flood)
    finally:
        ws.close()
    # The run was stopped with the socket: the sandbox's session answers again.
    assert server.command(sandbox_id, "echo ok")["stdout"] == "ok\n"
    server.destroy(sandbox_id)


def test_a_resize_flood_to_a_terminal_from_a_client_that_never_reads_is_cut(
    server: Server,
) -> None:
    """The same through ``stream_jobs``: each bad resize answers a notice. Failed before:
    every one was queued outside the cap, and the server grew without bound."""
    sandbox_id = server.sandbox()
    ws = RawWs(server, sandbox_id)
    try:
        ws.send({"type": "pty", "command": "sleep 60"})
        while ws.recv_json()["type"] != "started":
            pass
        flood = ws.flood(frame({"type": "resize", "cols": 0, "rows": 0}) * 2000, server)
        _assert_cut(ws, flood)
    finally:
        ws.close()
    # Cut, the terminal was only detached; the server still serves the sandbox.
    assert server.command(sandbox_id, "echo ok")["stdout"] == "ok\n"
    server.destroy(sandbox_id)


def test_empty_stdin_is_not_a_guest_request(server: Server) -> None:
    """``{"type": "stdin", "data": ""}`` has nothing to send: it must not cost a request to the
    guest (it always fit the backlog, counted as 0 bytes, in a queue with no item cap). Failed
    before for a foreground run: 2,000 empty messages were 2,000 guest requests. A background
    command and a terminal never sent them (checked here all the same)."""
    sandbox_id = server.sandbox()
    before = server.empty_stdin_requests()
    try:
        ws = RawWs(server, sandbox_id)
        try:
            ws.send({"type": "command", "command": "cat", "stdin": True, "timeout_s": 30})
            ws.sock.sendall(frame({"type": "stdin", "data": ""}) * 2000)
            ws.send({"type": "stdin", "data": "hi\n"})
            ws.send({"type": "stdin_eof"})
            while (event := ws.recv_json())["type"] != "result":
                pass
            assert event["result"]["stdout"] == "hi\n", event
        finally:
            ws.close()
        for start, empty in [
            ({"type": "command", "command": "cat", "background": True}, {"data": ""}),
            ({"type": "pty", "command": "cat"}, {"type": "input", "data_b64": ""}),
        ]:
            ws = RawWs(server, sandbox_id)
            try:
                ws.send(start)
                while ws.recv_json()["type"] != "started":
                    pass
                ws.sock.sendall(frame({"type": "stdin", **empty}) * 1000)
            finally:
                ws.close()
        # What the server read is handled before it sees the socket close; give it a moment.
        time.sleep(1)
        assert server.empty_stdin_requests() == before, "empty stdin reached the guest"
    finally:
        server.destroy(sandbox_id)


def test_a_ping_flood_from_a_client_that_never_reads_is_dropped(server: Server) -> None:
    """Pings are answered by the WebSocket layer, not the stream: each pong was written at once
    past the flow control that holds the stream's frames. Failed before: a client that pinged
    and read nothing grew the server by ~500 MiB in 15 s; now it is dropped once it owes
    1,024 pongs with the transport's buffer full."""
    sandbox_id = server.sandbox()
    ws = RawWs(server, sandbox_id)
    try:
        pings = frame({}, opcode=0x9, payload=b"p" * 125) * 1000
        flood = ws.flood(pings, server, marker="pings and does not read")
        assert flood.stopped in ("cut", "reset"), f"not dropped: {flood}"
        assert flood.rss_growth_mib < RSS_GROWTH_MAX_MIB, str(flood)
    finally:
        ws.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.destroy(sandbox_id)


def test_a_tenants_streams_together_queue_no_more_than_its_share(server: Server) -> None:
    """Failed before (the third red team's find, 2026-12-06): each stream may queue 8 MiB
    for a client that does not read, and nothing bounded them together: 200 sockets that
    never read, attached to one fast terminal, took the server to 1.78 GB in 3 s. All of a
    tenant's streams now share API_STREAM_QUEUE_MB_PER_TENANT (24 MiB here; 12 sockets
    held ~100 MiB before)."""
    sandbox_id = server.sandbox()
    socks: list[RawWs] = []
    try:
        pids = []
        for _ in range(3):  # each terminal streams to 4 clients at most (the next test)
            first = RawWs(server, sandbox_id)
            socks.append(first)
            first.send({"type": "pty", "command": "cat /dev/zero | base64"})
            while (event := first.recv_json())["type"] != "started":
                pass
            pids.append(event["info"]["pid"])
        rss_before = server.rss_mib()
        for pid in pids:
            for _ in range(3):
                ws = RawWs(server, sandbox_id)
                ws.send({"type": "pty", "pid": pid})
                socks.append(ws)
        rss_most = rss_before
        for _ in range(30):  # 3 s: a fast terminal fills any queue many times over
            time.sleep(0.1)
            rss_most = max(rss_most, server.rss_mib())
        assert rss_most - rss_before < 56, (rss_before, rss_most)
    finally:
        for ws in socks:
            ws.close()
    server.destroy(sandbox_id)


def test_a_terminal_or_command_streams_to_four_clients_at_most(server: Server) -> None:
    """Failed before (red team, 2026-12-06): nothing bounded the clients one terminal or
    background command streams to, and each output chunk is encoded and sent once per client
    on the server's one event loop: 90 WebSockets attached to one 0.5-core terminal running
    `cat /dev/urandom` took 0.8 of a core and another tenant's GET from 9 to 544 ms median.
    The fifth client is refused (too_many_listeners); once one leaves, another may come."""
    sandbox_id = server.sandbox()
    socks: list[RawWs] = []
    try:
        for start, attach in (
            ({"type": "pty", "command": "sleep 60"}, "pty"),
            ({"type": "command", "command": "sleep 60", "background": True}, "attach"),
        ):
            first = RawWs(server, sandbox_id)
            socks.append(first)
            first.send(start)
            while (event := first.recv_json())["type"] != "started":
                pass
            pid, command_id = event["info"]["pid"], event["info"]["command_id"]
            job = {"type": attach, "pid": pid, "command_id": command_id}
            attached = []
            for _ in range(3):
                ws = RawWs(server, sandbox_id)
                ws.send(job)
                assert ws.recv_json()["type"] == "started"
                attached.append(ws)
            socks.extend(attached)
            fifth = RawWs(server, sandbox_id)
            socks.append(fifth)
            fifth.send(job)
            refused = fifth.recv_json()
            assert refused["type"] == "error", refused  # before: "started", as the 90th
            assert refused["error"]["code"] == "too_many_listeners", refused
            attached[0].close()
            time.sleep(0.5)  # the server sees the close and detaches it
            sixth = RawWs(server, sandbox_id)
            socks.append(sixth)
            sixth.send(job)
            assert sixth.recv_json()["type"] == "started"
    finally:
        for ws in socks:
            ws.close()
    server.destroy(sandbox_id)


def test_websocket_frames_are_not_compressed(server: Server) -> None:
    """Failed before (red team, 2026-12-06): uvicorn's default permessage-deflate compressed
    every output frame on the server's one event loop, ~80% of its time under a stream of
    output, server CPU the guest's output budget does not count. A client offering it is
    answered without it."""
    from websockets.sync.client import connect

    sandbox_id = server.sandbox()
    url = server.url.replace("http://", "ws://") + f"/v1/sandboxes/{sandbox_id}/stream"
    with connect(url, additional_headers=server.headers) as ws:  # offers permessage-deflate
        assert ws.request is not None and ws.response is not None
        assert "permessage-deflate" in ws.request.headers.get("Sec-WebSocket-Extensions", "")
        assert "Sec-WebSocket-Extensions" not in ws.response.headers  # before: deflate
        ws.send(json.dumps({"type": "command", "command": "echo hi"}))
        kinds = []
        while (event := json.loads(ws.recv(timeout=30)))["type"] != "result":
            kinds.append(event["type"])
        assert event["result"]["stdout"] == "hi\n"
    server.destroy(sandbox_id)
