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
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

import sandlot.guest.ops
from sandlot import GuestError, SandboxFileNotFound
from sandlot.core import guest_link
from sandlot.core.files import read_through
from sandlot.core.guest_link import GuestConnection
from sandlot.errors import GuestChannelBroken, GuestDied, GuestTimeout, ProtocolMismatch
from sandlot.guest.ops import PROTOCOL_VERSION, Op
from sandlot.guest.seal import KEY_BYTES, TO_GUEST, TO_HOST, Seal


class EndlessFile:
    """A connection whose guest claims a file never ends."""

    async def ask(self, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        return {"data": base64.b64encode(b"x" * 65536).decode(), "eof": False, "size": 1}


async def test_read_stops_at_the_disk_size_whatever_the_guest_says() -> None:
    received = 0
    with pytest.raises(GuestError, match="disk size"):
        async for chunk in read_through(EndlessFile(), "f", limit_bytes=1 << 20):  # type: ignore[arg-type]
            received += len(chunk)
    assert received <= 1 << 20


async def _guest_pipes(*, reading: bool) -> tuple[GuestConnection, asyncio.WriteTransport]:
    """A connection over real pipes to a "guest" that says nothing and, unless ``reading``,
    takes nothing in (its own processes starve it); a reader drains the pipe otherwise."""
    loop = asyncio.get_running_loop()
    to_guest_r, to_guest_w = os.pipe()
    from_guest_r, from_guest_w = os.pipe()
    reader = asyncio.StreamReader()
    read_transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_guest_r, "rb", 0)
    )
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(to_guest_w, "wb", 0)
    )
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    guest_in = os.fdopen(to_guest_r, "rb", 0)
    if reading:
        loop.run_in_executor(
            None, lambda: [None for _ in iter(lambda: guest_in.read(1 << 16), b"")]
        )
    conn = GuestConnection(reader, writer)
    conn._pipes = (guest_in, from_guest_w, read_transport)  # type: ignore[attr-defined]
    return conn, transport


async def _close(conn: GuestConnection, transport: asyncio.WriteTransport) -> None:
    if not transport.is_closing():
        transport.abort()
    guest_in, from_guest_w, read_transport = conn._pipes  # type: ignore[attr-defined]
    os.close(from_guest_w)
    await conn.close()
    read_transport.close()
    guest_in.close()
    await asyncio.sleep(0)  # the transports' own close callbacks


async def test_a_guest_that_takes_nothing_in_is_sent_one_frame_and_then_broken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Failed before (red team, 2026-12-07): every request to a guest whose own processes
    # starved it sat whole in the pipe's buffer for the sandbox's life, ~5 MB an upload and
    # ~39 MB an MCP write; 60 writes held 2.6 GB of the server. Frames now go one at a time,
    # and a guest that takes in nothing for INPUT_STALL_S is broken (then restarted).
    monkeypatch.setattr(guest_link, "INPUT_STALL_S", 0.5)
    conn, transport = await _guest_pipes(reading=False)
    chunk = base64.b64encode(b"A" * (1 << 20)).decode()
    calls = [
        asyncio.create_task(conn.request(Op.FILE_WRITE, {"path": f"f{n}", "data": chunk}))
        for n in range(50)
    ]
    try:
        await asyncio.sleep(0.2)
        assert transport.get_write_buffer_size() < 2 << 20  # one frame, not fifty
        done, _ = await asyncio.wait(calls, timeout=5)
        assert len(done) == 50
        assert {type(call.exception()) for call in calls} == {GuestChannelBroken}
        assert not conn.alive
    finally:
        for call in calls:
            call.cancel()
        await _close(conn, transport)


async def test_a_call_cancelled_while_its_frame_waits_leaves_no_frame_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Failed before (red team on the fixes, 2026-12-07): a caller cancelled while its frame
    # waited for the guest (its client hung up) left the frame in the buffer and the send
    # free for the next: 60 hang-ups held 80 MiB, and no wait lasted long enough to see
    # the stall. The wait is the connection's now.
    monkeypatch.setattr(guest_link, "INPUT_STALL_S", 1.0)
    conn, transport = await _guest_pipes(reading=False)
    chunk = base64.b64encode(b"A" * (1 << 20)).decode()
    try:
        for n in range(10):
            call = asyncio.create_task(
                conn.request(Op.FILE_WRITE, {"path": f"f{n}", "data": chunk})
            )
            await asyncio.sleep(0.05)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        assert transport.get_write_buffer_size() < 2 << 20  # one frame, not ten
        deadline = time.monotonic() + 5
        while conn.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not conn.alive  # the stall is seen though nobody waits on it any more
    finally:
        await _close(conn, transport)


async def test_a_cancel_is_written_behind_a_frame_the_guest_takes_in_slowly() -> None:
    # Failed before (red team on the fixes, 2026-12-07): a cancel waited for the send lock
    # behind a large frame a slow guest was taking in, ran out of time and was never
    # written: the run it was to end went on after its client's 499.
    conn, transport = await _guest_pipes(reading=False)
    big = base64.b64encode(b"A" * (4 << 20)).decode()
    try:
        sender = asyncio.create_task(conn.request(Op.FILE_WRITE, {"path": "big", "data": big}))
        await asyncio.sleep(0.1)
        before = transport.get_write_buffer_size()
        await conn.notify(Op.CANCEL, {"target": 1})
        assert transport.get_write_buffer_size() > before  # written, behind the big frame
    finally:
        sender.cancel()
        await _close(conn, transport)


async def test_a_short_call_a_guest_never_answers_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Failed before (red team, 2026-12-07): a file request (a stat, a chunk, a listing) to a
    # guest starved by its own processes waited for good, holding its tenant's open request.
    monkeypatch.setattr(guest_link, "SHORT_CALL_TIMEOUT_S", 0.3)
    conn, transport = await _guest_pipes(reading=True)
    try:
        with pytest.raises(GuestTimeout, match="did not answer"):
            await asyncio.wait_for(conn.ask(Op.FILE_STAT, {"path": "x"}), 10)
        assert conn.alive  # the guest is left as it is: it may be only slow
    finally:
        await _close(conn, transport)


# A real process plays the guest: it reads the host's key, then takes each step in turn
# ("sealed" frame, "plain" unsealed frame, "raw" bytes, "forged" frame sealed with another
# key, "skip" a sequence number, "again" the last bytes, "read" one request), then lingers.
FAKE_GUEST = """
import json, struct, sys, time
sys.path.insert(0, sys.argv[3])
from seal import TO_HOST, Seal
out, inp = sys.stdout.buffer, sys.stdin.buffer
def read():
    (size,) = struct.unpack(">I", inp.read(4))
    return inp.read(size)
def framed(body):
    return struct.pack(">I", len(body)) + body
seal = Seal(bytes.fromhex(json.loads(read())["key"]), TO_HOST)
forger = Seal(bytes(32), TO_HOST)
last = b""
for kind, value in json.loads(sys.argv[1]):
    data = b""
    if kind == "sealed":
        data = framed(seal.seal(json.dumps(value).encode()))
    elif kind == "forged":
        forger.seq = seal.seq
        data = framed(forger.seal(json.dumps(value).encode()))
    elif kind == "plain":
        data = framed(json.dumps(value).encode())
    elif kind == "raw":
        data = bytes.fromhex(value)
    elif kind == "skip":
        seal.seal(b"")
    elif kind == "again":
        data = last
    elif kind == "read":
        read()
    out.write(data)
    out.flush()
    last = data or last
time.sleep(float(sys.argv[2]))
"""

READY = ("sealed", {"id": 0, "event": "ready", "protocol": PROTOCOL_VERSION})


async def _guest(
    *steps: tuple[str, Any], linger_s: float = 2.0
) -> tuple[GuestConnection, asyncio.subprocess.Process]:
    argv = [json.dumps(steps), str(linger_s), str(GUEST_DIR)]
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
    error = {"id": 7, "event": "error", "code": "file_not_found", "message": "m"}
    conn, proc = await _guest(READY, ("read", None), ("sealed", error))
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
    conn, proc = await _guest(("sealed", {"id": 0, "event": "ready", "protocol": version}))
    try:
        with pytest.raises(ProtocolMismatch, match="sandlot image build"):
            await conn.wait_ready(5)
    finally:
        await _finish(conn, proc)


async def test_a_guest_from_before_sealing_is_named_as_such() -> None:
    # Its ready frame comes unsealed: the host says "rebuild", not "tampered with".
    conn, proc = await _guest(("plain", {"id": 0, "event": "ready", "protocol": 3}))
    try:
        with pytest.raises(ProtocolMismatch, match="protocol 3"):
            await conn.wait_ready(5)
    finally:
        await _finish(conn, proc)


@pytest.mark.parametrize(
    "attack",
    [
        ("forged", {"id": 1, "event": "result", "result": {"exit_code": 0}}),
        ("plain", {"id": 1, "event": "result", "result": {"exit_code": 0}}),
        ("again", None),  # the ready frame, replayed
        ("raw", "00000003" + "7b7d0a"),  # bytes with no tag at all
    ],
    ids=["other-key", "unsealed", "replayed", "untagged"],
)
async def test_a_frame_the_guest_did_not_seal_breaks_the_channel(
    attack: tuple[str, Any],
) -> None:
    # What code in the sandbox could write into the guest's stdout on gVisor: never taken
    # as an answer, the connection ends and the pending call says why.
    honest = ("sealed", {"id": 1, "event": "result", "result": {"exit_code": 0}})
    conn, proc = await _guest(READY, ("read", None), attack, honest)
    try:
        await conn.wait_ready(5)
        with pytest.raises(GuestChannelBroken, match="failed its check"):
            await conn.request(Op.PING, {}, call_id=1)
        assert not conn.alive
    finally:
        await _finish(conn, proc)


async def test_a_frame_taken_out_of_the_channel_breaks_it() -> None:
    # Code that reads the guest's stdout steals a frame: the next one's number is wrong.
    answer = ("sealed", {"id": 1, "event": "result", "result": {"exit_code": 0}})
    conn, proc = await _guest(READY, ("read", None), ("skip", None), answer)
    try:
        await conn.wait_ready(5)
        with pytest.raises(GuestChannelBroken):
            await conn.request(Op.PING, {}, call_id=1)
    finally:
        await _finish(conn, proc)


async def test_a_header_without_its_body_breaks_the_channel_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Someone else's header (1 KiB announced, 10 bytes sent) would otherwise swallow the
    # guest's real frames into its body and hang every call with no timeout of its own.
    monkeypatch.setattr(guest_link, "BODY_TIMEOUT_S", 0.3)
    header = struct.pack(">I", 1024) + b"x" * 10
    conn, proc = await _guest(READY, ("read", None), ("raw", header.hex()), linger_s=5)
    try:
        await conn.wait_ready(5)
        with pytest.raises(GuestChannelBroken, match="did not follow its header"):
            await asyncio.wait_for(conn.request(Op.FILE_READ, {"path": "x"}, call_id=1), 5)
    finally:
        await _finish(conn, proc)


async def test_oversized_frame_kills_the_connection_not_the_host() -> None:
    conn, proc = await _guest(("raw", struct.pack(">I", 1 << 30).hex()))  # a 1 GiB frame
    try:
        with pytest.raises(GuestChannelBroken, match="frame header"):
            await conn.request(Op.PING, {})
        assert not conn.alive
    finally:
        await _finish(conn, proc)


async def test_guest_exit_fails_pending_calls() -> None:
    conn, proc = await _guest(linger_s=0.2)
    try:
        with pytest.raises(GuestDied):
            await conn.request(Op.PING, {})
        with pytest.raises(GuestDied):
            await conn.request(Op.PING, {})
    finally:
        await _finish(conn, proc)


async def test_a_guest_that_stops_reading_holds_neither_a_cancel_nor_a_close() -> None:
    # A guest that takes in nothing more (its pipe full behind a large write) must not hold
    # a cancelled call's unwinding or a destroy for good: each notice waits a bounded time.
    conn, proc = await _guest(READY, linger_s=30.0)
    try:
        await conn.wait_ready(5)
        write = asyncio.create_task(conn.request(Op.FILE_WRITE, {"data": "x" * (1 << 20)}))
        await asyncio.sleep(0.2)
        assert not write.done()  # stuck on the full pipe
        started = time.monotonic()
        await asyncio.wait_for(conn.notify(Op.CANCEL, {"target": 1}), 10)
        await asyncio.wait_for(conn.close(), 10)
        assert time.monotonic() - started < 2 * guest_link.NOTIFY_DRAIN_S + 1
        with pytest.raises(GuestDied):
            await asyncio.wait_for(write, 5)
    finally:
        proc.kill()
        await proc.wait()


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
    assert set(handlers) == {op for op in ops.Op if op not in (ops.Op.SHUTDOWN, ops.Op.HELLO)}
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


def _frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


PROGRESS = ("queued", "started")  # a call's progress events, before its answer


class RealGuest:
    """The real supervisor in a subprocess, spoken to as the host speaks to it."""

    def __init__(
        self, workdir: Path, *, hello: bool = True, env: dict[str, str] | None = None
    ) -> None:
        env = {
            "PATH": "/usr/bin:/bin",
            "SANDLOT_WORKSPACE": str(workdir / "workspace"),
            "SANDLOT_SHELL_STATE": str(workdir / "shells"),
            **(env or {}),
        }
        launcher = f"import sys; sys.path.insert(0, {str(GUEST_DIR)!r}); import supervisor; "
        launcher += "supervisor.main(sys.argv)"
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", launcher],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.key = os.urandom(KEY_BYTES)
        self.to_guest, self.from_guest = Seal(self.key, TO_GUEST), Seal(self.key, TO_HOST)
        if hello:
            self.write(_frame({"id": 0, "op": "hello", "key": self.key.hex()}))

    def write(self, data: bytes) -> None:
        self.stdin.write(data)
        self.stdin.flush()

    def send(self, obj: dict[str, Any]) -> bytes:
        sealed = self.to_guest.seal(json.dumps(obj).encode())
        data = struct.pack(">I", len(sealed)) + sealed
        self.write(data)
        return data

    def read(self) -> dict[str, Any]:
        (size,) = struct.unpack(">I", self.stdout.read(4))
        frame: dict[str, Any] = json.loads(self.from_guest.open(self.stdout.read(size)))
        return frame

    def answer(self, call_id: int) -> dict[str, Any]:
        """The call's answer: its progress events ("queued", "started": sent when it waited
        for the kernel, as a loaded machine makes a first call do) are skipped."""
        while (frame := self.read())["id"] != call_id or frame.get("event") in PROGRESS:
            pass
        return frame

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for stream in (self.stdin, self.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def real_guest(tmp_path: Path) -> Iterator[RealGuest]:
    guest = RealGuest(tmp_path)
    try:
        yield guest
    finally:
        guest.close()


def test_ready_frame_carries_the_protocol_version(real_guest: RealGuest) -> None:
    ready = real_guest.read()  # sealed with the key the host sent
    real_guest.send({"id": 1, "op": "shutdown"})
    assert real_guest.proc.wait(10) == 0
    assert ready["event"] == "ready" and ready["id"] == 0
    assert ready["protocol"] == sandlot.guest.ops.PROTOCOL_VERSION


def test_a_guest_without_the_key_does_nothing(tmp_path: Path) -> None:
    guest = RealGuest(tmp_path, hello=False)
    try:
        guest.write(_frame({"id": 1, "op": "ping"}))
        assert guest.proc.wait(10) == 2
        assert guest.stdout.read() == b""  # not even "ready"
        assert guest.proc.stderr is not None
        assert b"not the channel's key" in guest.proc.stderr.read()
    finally:
        guest.close()


@pytest.mark.parametrize("attack", ["unsealed", "replayed", "other-key"])
def test_a_request_the_host_did_not_seal_ends_the_guest(real_guest: RealGuest, attack: str) -> None:
    # What code in the sandbox could write into the supervisor's stdin on gVisor: a request
    # the supervisor would run as if the host had sent it (and answer under the host's id).
    assert real_guest.read()["event"] == "ready"
    sent = real_guest.send({"id": 1, "op": "ping"})
    assert real_guest.answer(1)["result"]["pong"] is True
    if attack == "unsealed":
        real_guest.write(_frame({"id": 2, "op": "ping"}))
    elif attack == "replayed":
        real_guest.write(sent)
    else:
        forger = Seal(bytes(KEY_BYTES), TO_GUEST)
        forger.seq = real_guest.to_guest.seq
        body = forger.seal(json.dumps({"id": 2, "op": "ping"}).encode())
        real_guest.write(struct.pack(">I", len(body)) + body)
    last = real_guest.read()
    assert last == {
        "id": 0,
        "event": "error",
        "code": "guest_channel_broken",
        "message": ANY,
    }
    assert real_guest.proc.wait(10) == 0
    assert real_guest.stdout.read() == b""  # nothing answered after the break


def test_the_kernel_that_runs_code_never_holds_the_key(
    real_guest: RealGuest, tmp_path: Path
) -> None:
    # The first kernel is forked from the supervisor: before the key is read, or every
    # cell could find it in its own memory and seal frames of its own.
    assert real_guest.read()["event"] == "ready"
    dump = (
        "import re\n"
        "with open('/proc/self/maps') as m, open('/proc/self/mem', 'rb', 0) as mem,"
        " open('mem.bin', 'wb') as out:\n"
        "    for line in m:\n"
        "        span, perms = line.split()[:2]\n"
        "        if 'r' not in perms: continue\n"
        "        lo, hi = (int(x, 16) for x in span.split('-'))\n"
        "        try:\n"
        "            mem.seek(lo); out.write(mem.read(hi - lo))\n"
        "        except (OSError, OverflowError, ValueError): pass\n"
    )
    real_guest.send({"id": 1, "op": "exec_code", "code": dump, "timeout_s": 60})
    result = real_guest.answer(1)["result"]
    assert result["exit_code"] == 0, result
    memory = (tmp_path / "workspace" / "mem.bin").read_bytes()
    assert len(memory) > 1 << 20  # the dump is real
    assert real_guest.key not in memory
    assert real_guest.key.hex().encode() not in memory


def test_no_planted_file_runs_before_the_guest_holds_its_key(tmp_path: Path) -> None:
    # Found by a red-team run: the first kernel is forked before the key is read, and its
    # site.main() imported a sitecustomize.py that earlier code had planted on PYTHONPATH,
    # so sandbox code ran beside a supervisor still waiting for its key (on gVisor it could
    # open that supervisor's stdin) and before the host had capped the sandbox's terminals.
    planted = tmp_path / "planted"
    planted.mkdir()
    ran = tmp_path / "ran"
    (planted / "sitecustomize.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")
    guest = RealGuest(tmp_path, hello=False, env={"PYTHONPATH": str(planted)})
    try:
        time.sleep(1.5)  # the kernel is forked at once; nothing of the sandbox's may run yet
        assert not ran.exists()
        guest.write(_frame({"id": 0, "op": "hello", "key": guest.key.hex()}))
        assert guest.read()["event"] == "ready"
        guest.send({"id": 1, "op": "exec_code", "code": "1", "timeout_s": 30})
        assert guest.answer(1)["result"]["exit_code"] == 0
        assert ran.exists()  # the same file runs, once the gate is open
    finally:
        guest.close()
