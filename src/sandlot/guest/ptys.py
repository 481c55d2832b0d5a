"""Terminals: the ``pty_open`` and ``pty_resize`` handlers.

Standard library only, Python >= 3.9 (shipped into every sandbox). ``pty``-like modules
(termios, fcntl) are imported when a terminal is opened, never at the guest's start.

A terminal is one call that lasts as long as its process: the child gets the pty's slave as
stdin, stdout and stderr, a session of its own (setsid) and the slave as its controlling
terminal (TIOCSCTTY), so job control, ^C and SIGWINCH behave as in a real terminal. Input
arrives through the ``stdin`` op (the call's stdin is the master); output leaves as STDOUT
events whose ``data`` is base64 of the raw bytes, a chunk at a time. Sending blocks while the
host does not read, and the loop does not read the master meanwhile: a flood of output fills
the pty's buffer and stops the writer, it never piles up in memory here.
"""

import base64
import os
import select
import subprocess
import time

from ops import Event
from output import FRAME_COST_BYTES, STREAMED
from procs import forget, kill_session, set_oom_preferred, signal_exit_code, spawn
from wire import GuestFault, encode_body
from workspace import WORKSPACE

READ_CHUNK_BYTES = 65536  # per frame: ~88 KiB of base64; the pipe pump reads as much
DRAIN_QUIET_S = 0.05
# After the process ends, what it left in the terminal is still read, for at most this long
# (a left-over process may hold the terminal and write forever). gVisor's terminal takes
# megabytes a writer does not wait for: reading them out takes seconds.
DRAIN_MAX_S = 10.0
KILLED_DRAIN_S = 0.5  # a killed terminal's last output is not worth waiting for
MAX_SIZE = 10000  # columns or rows: a winsize field is 16 bits


def _size(request, key, default):
    value = request.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
        raise GuestFault("invalid_request", "%s must be an integer in 1..%d" % (key, MAX_SIZE))
    return value


def _set_size(fd, cols, rows):
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_terminal():
    """In the child, after setsid: make the pty (its stdin) the controlling terminal."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _read_ready(master, poller):
    """What the terminal holds now, up to READ_CHUNK_BYTES, and whether it is still open.

    A terminal hands out at most ~4 KiB per read: reads are gathered while more is ready, so
    a flood travels in a quarter of the frames (each frame costs a JSON encode and a write).
    """
    chunks = []
    size = 0
    while size < READ_CHUNK_BYTES:
        try:
            data = os.read(master, READ_CHUNK_BYTES - size)
        except OSError:
            data = b""  # EIO: every holder of the slave has closed it
        if not data:
            return b"".join(chunks), False
        chunks.append(data)
        size += len(data)
        if not poller.poll(0):
            break
    return b"".join(chunks), True


class Ptys:
    """The terminal handlers; the calls registry holds each terminal's master for resize."""

    def __init__(self, writer, calls, env):
        self.writer = writer
        self.calls = calls
        self.env = env

    def _argv(self, request):
        command = request.get("command")
        if command:
            if not isinstance(command, str) or "\0" in command:
                raise GuestFault("invalid_request", "command must be a string without NUL")
            return ["/bin/sh", "-c", command]
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        return [shell, "-i"]

    def _env(self, request):
        env = dict(self.env, TERM="xterm-256color")
        given = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        for key, value in given.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise GuestFault(
                    "invalid_request",
                    "env names must be non-empty without '=' or NUL; values no NUL",
                )
            env[key] = value
        return env

    def _cwd(self, request):
        cwd = WORKSPACE if os.path.isdir(WORKSPACE) else "/"
        if request.get("cwd"):
            cwd = os.path.join(WORKSPACE, str(request["cwd"]))
            if "\0" in cwd or not os.path.isdir(cwd):
                raise GuestFault("file_not_found", "cwd %r is not a directory" % request["cwd"])
        return cwd

    def pty_open(self, request):
        call_id = request["id"]
        cols = _size(request, "cols", 80)
        rows = _size(request, "rows", 24)
        argv, env, cwd = self._argv(request), self._env(request), self._cwd(request)
        started = time.monotonic()
        call = self.calls.start(call_id)
        try:
            master, slave = os.openpty()
            try:
                _set_size(master, cols, rows)
                proc = spawn(
                    argv,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_take_terminal,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)  # the child holds it now: EIO on the master once it is gone
            set_oom_preferred(proc.pid)
            call.pid = proc.pid
            call.pty_fd = master
            call.stdin_fd = os.dup(master)
            call.stdin_ready.set()
            try:
                reason, total = self._pump(request, call, proc, master, started)
            finally:
                call.pty_fd = None
                call.close_stdin_when_idle()
                os.close(master)
            returncode = proc.wait()
            forget(proc)
        finally:
            self.calls.end(call_id)
        result = {
            "exit_code": signal_exit_code(returncode),
            "text": None,
            "error": None,
            "kill_reason": reason,
            "state_lost": False,
            "stdout": "",
            "stderr": "",
            "stdout_bytes": total,
            "duration_ms": (time.monotonic() - started) * 1000.0,
        }
        if returncode < 0 and not reason:
            # SIGXCPU too: no CPU-time limit is set, so it is a signal any process
            # could send, not a limit hit (a red team forged "cpu" with it, 2026-12-06).
            result["kill_reason"] = "killed"
        return result

    def _pump(self, request, call, proc, master, started):
        """Send the terminal's output until its process ends (or is killed): the kill
        reason, if any, and the bytes sent."""
        call_id = request["id"]
        deadline = started + float(request.get("timeout_s", 86400))
        stream = bool(request.get("stream"))
        total = 0
        reason = None
        poller = select.poll()
        poller.register(master, select.POLLIN)
        master_open = True
        ended_at = None
        while True:
            now = time.monotonic()
            if reason is None and call.cancelled:
                reason = "killed"
            if reason is None and now >= deadline:
                reason = "timeout"
            if reason is not None and ended_at is None:
                kill_session(proc.pid)
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            drain_s = DRAIN_MAX_S if reason is None else KILLED_DRAIN_S
            if ended_at is not None and (not master_open or now - ended_at > drain_s):
                return reason, total  # past drain_s: a left-over process keeps talking
            if not master_open:
                # Every holder of the slave closed it but the process runs on: wait for it.
                try:
                    proc.wait(0.25)
                except subprocess.TimeoutExpired:
                    pass
                continue
            wait_s = DRAIN_QUIET_S if ended_at is not None else 0.25
            if not poller.poll(wait_s * 1000):
                if ended_at is not None:
                    return reason, total
                continue
            data, master_open = _read_ready(master, poller)
            if not data:
                continue
            total += len(data)
            if stream:
                encoded = base64.b64encode(data).decode("ascii")
                body = encode_body({"id": call_id, "event": Event.STDOUT, "data": encoded})
                STREAMED.wait(len(body) + FRAME_COST_BYTES)  # as on a slow terminal
                self.writer.send_body(body)

    def pty_resize(self, request):
        target = request.get("target")
        cols = _size(request, "cols", 80)
        rows = _size(request, "rows", 24)
        call = self.calls.running.get(target)
        fd = getattr(call, "pty_fd", None)
        if fd is None:
            raise GuestFault("invalid_request", "no running terminal %r" % (target,))
        # The kernel sends SIGWINCH to the terminal's foreground process group.
        _set_size(fd, cols, rows)
        return {"cols": cols, "rows": rows}
