"""The host's side of the guest protocol, against guests that misbehave.

The guest shares a uid with untrusted code, so the host must survive a guest that lies.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import sys
from typing import Any

import pytest

from sandlot import GuestError, SandboxFileNotFound
from sandlot.core.files import read_through
from sandlot.core.guest_link import GuestConnection
from sandlot.errors import GuestDied, ProtocolMismatch
from sandlot.guest.ops import PROTOCOL_VERSION, Op

pytestmark = pytest.mark.asyncio


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
