"""The spawner: a small root process that starts each sandbox's bwrap for the manager.

Run by the host's ``spawner.py`` as ``python -I -S spawner_server.py FD`` (standard library
only: it is not imported as part of sandlot). Without it, every create ran ``sh`` (into the
sandbox's cgroup), then ``nsenter`` (into the launch mount namespace and the sandbox's network
namespace, down to its uid), then bwrap: two execs of their own, ~4 ms of the machine's CPU a
create (perf, BENCHMARKS.md), and a subprocess of the manager's, whose asyncio machinery (a
watcher thread, three pipe transports) ran on the manager's busy event loop. Here the same
steps are a fork of this small, single-threaded process and a few system calls before the
exec, off the manager's process.

The protocol is the template's (``template.py`` on both sides): one SOCK_SEQPACKET socket whose
fd the argv names. ``{"ready": true}`` comes first. A request ``{"id", "argv", "env",
"cgroup_files", "ns", "uid", "gid", "targets"}`` carries the fds stdin, stdout, stderr, one per
name in ``ns`` ("mnt", "net"), then one per entry of ``targets`` (the fd number bwrap's argv
gives it). The child, in this order: writes "0" to each of ``cgroup_files`` (the sandbox's
cgroup, while still root and alone), enters each namespace, drops to ``uid``/``gid`` with no
supplementary groups, puts its fds in place (every other fd is close-on-exec) and execs
``argv`` with ``env``. A failed step ends it with status 125 and the reason on its stderr.
The answer is ``{"id", "pid"}`` with a pidfd of the child (or ``{"id", "error"}``), and
``{"exit": pid, "status": code}`` once it has ended. The socket's EOF (the manager gone) ends
this process; bwrap's ``--die-with-parent`` then ends the children.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
NAMESPACES = {"mnt": CLONE_NEWNS, "net": CLONE_NEWNET}
STDIO_FDS = 3
MAX_FDS = 16
MAX_MESSAGE = 65536  # an argv of a few hundred arguments
# Above every fd bwrap's argv names: each fd is moved up here first, then down into its place,
# so that no move overwrites another fd still to be moved.
HIGH_FD = 512
FAILED = 125
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> NoReturn:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def exec_child(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: the steps in the module's docstring; never returns."""
    try:
        os.dup2(fds[2], 2)  # from here on, every failure is told on the launcher's stderr
        for path in request["cgroup_files"]:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        names = request["ns"]
        for name, fd in zip(names, fds[STDIO_FDS : STDIO_FDS + len(names)], strict=True):
            if _libc.setns(fd, NAMESPACES[name]) != 0:
                _fail(f"setns into the {name} namespace")
        gid, uid = int(request["gid"]), int(request["uid"])
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in fds]
        for target, fd in enumerate(high[:STDIO_FDS]):
            os.dup2(fd, target)
        for target, fd in zip(request["targets"], high[STDIO_FDS + len(names) :], strict=True):
            os.dup2(fd, int(target))
        # As subprocess does: Python ignores SIGPIPE and SIGXFSZ, and an exec keeps what is
        # ignored.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        argv = [str(a) for a in request["argv"]]
        os.execve(  # noqa: S606 (the argv is bwrap's, made by the manager)
            argv[0], argv, {str(k): str(v) for k, v in request["env"].items()}
        )
    except BaseException as exc:
        try:
            os.write(2, f"sandlot spawner: {exc}\n".encode("utf-8", "replace"))
        finally:
            os._exit(FAILED)
    os._exit(FAILED)  # not reached: execve returns only by raising


def _check(request: Any, fds: list[int], flags: int) -> None:
    """The request is whole: every fd it names arrived (a child that missed its cgroup's
    file would run outside it), and nothing else."""
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        raise ValueError(f"the request was cut short ({len(fds)} fds arrived)")
    if not isinstance(request, dict) or not request.get("argv"):
        raise ValueError("the request names no argv")
    if any(name not in NAMESPACES for name in request["ns"]):
        raise ValueError(f"unknown namespaces {request['ns']!r}")
    if any(int(t) <= 2 or int(t) >= HIGH_FD for t in request["targets"]):
        raise ValueError(f"fd targets out of range: {request['targets']!r}")
    if int(request["uid"]) <= 0 or int(request["gid"]) <= 0:
        raise ValueError("a launcher never stays root")
    wanted = STDIO_FDS + len(request["ns"]) + len(request["targets"])
    if len(fds) != wanted:
        raise ValueError(f"the request carries {len(fds)} fds, not {wanted}")


def _receive(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """One message and its fds, close-on-exec (no child but the one they are for gets them)."""
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE, cmsg_space, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def spawn(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    pid = os.fork()
    if pid == 0:
        exec_child(request, fds)
    pidfd = os.pidfd_open(pid)
    try:
        _send(sock, {"id": request["id"], "pid": pid}, [pidfd])
    finally:
        os.close(pidfd)


def report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _send(sock, {"ready": True})
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for ready, _ in poller.poll():
            if ready == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                report_exits(sock)
                continue
            data, fds, flags = _receive(sock)
            if not data:
                return  # the manager is gone
            request = None
            try:
                request = json.loads(data)
                _check(request, fds, flags)
                spawn(sock, request, fds)
            except Exception as exc:  # one bad request never ends the spawner
                request_id = request.get("id") if isinstance(request, dict) else None
                _send(sock, {"id": request_id, "error": str(exc)})
            finally:
                for fd in fds:
                    os.close(fd)


def main() -> None:
    # Dies with the manager's thread that started it (its event loop's), as bwrap did with
    # the launchers before; the socket's EOF says the same a moment later.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir("/")
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(sock.fileno(), False)
    if os.getppid() == 1:
        return  # the manager died before the death signal was set
    serve(sock)


if __name__ == "__main__":
    main()
