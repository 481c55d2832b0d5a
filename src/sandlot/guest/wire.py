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
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    # A lone surrogate (a file name that is not UTF-8, an exception message) must not make
    # the frame unsendable: it becomes "?" and the rest of the frame still gets through.
    data = text.encode("utf-8", "replace")
    return HEADER.pack(len(data)) + data


def encoded_size(text):
    """Bytes ``text`` takes inside a frame (JSON escaping makes a control byte 6 bytes)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "replace")) - 2


def fit_prefix(text, budget_bytes, from_end=False):
    """The longest prefix (or suffix) of ``text`` whose encoded size is within the budget.

    Shrinks by the measured ratio, so a few C-speed encodes settle even 8 MiB of text.
    """
    n = min(len(text), max(0, budget_bytes))
    while n > 0:
        part = text[len(text) - n :] if from_end else text[:n]
        size = encoded_size(part)
        if size <= budget_bytes:
            return part
        n = min(n - 1, n * budget_bytes // size)
    return ""


def clip_text(text, budget_bytes):
    """``text`` as is if its encoded size fits the budget, else its head and tail around a
    marker, together within the budget: a result must always fit a frame."""
    if text is None or encoded_size(text) <= budget_bytes:
        return text
    half = max(0, budget_bytes // 2 - 64)
    head = fit_prefix(text, half)
    tail = fit_prefix(text, half, from_end=True)
    omitted = len(text) - len(head) - len(tail)
    return "%s ... [%d characters omitted] ... %s" % (head, omitted, tail)


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
