"""The running exec calls, by id: what ``cancel`` and ``stdin`` requests act on.

Standard library only, Python >= 3.9 (shipped into every sandbox). Both ops touch only the
registry and the :class:`Call` they name, never a process: the cell or shell loop that owns
the call sees ``cancelled`` and kills its own process.
"""

import os
import time

import threads
from wire import GuestFault, write_all

STDIN_WAIT_S = 5.0  # how long input may arrive before the command it is for has started
ENDED_PIDS_KEPT = 64  # a quick background command may end before its pid is asked for


class Call:
    """One running exec call: can be cancelled and fed stdin by other requests."""

    def __init__(self, streaming=True):
        self.cancelled = False
        # Whether its output goes to the host as it comes (when the request asked to stream):
        # each chunk is a frame the host's one event loop checks and parses, for nothing when
        # nobody listens (a background command's result keeps its head and tail anyway).
        self.streaming = streaming
        self.stdin_fd = None
        self.stdin_ready = threads.Event()
        self.stdin_lock = threads.Lock()
        self.finished = False
        self.pid = None

    def write_stdin(self, data, eof):
        with self.stdin_lock:
            if self.stdin_fd is None:
                return False
            try:
                if data:
                    write_all(self.stdin_fd, data)
            except OSError:
                eof = True  # the reader is gone: nothing more can be delivered
            if eof or self.finished:
                os.close(self.stdin_fd)
                self.stdin_fd = None
            return True

    def close_stdin_when_idle(self):
        """The command ended: close its stdin now, or, if a writer is blocked on a pipe that
        a left-over process keeps open and never reads, let that writer close it when it can.
        Waiting for the writer here would hang the finished call."""
        self.finished = True
        if self.stdin_lock.acquire(blocking=False):
            try:
                if self.stdin_fd is not None:
                    os.close(self.stdin_fd)
                    self.stdin_fd = None
            finally:
                self.stdin_lock.release()


class Calls:
    """The registry of running calls, and the handlers of ``cancel`` and ``stdin``."""

    def __init__(self):
        self.running = {}
        self.ended_pids = {}
        self.ended_lock = threads.Lock()
        # ``stream`` requests for calls not started yet (their request's thread has not run).
        self.streaming_asked = {}

    def start(self, call_id, request=None):
        streaming = not (request or {}).get("stream_paused")
        call = Call(streaming=self.streaming_asked.pop(call_id, streaming))
        self.running[call_id] = call
        return call

    def end(self, call_id):
        call = self.running.pop(call_id, None)
        if call is not None and call.pid is not None:
            with self.ended_lock:
                self.ended_pids[call_id] = call.pid
                while len(self.ended_pids) > ENDED_PIDS_KEPT:
                    self.ended_pids.pop(next(iter(self.ended_pids)))

    def pid(self, request):
        """The pid of call ``target``'s process (its bash), once it has started."""
        target = request.get("target")

        def started():
            call = self.running.get(target)
            if call is not None and call.pid is not None:
                return call.pid
            with self.ended_lock:  # end() of another call may be evicting entries
                return self.ended_pids.get(target)

        pid = _poll(started)
        if pid is None:
            raise GuestFault("invalid_request", "no call %r has started" % (target,))
        return {"pid": pid}

    def stream(self, request):
        """Start or stop streaming call ``target``'s output. Handled in the read loop, in
        order with the requests around it, so it never waits: a call not started yet (its
        own request's thread has not run) takes it when it starts."""
        target = request.get("target")
        on = bool(request.get("on"))
        call = self.running.get(target)
        if call is not None:
            call.streaming = on
        elif isinstance(target, int):
            self.streaming_asked[target] = on
            while len(self.streaming_asked) > ENDED_PIDS_KEPT:  # ended calls' are never taken
                self.streaming_asked.pop(next(iter(self.streaming_asked)))
        return {"streaming": on}

    def cancel(self, request):
        call = self.running.get(request.get("target"))
        if call is not None:
            call.cancelled = True
        return {"cancelled": call is not None}

    def stdin(self, request):
        target = request.get("target")

        def ready():
            call = self.running.get(target)
            return call if call is not None and call.stdin_ready.is_set() else None

        call = _poll(ready) or self.running.get(target)
        import base64  # stdin is rare: not a cost of every supervisor's start

        data = base64.b64decode(request.get("data", ""))
        if call is None or not call.write_stdin(data, bool(request.get("eof"))):
            raise GuestFault("invalid_request", "no running call with open stdin")
        return {"written": len(data)}


def _poll(found):
    """``found()`` until it is not None, for at most :data:`STDIN_WAIT_S`: a request (input,
    a pid) may race ahead of the call it names. None if it never was."""
    deadline = time.monotonic() + STDIN_WAIT_S
    while True:
        value = found()
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(0.005)
