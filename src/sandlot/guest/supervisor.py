"""sandlot guest agent: the one program that runs inside every sandbox.

Standard library only, Python >= 3.9, because it runs under whatever ``python3`` the sandbox
image has, never under the host's virtualenv.

Protocol: frames on stdin/stdout, each a 4-byte big-endian length and a UTF-8 JSON object.
The host sends ``{"id": N, "op": ..., ...}``; the guest answers with any number of
``{"id": N, "event": "stdout"|"stderr", "data": str}`` (only when the request asked to
``stream``) and then exactly one ``{"id": N, "event": "result", "result": {...}}`` or
``{"id": N, "event": "error", "code": str, "message": str}``. Before anything else the guest
sends ``{"id": 0, "event": "ready", ...}``.

Processes: this supervisor; one Python *kernel* process that holds the interpreter state and
runs cells (``--kernel``); one short-lived bash per shell command. The supervisor enforces
each call's timeout and output caps, so a runaway cell never takes the protocol down with it.
"""

import base64
import codecs
import json
import linecache
import os
import selectors
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback

PROTOCOL_VERSION = 1
# Started as a module import, not as a script, so a precompiled .pyc is used (a script run
# as __main__ is compiled afresh every time: ~7 ms for this file).
LAUNCHER = "import sys; sys.path.insert(0, %r); import supervisor; supervisor.main(sys.argv)"
WORKSPACE = os.environ.get("SANDLOT_WORKSPACE", "/workspace")
STATE_DIR = os.path.join(WORKSPACE, ".sandlot")
OUTPUT_DIR = os.path.join(STATE_DIR, "outputs")
SHELL_STATE_DIR = os.environ.get("SANDLOT_SHELL_STATE", "/tmp/.sandlot_shells")
PYTHON = sys.executable or "/usr/bin/python3"
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
READ_CHUNK_BYTES = 65536
INTERRUPT_GRACE_S = 0.5
DRAIN_QUIET_S = 0.02
DRAIN_MAX_S = 0.5
FILE_CHUNK_MAX_BYTES = 8 << 20


# --------------------------------------------------------------------------- framing


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


# --------------------------------------------------------------------------- output capture


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
            self.fd = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644
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
            return {
                "text": bytes(self.buf).decode("utf-8", "replace"),
                "truncated": False,
                "bytes": self.total,
                "path": None,
            }
        omitted = self.total - len(self.head) - min(len(self.tail), self.half)
        marker = "\n[... %d bytes omitted%s ...]\n" % (
            omitted,
            "; full output in " + self.path if self.path else "",
        )
        text = (
            self.head.decode("utf-8", "replace")
            + marker
            + bytes(self.tail[-self.half :]).decode("utf-8", "replace")
        )
        return {"text": text, "truncated": True, "bytes": self.total, "path": self.path}


KEEP_SPILL_FILES = 8


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
        self.sel = selectors.DefaultSelector()
        self.sinks = {}
        for fd, sink in sinks.items():
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
            self.sinks[fd] = sink

    def open_count(self):
        return len(self.sinks)

    def poll(self, timeout_s, extra=None):
        """Read what is ready within ``timeout_s``; return True if ``extra`` became readable."""
        if extra is not None:
            self.sel.register(extra, selectors.EVENT_READ)
        try:
            if not self.sinks and extra is None:
                time.sleep(max(0.0, timeout_s))
                return False
            hit_extra = False
            for key, _ in self.sel.select(max(0.0, timeout_s)):
                if key.fd == extra:
                    hit_extra = True
                else:
                    self._read(key.fd)
            return hit_extra
        finally:
            if extra is not None:
                self.sel.unregister(extra)

    def _read(self, fd):
        try:
            data = os.read(fd, READ_CHUNK_BYTES)
        except BlockingIOError:
            return 0
        if not data:
            self.sel.unregister(fd)
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
            events = self.sel.select(DRAIN_QUIET_S)
            if not events:
                break
            for key, _ in events:
                self._read(key.fd)

    def close(self):
        self.sel.close()


def set_oom_preferred(pid):
    """Make the kernel's OOM killer pick user code before the supervisor."""
    try:
        with open("/proc/%d/oom_score_adj" % pid, "w") as f:
            f.write("1000")
    except OSError:
        pass


def kill_group_except(pgid, keep_pid):
    """SIGKILL every process in group ``pgid`` but ``keep_pid`` (children a cell left behind)."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == keep_pid:
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                os.kill(int(name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def signal_exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------- children and orphans

CHILDREN = set()
CHILDREN_LOCK = threading.Lock()


def spawn(*args, **kwargs):
    """Popen, remembering the pid so the orphan reaper never takes our child's exit status."""
    with CHILDREN_LOCK:
        proc = subprocess.Popen(*args, **kwargs)
        CHILDREN.add(proc.pid)
    return proc


def forget(proc):
    with CHILDREN_LOCK:
        CHILDREN.discard(proc.pid)


def reap_orphans_forever():
    """As pid 1, reap the zombies of orphans (double-forked daemons) that were reparented to us.

    Never waitpid(-1): that would steal the exit status of a command still being waited for.
    """
    while True:
        time.sleep(0.5)
        with CHILDREN_LOCK:
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in CHILDREN or name == "1":
                    continue
                try:
                    with open("/proc/%s/stat" % name) as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if fields[0] == "Z" and fields[1] == "1":
                        os.waitpid(int(name), os.WNOHANG)
                except (OSError, IndexError, ValueError):
                    continue


# --------------------------------------------------------------------------- python kernel (child)


def kernel_main(ctl_in, ctl_out):
    """Run cells sent by the supervisor in one persistent namespace."""
    import ast  # the kernel's alone: keeps ~10 ms of imports off the supervisor's start
    import asyncio
    import builtins

    _harden()

    sys.path[0] = ""
    # The user's own `import supervisor` must find their module, not this one.
    sys.modules.pop("supervisor", None)
    try:
        os.chdir(WORKSPACE)
    except OSError:
        pass
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    state = {"in_cell": False, "loop": None, "count": 0}

    def on_sigint(signum, frame):
        # Interrupts only land inside a cell; between cells they would corrupt the protocol.
        if state["in_cell"]:
            raise KeyboardInterrupt

    def run_cell(code):
        state["count"] += 1
        filename = "<cell-%d>" % state["count"]
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        result = {"exit_code": 0, "text": None, "error": None}
        try:
            state["in_cell"] = True
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
            body = compile(tree, filename, "exec", flags=flags)
            value = None
            if body.co_flags & 0x80:  # CO_COROUTINE: the cell used top-level await
                value = _run_async(eval(body, namespace))
            else:
                exec(body, namespace)
            if last is not None:
                expr = compile(last, filename, "eval", flags=flags)
                value = eval(expr, namespace)
                if expr.co_flags & 0x80:
                    value = _run_async(value)
                if value is not None:
                    namespace["_"] = value
                    result["text"] = repr(value)
        except SystemExit as exc:
            code_value = exc.code
            if code_value is None:
                result["exit_code"] = 0
            elif isinstance(code_value, int):
                result["exit_code"] = code_value
            else:
                sys.stderr.write("%s\n" % (code_value,))
                result["exit_code"] = 1
        except BaseException as exc:  # the cell's failure is a result, not our crash
            result["exit_code"] = 1
            result["error"] = _describe(exc)
        finally:
            state["in_cell"] = False
        return result

    def _run_async(awaitable):
        if state["loop"] is None:
            state["loop"] = asyncio.new_event_loop()
        return state["loop"].run_until_complete(awaitable)

    def _describe(exc):
        # Hide the kernel's own frames: the traceback should show only the user's code.
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(te.format())}

    # Children of cells must not inherit the control pipes (a forked child still holds them,
    # which is why every reply also echoes the request's nonce).
    os.set_inheritable(ctl_in, False)
    os.set_inheritable(ctl_out, False)
    writer = FrameWriter(ctl_out)
    while True:
        signal.signal(signal.SIGINT, on_sigint)
        try:
            request = read_frame(ctl_in)
        except EOFError:
            return
        except KeyboardInterrupt:
            continue
        result = None
        while result is None:
            try:
                result = run_cell(request["code"])
            except KeyboardInterrupt:
                result = {
                    "exit_code": 1,
                    "text": None,
                    "error": {"type": "KeyboardInterrupt", "message": "", "traceback": ""},
                }
        if result["text"] is not None and len(result["text"]) > request.get("text_limit", 1 << 20):
            limit = request.get("text_limit", 1 << 20)
            result["text"] = result["text"][: limit // 2] + " ... " + result["text"][-limit // 2 :]
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        result["nonce"] = request.get("nonce")
        writer.send(result)


def _checked_reply(reply, nonce):
    """Only a well-formed answer to *this* request counts; anything else breaks the kernel."""
    if not isinstance(reply, dict) or reply.get("nonce") != nonce:
        raise ValueError("reply does not answer this request")
    error = reply.get("error")
    if not isinstance(reply.get("exit_code"), int) or isinstance(reply.get("exit_code"), bool):
        raise ValueError("bad exit_code")
    if reply.get("text") is not None and not isinstance(reply.get("text"), str):
        raise ValueError("bad text")
    if error is not None and not (
        isinstance(error, dict)
        and all(isinstance(error.get(k), str) for k in ("type", "message", "traceback"))
    ):
        raise ValueError("bad error")
    return reply


class Kernel:
    """The supervisor's handle on the kernel process; restarts it when it dies."""

    def __init__(self, env):
        self.env = env
        self.proc = None
        self.ctl_w = None
        self.ctl_r = None
        self.lock = threading.Lock()
        self.ever_started = False
        self.loss_reported = False

    def ensure(self):
        if self.proc is not None and self.proc.poll() is None:
            return False
        self.stop()
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        self.proc = spawn(
            [
                PYTHON,
                "-u",
                "-c",
                LAUNCHER % os.path.dirname(os.path.abspath(__file__)),
                "--kernel",
                str(req_r),
                str(res_w),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(req_r, res_w),
            cwd=WORKSPACE if os.path.isdir(WORKSPACE) else "/",
            env=self.env,
            start_new_session=True,
        )
        os.close(req_r)
        os.close(res_w)
        self.ctl_w, self.ctl_r = req_w, res_r
        set_oom_preferred(self.proc.pid)
        restarted = self.ever_started and not self.loss_reported
        self.ever_started = True
        self.loss_reported = False
        return restarted

    def alive(self):
        """Running, and not already doomed: a SIGKILL sent a moment ago may still be pending
        (death is asynchronous), and must count as dead for whoever asks right after."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with open("/proc/%d/status" % self.proc.pid) as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key == "State" and value.split()[0] in ("Z", "X"):
                        return False
                    if key in ("SigPnd", "ShdPnd") and int(value, 16) & (1 << (signal.SIGKILL - 1)):
                        return False
        except (OSError, ValueError):
            return False
        return True

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            forget(self.proc)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self.proc = None
        for fd in (self.ctl_w, self.ctl_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.ctl_w = self.ctl_r = None


# --------------------------------------------------------------------------- supervisor ops


class Call:
    """One running exec call: can be cancelled and fed stdin by other requests."""

    def __init__(self):
        self.cancelled = False
        self.stdin_fd = None
        self.stdin_ready = threading.Event()
        self.stdin_lock = threading.Lock()
        self.finished = False

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


def count_tasks():
    """Processes alive in the sandbox's pid namespace, the guest's included.

    The host reads the same figure from the pids cgroup, except under gVisor: there the
    cgroup holds the sentry, the sandbox's processes live inside it, and a fork bomb held at
    RLIMIT_NPROC shows up in no host counter. Listing /proc forks nothing, so it works at
    the limit too.
    """
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return None


class Supervisor:
    def __init__(self, writer):
        self.writer = writer
        self.env = self._base_env()
        self.kernel = Kernel(self.env)
        self.sessions = {}
        self.sessions_lock = threading.Lock()
        self.calls = {}

    @staticmethod
    def _base_env():
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": WORKSPACE,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "TERM": "dumb",
        }
        # What the sandbox was started with (the caller's env included) wins over defaults.
        for key, value in os.environ.items():
            if not key.startswith("SANDLOT_"):
                env[key] = value
        return env

    # -- dispatch

    def handle(self, request):
        call_id = request.get("id")
        op = request.get("op")
        try:
            method = getattr(self, "op_" + str(op), None)
            if method is None:
                raise GuestFault("invalid_request", "unknown op %r" % (op,))
            result = method(request)
            if isinstance(result, dict) and "exit_code" in result:
                result["tasks"] = count_tasks()
            self.writer.send({"id": call_id, "event": "result", "result": result})
        except GuestFault as fault:
            self.writer.send(
                {"id": call_id, "event": "error", "code": fault.code, "message": fault.message}
            )
        except OSError as exc:
            code, message = os_error_code(exc)
            self.writer.send({"id": call_id, "event": "error", "code": code, "message": message})
        except Exception as exc:  # report, never die: the host decides what a failure means
            self.writer.send(
                {
                    "id": call_id,
                    "event": "error",
                    "code": "guest_error",
                    "message": "%s: %s" % (type(exc).__name__, exc),
                }
            )

    def op_ping(self, request):
        return {"pong": True, "pid": os.getpid()}

    def op_cancel(self, request):
        call = self.calls.get(request.get("target"))
        if call is not None:
            call.cancelled = True
        return {"cancelled": call is not None}

    def op_stdin(self, request):
        # Input may race ahead of the process it is for: wait briefly for its pipe.
        deadline = time.monotonic() + 5.0
        call = self.calls.get(request.get("target"))
        while time.monotonic() < deadline and (call is None or not call.stdin_ready.is_set()):
            time.sleep(0.005)
            call = self.calls.get(request.get("target"))
        data = base64.b64decode(request.get("data", ""))
        if call is None or not call.write_stdin(data, bool(request.get("eof"))):
            raise GuestFault("invalid_request", "no running call with open stdin")
        return {"written": len(data)}

    # -- python

    def op_exec_code(self, request):
        call_id = request["id"]
        call = Call()
        self.calls[call_id] = call
        try:
            with self.kernel.lock:
                state_lost = self.kernel.ensure()
                # The timeout counts from when the cell can run, not while it waits its turn.
                return self._run_cell(request, call, time.monotonic(), state_lost)
        finally:
            self.calls.pop(call_id, None)

    def _run_cell(self, request, call, started, state_lost):
        kernel = self.kernel
        proc = kernel.proc
        deadline = started + float(request.get("timeout_s", 30))
        reason = []
        sinks = self._sinks(request, lambda: reason.append("output_limit"))
        pump = Pump({proc.stdout.fileno(): sinks[0], proc.stderr.fileno(): sinks[1]})
        nonce = os.urandom(16).hex()
        write_all(
            kernel.ctl_w,
            encode_frame(
                {
                    "code": request["code"],
                    "text_limit": request.get("output_limit", 1 << 20),
                    "nonce": nonce,
                }
            ),
        )
        reply = None
        interrupt_at = None
        try:
            while True:
                now = time.monotonic()
                if reply is None and not reason and call.cancelled:
                    reason.append("killed")
                if reply is None and not reason and now >= deadline:
                    reason.append("timeout")
                if reason and interrupt_at is None:
                    interrupt_at = now
                    try:
                        os.kill(proc.pid, signal.SIGINT)
                    except OSError:
                        pass
                if interrupt_at is not None and now - interrupt_at > INTERRUPT_GRACE_S:
                    break  # ignored the interrupt (C loop, or a handler of its own)
                wait_s = 0.05 if interrupt_at is not None else min(0.25, deadline - now)
                if pump.poll(wait_s, extra=kernel.ctl_r):
                    try:
                        reply = _checked_reply(read_frame(kernel.ctl_r), nonce)
                    except (EOFError, ValueError):
                        reply = None  # dead, or a forged / out-of-step reply: start afresh
                    break
                if proc.poll() is not None:
                    break
            pump.drain_now()
            if interrupt_at is not None:
                # The cell is over, but processes it started may still run: end them.
                kill_group_except(proc.pid, proc.pid)
        finally:
            pump.close()
        result = {"kill_reason": reason[0] if reason else None, "state_lost": state_lost}
        if reply is None:
            # The kernel died or would not stop: its state is gone, start a fresh one.
            kernel.stop()
            returncode = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            result["exit_code"] = signal_exit_code(returncode)
            result["state_lost"] = True
            result["signal"] = -returncode if returncode < 0 else None
            if not reason and returncode < 0:
                result["kill_reason"] = "cpu" if -returncode == signal.SIGXCPU else "killed"
            result["error"] = {
                "type": "KernelDied" if not reason else "Interrupted",
                "message": "the interpreter was killed (signal %s); "
                "its variables and imports are lost" % (-returncode),
                "traceback": "",
            }
            result["text"] = None
            threading.Thread(target=self._rewarm_kernel, daemon=True).start()
        else:
            result.update(exit_code=reply["exit_code"], text=reply["text"], error=reply["error"])
        self._finish_streams(result, sinks, started)
        return result

    def _rewarm_kernel(self):
        with self.kernel.lock:
            try:
                self.kernel.ensure()
            except OSError:
                pass

    # -- shell

    def op_exec_shell(self, request):
        call_id = request["id"]
        kernel_alive = self.kernel.alive()
        name = str(request.get("session") or "default")
        with self.sessions_lock:
            session = self.sessions.setdefault(
                name, {"cwd": WORKSPACE, "env": dict(self.env), "lock": threading.Lock()}
            )
        call = Call()
        self.calls[call_id] = call
        try:
            with session["lock"]:
                # The timeout counts from when the command can run, not while it queues.
                result = self._run_shell(request, session, name, call, time.monotonic())
            if kernel_alive and not self.kernel.alive():
                # The command killed the Python interpreter (kill -9 -1, say): say so now.
                self.kernel.loss_reported = True
                result["state_lost"] = True
            return result
        finally:
            self.calls.pop(call_id, None)

    def _run_shell(self, request, session, name, call, started):
        os.makedirs(SHELL_STATE_DIR, exist_ok=True)
        state_base = os.path.join(SHELL_STATE_DIR, "%s-%s" % (_safe_name(name), request["id"]))
        env = dict(session["env"])
        call_env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        for key, value in call_env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise GuestFault(
                    "invalid_request",
                    "env names must be non-empty without '=' or NUL; values no NUL",
                )
        if "\0" in request["command"]:
            raise GuestFault("invalid_request", "command contains a NUL byte")
        env.update(call_env)
        cwd = session["cwd"]
        if request.get("cwd"):
            cwd = os.path.join(session["cwd"], request["cwd"])
            if "\0" in cwd or not os.path.isdir(cwd):
                raise GuestFault("file_not_found", "cwd %r is not a directory" % request["cwd"])
        elif not os.path.isdir(cwd):
            cwd = WORKSPACE if os.path.isdir(WORKSPACE) else "/"  # the session's dir was removed
        has_input = request.get("input") is not None
        keep_stdin = bool(request.get("stdin"))
        proc = spawn(
            ["/bin/bash", "-c", SHELL_WRAPPER, "bash", state_base, request["command"]],
            stdin=subprocess.PIPE if (has_input or keep_stdin) else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        set_oom_preferred(proc.pid)
        if proc.stdin is not None:
            call.stdin_fd = os.dup(proc.stdin.fileno())
            proc.stdin.close()
            if has_input:
                # From a thread: a big input and a chatty command would deadlock one thread.
                data = request["input"].encode("utf-8")
                threading.Thread(
                    target=call.write_stdin, args=(data, not keep_stdin), daemon=True
                ).start()
        call.stdin_ready.set()
        deadline = started + float(request.get("timeout_s", 30))
        reason = []
        sinks = self._sinks(request, lambda: reason.append("output_limit"))
        pump = Pump({proc.stdout.fileno(): sinks[0], proc.stderr.fileno(): sinks[1]})
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if not reason and call.cancelled:
                    reason.append("killed")
                if not reason and now >= deadline:
                    reason.append("timeout")
                if reason:
                    _killpg(proc.pid)
                    proc.wait()
                    break
                wait_s = min(0.25, deadline - now)
                if pump.open_count():
                    pump.poll(wait_s)
                else:
                    # Pipes closed but not yet reaped: wait on the process, not on a sleep.
                    try:
                        proc.wait(max(0.0, wait_s))
                    except subprocess.TimeoutExpired:
                        pass
            pump.drain_after_exit()
        finally:
            pump.close()
            proc.stdout.close()
            proc.stderr.close()
            call.close_stdin_when_idle()
        returncode = proc.wait()
        forget(proc)
        self._update_session(session, state_base, call_env)
        result = {
            "exit_code": signal_exit_code(returncode),
            "text": None,
            "error": None,
            "kill_reason": reason[0] if reason else None,
            "state_lost": False,
        }
        if returncode < 0 and not reason:
            result["kill_reason"] = "cpu" if -returncode == signal.SIGXCPU else "killed"
        self._finish_streams(result, sinks, started)
        return result

    def _update_session(self, session, state_base, call_env):
        try:
            with open(state_base + ".cwd") as f:
                cwd = f.read().strip()
            if os.path.isdir(cwd):
                session["cwd"] = cwd
            with open(state_base + ".env", "rb") as f:
                raw = f.read()
            env = {}
            for item in raw.split(b"\0"):
                key, sep, value = item.partition(b"=")
                if sep and key:
                    env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
            for key, value in call_env.items():
                # Per-call env applies to that call only, unless the command changed it.
                if env.get(key) == value:
                    if key in session["env"]:
                        env[key] = session["env"][key]
                    else:
                        env.pop(key, None)
            for key in ("PWD", "OLDPWD", "SHLVL", "_"):
                env.pop(key, None)
            if env:
                session["env"] = env
        except OSError:
            pass  # killed before its EXIT trap ran: the session keeps its previous state
        finally:
            for suffix in (".cwd", ".env"):
                try:
                    os.unlink(state_base + suffix)
                except OSError:
                    pass

    def op_close_session(self, request):
        with self.sessions_lock:
            existed = self.sessions.pop(str(request.get("session")), None) is not None
        return {"closed": existed}

    # -- shared

    def _sinks(self, request, on_overflow):
        call_id = request["id"]
        keep = int(request.get("output_limit", 1 << 20))
        file_limit = int(request.get("output_file_limit", 100 << 20))
        spill_limit = request.get("output_spill_limit")
        stream = bool(request.get("stream"))
        sinks = []
        for name in ("stdout", "stderr"):
            on_text = None
            if stream:
                on_text = self._streamer(call_id, name)
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

    def _streamer(self, call_id, name):
        def send(text):
            self.writer.send({"id": call_id, "event": name, "data": text})

        return send

    @staticmethod
    def _finish_streams(result, sinks, started):
        for name, sink in zip(("stdout", "stderr"), sinks):
            out = sink.finish()
            result[name] = out["text"]
            result[name + "_truncated"] = out["truncated"]
            result[name + "_bytes"] = out["bytes"]
            result[name + "_path"] = out["path"]
        result["duration_ms"] = (time.monotonic() - started) * 1000.0

    # -- files (confined to the workspace)

    def op_file_read(self, request):
        path = resolve_path(request.get("path"))
        offset = int(request.get("offset", 0))
        length = min(int(request.get("length", FILE_CHUNK_MAX_BYTES)), FILE_CHUNK_MAX_BYTES)
        fd = _open_confined(path, os.O_RDONLY)  # refuses directories and non-regular files
        try:
            info = os.fstat(fd)
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return {
            "data": base64.b64encode(data).decode("ascii"),
            "size": info.st_size,
            "eof": offset + len(data) >= info.st_size,
        }

    def op_file_write(self, request):
        path = resolve_path(request.get("path"))
        if path == WORKSPACE:
            raise GuestFault("is_a_directory", "/workspace is a directory")
        parent = os.path.dirname(path)
        _makedirs_confined(parent)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
        fd = _open_confined(path, flags, int(request.get("mode", 0o644)))
        try:
            write_all(fd, base64.b64decode(request.get("data", "")))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return {"path": display(path), "size_bytes": size}

    def op_file_list(self, request):
        path = resolve_path(request.get("path") or ".")
        depth = max(1, int(request.get("depth", 1)))
        if not os.path.isdir(path):
            raise GuestFault("not_a_directory", "%s is not a directory" % display(path))
        entries = []
        self._walk(path, depth, entries)
        return {"entries": entries}

    def _walk(self, path, depth, entries):
        with os.scandir(path) as it:
            for entry in sorted(it, key=lambda e: e.name):
                info = _describe_path(entry.path)
                entries.append(info)
                if depth > 1 and info["type"] == "dir":
                    self._walk(entry.path, depth - 1, entries)

    def op_file_stat(self, request):
        return _describe_path(resolve_path(request.get("path")))

    def op_file_remove(self, request):
        import shutil

        path = resolve_path(request.get("path"), follow_final=False)
        if path == WORKSPACE:
            raise GuestFault("permission_denied", "refusing to remove /workspace itself")
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            if not request.get("recursive"):
                os.rmdir(path)
            else:
                shutil.rmtree(path)
        else:
            os.unlink(path)
        return {"removed": display(path)}

    def op_file_mkdir(self, request):
        path = resolve_path(request.get("path"))
        _makedirs_confined(path)
        return _describe_path(path)


SHELL_WRAPPER = r"""
__agsb_state=$1
__agsb_cmd=$2
set --
__agsb_save() {
  __agsb_rc=$?
  pwd > "$__agsb_state.cwd" 2>/dev/null
  /usr/bin/env -0 > "$__agsb_state.env" 2>/dev/null
  exit $__agsb_rc
}
trap __agsb_save EXIT
eval "$__agsb_cmd"
"""


def _safe_name(name):
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:64] or "default"


def _killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


# --------------------------------------------------------------------------- path confinement


def display(path):
    rel = os.path.relpath(path, WORKSPACE)
    return "/workspace" if rel == "." else "/workspace/" + rel


def _inside(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def resolve_path(raw, follow_final=True):
    """Map a user path to an absolute path inside the workspace, or refuse it.

    Relative paths are taken from /workspace. ``..`` that climbs out, absolute paths
    elsewhere, and symlinks (anywhere on the path) that lead out are refused.
    """
    if not isinstance(raw, str) or not raw or "\0" in raw:
        raise GuestFault("invalid_request", "path must be a non-empty string")
    if raw == "/workspace" or raw.startswith("/workspace/"):
        raw = WORKSPACE + raw[len("/workspace") :]
    joined = raw if os.path.isabs(raw) else os.path.join(WORKSPACE, raw)
    normal = os.path.normpath(joined)
    root = os.path.realpath(WORKSPACE)
    if not _inside(normal, os.path.normpath(WORKSPACE)):
        raise GuestFault(
            "path_outside_workspace", "%r is outside /workspace; use a path relative to it" % raw
        )
    parent_real = _realpath(os.path.dirname(normal), raw)
    final = os.path.join(parent_real, os.path.basename(normal)) if normal != WORKSPACE else root
    if follow_final:
        final = _realpath(final, raw)
    if not _inside(final, root):
        raise GuestFault(
            "path_outside_workspace", "%r resolves (through a symlink) outside /workspace" % raw
        )
    return final


def _realpath(path, raw):
    """os.path.realpath, refusing a path whose symlinks cannot all be read.

    A link we may not read cannot be shown to stay inside the workspace: gVisor, for one,
    refuses readlink("/proc/1/root") (EACCES) where Linux answers "/".
    """
    try:
        return os.path.realpath(path)
    except OSError as exc:
        raise GuestFault(
            "path_outside_workspace",
            "%r goes through a symlink that cannot be followed (%s)" % (raw, exc.strerror),
        ) from exc


def _open_confined(path, flags, mode=0o644):
    """Open a regular file only. O_NOFOLLOW closes the window between the check and the
    open; O_NONBLOCK keeps a FIFO swapped in by sandboxed code from blocking us forever."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    mode_now = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode_now):
        os.close(fd)
        if stat.S_ISDIR(mode_now):
            raise GuestFault("is_a_directory", "%s is a directory" % display(path))
        raise GuestFault("invalid_request", "%s is not a regular file" % display(path))
    return fd


def _makedirs_confined(path):
    root = os.path.realpath(WORKSPACE)
    if not _inside(_realpath(path, path), root):
        raise GuestFault("path_outside_workspace", "%s is outside /workspace" % path)
    os.makedirs(path, exist_ok=True)


def _describe_path(path):
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(info.st_mode):
        kind = "dir"
    elif stat.S_ISREG(info.st_mode):
        kind = "file"
    else:
        kind = "other"
    return {
        "name": os.path.basename(path) or "workspace",
        "path": os.path.relpath(path, os.path.realpath(WORKSPACE)),
        "type": kind,
        "size_bytes": info.st_size,
        "mtime": info.st_mtime,
        "mode": stat.S_IMODE(info.st_mode),
    }


def os_error_code(exc):
    import errno

    codes = {
        errno.ENOENT: "file_not_found",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
        errno.EISDIR: "is_a_directory",
        errno.ENOTDIR: "not_a_directory",
        errno.EEXIST: "file_exists",
        errno.ENOTEMPTY: "file_exists",
        errno.ENOSPC: "disk_full",
        errno.EDQUOT: "disk_full",
        errno.ELOOP: "path_outside_workspace",
        errno.ENAMETOOLONG: "invalid_request",
        errno.EAGAIN: "pids_exhausted",  # fork or thread creation at the pids limit
        errno.EINVAL: "invalid_request",
    }
    name = exc.filename if exc.filename is not None else ""
    where = display(name) if isinstance(name, str) and name.startswith(WORKSPACE) else name
    return codes.get(exc.errno, "file_error"), "%s: %s" % (exc.strerror or exc, where)


# --------------------------------------------------------------------------- entry points


def _harden():
    """Keep other processes of the sandbox (same uid) out of this one's memory and fds.

    Non-dumpable: /proc/<pid>/mem, /fd and ptrace now need a capability nobody here has.
    The supervisor does it so background jobs cannot forge its replies to the host; the
    kernel, so they cannot forge a cell's result from outside the cell.
    """
    import ctypes
    import resource

    pr_set_dumpable = 4
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files in the workspace
    except (ValueError, OSError):
        pass


def supervisor_main():
    _harden()
    # As pid 1 no signal without a handler reaches us from inside the sandbox; Python's own
    # SIGINT handler would, and would end the supervisor with a KeyboardInterrupt.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    if os.getpid() == 1:
        threading.Thread(target=reap_orphans_forever, daemon=True).start()
    writer = FrameWriter(1)
    # Nothing may write to fd 1 but the protocol: point the Python-level stdout elsewhere.
    sys.stdout = sys.stderr
    supervisor = Supervisor(writer)
    try:
        os.makedirs(WORKSPACE, exist_ok=True)
    except OSError:
        pass
    threading.Thread(target=supervisor._rewarm_kernel, daemon=True).start()
    writer.send(
        {
            "id": 0,
            "event": "ready",
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "uid": os.getuid(),
        }
    )
    while True:
        try:
            request = read_frame(0)
        except EOFError:
            break
        if request.get("op") == "shutdown":
            break
        try:
            threading.Thread(target=supervisor.handle, args=(request,), daemon=True).start()
        except RuntimeError:
            # The pids limit is exhausted (a fork bomb): say so instead of dying.
            writer.send(
                {
                    "id": request.get("id"),
                    "event": "error",
                    "code": "pids_exhausted",
                    "message": "the sandbox has no free process slots",
                }
            )
    supervisor.kernel.stop()


def main(argv):
    if len(argv) >= 4 and argv[1] == "--kernel":
        kernel_main(int(argv[2]), int(argv[3]))
    else:
        supervisor_main()


if __name__ == "__main__":
    main(sys.argv)
