"""Webhooks on a background command's end (``server/webhooks.py``): what is sent, when, how
often, and where the server refuses to send it (server-side request forgery).

The server tests run a real ``sandlot serve`` and a real receiving HTTP server on 127.0.0.2,
the one loopback address the server is allowed to reach (``API_WEBHOOK_ALLOW_CIDRS``); the
address checks, the pinned connection and TLS run without a server.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from sandlot import SandboxManager
from sandlot._turns import FairTurns
from sandlot.core import execution
from sandlot.core.background import CommandEnded, Webhook
from sandlot.errors import ConfigError, InvalidRequest
from sandlot.models import CommandInfo, ExecResult, SandboxInfo
from sandlot.requests import RunCommand, SandboxSpec
from sandlot.server import webhooks as wh
from tests.conftest import make_settings, start_server, stop_server

RECEIVER_HOST = "127.0.0.2"
ISOLATION = {
    "TENANT_MAX_SANDBOXES": "50",
    "SANDBOX_BACKEND": "unsafe-local",
    "SANDBOX_ALLOW_UNSAFE": "true",
    "SANDBOX_UID_BASE": "550000",
    "SANDBOX_CGROUP_ROOT": "sandlot-wh",
    "SANDBOX_HOST_LEDGER_DIR": "/tmp/wh-ledger",
    "API_RATE_LIMIT_PER_SECOND": "10000",
    "API_RATE_LIMIT_BURST": "10000",
}
PENDING_CAP = 3

# The README's verification snippet, run here as a receiver would run it.
VERIFY = '''
import hashlib, hmac, time

def verify(secret: str, body: bytes, header: str, tolerance_s: int = 300) -> bool:
    """True if `header` (X-Sandlot-Signature) signs `body` (the raw request body)."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    t, sent = fields.get("t", ""), fields.get("v1", "")
    if not t.isdigit() or abs(time.time() - int(t)) > tolerance_s:
        return False  # too old (a replay) or malformed
    mac = hmac.new(secret.encode(), t.encode() + b"." + body, hashlib.sha256)
    return hmac.compare_digest(mac.hexdigest(), sent)
'''


def verify(secret: str, body: bytes, header: str) -> bool:
    scope: dict[str, Any] = {}
    exec(VERIFY, scope)  # the documented snippet itself
    result: bool = scope["verify"](secret, body, header)
    return result


# ---------------------------------------------------------------------- a receiver


@dataclass
class Received:
    at: float  # monotonic
    path: str
    headers: dict[str, str]
    body: bytes
    closed_at: float | None = None  # a hung request: when the sender hung up

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.body)
        return data


@dataclass
class Receiver:
    """A real HTTP server on 127.0.0.2: answers each POST with the next status of
    ``script`` (200 past its end), or, for "hang", holds the request unanswered until the
    sender hangs up or ``release`` is set."""

    script: list[int | str] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)
    tls: ssl.SSLContext | None = None
    server_names: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                item = Received(time.monotonic(), self.path, dict(self.headers.items()), body)
                with receiver.changed:
                    action = receiver.script.pop(0) if receiver.script else 200
                    receiver.received.append(item)
                    receiver.changed.notify_all()
                if action == "hang":
                    item.closed_at = self._hang()
                    return
                self.send_response(int(action))
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def _hang(self) -> float | None:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not receiver.release.is_set():
                    ready, _, _ = select.select([self.connection], [], [], 0.05)
                    if ready and not self.connection.recv(1, socket.MSG_PEEK):
                        return time.monotonic()  # the sender hung up
                return None

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((RECEIVER_HOST, 0), Handler)
        self.server.daemon_threads = True
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{RECEIVER_HOST}:{self.server.server_address[1]}/hook?token=t0ps3cret"

    @property
    def port(self) -> int:
        port: int = self.server.server_address[1]
        return port

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while len(self.received) < count and time.monotonic() < deadline:
                self.changed.wait(max(0.0, deadline - time.monotonic()))
            return list(self.received)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


@pytest.fixture
def make_receiver() -> Iterator[Any]:
    made: list[Receiver] = []

    def make(script: list[int | str] | None = None) -> Receiver:
        made.append(Receiver(script=list(script or [])))
        return made[-1]

    yield make
    for one in made:
        one.close()


# ---------------------------------------------------------------------- a real server


@dataclass
class Server:
    url: str
    keys: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes]
    created: list[tuple[str, str]] = field(default_factory=list)

    def call(self, who: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[who]}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def create(self, who: str) -> str:
        answer = self.call(who, "POST", "/v1/sandboxes", json={"ttl_s": 300})
        assert answer.status_code == 201, answer.text
        sandbox_id: str = answer.json()["id"]
        self.created.append((who, sandbox_id))
        return sandbox_id

    def destroy_created(self) -> None:
        while self.created:
            who, sandbox_id = self.created.pop()
            self.call(who, "DELETE", f"/v1/sandboxes/{sandbox_id}")

    def start(self, who: str, sandbox_id: str, command: str, **fields: Any) -> httpx.Response:
        body = {"command": command, "background": True, **fields}
        return self.call(who, "POST", f"/v1/sandboxes/{sandbox_id}/commands", json=body)

    def started(self, who: str, sandbox_id: str, command: str, **fields: Any) -> dict[str, Any]:
        answer = self.start(who, sandbox_id, command, **fields)
        assert answer.status_code == 202, answer.text
        info: dict[str, Any] = answer.json()
        return info

    def deliveries(self) -> dict[str, float]:
        text = self.call("admin", "GET", "/metrics").text
        found = re.findall(r'sandlot_webhook_deliveries_total\{outcome="(\w+)"\} (\S+)', text)
        return {outcome: float(value) for outcome, value in found}


def _serve(extra_env: dict[str, str]) -> tuple[Server, Path]:
    from sandlot.server.auth import AuthStore

    data_dir = Path(tempfile.mkdtemp(prefix="wh-", dir="/tmp"))
    data_dir.chmod(0o711)
    store = AuthStore(data_dir / "sandlot.db")
    tenants = ("acme", "globex", "initech", "capped", "hooli")
    keys = {"admin": store.create_key("ops", "admin")[1]}
    keys |= {tenant: store.create_key(tenant, "user")[1] for tenant in tenants}
    store.close()
    process, url, log_path = start_server(data_dir, {**ISOLATION, **extra_env})
    return Server(url, keys, log_path, process), data_dir


@pytest.fixture(scope="module")
def serving() -> Iterator[Server]:
    made, data_dir = _serve(
        {
            "API_WEBHOOK_ALLOW_CIDRS": f"{RECEIVER_HOST}/32",
            "API_WEBHOOKS_PENDING_PER_TENANT": str(PENDING_CAP),
        }
    )
    yield made
    stop_server(made.process)
    shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def server(serving: Server) -> Iterator[Server]:
    yield serving
    serving.destroy_created()


def _until(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    return check()


# ---------------------------------------------------------------------- what is sent


def test_a_commands_end_is_delivered_once_with_its_fields_and_a_valid_signature(
    server: Server, receiver: Receiver
) -> None:
    sandbox_id = server.create("acme")
    secret = "whsec-" + "k" * 40
    before = time.time()
    info = server.started(
        "acme",
        sandbox_id,
        "echo out; echo err >&2; exit 3",
        webhook_url=receiver.url,
        webhook_secret=secret,
    )
    (got,) = receiver.wait_for(1)
    time.sleep(1.5)  # a second delivery would be here by now
    assert len(receiver.received) == 1
    body = got.json()
    assert body["event"] == "command.completed"
    assert body["sandbox_id"] == sandbox_id
    assert (body["command_id"], body["pid"]) == (info["command_id"], info["pid"])
    assert (body["exit_code"], body["kill_reason"]) == (3, None)
    assert (body["stdout_tail"], body["stderr_tail"]) == ("out\n", "err\n")
    assert body["duration_ms"] > 0
    assert before <= body["sent_at"] <= time.time()
    assert set(body) == {
        "event",
        "sandbox_id",
        "command_id",
        "pid",
        "exit_code",
        "kill_reason",
        "duration_ms",
        "stdout_tail",
        "stderr_tail",
        "sent_at",
    }
    headers = {k.lower(): v for k, v in got.headers.items()}
    assert headers["x-sandlot-event"] == "command.completed"
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-sandlot-delivery"])
    assert headers["host"] == f"{RECEIVER_HOST}:{receiver.port}"
    assert got.path == "/hook?token=t0ps3cret"
    assert verify(secret, got.body, headers["x-sandlot-signature"])
    assert not verify("another secret", got.body, headers["x-sandlot-signature"])
    assert not verify(secret, got.body + b" ", headers["x-sandlot-signature"])
    # The URL's token and the secret stay out of the server's log.
    log = server.log.read_text()
    assert "t0ps3cret" not in log and secret not in log


def test_without_a_secret_nothing_is_signed_and_the_output_is_its_tail(
    server: Server, receiver: Receiver
) -> None:
    sandbox_id = server.create("acme")
    # 10,000 bytes of output, its last 4 KiB kept; a 3-byte character across the cut
    command = "printf 'a%.0s' $(seq 6000); printf '\\xe2\\x82\\xac%.0s' $(seq 2000)"
    server.started("acme", sandbox_id, command, webhook_url=receiver.url)
    (got,) = receiver.wait_for(1)
    headers = {k.lower() for k in got.headers}
    assert "x-sandlot-signature" not in headers
    tail = got.json()["stdout_tail"]
    assert len(tail.encode()) <= 4096 and len(tail.encode()) > 4090
    assert tail == "\u20ac" * len(tail)  # cut on a character's boundary


def test_a_command_without_a_webhook_sends_nothing(server: Server, receiver: Receiver) -> None:
    sandbox_id = server.create("acme")
    info = server.started("acme", sandbox_id, "true")
    wait = f"/v1/sandboxes/{sandbox_id}/commands/{info['pid']}/wait"
    assert server.call("acme", "GET", wait, params={"timeout_s": 10}).status_code == 200
    time.sleep(0.5)
    assert receiver.received == []


def test_a_killed_and_a_timed_out_command_are_delivered_with_their_kill_reason(
    server: Server, make_receiver: Any
) -> None:
    killed, timed_out = make_receiver(), make_receiver()
    sandbox_id = server.create("acme")
    info = server.started("acme", sandbox_id, "sleep 60", webhook_url=killed.url)
    server.started("acme", sandbox_id, "sleep 60", webhook_url=timed_out.url, timeout_s=0.5)
    kill = f"/v1/sandboxes/{sandbox_id}/commands/{info['pid']}"
    answer = server.call("acme", "DELETE", kill, params={"command_id": info["command_id"]})
    assert answer.json()["killed"] is True
    (by_kill,) = killed.wait_for(1)
    (by_timeout,) = timed_out.wait_for(1)
    assert by_kill.json()["kill_reason"] == "killed"
    assert by_kill.json()["command_id"] == info["command_id"]
    assert by_timeout.json()["kill_reason"] == "timeout"
    assert by_timeout.json()["duration_ms"] >= 400


def test_a_sandbox_destroyed_mid_command_delivers_with_its_kill_reason(
    server: Server, receiver: Receiver
) -> None:
    sandbox_id = server.create("acme")
    info = server.started("acme", sandbox_id, "sleep 60", webhook_url=receiver.url)
    assert server.call("acme", "DELETE", f"/v1/sandboxes/{sandbox_id}").status_code == 200
    (got,) = receiver.wait_for(1)
    body = got.json()
    assert (body["command_id"], body["sandbox_id"]) == (info["command_id"], sandbox_id)
    assert (body["kill_reason"], body["exit_code"]) == ("sandbox_destroyed", None)


def test_the_webhook_stays_on_the_host(server: Server, receiver: Receiver) -> None:
    """Neither the URL nor the secret reaches the sandbox's command."""
    sandbox_id = server.create("acme")
    info = server.started(
        "acme",
        sandbox_id,
        "env; cat /proc/self/cmdline",
        webhook_url=receiver.url,
        webhook_secret="s3cret-in-the-host",
    )
    wait = f"/v1/sandboxes/{sandbox_id}/commands/{info['pid']}/wait"
    result = server.call("acme", "GET", wait, params={"timeout_s": 10}).json()
    assert "PATH=" in result["stdout"]
    assert "s3cret-in-the-host" not in result["stdout"]
    assert "t0ps3cret" not in result["stdout"]
    receiver.wait_for(1)


# ---------------------------------------------------------------------- where it may not go


REFUSED_URLS = [
    "http://127.0.0.1:{port}/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]:{port}/",
    "http://10.0.0.1/",
    "http://100.64.0.1/",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://[fe80::1]/",
    "http://0.0.0.0:{port}/",
    "http://2130706433:{port}/",  # 127.0.0.1 as one decimal number
    "http://localhost:{port}/",
    "http://localhost.:{port}/",
]


@pytest.mark.parametrize("url", REFUSED_URLS)
def test_a_url_to_a_non_public_address_is_refused_before_the_command_starts(
    server: Server, receiver: Receiver, url: str
) -> None:
    sandbox_id = server.create("acme")
    answer = server.start(
        "acme", sandbox_id, "sleep 30", webhook_url=url.format(port=receiver.port)
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request", error
    assert "API_WEBHOOK_ALLOW_CIDRS" in error["message"] and "webhook_url" in error["message"]
    # never started (it would run for 30 s)
    assert server.call("acme", "GET", f"/v1/sandboxes/{sandbox_id}/commands").json() == []
    assert receiver.received == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"background": False, "webhook_url": "https://example.com/h"}, "webhook_url"),
        ({"webhook_url": "ftp://example.com/h"}, "webhook_url"),
        ({"webhook_url": "https://example.com/" + "a" * 2048}, "webhook_url"),
        ({"webhook_url": "https://user:pw@example.com/h"}, "webhook_url"),
        ({"webhook_url": "https://example.com:0/h"}, "webhook_url"),
        ({"webhook_secret": "s"}, "webhook_secret"),
        ({"webhook_url": "https://example.com/h", "webhook_secret": "s" * 257}, "webhook_secret"),
    ],
)
def test_a_malformed_webhook_is_a_typed_422_naming_its_field(
    server: Server, fields: dict[str, Any], named: str
) -> None:
    sandbox_id = server.create("acme")
    answer = server.start("acme", sandbox_id, "true", **fields)
    assert answer.status_code == 422, answer.text
    assert named in answer.json()["error"]["message"]


# ---------------------------------------------------------------------- tries and bounds


def test_a_receiver_that_answers_500_twice_gets_three_tries(
    server: Server, make_receiver: Any
) -> None:
    flaky = make_receiver([500, 503, 200])
    down = make_receiver([500, 500, 500, 500])
    refusing = make_receiver([404])
    before = server.deliveries()
    sandbox_id = server.create("globex")
    for one in (flaky, down, refusing):
        server.started("globex", sandbox_id, "true", webhook_url=one.url)
    tries = flaky.wait_for(3, timeout_s=15)
    assert len(tries) == 3
    assert len({t.headers["X-Sandlot-Delivery"] for t in tries}) == 1  # one delivery
    assert tries[1].at - tries[0].at >= 0.9
    assert tries[2].at - tries[1].at >= 3.9
    time.sleep(2)
    assert len(down.received) == 3  # three tries, no more
    assert len(refusing.received) == 1  # a 4xx is not tried again
    after = _until(lambda: (d := server.deliveries())["failed"] - before["failed"] >= 2 and d)
    assert after["delivered"] - before["delivered"] == 1
    assert after["failed"] - before["failed"] == 2


def test_a_hanging_receiver_is_given_up_without_holding_other_tenants(
    server: Server, make_receiver: Any
) -> None:
    hanging, prompt = make_receiver(["hang"]), make_receiver()
    before = server.deliveries()
    slow_box, other_box = server.create("initech"), server.create("globex")
    server.started("initech", slow_box, "true", webhook_url=hanging.url)
    (held,) = hanging.wait_for(1)
    server.started("globex", other_box, "true", webhook_url=prompt.url)
    assert len(prompt.wait_for(1, timeout_s=3)) == 1  # not behind the hanging one
    latencies = []
    while time.monotonic() - held.at < 4:
        start = time.monotonic()
        assert server.call("globex", "GET", f"/v1/sandboxes/{other_box}").status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.1)
    assert max(latencies) < 1.0, latencies
    closed = _until(lambda: held.closed_at, timeout_s=5)
    assert closed is not None
    assert 4.5 <= closed - held.at <= 7.0  # given up at the 5 s timeout
    time.sleep(5.5)  # after a timeout no second try (the first may have been taken)
    assert len(hanging.received) == 1
    after = server.deliveries()
    assert after["failed"] - before["failed"] == 1


def test_a_tenants_pending_deliveries_are_capped(server: Server, receiver: Receiver) -> None:
    receiver.script = ["hang"] * 10
    before = server.deliveries()
    sandbox_id = server.create("capped")
    for _ in range(PENDING_CAP + 3):  # each ends at once, its delivery held 5 s
        server.started("capped", sandbox_id, "true", webhook_url=receiver.url)
    _until(lambda: server.deliveries()["dropped"] - before["dropped"] >= 3, timeout_s=3)
    time.sleep(0.5)
    assert len(receiver.received) == PENDING_CAP
    after = server.deliveries()
    assert after["dropped"] - before["dropped"] == 3
    dropped_lines = [
        line for line in server.log.read_text().splitlines() if "webhook dropped" in line
    ]
    assert len(dropped_lines) == 1, dropped_lines  # once a minute per tenant
    assert "capped" in dropped_lines[0]
    receiver.release.set()


def test_the_servers_shutdown_cancels_pending_deliveries_within_a_second(
    make_receiver: Any,
) -> None:
    hanging = make_receiver(["hang"])
    made, data_dir = _serve({"API_WEBHOOK_ALLOW_CIDRS": f"{RECEIVER_HOST}/32"})
    try:
        sandbox_id = made.create("hooli")
        made.started("hooli", sandbox_id, "true", webhook_url=hanging.url)
        (held,) = hanging.wait_for(1)
        stopped_at = time.monotonic()
        made.process.send_signal(signal.SIGTERM)
        closed = _until(lambda: held.closed_at, timeout_s=5)
        assert closed is not None and closed - stopped_at < 1.5, closed and closed - stopped_at
        made.process.wait(30)
        assert "webhooks not sent: the server is stopping" in made.log.read_text()
    finally:
        stop_server(made.process)
        shutil.rmtree(data_dir, ignore_errors=True)


# ---------------------------------------------------------------------- without a server


@pytest.mark.parametrize(
    ("address", "what"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("100.127.255.254", "carrier-grade NAT"),
        ("169.254.169.254", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("198.18.0.1", "benchmarking"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fc00::1", "unique local"),
        ("fd12:3456::1", "unique local"),
        ("fe80::1", "link-local"),
        ("fe80::1%1", "link-local"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "link-local"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:100.64.0.1", "carrier-grade NAT"),
        ("::127.0.0.1", "IPv4-compatible"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2001::1", "IETF protocol"),  # Teredo
        ("2001:db8::1", "documentation"),
    ],
)
def test_a_non_public_address_is_refused(address: str, what: str) -> None:
    refusal = wh.address_refusal(ipaddress.ip_address(address))
    assert refusal is not None and what in refusal


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_a_public_address_is_taken(address: str) -> None:
    assert wh.address_refusal(ipaddress.ip_address(address)) is None


def test_the_allow_list_lets_in_its_networks_only() -> None:
    allowed = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("fd00::/8"))

    def refused(address: str) -> bool:
        return wh.address_refusal(ipaddress.ip_address(address), allowed) is not None

    assert not refused("127.0.0.2")
    assert not refused("::ffff:127.0.0.2")  # its IPv4-mapped form too
    assert not refused("fd00::5")
    assert refused("::1")  # loopback, but not in the list
    assert refused("10.0.0.1")
    assert refused("169.254.169.254")


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/",
        "http://user:pw@example.com/",
        "http://example.com@127.0.0.1/",
        "http:///path",
        "http://example.com:0/",
        "http://example.com:99999/",
        "http://exa mple.com/",
        "http://example.com\\@127.0.0.1/",
        "http://example.com/\r\nX-Injected: 1",
    ],
)
def test_a_malformed_url_is_refused(url: str) -> None:
    with pytest.raises(InvalidRequest, match="webhook_url"):
        wh.parse_target(url)


def test_a_target_keeps_its_host_for_the_header_and_connects_to_the_address() -> None:
    target = wh.parse_target("HTTPS://Hooks.Example.COM/a/b?c=d#frag")
    assert (target.scheme, target.host, target.port) == ("https", "hooks.example.com", 443)
    assert (target.host_header, target.path) == ("hooks.example.com", "/a/b?c=d")
    assert target.url_for(ipaddress.ip_address("93.184.216.34")) == (
        "https://93.184.216.34:443/a/b?c=d"
    )
    six = wh.parse_target("http://[2606:4700::1]:8080/")
    assert six.literal == ipaddress.ip_address("2606:4700::1")
    assert six.host_header == "[2606:4700::1]:8080"
    assert six.url_for(ipaddress.ip_address("2606:4700::1")) == "http://[2606:4700::1]:8080/"
    assert "c=d" not in target.where()  # a log line never holds the query's token


def test_the_signature_is_hmac_sha256_of_the_timestamp_and_the_body() -> None:
    body = b'{"event":"command.completed"}'
    header = wh.sign("secret", 1_700_000_000, body)
    expected = hmac.new(b"secret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    fresh = wh.sign("secret", int(time.time()), body)
    assert verify("secret", body, fresh)
    assert not verify("secret", body, header)  # too old: a replay


def test_run_command_takes_a_webhook_in_the_background_only() -> None:
    made = RunCommand(
        command="true", background=True, webhook_url="https://x.example/h", webhook_secret="s3"
    )
    assert "s3" not in repr(made) and made.webhook_secret == "s3"  # not in a log line
    with pytest.raises(ValidationError, match="webhook_url"):
        RunCommand(command="true", webhook_url="https://x.example/h")
    with pytest.raises(ValidationError, match="webhook_secret"):
        RunCommand(command="true", background=True, webhook_secret="k")
    with pytest.raises(ValidationError, match="webhook_url"):
        RunCommand(command="true", background=True, webhook_url="file:///etc/passwd")


def test_the_guests_payload_carries_no_webhook() -> None:
    request = RunCommand(
        command="true",
        background=True,
        webhook_url="https://hooks.example/abc",
        webhook_secret="s3cret",
    )
    _op, payload = execution.command_payload(request, streams_stdin=True)
    sent = json.dumps(payload)
    assert "hooks.example" not in sent and "s3cret" not in sent


def test_tenants_take_turns_at_the_places() -> None:
    async def run() -> list[str]:
        turns = FairTurns(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def hold(tenant: str) -> None:
            async with turns.turn(tenant):
                order.append(tenant)
                await gate.wait()

        first = asyncio.create_task(hold("a"))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(hold("a")) for _ in range(5)]
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(hold("c"))
        later = asyncio.create_task(hold("b"))
        await asyncio.sleep(0)
        cancelled.cancel()
        gate.set()
        await asyncio.gather(first, *waiting, later)
        assert turns.held == 0 and not turns.waiting()
        return order

    order = asyncio.run(run())
    # b waited behind none of a's five: the tenant that just had the place goes after the
    # others waiting (behind one of them before the turns were shared with the local model's).
    assert order[:3] == ["a", "b", "a"]
    assert "c" not in order and len(order) == 7


# Deliveries without a server: a Webhooks of its own, its resolver replaced.


def _webhooks(allow: str = "", count: list[str] | None = None) -> wh.Webhooks:
    settings = make_settings(Path("/tmp/wh-unused"), webhook_allow_cidrs=allow)
    return wh.Webhooks(settings, (count if count is not None else []).append)


def _ended_fields(url: str, secret: str | None = None) -> dict[str, Any]:
    info = SandboxInfo.model_construct(id="sb-1", owner="acme")
    command = CommandInfo(pid=7, command="true", started_at=time.time(), command_id="c" * 16)
    return {
        "info": info,
        "command": command,
        "result": ExecResult(exit_code=0, stdout="hi\n", duration_ms=3.0),
        "kill_reason": None,
        "webhook": Webhook(url, secret),
    }


async def _deliver(hooks: wh.Webhooks, fields: dict[str, Any]) -> None:
    hooks.on_event("command_ended", fields)
    await asyncio.wait(list(hooks._tasks), timeout=20)


def test_the_default_refuses_loopback_names_and_addresses() -> None:
    hooks = _webhooks()

    async def refused(url: str) -> str:
        with pytest.raises(InvalidRequest) as caught:
            await hooks.check_url("acme", url)
        return str(caught.value)

    async def run() -> None:
        assert "loopback" in await refused("http://127.0.0.1/")
        assert "API_WEBHOOK_ALLOW_CIDRS" in await refused("http://localhost/")
        assert "API_WEBHOOK_ALLOW_CIDRS" in await refused("http://does-not-exist.invalid/")
        await hooks.aclose()

    asyncio.run(run())


def test_any_refused_address_of_a_name_refuses_it() -> None:
    hooks = _webhooks()

    async def addresses(tenant: str, host: str, port: int) -> list[Any]:
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.7")]

    hooks._addresses = addresses  # type: ignore[method-assign]

    async def run() -> None:
        with pytest.raises(InvalidRequest, match="did not resolve, or resolved to"):
            await hooks.check_url("acme", "https://hooks.example/")
        await hooks.aclose()

    asyncio.run(run())


def test_a_delivery_connects_to_the_address_checked_with_the_urls_host(
    receiver: Receiver,
) -> None:
    """The name is resolved by the check only (httpx could not resolve it: it is not in
    DNS), the connection goes to that address, and the Host header is the URL's."""
    count: list[str] = []
    hooks = _webhooks(f"{RECEIVER_HOST}/32", count)

    async def addresses(tenant: str, host: str, port: int) -> list[Any]:
        assert host == "hooks.sandlot.invalid"
        return [ipaddress.ip_address(RECEIVER_HOST)]

    hooks._addresses = addresses  # type: ignore[method-assign]
    url = f"http://hooks.sandlot.invalid:{receiver.port}/in"

    async def run() -> None:
        await hooks.check_url("acme", url)
        await _deliver(hooks, _ended_fields(url))
        await hooks.aclose()

    asyncio.run(run())
    (got,) = receiver.received
    assert got.headers["Host"] == f"hooks.sandlot.invalid:{receiver.port}"
    assert got.json()["stdout_tail"] == "hi\n"
    assert count == ["delivered"]


def test_a_name_that_resolves_elsewhere_by_delivery_time_is_refused_then(
    receiver: Receiver,
) -> None:
    """DNS rebinding: public (here: allowed) when the command starts, loopback when its
    webhook is sent. The delivery is refused; nothing connects."""
    count: list[str] = []
    hooks = _webhooks(f"{RECEIVER_HOST}/32", count)
    answers = iter([[RECEIVER_HOST], ["127.0.0.1"]])

    async def addresses(tenant: str, host: str, port: int) -> list[Any]:
        return [ipaddress.ip_address(a) for a in next(answers)]

    hooks._addresses = addresses  # type: ignore[method-assign]
    url = f"http://rebind.sandlot.invalid:{receiver.port}/in"

    async def run() -> None:
        await hooks.check_url("acme", url)
        await _deliver(hooks, _ended_fields(url))
        await hooks.aclose()

    asyncio.run(run())
    assert receiver.received == []
    assert count == ["refused"]


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            f"/CN={name}",
            "-addext",
            f"subjectAltName=DNS:{name}",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_sends_the_urls_name_as_sni_and_checks_the_certificate_against_it(
    tmp_path: Path,
) -> None:
    cert, key = _self_signed(tmp_path, "hooks.sandlot.invalid")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    names: list[str | None] = []
    server_tls.sni_callback = lambda _sock, name, _ctx: names.append(name)  # type: ignore[assignment, func-returns-value]
    receiver = Receiver(tls=server_tls)
    try:
        count: list[str] = []
        hooks = _webhooks(f"{RECEIVER_HOST}/32", count)
        hooks._ssl = ssl.create_default_context(cafile=str(cert))

        async def addresses(tenant: str, host: str, port: int) -> list[Any]:
            return [ipaddress.ip_address(RECEIVER_HOST)]

        hooks._addresses = addresses  # type: ignore[method-assign]
        good = f"https://hooks.sandlot.invalid:{receiver.port}/in"
        wrong = f"https://other.sandlot.invalid:{receiver.port}/in"

        async def run() -> None:
            await _deliver(hooks, _ended_fields(good))
            await _deliver(hooks, _ended_fields(wrong))  # the certificate does not name it
            await hooks.aclose()

        start = time.monotonic()
        asyncio.run(run())
        assert names[0] == "hooks.sandlot.invalid"
        assert len(receiver.received) == 1
        assert count == ["delivered", "failed"]
        assert time.monotonic() - start < 1.0  # a certificate refused is not tried again
    finally:
        receiver.close()


def test_an_embedded_manager_refuses_a_webhook_rather_than_drop_it(tmp_path: Path) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="wh-", dir="/tmp"))
    data_dir.chmod(0o711)
    settings = make_settings(
        data_dir,
        uid_base=550000,
        cgroup_root="sandlot-wh",
        host_ledger_dir=Path("/tmp/wh-ledger"),
    )
    events: list[tuple[str, dict[str, Any]]] = []

    async def run() -> None:
        async with SandboxManager(settings) as manager:
            manager.add_listener(lambda event, fields: events.append((event, fields)))
            info = await manager.create(SandboxSpec(backend="unsafe-local"))
            request = RunCommand(
                command="true", background=True, webhook_url="https://hooks.example/h"
            )
            with pytest.raises(ConfigError, match="webhook_url"):
                await manager.start_command(info.id, request)
            assert await manager.list_commands(info.id) == []
            # The event every background command's end is, webhook or not:
            started = await manager.start_command(
                info.id, RunCommand(command="exit 4", background=True)
            )
            await manager.wait_command(info.id, started.pid, 10)
            await asyncio.sleep(0.1)
            sleeper = await manager.start_command(
                info.id, RunCommand(command="sleep 60", background=True)
            )
            await manager.destroy(info.id)
            ended = [fields for event, fields in events if event == "command_ended"]
            assert [f["command"].command_id for f in ended] == [
                started.command_id,
                sleeper.command_id,
            ]
            assert ended[0]["result"].exit_code == 4 and ended[0]["kill_reason"] is None
            assert ended[1]["kill_reason"] == "sandbox_destroyed"
            assert ended[0]["info"].id == info.id and ended[0]["webhook"] is None

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_command_ended_carries_the_secret_out_of_any_repr() -> None:
    ended = CommandEnded(
        CommandInfo(pid=1, command="true", started_at=0.0),
        None,
        "guest_lost",
        Webhook("https://hooks.example/h", "s3cret"),
    )
    assert "s3cret" not in repr(ended)


def _wait_behind_slow_names(monkeypatch: pytest.MonkeyPatch, slow: list[tuple[str, str]]) -> float:
    """How long tenant "b"'s check of a name that resolves at once takes while each (tenant,
    host) of ``slow`` is being looked up by a resolver that never answers (a second past the
    check's own bound: refused)."""
    gate = threading.Event()

    def lookup(host: str, port: int, *args: Any) -> Any:
        if host.startswith("slow"):
            gate.wait(30)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]

    monkeypatch.setattr(wh.socket, "getaddrinfo", lookup)
    hooks = _webhooks()

    async def run() -> float:
        waiting = [
            asyncio.create_task(hooks.check_url(tenant, f"http://{host}/")) for tenant, host in slow
        ]
        await asyncio.sleep(0.2)
        start = time.monotonic()
        try:
            await hooks.check_url("b", "http://fast.example/")
            return time.monotonic() - start
        except InvalidRequest:
            return time.monotonic() - start + 1000
        finally:
            gate.set()
            await asyncio.gather(*waiting, return_exceptions=True)
            await hooks.aclose()

    return asyncio.run(run())


def test_one_tenants_slow_names_hold_its_own_lookups_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose servers never answer holds a resolver thread for the resolver's whole
    timeout: one tenant's many such names must not take every thread from the others."""
    slow = [("a", f"slow{n}.example") for n in range(wh.DNS_THREADS + 1)]
    assert _wait_behind_slow_names(monkeypatch, slow) < 1.0


# ---------------------------------------------------------------- red team on webhooks

RT_HOST = "127.0.0.3"


def _rt_listen(handler: Any) -> tuple[socket.socket, int]:
    ls = socket.socket()
    ls.bind((RT_HOST, 0))
    ls.listen(16)

    def run() -> None:
        while True:
            try:
                conn, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return ls, ls.getsockname()[1]


def test_a_receivers_stream_of_1xx_answers_does_not_hold_the_event_loop() -> None:
    """Failed before (red team, 2026-12-07). A receiver that answers `100 Continue` forever:
    httpcore parsed each one on the server's event loop until the try's 5 s timeout. Measured
    (rt15w): one such delivery took 4.5 s of CPU in 4.5 s (a whole core, the server's one loop),
    eight took another tenant's GET from 2 ms to 118 ms median (p95 345 ms). A try should read a
    bounded number of bytes (or 1xx answers) before its final status and give up past it."""
    chunk = b"HTTP/1.1 100 Continue\r\n\r\n" * 4000

    def flood(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                while True:
                    conn.sendall(chunk)
            except OSError:
                pass

    ls, port = _rt_listen(flood)
    count: list[str] = []
    hooks = _webhooks(f"{RT_HOST}/32", count)

    async def run() -> float:
        cpu = time.thread_time()  # this thread's: the event loop's, not the receiver's
        hooks.on_event("command_ended", _ended_fields(f"http://{RT_HOST}:{port}/h"))
        await asyncio.wait(list(hooks._tasks), timeout=20)
        await hooks.aclose()
        return time.thread_time() - cpu

    try:
        loop_cpu_s = asyncio.run(run())
    finally:
        ls.close()
    assert count == ["failed"]
    assert loop_cpu_s < 0.5, f"one delivery held the event loop for {loop_cpu_s:.2f} s of CPU"


def test_no_log_line_holds_the_urls_path_or_query(caplog: pytest.LogCaptureFixture) -> None:
    """Failed before (red team, 2026-12-07). The module promises logs name the URL's scheme, host
    and port only (a path or query often holds a token). httpx's own INFO line ("HTTP Request:
    POST http://ip:port/path?query ...") is logged at the server's default LOG_LEVEL=INFO for
    every try: rt15w saw `HTTP Request: POST
    http://127.0.0.2:18577/hook/TOKENplugh456?t=TOKENplugh456` in server.log."""
    token = "TOKENplugh456"

    class Ok(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((RT_HOST, 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    count: list[str] = []
    hooks = _webhooks(f"{RT_HOST}/32", count)
    url = f"http://{RT_HOST}:{server.server_address[1]}/hook/{token}?t={token}"

    async def run() -> None:
        hooks.on_event("command_ended", _ended_fields(url))
        await asyncio.wait(list(hooks._tasks), timeout=20)
        await hooks.aclose()

    caplog.set_level(logging.INFO)
    try:
        asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert count == ["delivered"]
    assert token not in caplog.text


def test_other_tenants_hung_names_do_not_take_every_resolver_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failed before (red team, 2026-12-07): with DNS_PER_TENANT=2 of DNS_THREADS=8, four
    tenants' names that never answer held all 8 threads, and a fifth tenant's check of a
    name that resolves at once waited 5 s and was refused; its pending delivery failed with
    no retry. Now a tenant holds one of 32."""
    slow = [
        (f"evil{t}", f"slow{t}-{n}.example") for t in range(4) for n in range(wh.DNS_PER_TENANT)
    ]
    assert _wait_behind_slow_names(monkeypatch, slow) < 1.0
