"""Frames on a pair of file descriptors: a 4-byte big-endian length, then a UTF-8 JSON object.

Standard library only, Python >= 3.9 (shipped into every sandbox). The supervisor speaks this
to the host on stdin/stdout, and to its Python kernel over a pair of pipes.
"""

import json
import os
import struct
import threading

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(fd):
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError("frame of %d bytes is over the limit" % size)
    return json.loads(read_exact(fd, size).decode("utf-8"))


def encode_frame(obj):
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return HEADER.pack(len(data)) + data


def write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameWriter:
    def __init__(self, fd):
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, obj):
        data = encode_frame(obj)
        with self.lock:
            write_all(self.fd, data)


class GuestFault(Exception):
    """An error reported to the host as ``{"event": "error", "code", "message"}``."""

    def __init__(self, code, message):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
