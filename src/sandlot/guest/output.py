"""A call's output: read from its pipes, streamed to the host, capped, spilled to a file.

Standard library only, Python >= 3.9 (shipped into every sandbox).
"""

import codecs
import os
import select
import time

import threads
from ops import Event
from wire import encode_body, encoded_size, write_all
from workspace import WORKSPACE

OUTPUT_DIR = os.path.join(WORKSPACE, ".sandlot", "outputs")
READ_CHUNK_BYTES = 65536
DRAIN_QUIET_S = 0.02
DRAIN_MAX_S = 0.5
KEEP_SPILL_FILES = 8
STREAMS = (("stdout", Event.STDOUT), ("stderr", Event.STDERR))
# What a sandbox's streamed output (its watched commands' and its terminals') may cost the
# host: each chunk is a frame the host's one event loop checks, parses and hands on, ~6 ms a
# MiB for a terminal and ~14 for a command's text, charged to no sandbox (a red team's find,
# 2026-12-06: a 0.5-core sandbox's flood took 0.75 s of the manager's CPU a second). Counted
# in the frames' bytes (a control character is 6 in JSON) and FRAME_COST_BYTES more for each
# frame (a tiny write a frame cost the host 5x the CPU of bulk output at a fifth of the rate:
# the second red team's finds). Past it, a terminal's program waits, as on a slow terminal;
# a command's or a cell's stream skips what it cannot send, since a wait would count against
# the call's timeout (a watched run was killed where an unwatched one passed: the same
# review); their results keep head and tail and the spill file, whatever was streamed.
STREAM_BYTES_PER_S = 8 << 20
STREAM_BURST_BYTES = 8 << 20
FRAME_COST_BYTES = 4096


class StreamBudget:
    """A token bucket shared by every stream of one sandbox (one guest)."""

    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()
        self.lock = threads.Lock()

    def _refill(self):
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, size):
        """Spend ``size`` bytes; how long the caller waits before it sends them."""
        with self.lock:
            self._refill()
            self.tokens -= size
            return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def wait(self, size):
        delay = self.take(size)
        if delay > 0:
            time.sleep(delay)

    def spend(self, size):
        """Spend ``size`` bytes if the credit is there now; False (nothing spent) if not."""
        with self.lock:
            self._refill()
            if self.tokens < size:
                return False
            self.tokens -= size
            return True


STREAMED = StreamBudget(STREAM_BYTES_PER_S, STREAM_BURST_BYTES)


def call_sinks(request, writer, on_overflow, call=None):
    """The stdout and stderr sinks of one exec request, streaming through ``writer`` if it
    asked to ``stream`` (and while ``call`` is streaming)."""
    call_id = request["id"]
    keep = int(request.get("output_limit", 1 << 20))
    file_limit = int(request.get("output_file_limit", 100 << 20))
    spill_limit = request.get("output_spill_limit")
    stream = bool(request.get("stream"))
    sinks = []
    for name, event in STREAMS:
        on_text = None
        if stream:
            on_text = _streamer(writer, call_id, event, call)
        sinks.append(
            OutputSink(
                call_id,
                name,
                keep,
                file_limit,
                on_text,
                on_overflow,
                int(spill_limit) if spill_limit else None,
            )
        )
    return sinks


def _streamer(writer, call_id, event, call):
    def send(text):
        if call is not None and not call.streaming:
            return
        body = encode_body({"id": call_id, "event": event, "data": text})
        if STREAMED.spend(len(body) + FRAME_COST_BYTES):
            writer.send_body(body)

    return send


def finish_streams(result, sinks, started):
    """Put both sinks' text and counters, and the call's duration, into ``result``."""
    for (name, _), sink in zip(STREAMS, sinks):
        out = sink.finish()
        result[name] = out["text"]
        result[name + "_truncated"] = out["truncated"]
        result[name + "_bytes"] = out["bytes"]
        result[name + "_path"] = out["path"]
    result["duration_ms"] = (time.monotonic() - started) * 1000.0


class OutputSink:
    """Keeps head and tail of one stream; spills the full stream to a file past the cap.

    Memory stays bounded by ``keep_bytes`` whatever the program prints: an LLM needs the
    start (what ran) and the end (the traceback), not the middle.
    """

    def __init__(
        self,
        call_id,
        stream,
        keep_bytes,
        file_limit_bytes,
        on_text,
        on_overflow,
        spill_limit_bytes=None,
    ):
        self.call_id = call_id
        self.stream = stream
        self.keep = keep_bytes
        self.half = max(1, keep_bytes // 2)
        self.file_limit = file_limit_bytes
        # The spill file lives on the sandbox's own disk: never let it take all of it.
        self.spill_limit = spill_limit_bytes or file_limit_bytes
        self.spilled_bytes = 0
        self.on_text = on_text
        self.on_overflow = on_overflow
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.buf = bytearray()
        self.head = b""
        self.tail = bytearray()
        self.total = 0
        self.spilled = False
        self.path = None
        self.fd = None
        self.overflowed = False

    def feed(self, data):
        if not data:
            return
        self.total += len(data)
        if self.on_text is not None:
            text = self.decoder.decode(data)
            if text:
                self.on_text(text)
        if not self.spilled:
            self.buf += data
            if len(self.buf) > self.keep:
                self._spill()
        else:
            self._write_file(data)
            self.tail += data
            if len(self.tail) > 4 * self.half:
                del self.tail[: -self.half]
        if self.total > self.file_limit and not self.overflowed:
            self.overflowed = True
            self.on_overflow()

    def _spill(self):
        self.spilled = True
        self.head = bytes(self.buf[: self.half])
        self.tail = bytearray(self.buf[-self.half :])
        try:
            os.makedirs(OUTPUT_DIR, exist_ok=True)
            _prune_spills(KEEP_SPILL_FILES - 1)
            self.path = os.path.join(OUTPUT_DIR, "%s.%s" % (self.call_id, self.stream))
            # The name is predictable (the call's id), and sandboxed code may have put a FIFO
            # there, whose open would block this pump (and the call's timeout) for good, or a
            # symlink: what is there goes, and the file is made anew (O_EXCL follows no link).
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.fd = os.open(
                self.path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
            )
        except OSError:
            self.path = None
            self.fd = None
        self._write_file(bytes(self.buf))
        self.buf = bytearray()

    def _write_file(self, data):
        if self.fd is None:
            return
        data = data[: max(0, self.spill_limit - self.spilled_bytes)]
        self.spilled_bytes += len(data)
        try:
            write_all(self.fd, data)
            if self.spilled_bytes >= self.spill_limit:
                raise OSError("spill limit reached")
        except OSError:
            # Disk cap reached: keep the partial file, stop writing, keep capturing head/tail.
            os.close(self.fd)
            self.fd = None

    def finish(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.spilled:
            text = bytes(self.buf).decode("utf-8", "replace")
            if encoded_size(text) <= self.keep:
                return {"text": text, "truncated": False, "bytes": self.total, "path": None}
            # Few bytes, but escaping would blow them up (a control byte is 6 bytes in a
            # frame): keep what fits, as for a long output.
            head, tail = bytes(self.buf), bytes(self.buf)
        else:
            head, tail = self.head, bytes(self.tail[-self.half :])
        head = _fit_bytes(head, self.half)
        tail = _fit_bytes(tail, self.half, from_end=True)
        omitted = self.total - len(head) - len(tail)
        marker = "\n[... %d bytes omitted%s ...]\n" % (
            omitted,
            "; full output in " + self.path if self.path else "",
        )
        text = head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")
        return {"text": text, "truncated": True, "bytes": self.total, "path": self.path}


def _fit_bytes(raw, budget_bytes, from_end=False):
    """The longest head (or tail) of ``raw`` whose decoded text takes at most ``budget_bytes``
    in a frame: the output kept is bounded by its encoded size, not its byte count."""
    n = min(len(raw), budget_bytes)
    while n > 0:
        part = raw[len(raw) - n :] if from_end else raw[:n]
        size = encoded_size(part.decode("utf-8", "replace"))
        if size <= budget_bytes:
            return part
        n = min(n - 1, n * budget_bytes // size)
    return b""


def _prune_spills(keep):
    """Delete all but the ``keep`` newest spilled outputs."""
    try:
        names = [os.path.join(OUTPUT_DIR, n) for n in os.listdir(OUTPUT_DIR)]
        names.sort(key=lambda p: os.stat(p).st_mtime, reverse=True)
        for path in names[keep:]:
            os.unlink(path)
    except OSError:
        pass


class Pump:
    """Reads a set of pipes into their sinks until told to stop."""

    def __init__(self, sinks):
        # poll, not selectors: that module imports collections and math, ~1 ms of CPU at
        # every supervisor's start. Any event (data, hang-up, error) means "read it".
        self.poller = select.poll()
        self.sinks = {}
        for fd, sink in sinks.items():
            os.set_blocking(fd, False)
            self.poller.register(fd, select.POLLIN)
            self.sinks[fd] = sink

    def open_count(self):
        return len(self.sinks)

    def poll(self, timeout_s, extra=None):
        """Read what is ready within ``timeout_s``; return True if ``extra`` became readable."""
        if extra is not None:
            self.poller.register(extra, select.POLLIN)
        try:
            if not self.sinks and extra is None:
                time.sleep(max(0.0, timeout_s))
                return False
            hit_extra = False
            for fd, _ in self.poller.poll(_ms(timeout_s)):
                if fd == extra:
                    hit_extra = True
                elif fd in self.sinks:
                    self._read(fd)
            return hit_extra
        finally:
            if extra is not None:
                self.poller.unregister(extra)

    def _read(self, fd):
        try:
            data = os.read(fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return 0
        if not data:
            self.poller.unregister(fd)
            del self.sinks[fd]
            return -1
        self.sinks[fd].feed(data)
        return len(data)

    def drain_now(self):
        """Read everything already sitting in the pipes, without waiting for more."""
        for fd in list(self.sinks):
            while fd in self.sinks and self._read(fd) > 0:
                pass

    def drain_after_exit(self):
        """After the process exited: read until EOF, or until a child holding the pipe is quiet."""
        end = time.monotonic() + DRAIN_MAX_S
        while self.sinks and time.monotonic() < end:
            events = self.poller.poll(_ms(DRAIN_QUIET_S))
            if not events:
                break
            for fd, _ in events:
                if fd in self.sinks:
                    self._read(fd)


def _ms(timeout_s):
    """``poll``'s timeout: milliseconds, rounded up (never a busy 0 for a short wait)."""
    return max(0, -int(-max(0.0, timeout_s) * 1000 // 1))
