"""``backends/pipes.py``: a guest's stdio pipes on the loop, on asyncio's loop and uvloop's.

Each transport owns its fd: it is closed exactly once, when the transport ends (EOF, a failed
write, close), and never by anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from sandlot.backends.pipes import WRITE_HIGH_WATER_BYTES, PipeReader, PipeWriter

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    def runner(main: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.run(main)

    return runner


def ends(fd: int) -> Callable[[], int]:
    """How many fds of this process hold ``fd``'s pipe, counted later: by the pipe's inode,
    not by a number that another thread may be given once it is closed."""
    link = f"pipe:[{os.fstat(fd).st_ino}]"

    def count() -> int:
        held = 0
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # gone since the listing
                held += os.readlink(f"/proc/self/fd/{name}") == link
        return held

    return count


def stream_writer(fd: int) -> tuple[PipeWriter, asyncio.StreamWriter]:
    """``fd``'s transport and the StreamWriter over it, as TemplateGuest makes them."""
    protocol = asyncio.streams.FlowControlMixin()
    pipe = PipeWriter(fd, protocol)
    return pipe, asyncio.StreamWriter(pipe, protocol, None, asyncio.get_running_loop())


def test_a_reader_feeds_its_stream_and_closes_its_fd_at_eof(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        held = ends(r)
        stream = asyncio.StreamReader()
        pipe = PipeReader(r, stream)
        os.write(w, b"hello ")
        os.write(w, b"world")
        os.close(w)
        assert await stream.read() == b"hello world"
        assert pipe.is_closing() and held() == 0
        pipe.close()  # again: nothing (the number may be someone else's by now)

    run(main())


def test_a_reader_closed_early_ends_its_stream(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        stream = asyncio.StreamReader()
        pipe = PipeReader(r, stream)
        waiting = asyncio.ensure_future(stream.readexactly(4))
        await asyncio.sleep(0)
        pipe.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await waiting
        with pytest.raises(BrokenPipeError):  # no read end is left
            os.write(w, b"x")
        os.close(w)

    run(main())


def test_a_full_stream_pauses_its_reader_until_read(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        stream = asyncio.StreamReader(limit=1024)
        pipe = PipeReader(r, stream)
        os.set_blocking(w, False)
        for _ in range(8):
            os.write(w, b"x" * 1024)
        await asyncio.sleep(0.05)
        assert not pipe.is_reading()  # over twice the limit buffered
        assert len(await stream.readexactly(8 * 1024)) == 8 * 1024
        assert pipe.is_reading()
        os.close(w)
        assert await stream.read() == b""

    run(main())


def test_a_writer_writes_what_the_pipe_cannot_take_at_once(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        held = ends(w)
        pipe, writer = stream_writer(w)
        data = os.urandom(1 << 20)  # sixteen times a pipe's buffer
        writer.write(data)
        assert pipe.get_write_buffer_size() > WRITE_HIGH_WATER_BYTES
        out = asyncio.StreamReader()
        PipeReader(r, out)
        received = asyncio.ensure_future(out.read())
        await writer.drain()
        writer.close()  # closes once the rest is written
        assert await received == data  # and its EOF: the write end is closed
        assert held() == 0  # neither end left: the reader closed its own at that EOF

    run(main())


def test_a_writer_whose_reader_is_gone_fails_drain_and_closes(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        held = ends(w)
        _, writer = stream_writer(w)
        os.close(r)
        writer.write(b"frame")
        with pytest.raises(ConnectionError):
            await writer.drain()
        assert held() == 0
        writer.write(b"dropped")  # after the loss: nothing, as asyncio's own
        writer.close()

    run(main())


def test_abort_drops_the_buffer_and_closes_at_once(run: Any) -> None:
    async def main() -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        protocol = asyncio.streams.FlowControlMixin()
        pipe = PipeWriter(w, protocol)
        pipe.write(b"x" * (1 << 20))
        assert pipe.get_write_buffer_size() > 0
        pipe.abort()
        assert pipe.is_closing()
        pipe.abort()
        pipe.close()
        os.set_blocking(r, False)
        taken = b""
        while chunk := os.read(r, 1 << 20):  # what the pipe took, then EOF: no writer left
            taken += chunk
        assert 0 < len(taken) < 1 << 20
        os.close(r)

    run(main())
