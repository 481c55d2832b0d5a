"""Pipe ends on the event loop, each fd owned here and closed exactly once, on the loop.

A templated guest's stdio are pipes the manager makes (``bubblewrap/forks.py``). asyncio's
``connect_read_pipe``/``connect_write_pipe`` take them as file objects, and under uvloop
(uvicorn's choice wherever it is installed: the server's loop until ``API_EVENT_LOOP`` made
asyncio's the default, and a loop anyone embedding the manager may run) libuv closes the fd
and then the file object closes the same number again. Between the two a worker thread may be
given that number (a cgroup file, a volume's image), and its descriptor is closed under it: an
EBADF in an unrelated create, seen in CI. uvloop also keeps a read pipe's transport open past
EOF when the protocol asks to (``StreamReaderProtocol`` does), so those were left to the
garbage collector, which finalized them in whatever thread it ran: each fd closed twice more,
and libuv called off its loop's thread. These transports watch the raw fd with
``add_reader``/``add_writer``, which both loops implement without taking the fd over, and
behave the same on both.
"""

from __future__ import annotations

import asyncio
import os

READ_CHUNK_BYTES = 1 << 16
# Like asyncio's transports: past this much unwritten, the protocol is paused (drain() waits).
WRITE_HIGH_WATER_BYTES = 1 << 16


class PipeReader(asyncio.ReadTransport):
    """Feeds what the read end ``fd`` gives into ``stream``, which it is the transport of
    (so the stream's buffer pauses it), until EOF, a read error (taken as EOF: the writer is
    gone either way) or :meth:`close`; then closes ``fd`` and feeds the stream its EOF."""

    def __init__(self, fd: int, stream: asyncio.StreamReader) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = fd
        self._stream = stream
        self._reading = False
        os.set_blocking(fd, False)
        stream.set_transport(self)
        self.resume_reading()

    def _readable(self) -> None:
        if self._fd is None:
            return
        try:
            data = os.read(self._fd, READ_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._stream.feed_data(data)
        else:
            self.close()

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._fd is not None and self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def resume_reading(self) -> None:
        if self._fd is not None and not self._reading:
            self._loop.add_reader(self._fd, self._readable)
            self._reading = True

    def is_closing(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is None:
            return
        self.pause_reading()
        fd, self._fd = self._fd, None
        os.close(fd)
        self._stream.feed_eof()


class PipeWriter(asyncio.WriteTransport):
    """Writes to the write end ``fd`` for ``protocol`` (a flow-control protocol such as
    ``asyncio.streams.FlowControlMixin``, behind an ``asyncio.StreamWriter``): what the pipe
    does not take at once is kept and written as it drains, the protocol paused past
    :data:`WRITE_HIGH_WATER_BYTES`. A failed write (the reader gone: EPIPE) closes ``fd``
    and ends the protocol's connection with that error, so a ``drain()`` raises it; later
    writes are dropped, as asyncio's are."""

    def __init__(self, fd: int, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = fd
        self._protocol = protocol
        self._buffer = bytearray()
        self._closing = False  # close(): the buffer is written, then the fd closed
        self._paused = False
        os.set_blocking(fd, False)
        protocol.connection_made(self)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._fd is None or self._closing or not data:
            return
        if not self._buffer:
            try:
                written = os.write(self._fd, data)
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError as exc:
                self._lost(exc)
                return
            if written == len(data):
                return
            data = memoryview(data)[written:]
            self._loop.add_writer(self._fd, self._writable)
        self._buffer += data
        if not self._paused and len(self._buffer) > WRITE_HIGH_WATER_BYTES:
            self._paused = True
            self._protocol.pause_writing()

    def _writable(self) -> None:
        if self._fd is None:
            return
        try:
            written = os.write(self._fd, self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        del self._buffer[:written]
        if self._buffer:
            return
        self._loop.remove_writer(self._fd)
        if self._paused:
            self._paused = False
            self._protocol.resume_writing()
        if self._closing:
            self._lost(None)

    def get_write_buffer_size(self) -> int:
        return len(self._buffer)

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing or self._fd is None

    def close(self) -> None:
        """Close once what is buffered is written (at once if nothing is)."""
        if self._fd is None or self._closing:
            return
        self._closing = True
        if not self._buffer:
            self._lost(None)

    def abort(self) -> None:
        """Close now; what is buffered is dropped."""
        self._lost(None)

    def _lost(self, exc: Exception | None) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self._buffer:
            self._loop.remove_writer(fd)
            self._buffer.clear()
        os.close(fd)
        self._protocol.connection_lost(exc)
