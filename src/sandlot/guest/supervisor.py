"""sandlot guest agent: the one program that runs inside every sandbox.

Standard library only, Python >= 3.9, because it runs under whatever ``python3`` the sandbox
image has, never under the host's virtualenv. Its modules sit beside this file (the launcher
puts their directory first on ``sys.path``): ``ops`` names the protocol, ``wire`` frames it,
``calls``, ``cells``, ``shells`` and ``files`` handle the requests.

Protocol: frames on stdin/stdout, each a 4-byte big-endian length and a UTF-8 JSON object.
The host sends ``{"id": N, "op": ..., ...}``; the guest answers with any number of
``{"id": N, "event": "stdout"|"stderr", "data": str}`` (only when the request asked to
``stream``) and then exactly one ``{"id": N, "event": "result", "result": {...}}`` or
``{"id": N, "event": "error", "code": str, "message": str}``. Before anything else the guest
sends ``{"id": 0, "event": "ready", ...}``.

Processes: this supervisor; one Python *kernel* process that holds the interpreter state and
runs cells (``--kernel``, see ``kernel.py``); one short-lived bash per shell command. The
supervisor enforces each call's timeout and output caps, so a runaway cell never takes the
protocol down with it.
"""

import _signal as signal  # the C core: `signal` imports enum (~2.5 ms of every start)
import os
import sys

import threads
from calls import Calls
from cells import Cells, Kernel
from ops import PROTOCOL_VERSION, Event, Op
from procs import become_subreaper, count_tasks, harden, reap_orphans_forever, watch_children
from seal import KEY_BYTES, TO_GUEST, TO_HOST, NotAuthentic, Seal
from wire import FrameWriter, GuestFault, loads, read_frame
from workspace import WORKSPACE, os_error_code

# Started as a module import, not as a script, so a precompiled .pyc is used (a script run
# as __main__ is compiled afresh every time: ~7 ms for this file).
LAUNCHER = "import sys; sys.path.insert(0, %r); import supervisor; supervisor.main(sys.argv)"
# The kernel is started without -I (the user's PYTHONPATH is theirs), so its path begins with
# the working directory, /workspace: dropped until the guest's own imports are done, or a
# planted json.py there would run inside every fresh interpreter (kernel.py puts it back).
# It imports kernel.py alone, not this module: the supervisor's own imports (shells, files,
# calls, subprocess, tempfile, shutil) would cost every sandbox's kernel start ~15 ms of CPU
# under the CPU quota, for modules the kernel never uses.
KERNEL_LAUNCHER = (
    "import sys; sys.path[:] = [%r] + [p for p in sys.path if p]; "
    "import kernel; kernel.main(sys.argv)"
)
GUEST_DIR = os.path.dirname(os.path.abspath(__file__))
# Variables every process the guest starts gets, whatever the sandbox was started with: no
# Python user site directory (HOME is the workspace, so its usercustomize.py, sitecustomize.py
# and .pth files would be code planted by earlier calls running before every later script).
FORCED_ENV = {"PYTHONNOUSERSITE": "1"}


class Later:
    """A handler object built on its first use: shells (``subprocess``, ``tempfile``,
    ``shutil``) and files cost each supervisor's start ~10 ms of CPU under the sandbox's
    quota, and a program run in a fresh sandbox may never ask for either."""

    def __init__(self, build):
        self.build = build
        self.built = None
        self.lock = threads.Lock()

    def get(self):
        with self.lock:
            if self.built is None:
                self.built = self.build()
            return self.built

    def __getattr__(self, name):
        # The dispatch table names its handlers at start: each is looked up when called.
        def handler(request):
            return getattr(self.get(), name)(request)

        return handler


def _shells(writer, calls, kernel, env):
    from shells import Shells

    return Shells(writer, calls, kernel, env)


def _ptys(writer, calls, env):
    from ptys import Ptys

    return Ptys(writer, calls, env)


def _files():
    from files import Files

    return Files()


def user_env():
    """The caller's variables, as the backend passed them (``SANDLOT_USER_ENV``, JSON)."""
    try:
        given = loads(os.environ.get("SANDLOT_USER_ENV") or "{}")
    except ValueError:
        return {}
    if not isinstance(given, dict):
        return {}
    return {str(k): str(v) for k, v in given.items() if "=" not in str(k) and str(k)}


def base_env():
    """The environment of the kernel and of every new shell session."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": WORKSPACE,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "TERM": "dumb",
    }
    # What the sandbox was started with wins over defaults, and the caller's env over both.
    # The caller's env arrives as JSON and reaches only the processes we start: in our own
    # environment, LD_LIBRARY_PATH or LD_PRELOAD would load code the sandbox planted into
    # the next supervisor (see backends/launch.py).
    for key, value in os.environ.items():
        if not key.startswith("SANDLOT_"):
            env[key] = value
    env.update(user_env())
    # The PATH the sandbox gets holds only read-only directories (a test checks); one the
    # caller sets is theirs to choose, writable directories included.
    env.update(FORCED_ENV)
    return env


class Supervisor:
    """Runs each request's handler and sends its one result or error frame."""

    def __init__(self, writer):
        self.writer = writer
        env = base_env()
        self.kernel = Kernel(env, KERNEL_LAUNCHER % GUEST_DIR)
        self.calls = Calls()
        self.cells = Cells(writer, self.calls, self.kernel)
        self.shells = Later(lambda: _shells(writer, self.calls, self.kernel, env))
        self.files = Later(_files)
        self.ptys = Later(lambda: _ptys(writer, self.calls, env))
        # Every op but SHUTDOWN, which the read loop handles by ending.
        self.handlers = {
            Op.PING: self.ping,
            Op.CANCEL: self.calls.cancel,
            Op.STDIN: self.calls.stdin,
            Op.PID: self.calls.pid,
            Op.STREAM: self.calls.stream,
            Op.EXEC_CODE: self.cells.exec_code,
            Op.EXEC_SHELL: self.shells.exec_shell,
            Op.CLOSE_SESSION: self.shells.close_session,
            Op.PTY_OPEN: self.ptys.pty_open,
            Op.PTY_RESIZE: self.ptys.pty_resize,
            Op.FILE_READ: self.files.file_read,
            Op.FILE_WRITE: self.files.file_write,
            Op.FILE_LIST: self.files.file_list,
            Op.FILE_STAT: self.files.file_stat,
            Op.FILE_REMOVE: self.files.file_remove,
            Op.FILE_MKDIR: self.files.file_mkdir,
        }

    def handler(self, op):
        """The handler of ``op`` as a request spells it (a plain string, or anything JSON)."""
        return self.handlers.get(op) if isinstance(op, str) else None

    def handle(self, request):
        call_id = request.get("id")
        op = request.get("op")
        try:
            method = self.handler(op)
            if method is None:
                raise GuestFault("invalid_request", "unknown op %r" % (op,))
            result = method(request)
            if isinstance(result, dict) and "exit_code" in result:
                result["tasks"] = count_tasks()
            self.writer.send({"id": call_id, "event": Event.RESULT, "result": result})
        except GuestFault as fault:
            self.send_error(call_id, fault.code, fault.message)
        except OSError as exc:
            self.send_error(call_id, *os_error_code(exc))
        except Exception as exc:  # report, never die: the host decides what a failure means
            self.send_error(call_id, "guest_error", "%s: %s" % (type(exc).__name__, exc))

    def send_error(self, call_id, code, message):
        self.writer.send({"id": call_id, "event": Event.ERROR, "code": code, "message": message})

    def ping(self, request):
        return {"pong": True, "pid": os.getpid()}


def take_key(writer):
    """Read the host's first frame, the channel's key, and seal the writer with it; return
    the seal the host's frames must pass. Exits if the first frame is not a key."""
    try:
        hello = read_frame(0)
        key = bytes.fromhex(hello["key"]) if hello.get("op") == Op.HELLO else b""
    except (EOFError, ValueError, TypeError, KeyError, AttributeError):
        key = b""
    if len(key) != KEY_BYTES:
        sys.stderr.write("sandlot guest: the host's first frame is not the channel's key\n")
        sys.stderr.flush()
        os._exit(2)
    writer.seal = Seal(key, TO_HOST)
    return Seal(key, TO_GUEST)


def supervisor_main():
    harden()
    # As pid 1 no signal without a handler reaches us from inside the sandbox; Python's own
    # SIGINT handler would, and would end the supervisor with a KeyboardInterrupt.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    writer = FrameWriter(1)
    # Nothing may write to fd 1 but the protocol: point the Python-level stdout elsewhere.
    sys.stdout = sys.stderr
    supervisor = Supervisor(writer)
    try:
        os.makedirs(WORKSPACE, exist_ok=True)
    except OSError:
        pass
    # Before any thread starts: a fork copies only the thread that calls it, so a lock
    # another thread held would stay locked in the kernel for good.
    try:
        supervisor.kernel.fork_first()
    except OSError:
        pass  # the rewarm below starts a fresh interpreter instead
    # The key only after that fork: the kernel runs the sandbox's code and must never hold it.
    from_host = take_key(writer)
    # Again, now: bwrap started us in /workspace before the host attached the sandbox's volume
    # over it (bubblewrap/backend.py), and the volume is there before the key is sent.
    try:
        os.chdir(WORKSPACE)
    except OSError:
        pass
    supervisor.kernel.open_gate()
    if become_subreaper():
        threads.start(reap_orphans_forever, watch_children())
    threads.start(supervisor.cells.rewarm)
    writer.send(
        {
            "id": 0,
            "event": Event.READY,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "uid": os.getuid(),
        }
    )
    while True:
        try:
            request = read_frame(0, from_host)
        except EOFError:
            break
        except ValueError as exc:
            # Bytes the host did not send (code in the sandbox wrote into our input, or took
            # a frame out of it): nothing read from here on can be trusted. Say so, sealed.
            code = "guest_channel_broken" if isinstance(exc, NotAuthentic) else "guest_error"
            supervisor.send_error(0, code, "the guest's input from the host: %s" % exc)
            break
        if request.get("op") == Op.SHUTDOWN:
            break
        if request.get("op") == Op.STREAM:
            # Here, not in a thread: before the requests that follow it (a listener's input
            # whose output it wants streamed). It never blocks.
            supervisor.handle(request)
            continue
        try:
            threads.start(supervisor.handle, request)
        except RuntimeError:
            # The pids limit is exhausted (a fork bomb): say so instead of dying.
            supervisor.send_error(
                request.get("id"), "pids_exhausted", "the sandbox has no free process slots"
            )
    try:
        supervisor.kernel.stop()
    except Exception:  # the guest ends whatever the kernel's state; say why, then go
        import traceback  # here only: an import on every guest's start costs its time

        traceback.print_exc()
    # Out without the interpreter's finalization: a daemon thread (the kernel's rewarm, cut
    # short by the stop above) may still be printing to stderr, and finalizing while it holds
    # stderr's lock aborts the process (SIGABRT instead of exit 0). Frames are written with
    # os.write, so nothing is left buffered but stderr, flushed here.
    try:
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError):
        pass
    os._exit(0)


def main(argv):
    supervisor_main()


if __name__ == "__main__":
    main(sys.argv)
