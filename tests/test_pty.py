"""Terminals: ``sandbox.pty`` embedded, over REST and the WebSocket, on every backend."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from sandlot import Sandbox, SandboxManager
from sandlot.errors import BackgroundLimitReached, CommandStillRunning, InvalidRequest
from tests.conftest import LiveServer, runtime_of


class Screen:
    """What a terminal wrote, as it arrives (on_data runs on the SDK's loop)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lock = threading.Lock()

    def __call__(self, chunk: bytes) -> None:
        assert isinstance(chunk, bytes)
        with self.lock:
            self.data += chunk

    def wait_for(self, needle: bytes, timeout_s: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if needle in self.data:
                    return bytes(self.data)
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} never came; the terminal wrote {bytes(self.data)!r}")


def test_shell_in_a_pty_is_interactive_and_sees_a_terminal(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(cols=100, rows=30, on_data=screen)
    assert term.pid > 0
    assert any(info.pid == term.pid and info.pty for info in sandbox.commands.list())
    term.send_input("tty; stty size\r")
    term.send_input("test -t 0 && echo IS-$((1+1))-TTY\r")
    text = screen.wait_for(b"IS-2-TTY\r\n")
    assert b"/dev/pts/" in text
    assert b"30 100" in text
    term.send_input("exit 7\r")
    result = term.wait(timeout_s=20)
    assert result.exit_code == 7
    assert result.stdout_bytes >= len(text)


def test_resize_reaches_the_program_as_sigwinch(sandbox: Sandbox) -> None:
    screen = Screen()
    if runtime_of(sandbox) == "runsc":
        # gVisor sends no SIGWINCH (README, "Terminals"): the new size is there to be read.
        term = sandbox.pty.create(cmd="read line; stty size", on_data=screen)
        term.resize(cols=132, rows=43)
        term.send_input("\r")
        screen.wait_for(b"43 132")
        assert term.wait(timeout_s=20).exit_code == 0
        return
    script = (
        '/usr/bin/python3 -c "import signal, os, sys, time\n'
        "def on(*a):\n"
        "    print('WINCH', *os.get_terminal_size(0), flush=True)\n"
        "signal.signal(signal.SIGWINCH, on)\n"
        "print('READY', flush=True)\n"
        'time.sleep(30)"'
    )
    term = sandbox.pty.create(cols=80, rows=24, cmd=script, on_data=screen)
    screen.wait_for(b"READY")
    term.resize(cols=132, rows=43)
    screen.wait_for(b"WINCH 132 43")
    assert term.kill() is True
    assert term.wait(timeout_s=10).kill_reason == "killed"


def test_ctrl_c_interrupts_the_foreground_program_not_the_shell(sandbox: Sandbox) -> None:
    if runtime_of(sandbox) == "runsc":
        pytest.skip("gVisor's terminal sends no SIGINT on ^C (README, Terminals): kill() ends it")
    screen = Screen()
    term = sandbox.pty.create(cmd="/bin/bash --norc -i", on_data=screen)
    term.send_input("sleep 100\r")
    time.sleep(0.5)
    term.send_input(b"\x03")  # the terminal's driver sends SIGINT to the foreground group
    term.send_input("echo AFTER-$?\r")
    screen.wait_for(b"AFTER-130\r\n")  # sleep died of SIGINT; the shell read on
    term.kill()


def test_output_is_raw_bytes_and_read_polls_it(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(cmd="printf '\\377\\033[31mred\\033[0m\\n'; sleep 0.3")
    result = term.wait(timeout_s=20)
    assert result.exit_code == 0
    data = term.read()
    assert b"\xff\x1b[31mred\x1b[0m\r\n" in data  # no decoding: 0xff comes back as 0xff
    assert term.read() == b""  # read() goes on from where the last one stopped


def test_cwd_env_and_size_limits(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("sub")
    screen = Screen()
    term = sandbox.pty.create(
        cmd="pwd; echo $WHO $TERM", cwd="sub", env={"WHO": "me"}, on_data=screen
    )
    term.wait(timeout_s=20)
    text = screen.wait_for(b"me xterm")
    assert b"/workspace/sub\r\n" in text
    with pytest.raises(Exception):
        sandbox.pty.create(cols=0)


def test_terminals_count_against_the_background_cap(
    sandbox: Sandbox, manager: SandboxManager
) -> None:
    limit = manager.settings.max_background_commands
    terms = [sandbox.pty.create(cmd="sleep 60") for _ in range(limit)]
    with pytest.raises(BackgroundLimitReached):
        sandbox.pty.create(cmd="sleep 60")
    with pytest.raises(BackgroundLimitReached):
        sandbox.commands.run("sleep 60", background=True)
    assert terms[0].kill() is True
    terms[0].wait(timeout_s=10)
    again = sandbox.pty.create(cmd="sleep 60")
    for term in [*terms[1:], again]:
        term.kill()


def test_a_terminal_past_its_timeout_is_killed(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(cmd="sleep 100", timeout_s=1)
    result = term.wait(timeout_s=30)
    assert result.kill_reason == "timeout", result


def test_a_command_is_not_a_terminal(sandbox: Sandbox) -> None:
    cmd = sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(InvalidRequest):
        sandbox.pty.resize(cmd.pid, 10, 10)
    cmd.kill()
    with pytest.raises(CommandStillRunning):
        sandbox.pty.create(cmd="sleep 30").wait(timeout_s=0.2)


# ---------------------------------------------------------------------- REST and WebSocket


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _poll_output(http: httpx.Client, base: str, pid: int, needle: bytes) -> bytes:
    seen = b""
    offset = 0
    deadline = time.monotonic() + 20
    while needle not in seen and time.monotonic() < deadline:
        window = http.get(f"{base}/pty/{pid}/output", params={"offset": offset})
        assert window.status_code == 200, window.text
        seen += base64.b64decode(window.json()["data_b64"])
        offset = window.json()["next_offset"]
        time.sleep(0.05)
    assert needle in seen, seen
    return seen


def test_rest_pty_round_trip(live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        created = http.post("/v1/sandboxes", json={"backend": "bubblewrap"})
        assert created.status_code == 201, created.text
        base = f"/v1/sandboxes/{created.json()['id']}"
        try:
            opened = http.post(f"{base}/pty", json={"cols": 90, "rows": 20})
            assert opened.status_code == 201, opened.text
            pid = opened.json()["pid"]
            assert opened.json()["pty"] is True
            typed = http.post(f"{base}/pty/{pid}/input", json={"data_b64": _b64(b"stty size\r")})
            assert typed.status_code == 204, typed.text
            _poll_output(http, base, pid, b"20 90")
            resized = http.post(f"{base}/pty/{pid}/resize", json={"cols": 70, "rows": 11})
            assert resized.status_code == 204, resized.text
            http.post(f"{base}/pty/{pid}/input", json={"data_b64": _b64(b"stty size\r")})
            _poll_output(http, base, pid, b"11 70")
            bad = http.post(f"{base}/pty/{pid}/input", json={"data_b64": "%%%"})
            assert bad.status_code == 422, bad.text
            command = http.post(f"{base}/commands", json={"command": "cat", "background": True})
            not_a_pty = http.post(
                f"{base}/pty/{command.json()['pid']}/resize", json={"cols": 1, "rows": 1}
            )
            assert not_a_pty.status_code == 422, not_a_pty.text
            # Another tenant cannot see or type into it; a viewer may read, not type.
            bob, viewer = live_server.headers("bob"), live_server.headers("viewer")
            for path, body in (
                (f"{base}/pty/{pid}/input", {"data_b64": _b64(b"id\r")}),
                (f"{base}/pty/{pid}/resize", {"cols": 5, "rows": 5}),
            ):
                assert http.post(path, json=body, headers=bob).status_code == 404
                assert http.post(path, json=body, headers=viewer).status_code == 403
            assert http.get(f"{base}/pty/{pid}/output", headers=bob).status_code == 404
            assert http.post(f"{base}/pty", json={}, headers=viewer).status_code == 403
            killed = http.delete(f"{base}/commands/{pid}")
            assert killed.json() == {"pid": pid, "killed": True}
            done = http.get(f"{base}/commands/{pid}/wait", params={"timeout_s": 10})
            assert done.status_code == 200 and done.json()["kill_reason"] == "killed"
            spec = http.get("/openapi.json").json()
            assert "/v1/sandboxes/{sandbox_id}/pty/{pid}/resize" in spec["paths"]
        finally:
            http.delete(base)


def _ws(live_server: LiveServer, sandbox_id: str, who: str = "alice") -> Any:
    url = live_server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/stream"
    return ws_connect(url, additional_headers=live_server.headers(who), open_timeout=10)


def _until(ws: Any, kind: str, needle: bytes = b"") -> tuple[dict[str, Any], bytes]:
    seen = b""
    while True:
        event = json.loads(ws.recv(timeout=20))
        if event["type"] == "output":
            seen += base64.b64decode(event["data_b64"])
        if event["type"] == kind and needle in seen:
            return event, seen
        assert event["type"] != "error", event


def test_websocket_pty_mode(live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        sandbox_id = http.post("/v1/sandboxes", json={"backend": "bubblewrap"}).json()["id"]
        try:
            with _ws(live_server, sandbox_id) as ws:
                ws.send(json.dumps({"type": "pty", "cols": 50, "rows": 10}))
                started = json.loads(ws.recv(timeout=20))
                assert started["type"] == "started" and started["info"]["pty"] is True
                pid = started["info"]["pid"]
                ws.send(json.dumps({"type": "input", "data_b64": _b64(b"stty size\r")}))
                _until(ws, "output", b"10 50")
                ws.send(json.dumps({"type": "resize", "cols": 61, "rows": 17}))
                ws.send(json.dumps({"type": "input", "data_b64": _b64(b"stty size\r")}))
                _until(ws, "output", b"17 61")
            # Detached, not ended: a new socket attaches and gets what it wrote before.
            with _ws(live_server, sandbox_id) as ws:
                ws.send(json.dumps({"type": "pty", "pid": pid}))
                assert json.loads(ws.recv(timeout=20))["type"] == "started"
                _until(ws, "output", b"17 61")
                ws.send(json.dumps({"type": "input", "data_b64": _b64(b"exit 3\r")}))
                result, _ = _until(ws, "result")
                assert result["result"]["exit_code"] == 3
            # Another tenant's handshake is refused: its sandbox does not exist for it.
            with pytest.raises(InvalidStatus) as refused, _ws(live_server, sandbox_id, "bob"):
                pass
            assert refused.value.response.status_code == 404
        finally:
            http.delete(f"/v1/sandboxes/{sandbox_id}")


def test_websocket_streams_a_background_command(live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        sandbox_id = http.post("/v1/sandboxes", json={"backend": "bubblewrap"}).json()["id"]
        try:
            with _ws(live_server, sandbox_id) as ws:
                message = {"type": "command", "command": "cat; echo bye >&2", "background": True}
                ws.send(json.dumps(message))
                started = json.loads(ws.recv(timeout=20))
                assert started["type"] == "started" and started["info"]["pty"] is False
                ws.send(json.dumps({"type": "stdin", "data": "ping\n"}))
                assert json.loads(ws.recv(timeout=20)) == {"type": "stdout", "data": "ping\n"}
                ws.send(json.dumps({"type": "stdin_eof"}))
                assert json.loads(ws.recv(timeout=20)) == {"type": "stderr", "data": "bye\n"}
                result = json.loads(ws.recv(timeout=20))
                assert result["type"] == "result" and result["result"]["exit_code"] == 0
        finally:
            http.delete(f"/v1/sandboxes/{sandbox_id}")


def test_remote_sdk_streams_pty_and_background_output(live_server: LiveServer) -> None:
    with Sandbox.create(api_url=live_server.url, api_key=live_server.keys["alice"]) as sb:
        screen = Screen()
        term = sb.pty.create(cols=40, rows=12, on_data=screen)
        term.send_input(b"stty size; printf '\\377\\n'\r")
        screen.wait_for(b"12 40")
        screen.wait_for(b"\xff\r\n")
        term.resize(cols=41, rows=13)
        term.send_input("stty size\r")
        screen.wait_for(b"13 41")
        assert b"13 41" in term.read()  # the server's window holds it too
        assert term.kill() is True
        lines: list[str] = []
        cmd = sb.commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.1; done",
            background=True,
            on_stdout=lines.append,
        )
        assert cmd.wait(timeout_s=20).exit_code == 0
        deadline = time.monotonic() + 10
        while "".join(lines) != "line1\nline2\nline3\n" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "".join(lines) == "line1\nline2\nline3\n"
        # Attaching to a running command streams what it writes from then on.
        later: list[str] = []
        slow = sb.commands.run("read go; echo after-attach", background=True)
        attached = sb.commands.connect(slow.pid, on_stdout=later.append)
        assert attached.pid == slow.pid
        slow.send_stdin("go\n")
        assert slow.wait(timeout_s=20).stdout == "after-attach\n"
        deadline = time.monotonic() + 10
        while later != ["after-attach\n"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert later == ["after-attach\n"]
