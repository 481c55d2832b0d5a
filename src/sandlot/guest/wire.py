"""Frames on a pair of file descriptors: a 4-byte big-endian length, then a UTF-8 JSON object.

Standard library only, Python >= 3.9 (shipped into every sandbox). The supervisor speaks this
to the host on stdin/stdout, and to its Python kernel over a pair of pipes.
"""

import _thread  # not threading: see threads.py (not imported: the host loads this module too)
import os
import struct
import sys

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20


def _lean_codec():
    """``(loads, dumps)`` on the ``json`` module's C core, without ``json`` itself.

    ``import json`` costs every sandbox's supervisor ~6 ms of CPU under its quota, most of it
    ``re`` (json.decoder compiles patterns at import) for the pure-Python fallbacks the C
    scanner and encoder never call. Same C code, same results; on an interpreter whose
    ``_json`` lacks these or answers differently, the ``json`` module is used instead.
    """
    import _json

    nan = float("nan")
    constants = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": nan}

    class Context:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = constants.__getitem__

    scan = _json.make_scanner(Context())
    whitespace = " \t\n\r"

    def loads(text):
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        start = len(text) - len(text.lstrip(whitespace))
        try:
            value, end = scan(text, start)
        except StopIteration as exc:
            raise ValueError("Expecting value: char %d" % exc.value) from None
        if text[end:].strip(whitespace):
            raise ValueError("Extra data: char %d" % end)
        return value

    def not_serializable(value):
        raise TypeError("Object of type %s is not JSON serializable" % type(value).__name__)

    def dumps(value, ensure_ascii=True):
        escape = _json.encode_basestring_ascii if ensure_ascii else _json.encode_basestring
        if isinstance(value, str):
            return escape(value)
        # One encoder per call: its table of containers being encoded (the circular check)
        # must not be shared by two threads encoding at once.
        encode = _json.make_encoder(
            {}, not_serializable, escape, None, ":", ",", False, False, True
        )
        return "".join(encode(value, 0))

    sample = {"a": [1, 2.5, None, True, "\u00e9\n\ud800", {"b": -3}], "": 1e300}
    compact = '{"a":[1,2.5,null,true,"\\u00e9\\n\\ud800",{"b":-3}],"":1e+300}'
    if dumps(sample) != compact or loads(compact) != sample or loads(" [] ") != []:
        raise ImportError("_json answers differently here")
    return loads, dumps


def _module_codec():
    import json

    def dumps(value, ensure_ascii=True):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=ensure_ascii)

    return json.loads, dumps


try:
    loads, dumps = _lean_codec()
except (ImportError, AttributeError, TypeError, ValueError):
    loads, dumps = _module_codec()


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(fd, seal=None):
    """The next frame on ``fd``; with a ``seal`` (the host's channel) only an authentic one.

    Raises EOFError at the end of the stream, ValueError for a frame over the limit and
    ``seal.NotAuthentic`` (a ValueError) for one whose tag is wrong.
    """
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError("frame of %d bytes is over the limit" % size)
    data = read_exact(fd, size)
    if seal is not None:
        data = seal.open(data)
    return loads(data.decode("utf-8"))


def encode_body(obj):
    text = dumps(obj, ensure_ascii=False)
    # A lone surrogate (a file name that is not UTF-8, an exception message) must not make
    # the frame unsendable: it becomes "?" and the rest of the frame still gets through.
    return text.encode("utf-8", "replace")


def encode_frame(obj):
    data = encode_body(obj)
    return HEADER.pack(len(data)) + data


# How deep a rich output's JSON value may nest, in the guest and on the host (models.py):
# pydantic refuses to serialize past ~250 levels (a result of 900 made every answer carrying
# it a 500), and one deeper than the host's parser takes made the whole answer unreadable (a
# 502 and a guest restart: red teams, 2026-12-06). Real JSON outputs nest a few levels.
MAX_JSON_DEPTH = 64
# The exit codes a result carries: a C int's (sys.exit(10**4000) said 4,001 digits, which a
# client's int64 cannot read). The supervisor makes a code outside them 1 (cells.py); the
# host's model refuses one (models.py).
EXIT_CODE_MIN, EXIT_CODE_MAX = -(1 << 31), (1 << 31) - 1


def nests_within(value: object, depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value``'s lists and dicts nest at most ``depth`` deep (walked without
    recursion: the value is the sandbox's to shape)."""
    level: list[object] = [value]
    for _ in range(depth + 1):
        inner: list[object] = []
        for item in level:
            if isinstance(item, dict):
                inner.extend(item.values())
            elif isinstance(item, list):
                inner.extend(item)
        if not inner:
            return True
        level = inner
    return False


# What a rich output costs the host to hold, against the call's output limit: its JSON bytes
# alone undercount it 20-fold (one 1 MiB output of "[{},{},...]" held 26 MiB of the
# manager's memory, 20,971 display(0) calls 21 MiB: red team, 2026-12-06). Measured on the
# host (CPython 3.11, pydantic 2, tracemalloc), each node with its slot in the container
# holding it: an empty dict 73 bytes, an empty list 65, a float 33, a short ASCII string ~63,
# a short non-ASCII one 85-89 (for ~10 bytes of JSON escapes), a dict entry ~100 with its key
# counted as a node; 80 a node plus its bytes covers each of them. A ``Result`` model takes
# ~830 bytes (~950 with an ``extra`` format) before its data, of which even an empty
# bundle's own nodes pay ~400: each bundle pays the rest on top.
JSON_NODE_COST_BYTES = 80
RESULT_COST_BYTES = 512
# The most rich outputs one call keeps; the rest are left out (``results_truncated``).
MAX_RESULTS = 1000


def json_nodes(value: object, most: int) -> int:
    """How many containers, dict keys and scalars make up ``value``, or a number over
    ``most`` as soon as it is known to pass it. Walked without recursion (the value is the
    sandbox's to shape), and a container's items are counted before they are walked, so a
    list of millions is refused at the cost of its ``len``."""
    count = 1
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            count += 2 * len(item)  # its keys and its values
            if count > most:
                return count
            pending.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            count += len(item)
            if count > most:
                return count
            pending.extend(v for v in item if isinstance(v, (dict, list)))
    return count


def result_cost(bundle: object, most: int) -> int:
    """What the display bundle ``bundle`` costs the host to hold (see JSON_NODE_COST_BYTES),
    or a number over ``most`` as soon as it is known to pass it. The one measure of the
    kernel (display.py), the supervisor (cells.py) and the host (core/execution.py)."""
    fixed = RESULT_COST_BYTES
    nodes = json_nodes(bundle, max(0, most - fixed) // JSON_NODE_COST_BYTES)
    cost = fixed + nodes * JSON_NODE_COST_BYTES
    if cost > most:
        return cost
    text = dumps(bundle)
    cost += len(text)  # ASCII: escaped, so its length is its size
    if cost > most or "\\u" not in text:  # no escape: no string wider than ASCII
        return cost
    return cost + _wide_bytes(bundle)


_ASCII_STR_BYTES = sys.getsizeof("")  # an ASCII string's size less its characters


def _wide_bytes(value: object) -> int:
    """What ``value``'s non-ASCII strings take in memory past their length: CPython keeps a
    whole string at the width of its widest character, so ASCII text with one emoji in it
    is 4 bytes a character, where its escaped JSON is about one (a result of 1 MB charged
    1,000,950 bytes held 4,000,080: red team, 2026-12-06). Keys and values, walked without
    recursion; the same figure on the guest's Python and the host's (both CPython 3.11)."""
    extra = 0
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                extra += max(0, sys.getsizeof(item) - len(item) - _ASCII_STR_BYTES)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return extra


class Results:
    """A call's display bundles, kept in order while they fit: at most MAX_RESULTS of them,
    costing at most ``limit_bytes`` together (``result_cost``). One that does not fit is
    counted in ``dropped``; a smaller one after it may still fit."""

    def __init__(self, limit_bytes: int) -> None:
        self.left = limit_bytes
        self.kept: list[object] = []
        self.dropped = 0

    def full(self) -> bool:
        return len(self.kept) >= MAX_RESULTS

    def add(self, bundle: object) -> bool:
        if self.full():
            self.dropped += 1
            return False
        cost = result_cost(bundle, self.left)
        if cost > self.left:
            self.dropped += 1
            return False
        self.left -= cost
        self.kept.append(bundle)
        return True


def encoded_size(text):
    """Bytes ``text`` takes inside a frame (JSON escaping makes a control byte 6 bytes)."""
    return len(dumps(text, ensure_ascii=False).encode("utf-8", "replace")) - 2


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
    """Whole frames on ``fd`` from any thread; sealed once ``seal`` is set (the host's
    channel), each tag drawn under the lock so the frames leave in the order sealed."""

    def __init__(self, fd, seal=None):
        self.fd = fd
        self.seal = seal
        self.lock = _thread.allocate_lock()

    def send(self, obj):
        self.send_body(encode_body(obj))

    def send_body(self, body):
        """Send a frame whose body :func:`encode_body` made (its size known first)."""
        with self.lock:
            if self.seal is not None:
                body = self.seal.seal(body)
            write_all(self.fd, HEADER.pack(len(body)) + body)


class GuestFault(Exception):
    """An error reported to the host as ``{"event": "error", "code", "message"}``."""

    def __init__(self, code, message):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
