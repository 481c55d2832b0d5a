"""Terminals from the attacker's side: keystroke injection, outliving destroy, output floods,
and more terminals than the cap.

TIOCSTI pushes bytes into a terminal's input queue as if typed; TIOCLINUX pastes the
console's selection. Either, reaching the host's terminal or another sandbox's, would run
commands outside the sandbox. Nothing in a sandbox has a host terminal (bwrap --new-session,
docker without -t) and every sandbox has a devpts of its own; on bubblewrap the seccomp
filter refuses both requests outright, even on the sandbox's own terminal.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time

import httpx
import pytest

from sandlot import Sandbox, SandboxManager
from sandlot.core.background import SCROLLBACK_BYTES
from tests.conftest import LiveServer, placement, runtime_of
from tests.test_pty import Screen

pytestmark = pytest.mark.hostile

INJECT = r"""
import errno, fcntl, glob, json, os, struct, sys, termios
found = {}
try:
    own = os.ttyname(0)
except OSError:
    own = None
targets = {}
for fd in range(64):
    try:
        os.fstat(fd)
        targets["fd%d" % fd] = fd
    except OSError:
        pass
paths = ["/dev/tty", "/dev/console", "/dev/tty0", "/dev/tty1", "/dev/ptmx"]
for path in paths + sorted(glob.glob("/dev/pts/*")):
    try:
        targets[path] = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        found[path] = "open:" + errno.errorcode.get(exc.errno, str(exc.errno))
for name, fd in targets.items():
    tries = (
        ("sti", termios.TIOCSTI, b"#"),
        ("sti-hi", termios.TIOCSTI | (1 << 32), b"#"),
        ("linux-paste", 0x541C, bytes([3])),
    )
    for label, request, arg in tries:
        try:
            fcntl.ioctl(fd, request, arg)
            found[name + ":" + label] = "INJECTED"
        except OverflowError:
            found[name + ":" + label] = "overflow"
        except OSError as exc:
            found[name + ":" + label] = errno.errorcode.get(exc.errno, str(exc.errno))
print("PROBE" + json.dumps({"own": own, "found": found}) + "END")
"""


def _probe_result(text: str) -> dict[str, object]:
    start = text.index("PROBE") + len("PROBE")
    parsed: dict[str, object] = json.loads(text[start : text.index("END", start)])
    return parsed


def test_tiocsti_from_a_command_reaches_no_terminal(jail: Sandbox) -> None:
    jail.files.write("inject.py", INJECT)
    result = jail.commands.run("/usr/bin/python3 inject.py", timeout_s=30)
    assert result.exit_code == 0, result
    probe = _probe_result(result.stdout)
    assert probe["own"] is None  # no controlling terminal at all
    found = probe["found"]
    assert isinstance(found, dict)
    assert "INJECTED" not in found.values(), found


def test_tiocsti_inside_a_pty_is_refused(jail: Sandbox) -> None:
    """Even its own terminal: on bubblewrap the seccomp filter refuses TIOCSTI and TIOCLINUX
    (a pasted ``#`` would otherwise show up as typed input). On docker the default seccomp
    profile allows TIOCSTI where the kernel does (dev.tty.legacy_tiocsti): it can type only
    into the sandbox's own terminal, which it could write to anyway."""
    jail.files.write("inject.py", INJECT)
    screen = Screen()
    term = jail.pty.create(cmd="/usr/bin/python3 inject.py", on_data=screen)
    assert term.wait(timeout_s=30).exit_code == 0
    probe = _probe_result(screen.wait_for(b"END").decode("utf-8", "replace"))
    assert isinstance(probe["own"], str) and probe["own"].startswith("/dev/pts/")
    found = probe["found"]
    assert isinstance(found, dict)
    injected = {name for name, outcome in found.items() if outcome == "INJECTED"}
    if runtime_of(jail) == "bubblewrap":
        assert not injected, found
        assert found["fd0:sti"] == "EPERM" and found["fd0:sti-hi"] == "EPERM", found
    own_names = {"fd0", "fd1", "fd2", "/dev/tty", probe["own"]}
    assert {name.split(":")[0] for name in injected} <= own_names, found


def test_another_sandboxs_terminal_is_not_there(
    manager: SandboxManager, isolated_backend: str
) -> None:
    with Sandbox.create(manager=manager, **placement(isolated_backend)) as other:
        term = other.pty.create(cmd="sleep 60")
        with Sandbox.create(manager=manager, **placement(isolated_backend)) as sb:
            # gVisor shows no /dev/pts until a terminal is opened in the sandbox.
            listed = sb.commands.run("ls /dev/pts 2>/dev/null", timeout_s=20)
            assert [name for name in listed.stdout.split() if name != "ptmx"] == [], listed
        term.kill()


HOG = """
import os
held = []
try:
    while len(held) < 5000:
        held.append(os.openpty())
    failure = "none"
except OSError as exc:
    failure = os.strerror(exc.errno)
print("HELD", len(held), failure)
"""


def _host_ptys() -> int:
    with open("/proc/sys/kernel/pty/nr") as f:
        return int(f.read())


def test_one_sandbox_cannot_take_the_hosts_terminals(
    manager: SandboxManager, isolated_backend: str
) -> None:
    # Every devpts instance draws on the host's kernel.pty.max: one sandbox opening all it
    # can must stop at its own cap (its instance's max), and another sandbox still gets a
    # terminal. The kernel keeps the hog's ptys open between cells.
    cap = manager.settings.max_ptys
    gvisor = isolated_backend.endswith("+runsc")
    with (
        Sandbox.create(manager=manager, **placement(isolated_backend)) as hog,
        Sandbox.create(manager=manager, **placement(isolated_backend)) as bystander,
    ):
        before = _host_ptys()
        held = hog.run_code(HOG, timeout_s=60)
        count, failure = held.stdout.split()[1], held.stdout.split(maxsplit=2)[2].strip()
        if gvisor:
            # gVisor's terminals are its own, held in its sentry's memory: none is the host's.
            assert _host_ptys() - before <= 2
        else:
            assert int(count) == cap and failure == "No space left on device", held.stdout
            assert _host_ptys() - before <= cap
        screen = Screen()
        term = bystander.pty.create(cmd="echo terminal-ok; sleep 5", on_data=screen)
        screen.wait_for(b"terminal-ok")
        got = bystander.run_code("import os; m, s = os.openpty(); os.ttyname(s)")
        assert got.text and got.text.startswith("'/dev/pts/"), got
        term.kill()


def _host_pids_with(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def test_a_pty_does_not_outlive_destroy(manager: SandboxManager, isolated_backend: str) -> None:
    if isolated_backend.endswith("+runsc"):
        pytest.skip("gVisor's processes live inside its sentry, not in the host's /proc")
    marker = f"{os.getpid()}.{time.monotonic_ns() % 1000000:06d}"
    sb = Sandbox.create(manager=manager, **placement(isolated_backend))
    screen = Screen()
    term = sb.pty.create(on_data=screen)
    # A job of the shell, a daemon that left the terminal's session, and the shell itself.
    term.send_input(f"sleep 4{marker} & (setsid nohup sleep 5{marker} >/dev/null 2>&1 &)\r")
    term.send_input("echo STARTED-$((6*7))\r")
    screen.wait_for(b"STARTED-42")
    deadline = time.monotonic() + 10
    while len(_host_pids_with(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_host_pids_with(marker)) == 2
    sb.kill()
    deadline = time.monotonic() + 10
    while _host_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _host_pids_with(marker) == []


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_output_flood_keeps_host_memory_bounded(sandbox: Sandbox) -> None:
    """50 MB through a terminal nobody reads: the host keeps the newest window only."""
    flood_bytes = 50_000_000
    before = _rss_bytes()
    term = sandbox.pty.create(cmd=f"head -c {flood_bytes} /dev/zero | tr '\\0' x", timeout_s=120)
    result = term.wait(timeout_s=180)
    assert result.exit_code == 0, result
    assert result.stdout_bytes >= flood_bytes
    grown = _rss_bytes() - before
    assert grown < 32 << 20, f"host memory grew by {grown} bytes"
    kept = term.read()
    assert 0 < len(kept) <= SCROLLBACK_BYTES
    assert set(kept) <= set(b"x")


def _server_rss_bytes(live_server: LiveServer) -> int:
    port = live_server.url.rsplit(":", 1)[1]
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"serve" in argv and port.encode() in argv:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    raise AssertionError("the live server's process is not found")


def _raw_websocket(live_server: LiveServer, path: str, who: str) -> socket.socket:
    """A WebSocket opened by hand that will never read again: no client library buffers
    frames for it, so the server alone must bound what it holds."""
    port = int(live_server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    key = base64.b64encode(os.urandom(16)).decode()
    auth = live_server.headers(who)["Authorization"]
    sock.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: {auth}\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _send_text_frame(sock: socket.socket, text: str) -> None:
    payload = text.encode()
    assert len(payload) < 126
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)


def test_a_websocket_client_that_never_reads_costs_the_server_a_bounded_queue(
    live_server: LiveServer,
) -> None:
    """60 MB of terminal output for a client that reads nothing: the server queues at most
    its stream cap (8 MiB) and drops the rest, instead of holding all of it."""
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        sandbox_id = http.post("/v1/sandboxes", json={"backend": "bubblewrap"}).json()["id"]
        base = f"/v1/sandboxes/{sandbox_id}"
        try:
            before = _server_rss_bytes(live_server)
            sock = _raw_websocket(live_server, f"{base}/stream", "alice")
            flood = "head -c 60000000 /dev/zero | tr '\\0' x"
            _send_text_frame(sock, json.dumps({"type": "pty", "command": flood}))
            deadline = time.monotonic() + 30
            listed: list[dict[str, object]] = []
            while not listed and time.monotonic() < deadline:
                listed = http.get(f"{base}/commands").json()
                time.sleep(0.05)
            assert listed, "the terminal never started"
            pid = listed[0]["pid"]
            waited = http.get(f"{base}/commands/{pid}/wait", params={"timeout_s": 300}, timeout=330)
            assert waited.status_code == 200, waited.text
            assert waited.json()["stdout_bytes"] >= 60_000_000
            grown = _server_rss_bytes(live_server) - before
            assert grown < 40 << 20, f"the server grew by {grown} bytes"
            sock.close()
        finally:
            http.delete(base)


def test_more_terminals_than_the_cap_is_a_typed_429(live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        sandbox_id = http.post("/v1/sandboxes", json={"backend": "bubblewrap"}).json()["id"]
        base = f"/v1/sandboxes/{sandbox_id}"
        try:
            statuses = [
                http.post(f"{base}/pty", json={"command": "sleep 60"}).status_code
                for _ in range(17)
            ]
            assert statuses == [201] * 16 + [429], statuses
            refused = http.post(f"{base}/pty", json={"command": "sleep 60"})
            assert refused.json()["error"]["code"] == "background_limit"
        finally:
            http.delete(base)
