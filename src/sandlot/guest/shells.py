"""Shell commands: the ``exec_shell`` and ``close_session`` handlers.

Standard library only, Python >= 3.9 (shipped into every sandbox). Each command runs in a
fresh bash; a named *session* carries its working directory and environment from one command
to the next (the wrapper saves both when bash exits).
"""

import _signal as signal  # the C core: `signal` imports enum (~2.5 ms of every start)
import os
import shutil
import stat
import subprocess
import tempfile
import time

import threads
from output import Pump, call_sinks, finish_streams
from procs import (
    forget,
    freeze_all_but,
    killpg,
    set_oom_preferred,
    settled_marks,
    signal_exit_code,
    spawn,
    stopped_marks,
    thread_marks,
)
from wire import GuestFault
from workspace import WORKSPACE

SHELL_STATE_DIR = os.environ.get("SANDLOT_SHELL_STATE", "/tmp/.sandlot_shells")

# The EXIT trap writes the command's cwd and env to two descriptors the guest opened on
# anonymous files (no name anywhere): written to names in /tmp, a process left from an
# earlier call could put a FIFO at the next one and block the trap, every command then
# "timeout" (a red team's find, 2026-12-06).
SHELL_WRAPPER = r"""
__agsb_cwd_fd=$1
__agsb_env_fd=$2
__agsb_cmd=$3
set --
__agsb_save() {
  __agsb_rc=$?
  pwd >&"$__agsb_cwd_fd" 2>/dev/null
  /usr/bin/env -0 >&"$__agsb_env_fd" 2>/dev/null
  exit $__agsb_rc
}
trap __agsb_save EXIT
eval "$__agsb_cmd"
"""


# The most of a command's saved cwd and environment the guest takes back; past it the file is
# refused whole and the session keeps its state (a path is at most 4 KiB; 1 MiB of
# environment is half of what an exec takes for its arguments and environment together).
STATE_CWD_LIMIT = 4096
STATE_ENV_LIMIT = 1 << 20


def _read_state(file, limit):
    """What the command's EXIT trap wrote to ``file`` (an anonymous file of the guest's), if
    at most ``limit`` bytes; else OSError, and the session keeps its state (the command
    inherits the descriptor: it may write anything to it)."""
    fd = file.fileno()
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise OSError("the saved state is over %d bytes" % limit)  # not cut: refused whole
    return b"".join(chunks)


def _safe_name(name):
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:64] or "default"


class Shells:
    """The shell handlers: named sessions, one command at a time in each."""

    def __init__(self, writer, calls, kernel, env):
        self.writer = writer
        self.calls = calls
        # Only watched: a command that kills the interpreter must say the cells' state is lost.
        self.kernel = kernel
        self.env = env  # a new session's environment
        self.sessions = {}
        self.sessions_lock = threads.Lock()
        # Held by a fresh command from before it clears the sandbox until it ends; every other
        # command takes it to start its bash, so none starts beside a fresh one.
        self.fresh_gate = threads.Lock()
        self._private_state_dir = None  # made if SHELL_STATE_DIR cannot be used (_state_dir)

    def _state_dir(self):
        """Where the state files are made: SHELL_STATE_DIR, or, where sandboxed code has put
        something else at its name (a file, a symlink, a directory it made unwritable), a
        private one of the guest's own: a file there made every command fail with
        file_exists (a red team's find, 2026-12-06)."""
        for candidate in (SHELL_STATE_DIR, self._private_state_dir):
            if candidate is None:
                continue
            try:
                os.makedirs(candidate, exist_ok=True)
                info = os.lstat(candidate)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and os.access(candidate, os.W_OK | os.X_OK):
                return candidate
        self._private_state_dir = tempfile.mkdtemp(prefix="sandlot-shells-")
        return self._private_state_dir

    def _event_sender(self, call_id):
        return lambda event: self.writer.send({"id": call_id, "event": event})

    def exec_shell(self, request):
        if request.get("fresh"):
            return self._exec_fresh(request)
        call_id = request["id"]
        kernel_alive = self.kernel.alive()
        name = str(request.get("session") or "default")
        with self.sessions_lock:
            session = self.sessions.setdefault(
                name, {"cwd": WORKSPACE, "env": dict(self.env), "lock": threads.Lock()}
            )
        call = self.calls.start(call_id, request)
        if request.get("background"):
            # A background command (a server, say) may run for hours: it starts from the
            # session's cwd and env but neither holds the session nor changes it.
            snapshot = {"cwd": session["cwd"], "env": dict(session["env"]), "lock": None}
            try:
                return self._run_shell(request, snapshot, name, call, time.monotonic())
            finally:
                self.calls.end(call_id)
        try:
            with threads.Turn(self._event_sender(call_id), session["lock"]):
                # The timeout counts from when the command can run, not while it queues.
                result = self._run_shell(request, session, name, call, time.monotonic())
            if kernel_alive and not self.kernel.alive():
                # The command killed the Python interpreter (kill -9 -1, say): say so now.
                self.kernel.loss_reported = True
                result["state_lost"] = True
            return result
        finally:
            self.calls.end(call_id)

    def _exec_fresh(self, request):
        """Run a command no process of an earlier call can touch, in a clean environment.

        Every process the guest and earlier calls started is killed first, except the Python
        kernel, which is stopped (it keeps its state, runs nothing) until the command ends;
        no cell and no other command runs meanwhile. A stop can be undone from inside (a
        timer the kernel armed can send it SIGCONT), so the kernel's threads are read before
        and after: if it ran at all meanwhile, it could have rewritten the command through
        /proc, and the call fails (GuestError) with the kernel ended, never a result. The
        command gets the sandbox's own environment and this call's ``env``, not a session's;
        /workspace as its working directory; and an empty HOME of its own, so no dotfile
        planted in /workspace is read.
        """
        call = self.calls.start(request["id"])
        try:
            with threads.Turn(self._event_sender(request["id"]), self.fresh_gate, self.kernel.lock):
                kernel = self.kernel.proc
                keep = kernel.pid if kernel is not None and kernel.poll() is None else None
                freeze_all_but(keep)
                marks = stopped_marks(keep) if keep is not None else None
                lost = keep is not None and marks is None
                if lost:
                    # A kernel that does not stop cannot be vouched for: it goes.
                    self.kernel.stop()
                    keep = None
                home = tempfile.mkdtemp(prefix="sandlot-home-")
                try:
                    env = dict(self.env, HOME=home)
                    session = {"cwd": WORKSPACE, "env": env, "lock": None}
                    result = self._run_shell(request, session, "fresh", call, time.monotonic())
                finally:
                    shutil.rmtree(home, ignore_errors=True)
                    if keep is not None:
                        self._resume_untouched(keep, marks)
                if lost:
                    self.kernel.loss_reported = True
                    result["state_lost"] = True
                return result
        finally:
            self.calls.end(request["id"])

    def _resume_untouched(self, pid, marks):
        """Let the stopped kernel go on if it ran nothing during the fresh command; else end
        it and fail the call: the command's result may be its forgery."""
        if settled_marks(pid) == marks:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
            return
        now = thread_marks(pid)
        self.kernel.stop()  # its loss is reported by the next cell (state_lost)
        if not any(m is not None and m[0] not in ("Z", "X") for m in now.values()):
            # Killed (out of memory, or by the command): whether it ran first cannot be told.
            raise GuestFault(
                "guest_error",
                "the Python kernel ended during this fresh command (killed), and whether it "
                "ran first cannot be told: the command's result is withheld; its state is "
                "lost; run the command again",
            )
        raise GuestFault(
            "guest_error",
            "the Python kernel, stopped during this fresh command, ran meanwhile (sandboxed "
            "code woke it): the command's result cannot be trusted and is withheld; the "
            "kernel was ended (its state is lost); run the command again",
        )

    def _run_shell(self, request, session, name, call, started):
        """Run one command of session ``name``; its cwd and env come back through two
        anonymous files (``_state_files``)."""
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
        state = self._state_files()
        try:
            return self._spawned(request, session, call, started, cwd, env, call_env, state)
        finally:
            for file in state:
                file.close()

    def _state_files(self):
        """Two anonymous files (O_TMPFILE where it works, else a name unlinked at once) in
        the state directory: the EXIT trap's cwd and env."""
        directory = self._state_dir()
        return [tempfile.TemporaryFile(dir=directory) for _ in range(2)]

    def _spawned(self, request, session, call, started, cwd, env, call_env, state):
        has_input = request.get("input") is not None
        keep_stdin = bool(request.get("stdin"))
        fds = [file.fileno() for file in state]
        argv = ["/bin/bash", "-c", SHELL_WRAPPER, "bash", str(fds[0]), str(fds[1])]
        argv.append(request["command"])
        options = dict(
            pass_fds=fds,
            stdin=subprocess.PIPE if (has_input or keep_stdin) else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        if request.get("fresh"):
            proc = spawn(argv, **options)  # the caller holds the gate
        else:
            # Behind a fresh command (it holds the gate for its whole run): a wait the host's
            # backstop must not count, as a session's queue.
            with threads.Turn(self._event_sender(request["id"]), self.fresh_gate):
                proc = spawn(argv, **options)
        set_oom_preferred(proc.pid)
        call.pid = proc.pid
        if proc.stdin is not None:
            call.stdin_fd = os.dup(proc.stdin.fileno())
            proc.stdin.close()
            if has_input:
                # From a thread: a big input and a chatty command would deadlock one thread.
                data = request["input"].encode("utf-8")
                threads.start(call.write_stdin, data, not keep_stdin)
        call.stdin_ready.set()
        deadline = started + float(request.get("timeout_s", 30))
        reason = []
        sinks = call_sinks(request, self.writer, lambda: reason.append("output_limit"), call)
        pump = Pump({proc.stdout.fileno(): sinks[0], proc.stderr.fileno(): sinks[1]})
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if not reason and call.cancelled:
                    reason.append("killed")
                if not reason and now >= deadline:
                    reason.append("timeout")
                if reason:
                    killpg(proc.pid)
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
            proc.stdout.close()
            proc.stderr.close()
            call.close_stdin_when_idle()
        returncode = proc.wait()
        forget(proc)
        self._update_session(session, state, call_env, keep=session["lock"] is not None)
        result = {
            "exit_code": signal_exit_code(returncode),
            "text": None,
            "error": None,
            "kill_reason": reason[0] if reason else None,
            "state_lost": False,
        }
        if returncode < 0 and not reason:
            # SIGXCPU too: no CPU-time limit is set, so it is a signal any process
            # could send, not a limit hit (a red team forged "cpu" with it, 2026-12-06).
            result["kill_reason"] = "killed"
        finish_streams(result, sinks, started)
        return result

    def _update_session(self, session, state, call_env, keep=True):
        try:
            if not keep:
                return  # a background command's state is its own
            cwd = _read_state(state[0], STATE_CWD_LIMIT).decode("utf-8", "replace")
            cwd = cwd.strip()
            if os.path.isdir(cwd):
                session["cwd"] = cwd
            raw = _read_state(state[1], STATE_ENV_LIMIT)
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

    def close_session(self, request):
        with self.sessions_lock:
            existed = self.sessions.pop(str(request.get("session")), None) is not None
        return {"closed": existed}
