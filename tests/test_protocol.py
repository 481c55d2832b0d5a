"""The host's side of the guest protocol, against guests that misbehave.

The guest shares a uid with untrusted code, so the host must survive a guest that lies.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

import sandlot.guest.ops
from sandlot import GuestError, SandboxFileNotFound
from sandlot.core.files import read_through
from sandlot.core.guest_link import GuestConnection
from sandlot.errors import GuestDied, ProtocolMismatch
from sandlot.guest.ops import PROTOCOL_VERSION, Op


class EndlessFile:
    """A connection whose guest claims a file never ends."""

    async def request(self, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"data": base64.b64encode(b"x" * 65536).decode(), "eof": False, "size": 1}


async def test_read_stops_at_the_disk_size_whatever_the_guest_says() -> None:
    received = 0
    with pytest.raises(GuestError, match="disk size"):
        async for chunk in read_through(EndlessFile(), "f", limit_bytes=1 << 20):  # type: ignore[arg-type]
            received += len(chunk)
    assert received <= 1 << 20


# A real process plays the guest: it writes `first`, reads one request, writes `answer`,
# then lingers before exiting.
FAKE_GUEST = """
import struct, sys, time
out = sys.stdout.buffer
out.write(bytes.fromhex(sys.argv[1])); out.flush()
if sys.argv[2]:
    size = struct.unpack(">I", sys.stdin.buffer.read(4))[0]
    sys.stdin.buffer.read(size)
    out.write(bytes.fromhex(sys.argv[2])); out.flush()
time.sleep(float(sys.argv[3]))
"""


def _frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


async def _guest(
    first: bytes, answer: bytes = b"", linger_s: float = 2.0
) -> tuple[GuestConnection, asyncio.subprocess.Process]:
    argv = [first.hex(), answer.hex(), str(linger_s)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FAKE_GUEST,
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    return GuestConnection(proc.stdout, proc.stdin), proc


async def _finish(conn: GuestConnection, proc: asyncio.subprocess.Process) -> None:
    await conn.close()
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def test_error_frames_map_to_our_exceptions() -> None:
    ready = _frame({"id": 0, "event": "ready", "protocol": PROTOCOL_VERSION})
    error = _frame({"id": 7, "event": "error", "code": "file_not_found", "message": "m"})
    conn, proc = await _guest(ready, error)
    try:
        await conn.wait_ready(5)
        with pytest.raises(SandboxFileNotFound):
            await conn.request(Op.FILE_READ, {"path": "x"}, call_id=7)
    finally:
        await _finish(conn, proc)


@pytest.mark.parametrize("version", [None, PROTOCOL_VERSION + 1, "1"])
async def test_a_guest_of_another_protocol_version_is_refused(version: object) -> None:
    # A stale guest baked into an image would otherwise be spoken to in a language it
    # half-understands.
    conn, proc = await _guest(_frame({"id": 0, "event": "ready", "protocol": version}))
    try:
        with pytest.raises(ProtocolMismatch, match="sandlot image build"):
            await conn.wait_ready(5)
    finally:
        await _finish(conn, proc)


async def test_oversized_frame_kills_the_connection_not_the_host() -> None:
    conn, proc = await _guest(struct.pack(">I", 1 << 30))  # claims a 1 GiB frame
    try:
        with pytest.raises(GuestError, match="frame"):
            await conn.request(Op.PING, {})
        assert not conn.alive
    finally:
        await _finish(conn, proc)


async def test_guest_exit_fails_pending_calls() -> None:
    conn, proc = await _guest(b"", linger_s=0.2)
    try:
        with pytest.raises(GuestDied):
            await conn.request(Op.PING, {})
        with pytest.raises(GuestDied):
            await conn.request(Op.PING, {})
    finally:
        await _finish(conn, proc)


# ---------------------------------------------------------------- the guest's own side

GUEST_DIR = Path(sandlot.guest.ops.__file__).parent
GUEST_MODULES = sorted(p.stem for p in GUEST_DIR.glob("*.py") if p.name != "__init__.py")


class _Frames:
    """A frame writer that keeps what the supervisor sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, obj: dict[str, Any]) -> None:
        self.sent.append(json.loads(json.dumps(obj)))  # as the host would decode it


@pytest.fixture
def guest(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``supervisor`` imported the way the sandbox imports it: top-level modules of the
    guest folder, which is first on sys.path. They leave sys.modules afterwards."""
    clashes = [name for name in GUEST_MODULES if name in sys.modules]
    assert not clashes, f"the host already has modules named {clashes}"
    monkeypatch.syspath_prepend(str(GUEST_DIR))
    try:
        yield importlib.import_module("supervisor")
    finally:
        for name in GUEST_MODULES:
            sys.modules.pop(name, None)


def test_every_op_but_shutdown_has_a_handler(guest: types.ModuleType) -> None:
    ops = sys.modules["ops"]
    handlers = guest.Supervisor(_Frames()).handlers
    assert set(handlers) == {op for op in ops.Op if op is not ops.Op.SHUTDOWN}
    assert all(callable(handler) for handler in handlers.values())
    # The host's names are the guest's: one file, imported twice.
    assert [op.value for op in ops.Op] == [op.value for op in sandlot.guest.ops.Op]


@pytest.mark.parametrize("op", ["nope", "shutdown", None, ["ping"], "op_ping", "PING"])
def test_an_op_outside_the_table_is_an_invalid_request(guest: types.ModuleType, op: Any) -> None:
    frames = _Frames()
    guest.Supervisor(frames).handle({"id": 3, "op": op})
    assert frames.sent == [
        {"id": 3, "event": "error", "code": "invalid_request", "message": f"unknown op {op!r}"}
    ]


def test_a_handler_answers_with_one_result_frame(guest: types.ModuleType) -> None:
    frames = _Frames()
    guest.Supervisor(frames).handle({"id": 5, "op": "ping"})
    assert frames.sent == [{"id": 5, "event": "result", "result": {"pong": True, "pid": ANY}}]


def test_ready_frame_carries_the_protocol_version(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "SANDLOT_WORKSPACE": str(tmp_path / "workspace"),
        "SANDLOT_SHELL_STATE": str(tmp_path / "shells"),
    }
    launcher = f"import sys; sys.path.insert(0, {str(GUEST_DIR)!r}); import supervisor; "
    launcher += "supervisor.main(sys.argv)"
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", launcher],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        (size,) = struct.unpack(">I", proc.stdout.read(4))
        ready = json.loads(proc.stdout.read(size))
        proc.stdin.write(_frame({"id": 1, "op": "shutdown"}))
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert ready["event"] == "ready" and ready["id"] == 0
    assert ready["protocol"] == sandlot.guest.ops.PROTOCOL_VERSION
