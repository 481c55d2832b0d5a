"""Attacks on a real ``sandlot serve`` by clients, most with no API key (issue 11).

Each test starts its own server with short timeouts, so one attack cannot spill into another
test's server. Every loop is bounded in count and time, and traffic stays on loopback: the
attackers connect from 127.0.0.2, so the per-address cap can be told apart from the global one
while a well-behaved client on 127.0.0.1 checks that the server still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from sandlot.server.auth import AuthStore
from sandlot.server.limits import AuthFailures
from sandlot.server.metering import LISTINGS_PER_TENANT
from tests.conftest import skip_reason, start_server, stop_server

pytestmark = pytest.mark.hostile

ATTACKER_IP = "127.0.0.2"
LIMITS = {
    "API_HEADER_TIMEOUT_SECONDS": "2",
    "API_BODY_IDLE_TIMEOUT_SECONDS": "2",
    "API_MAX_CONNECTIONS": "200",
    "API_MAX_CONNECTIONS_PER_IP": "50",
    "API_MAX_BODY_MB": "1",
    "LOG_LEVEL": "INFO",  # the access log is on, to see what it prints
}


class Server:
    def __init__(self, url: str, pid: int, key: str, log: Path) -> None:
        self.url = url
        self.pid = pid
        self.key = key
        self.log = log
        parsed = urlparse(url)
        self.address = (parsed.hostname or "127.0.0.1", parsed.port or 80)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def open_connections(self) -> int:
        """ESTABLISHED TCP connections to the server's port, as the kernel sees them."""
        port = f"{self.address[1]:04X}"
        count = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(":" + port) and fields[3] == "01":
                count += 1
        return count

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def connect(self, source_ip: str = ATTACKER_IP) -> socket.socket:
        sock = socket.socket()
        sock.settimeout(5)
        sock.bind((source_ip, 0))
        sock.connect(self.address)
        return sock


@pytest.fixture
def server(data_root: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    with _serving(data_root / f"trust-{request.node.name}", LIMITS) as running:
        yield running


@contextlib.contextmanager
def _serving(data_dir: Path, env: dict[str, str]) -> Iterator[Server]:
    """A real server with ``env`` on a new data directory, and one user key of tenant acme."""
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    key = store.create_key("acme", "user")[1]
    store.close()
    process, url, log = start_server(data_dir, env)
    try:
        yield Server(url, process.pid, key, log)
    finally:
        stop_server(process)


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response: the head, then as many body bytes as it declares (TCP may
    deliver them in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except (TimeoutError, OSError) as exc:
        return not isinstance(exc, TimeoutError)
    return True


def test_a_huge_body_without_a_key_is_refused_before_it_is_read(server: Server) -> None:
    # The attack declares 256 MiB; the answer must come before the body is read, so sending
    # the first 64 KiB of it is enough to see that (and keeps the test small).
    before = server.rss_mb()
    with server.connect() as sock:
        sock.sendall(
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 268435456\r\n\r\n" + b"[" * 65536
        )
        reply = _read_response(sock)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b'"unauthenticated"' in reply
    assert server.rss_mb() - before < 20


def test_a_body_over_the_cap_is_refused_typed_even_with_a_key(server: Server) -> None:
    headers = {"Authorization": f"Bearer {server.key}", "content-type": "application/json"}
    declared = httpx.post(
        server.url + "/v1/sandboxes", content=b"{" + b" " * (2 << 20) + b"}", headers=headers
    )
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "too_large"
    assert "API_MAX_BODY_MB" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"metadata": {"k": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}}'

    before = server.rss_mb()
    chunked = httpx.post(server.url + "/v1/sandboxes", content=chunks(), headers=headers)
    assert chunked.status_code == 413
    assert chunked.json()["error"]["code"] == "too_large"
    assert server.rss_mb() - before < 20
    assert server.healthy()


def test_half_sent_requests_cannot_take_the_server_down(server: Server) -> None:
    attackers: list[socket.socket] = []
    try:
        # More half-sent requests than one address may hold: the extra ones are closed at
        # once, and the server holds no more than the cap.
        for _ in range(120):
            with contextlib.suppress(OSError):
                sock = server.connect()
                sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                attackers.append(sock)
        time.sleep(0.3)
        assert server.open_connections() <= 50 + 2
        # Someone else is still served while the attack holds its 50.
        assert server.healthy()
        # And the attack's connections are dropped once their headers are late.
        deadline = time.monotonic() + 6
        while server.open_connections() > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.open_connections() == 0
        assert _closed_by_peer(attackers[0], within_s=1)
    finally:
        for sock in attackers:
            sock.close()


def test_keyless_connections_at_the_total_cap_give_way_to_a_real_request(
    server: Server,
) -> None:
    """Failed before (red team, 2026-12-06): half-sent requests from a few addresses, each
    at its per-address cap, held the whole cap (200 here), and every other client was
    refused until they timed out, which they could renew at no cost by reconnecting."""
    attackers: list[socket.socket] = []
    headers = {"Authorization": f"Bearer {server.key}"}
    try:
        for n in range(5):  # 5 addresses x 50 > the cap of 200
            for _ in range(50):
                with contextlib.suppress(OSError):
                    sock = server.connect(f"127.0.0.{n + 2}")
                    sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    attackers.append(sock)
        filled_at = time.monotonic()
        served = []
        for _ in range(10):  # well within the attack's 2 s header deadline
            with httpx.Client() as client:  # a new connection each time
                served.append(client.get(server.url + "/v1/sandboxes", headers=headers))
        assert time.monotonic() - filled_at < 1.5
        assert [r.status_code for r in served] == [200] * 10
        assert server.open_connections() <= 200 + 2
    finally:
        for sock in attackers:
            sock.close()


def _answer_to(server: Server, request: bytes, source_ip: str = ATTACKER_IP) -> bytes:
    """The status line the server answers ``request`` with on a new connection from
    ``source_ip``, or b"" if it closed the connection unanswered."""
    sock = server.connect(source_ip)
    try:
        sock.sendall(request)
        return _read_response(sock).split(b"\r\n", 1)[0]
    except OSError:
        return b""
    finally:
        sock.close()


def test_an_address_that_keeps_failing_to_authenticate_is_closed_unread(
    data_root: Path,
) -> None:
    """Failed before (red team, 2026-12-06): a client with no key had the server answer
    13,000 401s a second from one address, a whole core of its one event loop, for as long
    as it liked. Past its burst of failures an address's connections are closed before a
    byte is read, until it has credit again (one each 2 s here: room for a busy CI's nine
    connections); a keyed client from another address is served throughout, and one from
    the refused address once its credit is back (every client behind that address shares
    it: README)."""
    env = {**LIMITS, "API_AUTH_FAILURES_BURST": "5", "API_AUTH_FAILURES_PER_SECOND": "0.5"}
    keyless = b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n\r\n"
    with _serving(data_root / "trust-auth-failures", env) as server:
        keyed = (
            b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + server.key.encode()
            + b"\r\n\r\n"
        )
        answers = [_answer_to(server, keyless) for _ in range(12)]
        assert answers[:5] == [b"HTTP/1.1 401 Unauthorized"] * 5, answers
        assert answers[6:] == [b""] * 6, answers  # the sixth may come as credit comes back
        assert _answer_to(server, keyed, "127.0.0.1") == b"HTTP/1.1 200 OK"
        assert _answer_to(server, keyed) == b""  # refused, key or not
        time.sleep(2.1)  # credit for one more failure: the address is served again
        assert _answer_to(server, keyed) == b"HTTP/1.1 200 OK"
        # A kept-alive connection is closed after the 401 that spends the credit.
        sock = server.connect()
        try:
            sock.sendall(keyless)
            assert _read_response(sock).startswith(b"HTTP/1.1 401")
            assert _closed_by_peer(sock, within_s=2.0)
        finally:
            sock.close()
        assert server.healthy()


def test_a_keyless_client_looping_on_the_public_routes_is_closed_unread(
    data_root: Path,
) -> None:
    """Failed before (red team, 2026-12-06): one keep-alive connection with no key had 2,711
    answers a second from /health (76% of a core, 386 KiB/s of access log), 887 from
    /openapi.json. A keyless request to a public route now costs its address a tenth of a
    failed authentication: 40 of them here spend a burst of 5, then a 429, then its
    connections are closed unread as for failed authentications."""
    env = {**LIMITS, "API_AUTH_FAILURES_BURST": "5", "API_AUTH_FAILURES_PER_SECOND": "0.05"}
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _serving(data_root / "trust-keyless-public", env) as server:
        answers = [_answer_to(server, health) for _ in range(60)]
        served = answers.count(b"HTTP/1.1 200 OK")
        assert 40 <= served <= 42, answers
        assert b"HTTP/1.1 429 Too Many Requests" in answers, answers
        assert answers[-10:] == [b""] * 10, answers  # closed unread
        keyed = b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.key.encode()
        assert _answer_to(server, keyed + b"\r\n\r\n", "127.0.0.1") == b"HTTP/1.1 200 OK"
        assert server.healthy()


def test_failed_authentications_are_counted_per_address_within_a_bound() -> None:
    failures = AuthFailures(per_s=1.0, burst=3, max_addresses=2)
    assert [failures.failed("a") for _ in range(3)] == [False, False, True]
    assert failures.refused("a") and not failures.refused("b")
    failures.failed("b")
    failures.failed("c")  # the third address: the least recently failed ("a") is forgotten
    assert not failures.refused("a") and failures.refusals == 1
    # An IPv6 client's whole /64 shares one credit; an IPv4-mapped address is its IPv4's.
    six = AuthFailures(per_s=1.0, burst=2)
    six.failed("2001:db8:1:2::1")
    six.failed("2001:db8:1:2:ffff::9")
    assert six.refused("2001:db8:1:2::77") and not six.refused("2001:db8:1:3::1")
    six.failed("::ffff:10.0.0.1")
    six.failed("10.0.0.1")
    assert six.refused("10.0.0.1")


def test_a_body_trickled_after_a_401_holds_no_connection(server: Server) -> None:
    """Failed before (red team, 2026-12-06): a POST with no key got its 401 at once, but the
    connection read on as long as the client kept sending its chunked body (8 bytes every
    3 s), out of reach of the header deadline and of eviction: 200 of them from 5 addresses
    held the whole cap, and no keyed request got in for the minute measured."""
    attackers: list[socket.socket] = []
    headers = {"Authorization": f"Bearer {server.key}"}
    head = b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    try:
        for n in range(5):  # 5 addresses x 50 > the cap of 200
            for _ in range(50):
                with contextlib.suppress(OSError):
                    sock = server.connect(f"127.0.0.{n + 2}")
                    sock.sendall(head + b"8\r\nxxxxxxxx\r\n")
                    attackers.append(sock)
        # Each got its 401 (the newest is read: it is evicted last, where the oldest may have
        # given way to a newcomer before a loaded server answered it, which a run on two test
        # workers saw) ...
        assert _read_response(attackers[-1]).startswith(b"HTTP/1.1 401")
        # ... and a keyed client still gets in while they trickle on.
        for _ in range(5):
            for sock in attackers:
                with contextlib.suppress(OSError):
                    sock.sendall(b"8\r\nxxxxxxxx\r\n")
            with httpx.Client() as client:
                reply = client.get(server.url + "/v1/sandboxes", headers=headers)
            assert reply.status_code == 200
            time.sleep(0.5)
        # Past the linger (2 s) every one of them is closed, trickling or not: the last one
        # within 3 s, and the rest by then or within a few seconds more on a loaded machine
        # (250 closes on the server's one loop; this failed once on two test workers).
        assert _closed_by_peer(attackers[-1], within_s=3)
        deadline = time.monotonic() + 5
        while server.open_connections() > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.open_connections() <= 2
    finally:
        for sock in attackers:
            sock.close()


def _pipelining_holders(server: Server, pipelined: int) -> list[socket.socket]:
    """250 connections from 5 addresses (past the cap of 200), each with ``pipelined``
    requests for a public page (/openapi.json, 96 KB, no key) sent and nothing read."""
    page = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    return _non_readers(server, page * pipelined, per_address=50)


def _non_readers(server: Server, request: bytes, per_address: int) -> list[socket.socket]:
    """``per_address`` connections from each of 127.0.0.2-6 that send ``request`` and read
    nothing (a 4 KiB receive buffer: the server's writes back up at once)."""
    holders = []
    for n in range(5):
        for _ in range(per_address):
            with contextlib.suppress(OSError):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.settimeout(5)
                sock.bind((f"127.0.0.{n + 2}", 0))
                sock.connect(server.address)
                sock.sendall(request)
                holders.append(sock)
    return holders


def _keyed_requests_get_in(server: Server) -> None:
    headers = {"Authorization": f"Bearer {server.key}"}
    served = []
    # Within 15 s: what the holders queued is answered first (up to 16 a connection). The
    # clean-clone CI of 2026-12-07, on a VM ~1.6 times slower than the day before, had the
    # first wait 5-7 s, past httpx's default 5 s; a later one had the first request meet the
    # cap while every holder was still being written to (429, too_many_connections, which
    # says to retry), on trees before and after alike. Before the fix the holders kept every
    # connection for the minute measured, so a retry never got in.
    deadline = time.monotonic() + 15
    for _ in range(10):
        while True:
            with httpx.Client(timeout=15) as client:  # a new connection each time
                reply = client.get(server.url + "/v1/sandboxes", headers=headers)
            refused = reply.status_code == 429 and "too_many_connections" in reply.text
            if not refused or time.monotonic() > deadline:
                break  # as the SDK does: a connection turned away unread is sent again
            time.sleep(0.2)
        served.append(reply)
    assert [r.status_code for r in served] == [200] * 10


def test_deep_pipelining_is_refused(server: Server) -> None:
    """Failed before (red team, 2026-12-06): 200 requests pipelined on each connection and
    nothing read held the whole cap for the minute measured, and 20,000 pipelined in one
    send took the server from 98 to 503 MiB. Past 16 queued, the connection is dropped."""
    holders = _pipelining_holders(server, 200)
    try:
        time.sleep(0.5)
        _keyed_requests_get_in(server)
    finally:
        for sock in holders:
            sock.close()


SMALL_CAP = {**LIMITS, "API_MAX_CONNECTIONS": "40", "API_MAX_CONNECTIONS_PER_IP": "10"}


def _big_artifact(server: Server) -> str:
    """A sandbox's kept 16 MiB artifact (past what the kernel buffers for one connection);
    its download's request."""
    headers = {"Authorization": f"Bearer {server.key}"}
    sandbox_id = _sandbox(server)
    make = {"command": "mkdir -p artifacts && head -c 16777216 /dev/zero > artifacts/big.bin"}
    made = httpx.post(
        f"{server.url}/v1/sandboxes/{sandbox_id}/commands", json=make, headers=headers
    )
    assert made.json()["exit_code"] == 0, made.text
    httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)
    return f"/v1/sandboxes/{sandbox_id}/artifacts/big.bin"


def test_clients_that_read_nothing_of_their_answers_are_dropped(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): downloads none of whose bytes were read held
    the cap for as long as their clients liked: no deadline ran while the server waited to
    write. Now they are dropped after the body idle time (2 s here)."""
    with _serving(data_root / "trust-unread", SMALL_CAP) as server:
        request = (
            f"GET {_big_artifact(server)} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.key}\r\n\r\n"
        ).encode()
        holders = _non_readers(server, request, per_address=10)  # 50 > the cap of 40
        try:
            time.sleep(4)  # past the body idle time, with nothing read
            _keyed_requests_get_in(server)
        finally:
            for sock in holders:
                sock.close()


def test_a_keyed_download_is_not_cut_by_keyless_newcomers_at_the_cap(data_root: Path) -> None:
    """A keyed client reading a large answer at a modest pace pauses the server's writes
    again and again. Failed before (red team, 2026-12-06): each pause made it evictable, and
    keyless connections opened at the cap (half a request head each) cut it at 5.4 MB of
    16. A connection answering a keyed request is never evicted for a newcomer."""
    with _serving(
        data_root / "trust-download", {**SMALL_CAP, "API_BODY_IDLE_TIMEOUT_SECONDS": "30"}
    ) as server:
        path = _big_artifact(server)
        stop = threading.Event()

        def churn() -> None:
            sockets: list[socket.socket] = []
            while not stop.is_set():
                for n in range(4):
                    with contextlib.suppress(OSError):
                        sock = socket.socket()
                        sock.settimeout(1)
                        sock.bind((f"127.0.0.{n + 2}", 0))
                        sock.connect(server.address)
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                        sockets.append(sock)
                if len(sockets) > 60:
                    for sock in sockets[:20]:
                        sock.close()
                    del sockets[:20]
                time.sleep(0.02)
            for sock in sockets:
                sock.close()

        attacker = threading.Thread(target=churn, daemon=True)
        received = 0
        headers = {"Authorization": f"Bearer {server.key}"}
        try:
            with httpx.stream("GET", server.url + path, headers=headers, timeout=30) as reply:
                for chunk in reply.iter_bytes(65536):
                    received += len(chunk)
                    if received > 1 << 20 and not attacker.is_alive():
                        attacker.start()  # once the download is under way
                    time.sleep(0.02)
        finally:
            stop.set()
            if attacker.is_alive():
                attacker.join()
        assert received == 16 << 20


async def test_a_keyed_answers_unsent_tail_keeps_its_connection_from_eviction_for_a_while() -> None:
    """An answer is complete for uvicorn once written to the transport's buffer; evicted
    then, its last bytes were dropped: the download above lost its last 10 KB of 16 MiB
    under two test workers (2026-12-07). The connection waits on its client, and can be
    evicted, once they are sent; but no longer than the body idle time, and not once the
    transport is closing: unbounded, 20 keyed downloads that each left a tail unread held
    the whole connection cap for good (red team, 2026-12-07)."""
    from sandlot.server.connections import ConnectionCount, ConnectionLimits
    from sandlot.server.transport import FLUSH_POLL_S, guarded_protocol

    class Transport:
        buffered = 10_000
        closing = False

        def is_closing(self) -> bool:
            return self.closing

        def get_write_buffer_size(self) -> int:
            return self.buffered

    class AnsweredKeyed:
        response_complete = True
        scope: ClassVar[dict[str, object]] = {"state": {"principal": object()}}

    body_idle_timeout_s = 0.5
    count = ConnectionCount(ConnectionLimits(10, 0, 5.0, body_idle_timeout_s, 8192))

    def answered() -> tuple[Any, Transport]:
        connection = object.__new__(guarded_protocol(count))
        transport = Transport()
        connection.transport = transport
        connection.loop = asyncio.get_running_loop()
        connection.cycle = AnsweredKeyed()
        connection._admitted_ip = "127.0.0.1"
        connection._expect_headers()
        return connection, transport

    drained, drained_transport = answered()
    unread, _ = answered()
    closing, closing_transport = answered()
    await asyncio.sleep(FLUSH_POLL_S * 3)
    assert not {drained, unread, closing} & count.waiting.keys()  # tails still unsent
    drained_transport.buffered = 0
    closing_transport.closing = True
    await asyncio.sleep(FLUSH_POLL_S * 3)
    assert drained in count.waiting  # sent: evictable
    assert closing in count.waiting  # closing: evictable as before
    assert unread not in count.waiting
    await asyncio.sleep(body_idle_timeout_s)
    assert unread in count.waiting  # never read, past the bound: evictable
    for connection in (drained, unread, closing):
        connection._disarm()
        connection._cancel_flush_poll()


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    sock = server.connect()
    try:
        assert _closed_by_peer(sock, within_s=5)
    finally:
        sock.close()


def test_headers_over_the_cap_are_refused(server: Server) -> None:
    sock = server.connect()
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(80):  # 80 x 1 KiB > API_MAX_HEADER_KB (64)
            sock.sendall(b"X-Pad: " + b"a" * 1015 + b"\r\n")
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    finally:
        sock.close()


def test_a_stalled_upload_is_dropped(server: Server) -> None:
    headers = {"Authorization": f"Bearer {server.key}"}
    created = httpx.post(server.url + "/v1/sandboxes", json={}, headers=headers)
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["id"]
    sock = server.connect()
    try:
        sock.sendall(
            f"PUT /v1/sandboxes/{sandbox_id}/files/content?path=big.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.key}\r\ncontent-length: 50000000\r\n\r\n".encode()
            + b"x" * 100_000
        )
        started = time.monotonic()
        assert _closed_by_peer(sock, within_s=8)
        assert time.monotonic() - started < 8
    finally:
        sock.close()
    assert server.healthy()
    httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)


def test_api_keys_in_query_strings_stay_out_of_the_log(server: Server) -> None:
    secret = "sk-" + "q" * 30
    httpx.get(f"{server.url}/v1/sandboxes?api_key={secret}")
    httpx.get(f"{server.url}/health?api_key={secret}")
    time.sleep(0.2)
    assert secret not in server.log.read_text()


def _ws_url(server: Server, sandbox_id: str) -> str:
    return server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/stream"


def _sleeping_command(server: Server, sandbox_id: str, seconds: int) -> str:
    """Start ``sleep seconds`` in the background; the path of its command."""
    started = httpx.post(
        f"{server.url}/v1/sandboxes/{sandbox_id}/commands",
        json={"command": f"sleep {seconds}", "background": True},
        headers={"Authorization": f"Bearer {server.key}"},
    )
    assert started.status_code == 202, started.text
    return f"/v1/sandboxes/{sandbox_id}/commands/{started.json()['pid']}"


def _long_polls(
    server: Server, sandbox_id: str, count: int, *, timeout_s: float
) -> list[threading.Thread]:
    """``count`` long-polls, started, each waiting ``timeout_s`` on a sleeping command."""
    wait_url = server.url + _sleeping_command(server, sandbox_id, 30) + "/wait"
    polls = [
        threading.Thread(
            target=httpx.get,
            args=(f"{wait_url}?timeout_s={timeout_s}",),
            kwargs={"headers": {"Authorization": f"Bearer {server.key}"}, "timeout": 30},
        )
        for _ in range(count)
    ]
    for poll in polls:
        poll.start()
    return polls


def _sandbox(server: Server) -> str:
    headers = {"Authorization": f"Bearer {server.key}"}
    created = httpx.post(server.url + "/v1/sandboxes", json={}, headers=headers)
    assert created.status_code == 201, created.text
    sandbox_id: str = created.json()["id"]
    return sandbox_id


def test_stdin_to_a_command_that_never_reads_is_bounded(server: Server) -> None:
    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    before = server.rss_mb()
    notices: list[str] = []
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        ws.send(json.dumps({"type": "command", "command": "sleep 20", "stdin": True}))
        chunk = "x" * 65536
        for _ in range(1024):  # 64 MiB offered; the backlog cap is 1 MiB
            ws.send(json.dumps({"type": "stdin", "data": chunk}))
        with contextlib.suppress(TimeoutError):
            while len(notices) < 1:
                event = json.loads(ws.recv(timeout=5))
                if event["type"] == "notice":
                    notices.append(event["code"])
        grown = server.rss_mb() - before
    assert notices == ["stdin_backlog_full"]
    assert grown < 40, f"server grew by {grown:.0f} MiB"
    httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)


@pytest.mark.parametrize("kind", ["background", "pty"])
def test_input_to_a_background_job_that_never_reads_is_bounded(server: Server, kind: str) -> None:
    """The same backlog as a foreground run's, for a background command's stdin and a
    terminal's input over the WebSocket. Failed before: their queue capped items (64), not
    bytes, so 64 messages of up to 4 MiB each waited in the server per command."""
    import base64

    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    codes: list[str] = []
    if kind == "pty":
        # No echo: the terminal would send back what it takes in (here ~4 MB of output a
        # 20 messages), which a client that reads slower than it sends sees dropped.
        start = {"type": "pty", "command": "stty -echo; sleep 60"}
        # stty -icanon would not help: sleep never reads. ~750 KB raw per message.
        message = {"type": "input", "data_b64": base64.b64encode(b"x" * 750_000).decode()}
    else:
        start = {"type": "command", "command": "sleep 60", "background": True}
        message = {"type": "stdin", "data": "x" * 1_000_000}
    with connect(_ws_url(server, sandbox_id), additional_headers=headers, max_size=None) as ws:
        ws.send(json.dumps(start))
        while json.loads(ws.recv(timeout=30))["type"] != "started":
            pass

        def read_notices() -> None:  # as it sends: a client that reads nothing for 5 s is cut
            with contextlib.suppress(TimeoutError):
                while len(codes) < 80:  # paced by size, after the module's earlier floods
                    event = json.loads(ws.recv(timeout=30))
                    if event["type"] == "notice":
                        codes.append(event["code"])

        reader = threading.Thread(target=read_notices)
        reader.start()
        for _ in range(80):  # 60-80 MB offered; the backlog is 4 MiB
            ws.send(json.dumps(message))
        reader.join()
    # At most 4 MiB wait on the host (a terminal's guest takes some more into its own
    # memory, which the sandbox's cgroup bounds): the rest is refused at once (before, 64
    # messages queued and each later one waited 5 s for room). The server's RSS is no
    # measure here: reading 80 big messages leaves glibc's heap grown whatever is kept.
    # A terminal's guest takes input as it arrives, and paced by size (16 KiB a turn), it
    # arrives slowly enough for the guest to take most of the 80 messages: ~40 on
    # 2026-12-06, 65-69 on 2026-12-07 (a quieter VM), so only some are refused.
    refused_at_least = 60 if kind == "background" else 5
    assert set(codes) == {"stdin_backlog_full"} and len(codes) >= refused_at_least, len(codes)
    httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)


def _revoke_acme(server: Server) -> None:
    store = AuthStore(server.log.parent / "sandlot.db")
    try:
        (key,) = [k for k in store.list_keys() if k["tenant"] == "acme"]
        assert store.revoke_key(key["key_id"])
    finally:
        store.close()


def test_a_revoked_key_stops_typing_into_its_terminal(server: Server) -> None:
    """A terminal can outlive its key: input after the revocation closes the socket.
    Failed before: the key was checked when the terminal opened, and never again."""
    import base64

    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        ws.send(json.dumps({"type": "pty", "command": "cat"}))
        while json.loads(ws.recv(timeout=30))["type"] != "started":
            pass
        _revoke_acme(server)
        time.sleep(1.2)  # past the recheck interval
        typed = {"type": "input", "data_b64": base64.b64encode(b"after\n").decode()}
        with contextlib.suppress(ConnectionClosed):  # closed by then, since 2026-12-06
            ws.send(json.dumps(typed))
        events = []
        with contextlib.suppress(ConnectionClosed):
            while True:
                events.append(json.loads(ws.recv(timeout=10)))
    assert events and events[-1]["type"] == "error", events
    assert events[-1]["error"]["code"] == "unauthenticated"
    echoed = b"".join(base64.b64decode(e["data_b64"]) for e in events if e["type"] == "output")
    assert b"after" not in echoed


TICKS = "while true; do echo tick; sleep 0.1; done"


@pytest.mark.parametrize("kind", ["stdin", "background", "pty"])
def test_a_revoked_key_ends_its_streams_without_a_word_from_the_client(
    server: Server, kind: str
) -> None:
    """Failed before (red team, 2026-12-06): a foreground command kept taking the revoked
    key's stdin for as long as it ran (up to a day), and a background command or terminal
    kept streaming its output to it; the key was checked only on the client's next message
    (and never, on a foreground run's stdin)."""
    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    if kind == "stdin":
        start = {"type": "command", "command": "cat", "stdin": True, "timeout_s": 60}
    elif kind == "background":
        start = {"type": "command", "command": TICKS, "background": True}
    else:
        start = {"type": "pty", "command": TICKS}
    events: list[dict[str, Any]] = []
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        ws.send(json.dumps(start))
        if kind == "stdin":
            ws.send(json.dumps({"type": "stdin", "data": "before\n"}))
            while "before" not in json.loads(ws.recv(timeout=30)).get("data", ""):
                pass
        else:
            while json.loads(ws.recv(timeout=30))["type"] != "started":
                pass
        _revoke_acme(server)
        revoked_at = time.monotonic()
        if kind == "stdin":
            time.sleep(1.5)
            with contextlib.suppress(ConnectionClosed):
                ws.send(json.dumps({"type": "stdin", "data": "after\n"}))
        # The client says nothing more: the server must end the stream by itself.
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            while time.monotonic() - revoked_at < 8:
                events.append(json.loads(ws.recv(timeout=8)))
        closed_after_s = time.monotonic() - revoked_at
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[-1]["error"]["code"] == "unauthenticated", events[-3:]
    assert closed_after_s < 4, closed_after_s
    assert not any("after" in e.get("data", "") for e in events), events


async def test_output_queued_for_a_slow_client_is_bounded_by_bytes_not_chunks() -> None:
    # A sandbox can stream output one byte per chunk (about 1,000 chunks a second at 0.5 of a
    # core); each queued chunk costs the server a message object, not one byte. A budget of
    # characters let 8 Mi one-byte chunks queue (gigabytes); the budget must count each
    # chunk's real cost.
    import asyncio

    from sandlot.server import outbox

    queue: asyncio.Queue[dict[str, object] | None] = asyncio.Queue()
    put = outbox.put_text(queue, "stdout", outbox.Budget())
    for _ in range(200_000):
        put("x")
    queued = queue.qsize()
    most = outbox.STREAM_QUEUE_MAX_BYTES // (1 + outbox.CHUNK_OVERHEAD_BYTES) + 1
    assert queued <= most + 1, queued  # + the one "output dropped" notice
    items = [queue.get_nowait() for _ in range(queued)]
    notices = [item for item in items if item is not None and item["type"] == "notice"]
    assert [n["code"] for n in notices] == ["output_dropped"]


def test_one_key_cannot_reserve_more_than_its_tenant_quota(server: Server) -> None:
    # Failed before: the quota counted only sandboxes and memory, so one key held 10
    # sandboxes of 4,096 pids each (more than the host's 32,768), 80 GiB of disk on 77 GiB
    # free, and 20 cores on a 2-core host.
    headers = {"Authorization": f"Bearer {server.key}"}
    first = httpx.post(server.url + "/v1/sandboxes", json={"pids": 4096}, headers=headers)
    assert first.status_code == 201, first.text
    try:
        second = httpx.post(server.url + "/v1/sandboxes", json={"pids": 64}, headers=headers)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "quota_exceeded"
        assert "TENANT_MAX_PIDS" in second.json()["error"]["message"]
    finally:
        httpx.delete(f"{server.url}/v1/sandboxes/{first.json()['id']}", headers=headers)


def test_a_hostile_sandbox_id_never_reaches_the_audit_trail(server: Server) -> None:
    # Failed before: any id was accepted (404) and recorded, escape sequences and Rich markup
    # included, and `sandlot keys audit` printed it raw to the operator's terminal.
    headers = {"Authorization": f"Bearer {server.key}"}
    hostile = "sb-\x1b]0;owned\x07[bold red]x"
    quoted = urllib.parse.quote(hostile, safe="")
    response = httpx.delete(f"{server.url}/v1/sandboxes/{quoted}", headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    store = AuthStore(server.log.parent / "sandlot.db")
    try:
        assert all("\x1b" not in str(row["sandbox_id"]) for row in store.audit_log())
    finally:
        store.close()


def test_the_audit_listing_shows_control_characters_escaped(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows written before ids were checked (or by another writer) must still print safely.
    from sandlot.server.auth import LOCAL_PRINCIPAL
    from tests.test_cli import _run as run_cli

    data_dir = data_root / "audit-escape"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    store.audit(
        principal=LOCAL_PRINCIPAL,
        action="sandbox.delete",
        outcome="ok",
        sandbox_id="sb-\x1b[2J\x1b]0;owned\x07[blink]x",
    )
    store.close()
    monkeypatch.setenv("COLUMNS", "300")  # wide enough that Rich does not cut the cell
    done = run_cli(["keys", "audit"], data_dir)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b[2J" in done.stdout and "[blink]x" in done.stdout


def _spooled_files(pid: int) -> list[str]:
    """Anonymous temporary files (created and unlinked) the server holds open in the host's
    temporary directory: what a spooled upload looks like."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(tempfile.gettempdir() + "/") and target.endswith("(deleted)"):
                found.append(target)
    return found


def test_a_slow_multipart_upload_parks_nothing_on_the_host(server: Server) -> None:
    # Failed before: the form parser spooled every file part over 1 MiB to the host's /tmp,
    # so each slow or stalled upload parked up to API_MAX_UPLOAD_MB there.
    sandbox_id = _sandbox(server)
    boundary = "soakboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    size = 8 << 20
    with server.connect() as sock:
        sock.sendall(
            f"POST /v1/sandboxes/{sandbox_id}/files?path=a.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(head) + size + len(tail)}\r\n\r\n".encode()
            + head
            + b"x" * (size // 2)
        )
        time.sleep(1.0)  # half sent, still alive: what does the server hold meanwhile?
        parked = _spooled_files(server.pid)
        sock.sendall(b"x" * (size // 2) + tail)
        reply = sock.recv(65536)
    assert parked == [], parked
    assert reply.startswith(b"HTTP/1.1 201"), reply[:300]
    headers = {"Authorization": f"Bearer {server.key}"}
    stat = httpx.get(
        f"{server.url}/v1/sandboxes/{sandbox_id}/files/stat",
        params={"path": "a.bin"},
        headers=headers,
    )
    assert stat.json()["size_bytes"] == size
    httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)


def test_websockets_without_a_key_are_closed_and_websockets_count_as_connections(
    server: Server,
) -> None:
    """Failed before (red team, 2026-11-25): the agent's ``/stream`` accepted a socket with
    no key, answered "unauthenticated" to each message and kept it open, and an upgraded
    WebSocket left the connection count: one address held 1,150 such sockets, every one a
    file descriptor of the server's, until creates failed with ``fds_exhausted``. Then
    (2026-12-06) a socket closed after its upgrade was held ~10 s for the client's close
    reply: 40 renewed held the cap. Now a handshake with no key is refused with a 401."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = server.url.replace("http://", "ws://") + "/stream"
    for path in ("/stream", "/v1/sandboxes/sb-0123456789abcdef/stream"):
        with pytest.raises(InvalidStatus) as refused:
            connect(server.url.replace("http://", "ws://") + path, sock=server.connect())
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["code"] == "unauthenticated"
    # Nothing held after the refusals (it was ~10 s each).
    deadline = time.monotonic() + 1
    while server.open_connections() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.open_connections() == 0
    # With a key, a socket is held, and counted: one address holds at most its 50.
    headers = {"Authorization": f"Bearer {server.key}"}
    from websockets.exceptions import WebSocketException

    held = 0
    with contextlib.ExitStack() as stack:
        for _ in range(60):
            try:
                stack.enter_context(connect(url, sock=server.connect(), additional_headers=headers))
            except (OSError, TimeoutError, WebSocketException):
                continue  # refused: the address holds its cap
            held += 1
        assert held == 50, held
        assert server.open_connections() <= 50 + 2
        assert server.healthy()  # another address is still served
    deadline = time.monotonic() + 5
    while server.open_connections() > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    # Closed sockets leave the count: the address may connect again.
    with connect(url, sock=server.connect(), additional_headers=headers) as ws:
        ws.ping().wait(5)


@pytest.mark.parametrize("tenant", ["__pool__", "__readiness__", "__anything"])
def test_a_tenant_may_not_take_a_name_the_server_owns(data_root: Path, tenant: str) -> None:
    """Pooled sandboxes and the readiness probe's are owned by "__pool__" and
    "__readiness__": a tenant of that name would share the probe's guest template, and its
    creates would look like the pool's (the red team's find)."""
    from sandlot.errors import ConfigError

    data_dir = data_root / f"reserved-tenant-{tenant.strip('_')}"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    try:
        with pytest.raises(ConfigError, match="reserved"):
            store.create_key(tenant, "user")
        assert store.create_key("team_pool", "user")[1]  # '_' inside a name stays fine
    finally:
        store.close()


def test_the_websocket_message_cap_and_keepalive_follow_their_settings(data_root: Path) -> None:
    """API_WS_MAX_MESSAGE_KB and API_KEEPALIVE_TIMEOUT_SECONDS, set as an operator would."""
    from websockets.sync.client import connect

    settings = {"API_WS_MAX_MESSAGE_KB": "64", "API_KEEPALIVE_TIMEOUT_SECONDS": "1"}
    with _serving(data_root / "ws-cap", settings) as server:
        url, key = server.url, server.key
        sandbox_id = _sandbox(server)
        headers = {"Authorization": f"Bearer {key}"}
        with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
            ws.send(json.dumps({"type": "command", "command": "echo " + "y" * 40_000}))
            while json.loads(ws.recv(timeout=30))["type"] not in ("result", "error"):
                pass  # under the cap: served
            ws.send(json.dumps({"type": "command", "command": "echo " + "y" * 80_000}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
        # An idle keep-alive connection is let go after 1 s (the default is 5).
        sock = server.connect("127.0.0.1")
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {server.address[0]}\r\n\r\n".encode())
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(2.5)
        assert sock.recv(1) == b"", "the idle connection was kept past its timeout"
        sock.close()
        httpx.delete(f"{url}/v1/sandboxes/{sandbox_id}", headers=headers)


def test_a_tenant_holds_no_more_than_its_open_requests(data_root: Path) -> None:
    """Failed before (the third red team's find, 2026-12-06): a request being served is never
    evicted, and nothing counted them by tenant, so one key's 1,000 long-polls of an hour
    (from ten addresses) held every connection and locked every other tenant out. Past
    API_MAX_OPEN_PER_TENANT a tenant's next request or WebSocket is refused at once (429);
    another tenant is served, and a slot comes back when a request ends."""
    from websockets.sync.client import connect

    env = {**LIMITS, "API_MAX_OPEN_PER_TENANT": "3"}
    with _serving(data_root / "trust-open-per-tenant", env) as server:
        store = AuthStore(server.log.parent / "sandlot.db")
        other = {"Authorization": f"Bearer {store.create_key('other', 'user')[1]}"}
        store.close()
        headers = {"Authorization": f"Bearer {server.key}"}
        sandbox_id = _sandbox(server)
        polls = _long_polls(server, sandbox_id, 3, timeout_s=4)
        deadline = time.monotonic() + 10
        while True:  # the three polls are in: the tenant's fourth request is refused
            refused = httpx.get(server.url + "/v1/sandboxes", headers=headers)
            if refused.status_code == 429 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_open"
        with pytest.raises(Exception, match="429"):
            connect(_ws_url(server, sandbox_id), additional_headers=headers, open_timeout=10)
        assert httpx.get(server.url + "/v1/sandboxes", headers=other).status_code == 200
        for poll in polls:  # their wait runs out (the command runs on)
            poll.join(30)
        assert httpx.get(server.url + "/v1/sandboxes", headers=headers).status_code == 200


def test_a_streams_messages_are_read_at_its_tenants_pace(data_root: Path) -> None:
    """Failed before (the third red team's find, 2026-12-06): a stream's messages had no
    rate of their own, and one socket sent 14,500 resizes a second, each a round trip to
    the guest (a core of the server's). They are read at API_STREAM_MESSAGES_PER_SECOND
    (1,000 here, past a burst of 2,001): 5,000 take at least 3 s, and none is lost."""
    import base64

    from websockets.sync.client import connect

    env = {**LIMITS, "API_STREAM_MESSAGES_PER_SECOND": "1000"}
    with _serving(data_root / "trust-stream-pace", env) as server:
        sandbox_id = _sandbox(server)
        headers = {"Authorization": f"Bearer {server.key}"}
        with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
            ws.send(json.dumps({"type": "pty", "command": "cat"}))
            while json.loads(ws.recv(timeout=30))["type"] != "started":
                pass
            began = time.monotonic()
            for n in range(5000):
                ws.send(json.dumps({"type": "resize", "cols": 80 + n % 40, "rows": 24}))
            typed = {"type": "input", "data_b64": base64.b64encode(b"paced\n").decode()}
            ws.send(json.dumps(typed))
            echoed = b""
            while b"paced" not in echoed:
                event = json.loads(ws.recv(timeout=30))
                if event["type"] == "output":
                    echoed += base64.b64decode(event["data_b64"])
            took_s = time.monotonic() - began
        assert took_s >= 2.5, took_s


def test_a_large_body_costs_its_key_more_of_its_rate(data_root: Path) -> None:
    """Failed before (a sibling of the red team's stream find, 2026-12-06): a body cost one
    request whatever its size, and the server parses JSON on its one event loop (an 8 MiB
    array ~130 ms), so one key's 50 a second held it for everyone. Each 256 KiB now costs
    one more request: a 4 MiB body is 17 of a burst of 10, and the key waits."""
    env = {
        **LIMITS,
        "API_MAX_BODY_MB": "8",
        "API_RATE_LIMIT_PER_SECOND": "5",
        "API_RATE_LIMIT_BURST": "10",
    }
    with _serving(data_root / "trust-body-cost", env) as server:
        headers = {"Authorization": f"Bearer {server.key}", "Content-Type": "application/json"}
        body = b'{"code": [' + b",".join([b"0"] * (2 << 20)) + b"]}"  # 4 MiB
        url = server.url + "/v1/sandboxes/sb-0123456789abcdef/code"
        first = httpx.post(url, content=body, headers=headers, timeout=30)
        assert first.status_code in (404, 422), first.text  # admitted, then refused
        after = httpx.get(server.url + "/v1/sandboxes", headers=headers, timeout=10)
        assert after.status_code == 429, after.text  # before: 9 requests of the burst left
        assert after.json()["error"]["code"] == "rate_limited"
        small = b'{"code": "1"}'
        time.sleep(float(after.headers.get("retry-after", "1")))
        while (again := httpx.post(url, content=small, headers=headers)).status_code == 429:
            time.sleep(0.2)
        assert again.status_code == 404, again.text  # small bodies go on at the rate


def test_a_bodys_declared_size_is_charged_before_it_is_read(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): the rate was checked on the headers and the
    size charged once the body was read, so 90 bodies of 8 MiB sent at once all passed on
    the key's burst (690 MB of the server's memory). A body that declares more than the key
    has left is refused before a byte of it is read (here it never sends one)."""
    import socket

    env = {
        **LIMITS,
        "API_MAX_BODY_MB": "8",
        "API_RATE_LIMIT_PER_SECOND": "0.5",
        "API_RATE_LIMIT_BURST": "10",
    }
    with _serving(data_root / "trust-body-declared", env) as server:
        listed = httpx.get(
            server.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {server.key}"}
        )
        assert listed.status_code == 200  # 9 of the burst left: the body's 16 need 9 more
        host, port = server.url.removeprefix("http://").split(":")
        head = (
            f"POST /v1/sandboxes/sb-0123456789abcdef/code HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {server.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {4 << 20}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(head)
            answer = b""
            while b"}}" not in answer and (more := conn.recv(4096)):  # headers, then body
                answer += more
        # Before: the server waited for the body, and answered its idle timeout instead.
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"its body's size" in answer, answer


def rate_left(url: str, headers: dict[str, str]) -> int:
    """How many cheap requests the key has left: GETs until the first 429 (each costs one)."""
    with httpx.Client(base_url=url, headers=headers) as http:
        for spent in range(400):
            if http.get("/v1/sandboxes").status_code == 429:
                return spent
    raise AssertionError("no 429 in 400 requests")


MANY_FILES = (
    "import os\nos.mkdir('d')\n"
    "for i in range(8000):\n    open('d/%05d' % i + 'x' * 95, 'w').close()"
)


def _many_files_sandbox(http: httpx.Client) -> str:
    """A new sandbox whose ``d/`` holds :data:`MANY_FILES`' 8,000 files."""
    sid: str = http.post("/v1/sandboxes", json={"disk_mb": 64}).json()["id"]
    assert http.post(f"/v1/sandboxes/{sid}/code", json={"code": MANY_FILES}).is_success
    return sid


def test_a_listing_costs_its_key_by_its_size_and_its_entries(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): a listing of 25,900 entries took ~170 ms of
    the event loop and cost one request; 4 a second, twelve times under the rate, had the
    server at 72% of a core and another tenant's GET from 1.4 to 76 ms median. Each 256 KiB
    of a JSON answer now costs one more, and each 256 entries of a listing: these 8,000
    entries (~2.4 MB) ~40 more, through every route that lists."""
    env = {**LIMITS, "API_RATE_LIMIT_PER_SECOND": "0.01", "API_RATE_LIMIT_BURST": "200"}
    with _serving(data_root / "trust-answer-cost", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            sid = _many_files_sandbox(http)
            listed = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "d"})
            assert listed.status_code == 200 and len(listed.json()) == 8000
            by_size = len(listed.content) // (256 * 1024)
            assert by_size >= 8
            seed = http.get(f"/api/e2b/files/{sid}", params={"path": "d"})
            assert len(seed.json()) == 8000
            # 200 less create, code, two listings, their size and their entries; before: 196
            cost = 4 + 2 * by_size + 2 * (8000 // 256)
            assert rate_left(server.url, headers) == 200 - cost


def test_a_keys_burst_of_listings_is_not_all_made_before_the_first_is_charged(
    data_root: Path,
) -> None:
    """Failed before (2026-12-06, left by the twelfth round): a listing is charged by its
    entries once they are known, so a key's burst could have all its listings made before the
    first was charged: here 12 of 8,000 entries each, sent at once, were all made (~470
    requests' worth on a key with 26 left). A tenant's listings now take turns, each charged
    as soon as its entries are known, and one whose turn comes while its key owes is
    refused: the two made in the first turns put the key in debt."""
    env = {**LIMITS, "API_RATE_LIMIT_PER_SECOND": "0.01", "API_RATE_LIMIT_BURST": "40"}
    with _serving(data_root / "trust-listing-burst", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            sid = _many_files_sandbox(http)

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=20)
            async with httpx.AsyncClient(
                base_url=server.url, headers=headers, timeout=60, limits=limits
            ) as client:
                path = f"/v1/sandboxes/{sid}/files"
                sent = [client.get(path, params={"path": "d"}) for _ in range(12)]
                return await asyncio.gather(*sent)

        answers = asyncio.run(burst())
        made = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 429]
        assert len(made) + len(refused) == 12, [a.status_code for a in answers]
        assert all(len(a.json()) == 8000 for a in made)
        assert len(made) <= LISTINGS_PER_TENANT, len(made)  # before: 12
        assert all(a.json()["error"]["code"] == "rate_limited" for a in refused)
        assert all(float(a.headers["retry-after"]) > 0 for a in refused)


def test_an_upload_and_a_download_cost_their_key_by_their_size(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): a 100 MB upload took ~0.5 s of the server's CPU
    and cost one request, as did a download. Each MiB of either now costs one more, and an
    upload that declares more than its key has left is refused before it is read."""
    env = {**LIMITS, "API_RATE_LIMIT_PER_SECOND": "0.01", "API_RATE_LIMIT_BURST": "20"}
    with _serving(data_root / "trust-transfer-cost", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            sid = http.post("/v1/sandboxes", json={"disk_mb": 64}).json()["id"]
            url, blob = f"/v1/sandboxes/{sid}/files/content", os.urandom(3 << 20)
            assert http.put(url, params={"path": "blob"}, content=blob).is_success
            assert http.get(url, params={"path": "blob"}).content == blob
            # 11 left: 12 MiB more would cost 13 (before: it was written, for one)
            refused = http.put(url, params={"path": "big"}, content=os.urandom(12 << 20))
            assert refused.status_code == 429 and "its body's size" in refused.text, refused.text
            assert rate_left(server.url, headers) == 20 - 1 - 4 - 4 - 1  # before: 16 left


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_a_public_routes_body_is_never_read(server: Server, keyed: bool) -> None:
    """Failed before (2026-12-06, a sibling of the body charge): the guard read a POST's
    body to a public route before its 405, up to API_MAX_BODY_MB, so a keyless client had
    8 MiB buffered a request, and a key's body there was charged nothing of its rate. A
    public route takes no body: the 405 comes before a byte of it is sent."""
    host, port = server.url.removeprefix("http://").split(":")
    key = f"Authorization: Bearer {server.key}\r\n" if keyed else ""
    head = (
        f"POST /health HTTP/1.1\r\nHost: {host}\r\n{key}Content-Type: application/json\r\n"
        f"Content-Length: {512 << 10}\r\n\r\n"  # under the cap (API_MAX_BODY_MB=1)
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(head)
        answer = _read_response(conn)  # before: the body awaited, to the idle timeout
    assert answer.startswith(b"HTTP/1.1 405"), answer[:200]
    assert b'"method_not_allowed"' in answer, answer
    assert server.healthy()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sandboxes/sb-0123456789abcdef/code", {"code": "1"}),
        ("/v1/sandboxes/sb-0123456789abcdef/commands", {"command": "true", "env": None}),
        ("/execute", {"task": "print 6"}),
    ],
    ids=["code", "command-env", "execute"],
)
def test_many_unknown_fields_are_one_short_error(server: Server, path: str, body: dict) -> None:
    """Failed before (red team, 2026-12-06): each unknown field was an error of its own, so
    a 256 KiB body of 25,000 keys took the server's loop 150-400 ms and came back as a 1-3
    MB error, for one request of its key's rate; an env of 25,000 values the same."""
    headers = {"Authorization": f"Bearer {server.key}"}
    if "env" in body:
        body = {**body, "env": {str(n): n for n in range(25_000)}}
    else:
        body = {**body, **{str(n): 0 for n in range(25_000)}}
    answer = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
    assert answer.status_code == 422, answer.text[:300]
    assert len(answer.content) < 1_000, len(answer.content)
    message = answer.json()["error"]["message"]
    assert "unknown field" in message or "at most 256" in message, message
    query = "&".join(f"{n}=" for n in range(5_000))
    stat = httpx.get(
        server.url + f"/v1/sandboxes/sb-0123456789abcdef/files/stat?path=x&{query}",
        headers=headers,
    )
    assert stat.status_code == 422 and len(stat.content) < 1_000, stat.text[:300]


def test_a_streams_large_messages_cost_its_pace_by_their_size(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): the pace counted messages, not bytes, so 37
    messages a second of 4 MiB, far under it, took 98% of a core to parse and another
    tenant's listing from 1 ms to 1.1 s. Each 16 KiB now costs a turn: 100 messages of
    1 MiB are 6,500 turns, at 1,000 a second past a burst of 2,001."""
    env = {**LIMITS, "API_STREAM_MESSAGES_PER_SECOND": "1000"}
    with _serving(data_root / "trust-stream-bytes", env) as server:
        # Not JSON: each answered with an error.
        took_s, answers = _bad_messages_answered(server, "x" * (1 << 20), 100)
    assert all(answer["type"] == "error" for answer in answers), answers
    assert took_s >= 3.5, took_s  # before: ~0.5 s, within the burst


def _bad_messages_answered(
    server: Server, message: str, count: int
) -> tuple[float, list[dict[str, Any]]]:
    """``count`` copies of ``message`` sent at once on a new sandbox's stream: the seconds
    until all were answered, and the answers."""
    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        began = time.monotonic()
        for _ in range(count):
            ws.send(message)
        answers = [json.loads(ws.recv(timeout=30)) for _ in range(count)]
        return time.monotonic() - began, answers


@pytest.mark.parametrize(
    ("frame_kind", "payload"),
    [("binary", b"\x00\x01"), ("text", "not json"), ("text", "[" * 100_000)],
)
def test_a_bad_websocket_message_gets_a_typed_error_and_the_socket_goes_on(
    server: Server, frame_kind: str, payload: Any
) -> None:
    """Failed before (the third red team's find, 2026-12-06): a binary frame, text that is
    not JSON, or JSON nested 100,000 deep ended the socket with no frame (1006) and an
    unhandled exception's traceback in the log."""
    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        ws.send(payload)
        error = json.loads(ws.recv(timeout=10))
        assert error["type"] == "error" and error["error"]["code"] == "invalid_request", error
        ws.send(json.dumps({"type": "run_code", "code": "6 * 7"}))
        while (event := json.loads(ws.recv(timeout=30)))["type"] != "result":
            pass
        assert event["result"]["text"] == "42"
    assert "Exception in ASGI application" not in server.log.read_text()


@pytest.mark.parametrize(
    "start",
    [
        {"type": "pty", "command": "sleep 60"},
        {"type": "command", "command": "sleep 60", "background": True},
    ],
)
def test_a_stream_whose_sandbox_is_destroyed_ends_with_a_typed_error(
    server: Server, start: dict[str, Any]
) -> None:
    """Failed before (the third red team's find, 2026-12-06): a terminal's or background
    command's stream whose sandbox was destroyed closed with no frame, and the log got an
    unhandled CancelledError."""
    from websockets.sync.client import connect

    sandbox_id = _sandbox(server)
    headers = {"Authorization": f"Bearer {server.key}"}
    with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
        ws.send(json.dumps(start))
        while json.loads(ws.recv(timeout=30))["type"] != "started":
            pass
        gone = httpx.delete(f"{server.url}/v1/sandboxes/{sandbox_id}", headers=headers)
        assert gone.status_code == 200, gone.text
        events = [json.loads(ws.recv(timeout=10))]
        while events[-1]["type"] not in ("error", "result"):
            events.append(json.loads(ws.recv(timeout=10)))
    assert events[-1]["type"] == "error", events
    assert events[-1]["error"]["code"] == "sandbox_not_found", events
    assert "Exception in ASGI application" not in server.log.read_text()


def test_the_connection_cap_of_an_ipv6_client_is_its_64s() -> None:
    """Failed before (the third red team's find, 2026-12-06): the per-address cap counted
    each IPv6 address alone, so one client holding a /64 took 1,000 connections of 1,000
    under a cap of 100 an address. It counts by /64 now, as failed authentications do."""
    from sandlot.server.connections import ConnectionCount, ConnectionLimits

    count = ConnectionCount(ConnectionLimits(1000, 2, 5.0, 5.0, 65536))
    admitted = [count.admit(f"2001:db8:1:2::{n:x}") for n in range(1, 4)]
    assert admitted == [True, True, False]
    assert count.admit("2001:db8:1:3::1")  # another /64
    count.release("2001:db8:1:2::1")
    assert count.admit("2001:db8:1:2::ffff")


def test_bad_stream_messages_wait_for_their_tenants_pace_too(data_root: Path) -> None:
    """Failed before (the fourth red team's find, 2026-12-06): a message that was not JSON was
    answered before the pace, so four sockets got 36,000-50,000 error frames a second and
    another tenant's requests slowed from 20 ms to 1.1 s. 1,000 at 200 a second (past a
    burst of 401) take at least 3 s."""
    env = {**LIMITS, "API_STREAM_MESSAGES_PER_SECOND": "200"}
    with _serving(data_root / "trust-bad-paced", env) as server:
        took_s, answers = _bad_messages_answered(server, "not json", 1000)
    assert all(error["error"]["code"] == "invalid_request" for error in answers), answers[:3]
    assert took_s >= 2.5, took_s


def test_failed_stream_starts_give_their_slot_back_to_the_tenants_share(
    data_root: Path,
) -> None:
    """Failed before (the fourth red team's find, 2026-12-06): a terminal or command start
    counted its "started" frame (4 KiB) in the tenant's stream share before it could fail,
    and a failed one never gave it back: 344 failed attaches left a 1 MiB share with no room
    for any later stream's output."""
    from websockets.sync.client import connect

    env = {**LIMITS, "API_STREAM_QUEUE_MB_PER_TENANT": "1", "API_RATE_LIMIT_BURST": "1000"}
    with _serving(data_root / "trust-share-kept", env) as server:
        sandbox_id = _sandbox(server)
        headers = {"Authorization": f"Bearer {server.key}"}
        with connect(_ws_url(server, sandbox_id), additional_headers=headers) as ws:
            for _ in range(400):
                ws.send(json.dumps({"type": "attach", "pid": 99999}))
                failed = json.loads(ws.recv(timeout=30))
                assert failed["type"] == "error", failed
            ws.send(json.dumps({"type": "command", "command": "echo still heard"}))
            events = [json.loads(ws.recv(timeout=30))]
            while events[-1]["type"] != "result":
                events.append(json.loads(ws.recv(timeout=30)))
        streamed = "".join(e.get("data", "") for e in events if e["type"] == "stdout")
        assert streamed == "still heard\n", events


def test_a_wait_its_client_left_gives_its_tenants_slot_back(data_root: Path) -> None:
    """Failed before (the fourth red team's find, 2026-12-06): a long-poll whose client had
    gone held its tenant's open-request slot until its wait ran out (up to an hour): 100
    waits abandoned after a second locked the tenant out for their whole timeout."""
    env = {**LIMITS, "API_MAX_OPEN_PER_TENANT": "3"}
    with _serving(data_root / "trust-wait-left", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        sandbox_id = _sandbox(server)
        path = _sleeping_command(server, sandbox_id, 60) + "/wait?timeout_s=60"
        request = (
            f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n\r\n"
        ).encode()
        polls = []
        for _ in range(3):
            sock = server.connect("127.0.0.1")
            sock.sendall(request)
            polls.append(sock)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/v1/sandboxes", headers=headers).status_code != 429:
            assert time.monotonic() < deadline, "the three waits never held the tenant's slots"
            time.sleep(0.05)
        for sock in polls:  # the clients go away
            sock.close()
        deadline = time.monotonic() + 10
        while (
            served := httpx.get(server.url + "/v1/sandboxes", headers=headers)
        ).status_code == 429:
            assert time.monotonic() < deadline, served.text
            time.sleep(0.1)
        assert served.status_code == 200, served.text


# Each process of a sandbox whose command line starts with "sleep 6": how many.
SLEEPS = (
    'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline 2>/dev/null; echo; done'
    ' | grep -c "^sleep 6"'
)


def _post_and_hang_up(server: Server, path: str, body: dict[str, Any], **headers: str) -> None:
    """POST ``body`` whole on a raw socket, give the server a second with it, hang up."""
    data = json.dumps(body).encode()
    head = {
        "Host": "x",
        "Content-Type": "application/json",
        "Content-Length": str(len(data)),
        "Authorization": f"Bearer {server.key}",
        **headers,
    }
    request = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    with server.connect("127.0.0.1") as sock:
        sock.sendall(request.encode() + b"\r\n" + data)
        time.sleep(1.0)


def _sleeps_in(server: Server, sandbox_id: str) -> int:
    ran = httpx.post(
        f"{server.url}/v1/sandboxes/{sandbox_id}/commands",
        json={"command": SLEEPS, "session": "probe"},
        headers={"Authorization": f"Bearer {server.key}"},
        timeout=30,
    )
    assert ran.status_code == 200, ran.text
    return int(ran.json()["stdout"].strip())


def test_a_run_its_client_left_ends_and_gives_its_tenants_slot_back(data_root: Path) -> None:
    """Failed before (red team, 2026-12-07): a foreground run whose client hung up ran on
    for its whole timeout (up to a day), holding one of its tenant's open requests: six
    runs, a cap of six, and every later call of the tenant was 429 ``too_many_open``."""
    env = {**LIMITS, "API_MAX_OPEN_PER_TENANT": "3"}
    with _serving(data_root / "trust-run-left", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        sandbox_id = _sandbox(server)
        path = f"/v1/sandboxes/{sandbox_id}/commands"
        for n in range(3):
            run = {"command": "sleep 60", "timeout_s": 90, "session": f"s{n}"}
            _post_and_hang_up(server, path, run)
        served = httpx.get(server.url + "/v1/sandboxes", headers=headers)
        assert served.status_code == 200, served.text
        deadline = time.monotonic() + 10
        while (sleeps := _sleeps_in(server, sandbox_id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sleeps == 0, f"{sleeps} runs whose clients left still run"


def test_an_mcp_call_its_client_left_ends_with_its_request(data_root: Path) -> None:
    """Failed before (red team, 2026-12-07): the MCP SDK runs a tool call on after its
    client hangs up, but the POST that carried it returns, giving back its open request:
    a key had 63 calls in flight under a cap of 6, each holding what it was sent (39 MB
    for a 7 MiB write to a guest that read nothing)."""
    env = {**LIMITS, "API_MAX_OPEN_PER_TENANT": "4"}
    with _serving(data_root / "trust-mcp-left", env) as server:
        sandbox_id = _sandbox(server)
        version = "2025-06-18"
        mcp = {
            "Authorization": f"Bearer {server.key}",
            "Accept": "application/json, text/event-stream",
            "mcp-protocol-version": version,
        }
        hello = {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t"}}
        opened = httpx.post(
            server.url + "/mcp",
            headers=mcp,
            json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        )
        assert opened.status_code == 200, opened.text
        mcp["mcp-session-id"] = opened.headers["mcp-session-id"]
        httpx.post(
            server.url + "/mcp",
            headers=mcp,
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
        )
        del mcp["Authorization"]
        for n in range(6):
            arguments = {"command": "sleep 60", "sandbox_id": sandbox_id, "timeout_s": 90}
            call = {"name": "run_command", "arguments": arguments}
            body = {"jsonrpc": "2.0", "id": 10 + n, "method": "tools/call", "params": call}
            _post_and_hang_up(server, "/mcp", body, **mcp)
        deadline = time.monotonic() + 10
        while (sleeps := _sleeps_in(server, sandbox_id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sleeps == 0, f"{sleeps} MCP calls whose clients left still run"


def test_stdin_waiting_on_a_tenants_streams_is_counted_in_its_share(data_root: Path) -> None:
    """Failed before (the fourth red team's find, 2026-12-06): a foreground run's stdin was
    held to its own stream's backlog (1 MiB) alone, and 90 streams of one tenant held 433
    MiB of the server's memory. It counts in the tenant's stream share too (1 MiB here):
    the second stream's input past it is refused with a notice."""
    from websockets.sync.client import connect

    env = {**LIMITS, "API_STREAM_QUEUE_MB_PER_TENANT": "1"}
    with _serving(data_root / "trust-stdin-share", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        chunk = json.dumps({"type": "stdin", "data": "x" * (600 << 10)})
        start = {"type": "command", "command": "sleep 30", "stdin": True, "timeout_s": 30}
        with contextlib.ExitStack() as stack:
            sockets = [
                stack.enter_context(
                    connect(_ws_url(server, _sandbox(server)), additional_headers=headers)
                )
                for _ in range(2)
            ]
            for ws in sockets:
                ws.send(json.dumps(start))
                time.sleep(0.5)  # the run under way, its stdin open
                ws.send(chunk)
            with pytest.raises(TimeoutError):  # the first's 600 KiB fit
                sockets[0].recv(timeout=2)
            refused = json.loads(sockets[1].recv(timeout=10))
            assert refused["type"] == "notice", refused
            assert refused["code"] == "stdin_backlog_full", refused


def test_a_connection_over_the_address_cap_is_told_why_and_the_sdk_sends_it_again(
    data_root: Path,
) -> None:
    """Failed before (the sixth red team's leftover, 2026-12-06): over
    API_MAX_CONNECTIONS_PER_IP a connection was closed unread, so the SDK could not tell a
    create that never ran from one lost after it ran, and raised it (20 of 120 creates lost in
    a burst from one address). Now the server answers 429 ``too_many_connections`` before it
    reads a byte, and the SDK sends the call again."""
    import asyncio

    from sandlot.client import RemoteService
    from sandlot.requests import SandboxSpec

    env = {**LIMITS, "API_MAX_CONNECTIONS_PER_IP": "4"}
    with _serving(data_root / "trust-turned-away", env) as server:
        headers = {"Authorization": f"Bearer {server.key}"}
        # Four requests being served: the address's whole cap, none evictable.
        polls = _long_polls(server, _sandbox(server), 4, timeout_s=1.5)
        time.sleep(0.3)
        with server.connect("127.0.0.1") as sock:
            sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\ncontent-length: 2\r\n\r\n{}")
            reply = _read_response(sock)
            assert _closed_by_peer(sock, within_s=3)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), reply[:300]
        assert b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections", error
        assert "API_MAX_CONNECTIONS_PER_IP" in error["message"]

        async def create() -> Any:
            client = RemoteService(server.url, server.key)
            try:
                return await client.create(SandboxSpec())
            finally:
                await client.aclose()

        created = asyncio.run(create())  # turned away until the polls end, then sent again
        for poll in polls:
            poll.join(30)
        ids = [s["id"] for s in httpx.get(server.url + "/v1/sandboxes", headers=headers).json()]
        assert created.id in ids and len(ids) == 2  # the create ran once


def test_an_addresses_idle_connections_give_way_to_its_new_ones(data_root: Path) -> None:
    """Failed before (2026-12-06): 24 SDK clients of one process, each keeping its connection
    alive after its call, held a per-address cap of 4 until uvicorn's keep-alive timeout, and
    the others' calls were turned away. At the address's cap, its connection that has waited
    longest for a request (idle, or sending nothing) gives way, as at the total cap; the
    calls, a WebSocket's start among them, all run, each once."""
    import asyncio

    from sandlot.client import RemoteService
    from sandlot.requests import RunCode, RunCommand, SandboxSpec

    env = {**LIMITS, "API_MAX_CONNECTIONS_PER_IP": "4"}
    with _serving(data_root / "trust-idle-give-way", env) as server:
        sandbox_id = _sandbox(server)
        idle = [server.connect("127.0.0.1") for _ in range(4)]  # they send nothing

        async def burst() -> list[Any]:
            clients = [RemoteService(server.url, server.key) for _ in range(24)]
            out: list[str] = []
            try:
                calls = [client.create(SandboxSpec()) for client in clients[:8]]
                calls += [
                    client.run_code(sandbox_id, RunCode(code="6 * 7")) for client in clients[8:20]
                ]
                calls += [  # a background command's start, over a WebSocket
                    client.start_command(
                        sandbox_id, RunCommand(command="echo hi"), on_stdout=out.append
                    )
                    for client in clients[20:]
                ]
                return await asyncio.gather(*calls, return_exceptions=True)
            finally:
                await asyncio.gather(*(client.aclose() for client in clients))

        results = asyncio.run(burst())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, failed[:3]
        assert all(r.text == "42" for r in results[8:20]), results[8:11]
        assert all(_closed_by_peer(sock, within_s=1) for sock in idle)
        for sock in idle:
            sock.close()
        headers = {"Authorization": f"Bearer {server.key}"}
        listed = httpx.get(server.url + "/v1/sandboxes", headers=headers).json()
        assert len(listed) == 1 + 8  # each create ran once
        assert server.healthy()


def test_at_an_addresses_cap_its_oldest_waiting_connection_gives_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sandlot.server import connections
    from sandlot.server.connections import ConnectionCount, ConnectionLimits

    class Connection:
        def __init__(self, ip: str) -> None:
            self.ip = ip
            self.evicted = False
            self.unread = 0

        def evict(self) -> None:
            self.evicted = True
            count.served(self)
            count.release(self.ip)

        def has_unread(self) -> bool:
            return self.unread > 0

    clock = [100.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: clock[0])
    count = ConnectionCount(ConnectionLimits(1000, 2, 5.0, 5.0, 65536))
    a1, a2, b1 = Connection("10.0.0.1"), Connection("10.0.0.1"), Connection("10.0.0.2")
    for c in (a1, a2, b1):
        assert count.admit(c.ip)
    count.waits_on_client(b1, b1.ip)  # another address's: never taken for 10.0.0.1's
    clock[0] += 10
    assert not count.admit("10.0.0.1")  # both of its own are being served
    count.waits_on_client(a2, a2.ip)
    clock[0] += connections.ADDRESS_GRACE_S / 2
    count.waits_on_client(a1, a1.ip)  # newer than a2's wait
    assert not count.admit("10.0.0.1")  # a2's request may be on its way yet
    clock[0] += connections.ADDRESS_GRACE_S / 2
    # Failed before (red team, 2026-12-06): a2's next request is in its socket, unread (it
    # came in the same turn of the loop as the newcomer): a2 is as good as served.
    a2.unread = 120
    assert not count.admit("10.0.0.1") and not a2.evicted  # and a1 is too young
    a2.unread = 0
    assert count.admit("10.0.0.1") and a2.evicted and not a1.evicted and not b1.evicted
    a1.unread = 1
    clock[0] += connections.ADDRESS_GRACE_S
    assert not count.admit("10.0.0.1") and not a1.evicted
    a1.unread = 0
    assert count.admit("10.0.0.1") and a1.evicted and not b1.evicted
    assert count.by_ip["10.0.0.1"] == 2 and count.total == 3
    assert not count.admit("10.0.0.1")  # the new ones are not waiting yet
    assert count.waiting == {b1: "10.0.0.2"} and list(count.waiting_by_ip) == ["10.0.0.2"]


def test_a_client_that_connects_and_closes_at_the_cap_costs_no_traceback(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): over the cap, the server's 429 to a client
    that had connected and closed at once was answered with a reset, and the half-close
    after it raised ENOTCONN out of connection_made: a traceback each, drawn by the MCP
    SDK's rich handler in up to a second of the server's one loop, and a loop of them stalled
    every client (/health took 20.7 s)."""
    env = {**LIMITS, "API_MAX_CONNECTIONS_PER_IP": "4"}
    with _serving(data_root / "trust-connect-close", env) as server:
        held = [server.connect("127.0.0.2") for _ in range(4)]  # young: none evictable yet
        try:
            for _ in range(40):
                with contextlib.suppress(OSError):
                    server.connect("127.0.0.2").close()
            started = time.monotonic()
            assert server.healthy()
            assert time.monotonic() - started < 2
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        log = server.log.read_text()
        assert "Traceback" not in log and "ENOTCONN" not in log, log[-3000:]
        assert "Errno 107" not in log, log[-3000:]


def test_a_big_call_turned_away_at_the_cap_still_reads_why_and_is_sent_again(
    data_root: Path,
) -> None:
    """Failed before (red team, 2026-12-06): a turned-away connection dropped 64 KiB of
    what its client sent and then reset it, so a run of 600 KB of code lost the 429 to the
    reset and the SDK raised it (a run is not sent again on a transport error)."""
    import asyncio

    from sandlot.client import RemoteService
    from sandlot.requests import RunCode

    env = {**LIMITS, "API_MAX_CONNECTIONS_PER_IP": "4", "API_MAX_BODY_MB": "4"}
    with _serving(data_root / "trust-big-turned-away", env) as server:
        sandbox_id = _sandbox(server)
        code = "x = 0\n" + "#" * 600_000 + "\nx + 42"

        async def run() -> Any:
            client = RemoteService(server.url, server.key)
            try:
                return await client.run_code(sandbox_id, RunCode(code=code))
            finally:
                await client.aclose()

        for _ in range(6):
            # The address's cap, held by connections too young to give way: the run is
            # turned away, then (once they are 0.5 s old) takes one's place.
            held = [server.connect("127.0.0.1") for _ in range(4)]
            try:
                result = asyncio.run(run())
            finally:
                for sock in held:
                    sock.close()
            assert result.text == "42", result


def test_a_connection_serving_a_pipelined_request_is_never_evicted(data_root: Path) -> None:
    """Found by reading (red team, 2026-12-06): the head of a pipelined request, arriving
    while the one before it was served, marked the connection as waiting on its client, so
    after 0.5 s a newcomer of the same address evicted it and the answer under way was
    lost. Here the answer comes whole, and the newcomer is turned away."""
    env = {**LIMITS, "API_MAX_CONNECTIONS_PER_IP": "2"}
    with _serving(data_root / "trust-pipelined", env) as server:
        sandbox_id = _sandbox(server)
        wait = _sleeping_command(server, sandbox_id, 30) + "/wait?timeout_s=1.5"
        head = f"GET {wait} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n\r\n"
        polls = _long_polls(server, sandbox_id, 1, timeout_s=1.5)  # the address's second
        with server.connect("127.0.0.1") as sock:
            sock.sendall(head.encode() + b"GET /health HTTP/1.1\r\nHo")  # a pipelined head
            time.sleep(0.8)  # past the grace
            with server.connect("127.0.0.1") as newcomer:
                newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_response(newcomer).startswith(b"HTTP/1.1 429")
            sock.settimeout(10)
            reply = _read_response(sock)
        for poll in polls:
            poll.join(30)
        # The wait's whole answer: its command still runs (202).
        assert reply.startswith(b"HTTP/1.1 202") and reply.endswith(b"}"), reply[:300]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["running"] is True


def test_a_keyless_server_takes_nothing_from_another_sites_page(data_root: Path) -> None:
    """Failed before (2026-12-07): with keys off (``serve --no-auth``) only ``/mcp`` checked
    Host and Origin. Any web page its user visited could open a WebSocket to it (WebSockets
    have no CORS) and run code as the local admin (a JSON body needs a preflight, which the
    server fails, but a socket does not), and a page on a name it rebinds to 127.0.0.1
    could read every answer. Now such requests are refused (403) before anything runs."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    data_dir = Path(tempfile.mkdtemp(dir=data_root))
    process, url, _ = start_server(data_dir, {}, "--no-auth")
    try:
        port = urlparse(url).port
        body = json.dumps({"memory_mb": 64})
        # A page's cross-site post (typed as JSON here: the route reads nothing else).
        page = httpx.post(
            f"{url}/v1/sandboxes",
            content=body,
            headers={"Origin": "http://evil.example", "Content-Type": "application/json"},
        )
        assert page.status_code == 403, page.text
        assert "API_ALLOWED_ORIGINS" in page.json()["error"]["message"]
        # A name rebound to 127.0.0.1: the Host is the page's own name.
        rebound = httpx.get(f"{url}/v1/sandboxes", headers={"Host": f"evil.example:{port}"})
        assert rebound.status_code == 403, rebound.text
        assert httpx.get(f"{url}/metrics", headers={"Host": "evil.example"}).status_code == 403
        # A page's WebSocket, to the agent's stream and to a sandbox's.
        ws_url = url.replace("http://", "ws://")
        for path in ("/stream", "/v1/sandboxes/sb-0123456789abcdef/stream"):
            with pytest.raises(InvalidStatus) as refused:
                connect(ws_url + path, origin="http://evil.example")  # type: ignore[arg-type]
            assert refused.value.response.status_code == 403
        assert httpx.get(f"{url}/v1/sandboxes").json() == []  # nothing was made
        # A page on another port of this machine is another origin (red team on the fix: a
        # notebook's output or a cloned project's dev server opened the agent's stream), and
        # a Host that is more than name[:port] is no allowed name.
        for origin in (f"http://127.0.0.1:{port + 1}", f"http://localhost:{port}", "null"):
            other = httpx.get(f"{url}/v1/sandboxes", headers={"Origin": origin})
            assert other.status_code == 403, (origin, other.text)
        for host in (f"evil@127.0.0.1:{port}", f"127.0.0.1#@evil:{port}", "localhost."):
            assert httpx.get(f"{url}/v1/sandboxes", headers={"Host": host}).status_code == 403
        with pytest.raises(InvalidStatus):
            connect(ws_url + "/stream", origin=f"http://127.0.0.1:{port + 1}")  # type: ignore[arg-type]
        # The user's own clients: no Origin (curl, the SDK), or the server's own page (/docs).
        made = httpx.post(f"{url}/v1/sandboxes", json={"memory_mb": 64})
        assert made.status_code == 201, made.text
        own_page = httpx.get(f"{url}/v1/sandboxes", headers={"Origin": f"http://127.0.0.1:{port}"})
        assert own_page.status_code == 200 and len(own_page.json()) == 1
        with connect(ws_url + f"/v1/sandboxes/{made.json()['id']}/stream") as ws:
            ws.ping().wait(5)
    finally:
        stop_server(process)
    # API_ALLOWED_HOSTS names the others a keyless server may be reached by ("*": any), /mcp
    # included (the MCP SDK's own check refused them), and API_ALLOWED_ORIGINS other pages.
    env = {"API_ALLOWED_HOSTS": "sandlot.internal", "API_ALLOWED_ORIGINS": "http://ui.local:3000"}
    process, url, _ = start_server(data_dir, env, "--no-auth")
    try:
        named = {"Host": "sandlot.internal:80"}
        assert httpx.get(f"{url}/v1/sandboxes", headers=named).status_code == 200
        assert httpx.get(f"{url}/v1/sandboxes").status_code == 403  # 127.0.0.1 is not named
        ui = {**named, "Origin": "http://ui.local:3000"}
        assert httpx.get(f"{url}/v1/sandboxes", headers=ui).status_code == 200
        hello = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        mcp_headers = {**named, "Accept": "application/json, text/event-stream"}
        opened = httpx.post(f"{url}/mcp", json=hello, headers=mcp_headers)
        assert opened.status_code == 200, opened.text
        refused = httpx.post(f"{url}/mcp", json=hello, headers={**mcp_headers, "Host": "evil"})
        assert refused.status_code == 403
    finally:
        stop_server(process)


def test_a_body_sent_as_a_form_is_told_to_send_json(server: Server) -> None:
    """Seed 001's own lines (``curl -d '{...}'``) send their JSON as a form: the answer was
    a 422 "Input should be a valid dictionary" (seed audit, 2026-12-07); now a 415 that
    names the header to send. A form stays refused: a page may post one cross-site."""
    headers = {"Authorization": f"Bearer {server.key}"}
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):
        sent = httpx.post(
            f"{server.url}/api/sessions",
            content=json.dumps({"environment": "Python3", "provider": "e2b"}),
            headers={**headers, **({"Content-Type": kind} if kind else {})},
        )
        assert sent.status_code == 415, sent.text
        error = sent.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in error["message"]
    # A JSON body's own problems are still the body's: 422.
    bad = httpx.post(f"{server.url}/v1/sandboxes", json=[1], headers=headers)
    assert bad.status_code == 422, bad.text
