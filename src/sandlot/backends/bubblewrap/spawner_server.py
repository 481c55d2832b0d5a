"""The spawner: a small root process that starts each sandbox's bwrap for the manager.

Run by the host's ``spawner.py`` as ``python -I -S spawner_server.py MANAGER_PID FD``
(standard library only: the manager imports it for its constants alone). Without it, every
create ran ``sh`` (into the sandbox's cgroup), then ``nsenter`` (into the launch mount
namespace and the sandbox's network namespace, down to its uid), then bwrap, a subprocess of
the manager's whose asyncio machinery (a watcher thread, three pipe transports) ran on the
manager's busy event loop. Here the same steps are a fork of this small, single-threaded
process and a few system calls before the exec, off the manager's process. (The machine's
CPU is about the same: a fork of a Python process costs about what the two small execs did;
the manager, one process for every sandbox, spends ~2 ms less a create: BENCHMARKS.md.)

The protocol is the template's (``template.py`` on both sides): one SOCK_SEQPACKET socket whose
fd the argv names. ``{"ready": true}`` comes first. A request ``{"id", "argv", "env",
"cgroup_files", "ns", "uid", "gid", "targets"}`` carries the fds stdin, stdout, stderr, one per
name in ``ns`` ("mnt", "net"), then one per entry of ``targets`` (the fd number bwrap's argv
gives it). The child, in this order: takes a death signal tied to this process (and ends if
it is gone already), writes "0" to each of ``cgroup_files`` (the sandbox's cgroup, while still
root and alone), enters each namespace, drops to ``uid``/``gid`` with no supplementary
groups, takes the death signal again (the uid change clears it), puts its fds in place (every
other fd is close-on-exec) and execs ``argv`` with ``env``: a manager killed while its
children are between fork and exec leaves none of them to exec bwrap (a red team's find: a
bwrap started then lost its info fd's reader and died of SIGPIPE, its own child left blocked
in the sandbox's cgroup for good). A failed step ends it with status 125 and the reason on its
stderr. The answer is ``{"id", "pid"}`` with a pidfd of the child (or ``{"id", "error"}``),
and ``{"exit": pid, "status": code}`` once it has ended. The socket's EOF (the manager gone)
kills every child not yet reaped and ends this process; bwrap's ``--die-with-parent`` ends
what they started.
"""

from __future__ import annotations

import array
import contextlib
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
# An argv of a few hundred arguments; the manager refuses a longer request before sending it
# (a longer one arrives cut short, and its id cannot be read to answer it).
MAX_MESSAGE = 65536
MAX_TARGET_FD = 64
FAILED = 125
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> NoReturn:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def _die_with(parent: int) -> None:
    """SIGKILL when ``parent`` ends; end now if it has already."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(FAILED)


def exec_child(request: dict[str, Any], fds: list[int], parent: int) -> NoReturn:
    """In the forked child: the steps in the module's docstring; never returns."""
    try:
        _die_with(parent)
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
        _die_with(parent)
        # Each fd moved above every target first, then down into its place: no move then
        # overwrites an fd still to be moved (and a low open-file limit still holds them).
        above = max([STDIO_FDS - 1, *(int(t) for t in request["targets"])]) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
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


def _check_whole(fds: list[int], flags: int) -> None:
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        raise ValueError(f"the request was cut short ({len(fds)} fds arrived)")


def _check(request: Any, fds: list[int]) -> None:
    """The request is whole: every fd it names arrived (a child that missed its cgroup's
    file would run outside it), and nothing else."""
    if not isinstance(request, dict) or not request.get("argv"):
        raise ValueError("the request names no argv")
    if any(name not in NAMESPACES for name in request["ns"]):
        raise ValueError(f"unknown namespaces {request['ns']!r}")
    if any(int(t) <= 2 or int(t) > MAX_TARGET_FD for t in request["targets"]):
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


def spawn(sock: socket.socket, request: dict[str, Any], fds: list[int], children: set[int]) -> None:
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        exec_child(request, fds, me)
    children.add(pid)
    pidfd = os.pidfd_open(pid)
    try:
        _send(sock, {"id": request["id"], "pid": pid}, [pidfd])
    finally:
        os.close(pidfd)


def report_exits(sock: socket.socket, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _kill(children: set[int]) -> None:
    """The manager is gone: nobody will let its children's sandboxes go on."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _send(sock, {"ready": True})
    children: set[int] = set()  # forked, not yet reaped
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
                report_exits(sock, children)
                continue
            try:
                data, fds, flags = _receive(sock)
            except ConnectionError:
                data, fds, flags = b"", [], 0
            if not data:
                _kill(children)
                return  # the manager is gone
            request = None
            try:
                _check_whole(fds, flags)  # a message cut short is not even read
                request = json.loads(data)
                _check(request, fds)
                spawn(sock, request, fds, children)
            except Exception as exc:  # one bad request never ends the spawner
                request_id = request.get("id") if isinstance(request, dict) else None
                _send(sock, {"id": request_id, "error": str(exc)})
            finally:
                for fd in fds:
                    os.close(fd)


def main() -> None:
    manager, sock_fd = int(sys.argv[1]), int(sys.argv[2])
    # Dies with the manager's thread that started it (its event loop's), as bwrap did with
    # the launchers before; the socket's EOF says the same a moment later. A manager gone
    # before the signal was set: the parent is someone else already (compared with the
    # manager's pid, not 1: a container's entrypoint manager is pid 1).
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != manager:
        return
    os.chdir("/")
    sock = socket.socket(fileno=sock_fd)
    os.set_inheritable(sock.fileno(), False)
    serve(sock)


if __name__ == "__main__":
    main()
