"""Python cells: the ``exec_code`` handler and the kernel process it runs cells in.

Standard library only, Python >= 3.9 (shipped into every sandbox). The kernel (``kernel.py``)
holds the interpreter state; this side starts it, sends it cells, enforces each cell's
timeout and output caps, and starts a fresh one when it dies.
"""

import _signal as signal  # the C core: `signal` imports enum (~2.5 ms of every start)
import gc
import os
import sys
import time

import threads
from channel import KernelChannel
from ops import Event
from output import FRAME_COST_BYTES, STREAMED, Pump, call_sinks, finish_streams
from procs import (
    CHILDREN,
    CHILDREN_LOCK,
    forget,
    kill_group_except,
    set_oom_preferred,
    signal_exit_code,
    spawn,
)
from wire import (
    EXIT_CODE_MAX,
    EXIT_CODE_MIN,
    Results,
    clip_text,
    encode_body,
    nests_within,
)
from workspace import WORKSPACE

PYTHON = sys.executable or "/usr/bin/python3"
INTERRUPT_GRACE_S = 0.5
# Variables a fresh interpreter reads at its start that a forked kernel reproduces
# (``kernel.forked_main``), or that change nothing there (-u and -s are given anyway).
FORK_SAFE_VARS = {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONNOUSERSITE"}
# Prefixes of the variables that could: PYTHONHASHSEED, PYTHONWARNINGS, LD_PRELOAD, a locale.
STARTUP_VAR_PREFIXES = ("PYTHON", "LD_", "GLIBC_", "MALLOC_")


def _ctype_locale(env):
    for key in ("LC_ALL", "LC_CTYPE", "LANG"):
        if env.get(key):
            return env[key]
    return ""


def forkable(env):
    """Whether a kernel forked from this supervisor sees what a fresh interpreter with ``env``
    would: no variable asks its start for something else, and the same text encoding."""
    for key in env:
        if key.startswith(STARTUP_VAR_PREFIXES) and key not in FORK_SAFE_VARS:
            return False
    return _ctype_locale(env) == _ctype_locale(os.environ)


class Forked:
    """What the cells use of a ``Popen``, for a kernel forked from the supervisor."""

    def __init__(self, pid, stdout_fd, stderr_fd):
        self.pid = pid
        self.returncode = None
        self.stdout = open(stdout_fd, "rb", buffering=0)
        self.stderr = open(stderr_fd, "rb", buffering=0)
        self.lock = threads.Lock()

    def _wait(self, flags):
        with self.lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:
                    pid, status = self.pid, 0  # reaped elsewhere: as Popen, count it ended
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self):
        return self._wait(os.WNOHANG)

    def wait(self):
        return self._wait(0)


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


def _clipped(reply, request):
    """A reply's ``text`` and ``error`` within the call's output limit. The kernel clips them
    itself, but cell code runs in the kernel's process and can send a reply of its own: 20
    MiB in each field reached the host, which held ~180 MiB for the call (a red team's
    find). Clipped here, outside the sandbox code's reach."""
    limit = int(request.get("output_limit", 1 << 20))
    error = reply.get("error")
    if error is not None:
        error = {k: clip_text(error[k], limit) for k in ("type", "message", "traceback")}
    code = reply["exit_code"]
    if not EXIT_CODE_MIN <= code <= EXIT_CODE_MAX:
        code = 1  # as Python's own exit for a code it cannot use
    return {"exit_code": code, "text": clip_text(reply.get("text"), limit), "error": error}


def _checked_display(frame, nonce):
    """``(is_display, bundle)`` for a frame: a display bundle of *this* cell as
    ``{"data": {mime: value}, "is_main_result": bool}``, or None for one that a thread of an
    earlier cell showed after its cell ended (dropped, like output nobody waits for)."""
    if not isinstance(frame, dict) or "display" not in frame:
        return False, None
    if frame.get("nonce") != nonce:
        return True, None
    bundle = frame["display"]
    if not (
        isinstance(bundle, dict)
        and isinstance(bundle.get("data"), dict)
        and isinstance(bundle.get("is_main_result"), bool)
        and all(isinstance(mime, str) for mime in bundle["data"])
    ):
        raise ValueError("bad display bundle")
    # A value nested past the bound is left out here, as the host would: one deeper than the
    # host's parser takes made the whole answer unreadable there, and the guest restarted
    # (a red team's find).
    data = {mime: value for mime, value in bundle["data"].items() if nests_within(value)}
    return True, {"data": data, "is_main_result": bundle["is_main_result"]}


class Kernel:
    """The supervisor's handle on the kernel process; restarts it when it dies."""

    def __init__(self, env, program):
        self.env = env
        # The ``python -c`` program that starts a kernel: a launcher of the supervisor's
        # modules, which reads ``--kernel CTL_IN CTL_OUT`` from the arguments after it.
        self.program = program
        self.proc = None
        self.channel = None
        self.lock = threads.Lock()
        self.ever_started = False
        self.loss_reported = False
        self.gated = False

    def fork_first(self):
        """Start the first kernel by forking this supervisor, which must still be
        single-threaded: it then costs a fork and kernel.py's imports, not an interpreter's
        start (~20-40 ms of CPU under the sandbox's quota). Later kernels, after a crash or
        a memory kill, are fresh interpreters (``ensure``). False where the fork could not
        reproduce what a fresh interpreter would see (``forkable``)."""
        if self.proc is not None or not forkable(self.env):
            return False
        channel = KernelChannel()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        cwd = WORKSPACE if os.path.isdir(WORKSPACE) else "/"
        # Every object so far moves to the collector's permanent generation, in this
        # supervisor and in the kernel: a collection there writes into each tracked object's
        # header, and after the fork each such write copies a shared page.
        gc.freeze()
        with CHILDREN_LOCK:  # the reaper must never take the kernel's exit status
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    os.setsid()  # first: until then, killing its group would miss it
                    # Detached: the sockets' objects, if ever freed here, must not close
                    # descriptors whose numbers the kernel's own files have taken since.
                    ctl = channel.peer.detach()
                    channel.sock.detach()
                    import kernel

                    kernel.forked_main(ctl, out_w, err_w, self.env, cwd)
                    status = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(status)
            CHILDREN.add(pid)
        os.close(out_w)
        os.close(err_w)
        channel.started(pid)
        self.channel = channel
        self.gated = True  # it waits for open_gate() before anything of the sandbox's runs
        self.proc = Forked(pid, out_r, err_r)
        set_oom_preferred(pid)
        self.ever_started = True
        self.loss_reported = False
        return True

    def ensure(self):
        """Start a kernel unless one is alive; True if one was lost since the last report.

        A stopped kernel is not alive: whoever stopped it may be answering in its place."""
        if self.alive():
            return False
        self.stop()
        import subprocess  # a restart's cost (or a start that could not fork)

        channel = KernelChannel()
        ctl = channel.peer_fd()
        try:
            # -s: no user site directory, whose usercustomize.py or .pth files earlier code
            # could have planted in HOME=/workspace to run inside every fresh interpreter.
            self.proc = spawn(
                [PYTHON, "-s", "-u", "-c", self.program, "--kernel", str(ctl), str(ctl)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(ctl,),
                cwd=WORKSPACE if os.path.isdir(WORKSPACE) else "/",
                env=self.env,
                start_new_session=True,
            )
        except BaseException:
            channel.close()
            raise
        channel.started(self.proc.pid)
        self.channel = channel
        set_oom_preferred(self.proc.pid)
        restarted = self.ever_started and not self.loss_reported
        self.ever_started = True
        self.loss_reported = False
        return restarted

    def open_gate(self):
        """Let the forked first kernel go on past its gate (see ``kernel.forked_main``): the
        supervisor holds the host's key now. One byte, before any frame on the channel."""
        if self.gated and self.channel is not None:
            self.gated = False
            try:
                self.channel.sock.sendall(b"G")
            except OSError:
                pass  # it died: the next cell starts a fresh one

    def alive(self):
        """Running, and not already doomed: a SIGKILL sent a moment ago may still be pending
        (death is asynchronous), and must count as dead for whoever asks right after."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with open("/proc/%d/status" % self.proc.pid) as f:
                for line in f:
                    key, _, value = line.partition(":")
                    # Stopped (T) or traced (t) counts as dead too: a stopped kernel cannot
                    # answer, so anything that does is not the kernel.
                    if key == "State" and value.split()[0] in ("Z", "X", "T", "t"):
                        return False
                    if key in ("SigPnd", "ShdPnd") and int(value, 16) & (1 << (signal.SIGKILL - 1)):
                        return False
        except (OSError, ValueError):
            return False
        return True

    def stop(self):
        # Taken once: the rewarm thread may set or clear them meanwhile (the supervisor's
        # last stop runs beside it, without the lock), and a second look could find None.
        proc, self.proc = self.proc, None
        channel, self.channel = self.channel, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                # A kernel forked a moment ago may not lead its group yet: end it by pid.
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            proc.wait()
            forget(proc)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if channel is not None:
            channel.close()


class Cells:
    """The ``exec_code`` handler: one cell at a time in the one kernel."""

    def __init__(self, writer, calls, kernel):
        self.writer = writer
        self.calls = calls
        self.kernel = kernel

    def exec_code(self, request):
        call_id = request["id"]
        call = self.calls.start(call_id)
        try:
            with threads.Turn(self._event_sender(call_id), self.kernel.lock):
                state_lost = self.kernel.ensure()
                # The timeout counts from when the cell can run, not while it waits its turn.
                return self._run_cell(request, call, time.monotonic(), state_lost)
        finally:
            self.calls.end(call_id)

    def _run_cell(self, request, call, started, state_lost):
        kernel = self.kernel
        proc = kernel.proc
        deadline = started + float(request.get("timeout_s", 30))
        reason = []
        sinks = call_sinks(request, self.writer, lambda: reason.append("output_limit"), call)
        pump = Pump({proc.stdout.fileno(): sinks[0], proc.stderr.fileno(): sinks[1]})
        nonce = os.urandom(16).hex()
        channel = kernel.channel
        channel.send(
            {
                "code": request["code"],
                "text_limit": request.get("output_limit", 1 << 20),
                "nonce": nonce,
            }
        )
        reply = None
        interrupt_at = None
        # The kernel keeps its bundles within the cap, but cell code runs in the kernel's
        # process and can write to its socket: the cap is kept here too, measured as the host
        # will hold them (``wire.result_cost``), and so is the count (``wire.MAX_RESULTS``).
        results = Results(int(request.get("output_limit", 1 << 20)))
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
            if pump.poll(wait_s, extra=channel.fileno()):
                try:
                    reply = self._receive(channel, nonce, request, results)
                except (EOFError, ValueError, RecursionError):
                    # Dead, or an out-of-step reply, or a frame the cell wrote itself nested
                    # past the parser's depth (a 502 before): start afresh.
                    reply = None
                    break
                if reply is not None:
                    break
            if proc.poll() is not None:
                break
        pump.drain_now()
        if interrupt_at is not None:
            # The cell is over, but processes it started may still run: end them.
            kill_group_except(proc.pid, proc.pid)
        result = {
            "kill_reason": reason[0] if reason else None,
            "state_lost": state_lost,
            "results": results.kept,
            "results_truncated": results.dropped > 0,
        }
        if reply is None:
            # The kernel died or would not stop: its state is gone, start a fresh one.
            kernel.stop()
            returncode = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            result["exit_code"] = signal_exit_code(returncode)
            result["state_lost"] = True
            # Said here: the next cell must not say it again, whether the background start
            # below or that cell's own start makes the next kernel.
            kernel.loss_reported = True
            result["signal"] = -returncode if returncode < 0 else None
            if not reason and returncode < 0:
                # SIGXCPU too: no CPU-time limit is set, so it is a signal any process
                # could send, not a limit hit (a red team forged "cpu" with it, 2026-12-06).
                result["kill_reason"] = "killed"
            # A cell's os._exit(3) ends the kernel with a status, not a signal: say which.
            how = (
                "was killed (signal %s)" % -returncode
                if returncode < 0
                else "exited (status %s)" % returncode
            )
            result["error"] = {
                "type": "KernelDied" if not reason else "Interrupted",
                "message": "the interpreter %s; its variables and imports are lost" % how,
                "traceback": "",
            }
            result["text"] = None
            threads.start(self.rewarm)
        else:
            result.update(_clipped(reply, request))
        finish_streams(result, sinks, started)
        return result

    def _receive(self, channel, nonce, request, results):
        """Take every whole frame waiting: display bundles join ``results`` (and stream when
        asked); return the cell's reply once it came, else None.

        Raises:
            EOFError, ValueError: the kernel is gone, or sent what no kernel sends.
        """
        while True:
            frame = channel.receive()
            if frame is None:
                return None  # part of a frame, or bytes from another process
            is_display, bundle = _checked_display(frame, nonce)
            if not is_display:
                return _checked_reply(frame, nonce)
            if bundle is None:
                continue
            if frame["display"].get("cut") is True:
                results.dropped += 1  # the kernel kept its text only, or none of it
            if not results.add(bundle):
                continue
            if request.get("stream"):
                # Charged to the sandbox's stream budget as stdout is: a cell of display(0)
                # calls sent ~31,500 frames a second, each parsed on the host's one event loop
                # (red team, 2026-12-06). One the budget cannot pay is left out of the stream,
                # never out of the result.
                body = encode_body({"id": request["id"], "event": Event.DISPLAY, **bundle})
                if STREAMED.spend(len(body) + FRAME_COST_BYTES):
                    self.writer.send_body(body)

    def _event_sender(self, call_id):
        return lambda event: self.writer.send({"id": call_id, "event": event})

    def rewarm(self):
        with self.kernel.lock:
            try:
                self.kernel.ensure()
            except OSError:
                pass
