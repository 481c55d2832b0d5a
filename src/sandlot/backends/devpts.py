"""A bound on each sandbox's pseudo-terminals.

Every sandbox has a devpts instance of its own (no sandbox sees another's terminals), but
all instances draw on one host-wide count, ``kernel.pty.max`` (4096 on Debian, 1024 of it
kept for the host's own instance): code in one sandbox could open the ~3,000 left and make
every other sandbox's ``pty.create`` (and the host's ``ssh``/``script`` in other
containers) fail. devpts has a per-instance ``max``; neither bwrap nor docker sets it, so the
manager sets it itself: it enters the sandbox's mount namespace from a short-lived thread of
its own (:func:`sandlot.backends.mountns.run_inside`) and remounts the instance with
``max=N``, before the guest is given its key (so before any of the sandbox's code can
run). Needs CAP_SYS_ADMIN over the sandbox's user namespace: root's backends only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import select
import time
from collections.abc import Callable
from pathlib import Path

from sandlot.backends.mountns import run_inside
from sandlot.errors import SandboxStartError

MS_NOSUID = 0x2
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
# What bwrap gives its instance (``newinstance`` is implied: the instance exists already).
BWRAP_OPTIONS = "ptmxmode=0666,mode=620"
# What docker's runc gives a container's /dev/pts.
DOCKER_OPTIONS = "gid=5,ptmxmode=0666,mode=620"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _device_of(path: str) -> int | None:
    try:
        return Path(path).stat().st_dev
    except OSError:
        return None


def remounter(max_ptys: int, options: str) -> Callable[[], None]:
    """The remount, for :func:`sandlot.backends.mountns.run_inside`: run in the sandbox's
    mount namespace, it bounds the devpts instance at ``/dev/pts`` there."""
    # A remount changes the devpts *instance*, wherever else it is mounted: the host's own
    # must never be the one it reaches. Ours is read here, in the manager's namespace.
    ours = _device_of("/dev/pts")

    def remount() -> None:
        if _device_of("/dev/pts") in (ours, None):
            raise OSError(errno.EINVAL, "the sandbox has no devpts instance of its own")
        data = f"max={max_ptys},{options}".encode()
        flags = MS_REMOUNT | MS_NOSUID | MS_NOEXEC
        if _libc.mount(b"devpts", b"/dev/pts", b"devpts", flags, data) != 0:
            raise OSError(ctypes.get_errno(), "remount of /dev/pts")

    return remount


def cap_ptys(pid: int, max_ptys: int, options: str, *, parent: int | None = None) -> None:
    """Bound the devpts instance mounted at ``/dev/pts`` in ``pid``'s mount namespace to
    ``max_ptys`` terminals; ``parent``, if given, must be ``pid``'s parent. Blocking.

    Raises:
        SandboxStartError: the remount failed (the sandbox must not run unbounded).
    """
    try:
        run_inside(pid, remounter(max_ptys, options), parent=parent)
    except OSError as exc:
        raise SandboxStartError(
            f"could not bound the sandbox's terminals (devpts max={max_ptys}): {exc}"
        ) from exc


def read_child_pid(fd: int, timeout_s: float) -> int:
    """The sandbox's first pid (in the manager's pid namespace), from bwrap's ``--info-fd``
    JSON (``{"child-pid": N, ...}``). Blocking.

    Raises:
        SandboxStartError: bwrap said nothing usable within ``timeout_s`` (it failed first).
    """
    deadline = time.monotonic() + timeout_s
    data = b""
    # poll, not select: a manager with a few hundred sandboxes holds fds past select()'s
    # 1024 (FD_SETSIZE), and select() refused them ("filedescriptor out of range", at 203
    # live sandboxes in bench/scale.py).
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0 or not poller.poll(left_s * 1000):
            raise SandboxStartError("bubblewrap did not name the sandbox's first process in time")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise SandboxStartError("bubblewrap exited before it started the sandbox")
        data += chunk
        try:
            info = json.loads(data)
        except ValueError:
            continue  # not all of it yet
        pid = info.get("child-pid") if isinstance(info, dict) else None
        if not isinstance(pid, int) or pid <= 1:
            raise SandboxStartError(f"bubblewrap named no first process: {info!r}")
        return pid


def wait_for_exec(pid: int, launcher: str, timeout_s: float) -> None:
    """Wait until ``pid`` is no longer ``launcher`` (bwrap has finished the sandbox's
    mounts and exec'd the guest). Blocking, polls ``/proc/<pid>/status`` (its name).

    Raises:
        SandboxStartError: it did not exec within ``timeout_s``, or exited.
    """
    status = Path(f"/proc/{pid}/status")
    name = f"Name:\t{launcher}\n".encode()

    def execd() -> bool:
        data = _living(status)
        return not data.startswith(name)

    _poll(pid, execd, timeout_s)


# What /proc/<pid>/status says of a task with no capability left.
_NO_CAPS = (b"CapPrm:\t0000000000000000\n", b"CapEff:\t0000000000000000\n")


def wait_for_block(pid: int, timeout_s: float) -> None:
    """Wait until bwrap's child ``pid`` is at its ``--block-fd`` (its namespaces, mounts and
    nested user namespace made). Blocking, polls ``/proc/<pid>/status``: the child has every
    capability in its user namespaces from its clone on, and drops them all (bwrap's
    ``drop_privs``) only as its last step before it blocks.

    Raises:
        SandboxStartError: it did not get there within ``timeout_s``, or exited.
    """
    status = Path(f"/proc/{pid}/status")

    def dropped() -> bool:
        data = _living(status)
        return all(line in data for line in _NO_CAPS)

    _poll(pid, dropped, timeout_s)


def _living(status: Path) -> bytes:
    """A process's /proc status, read while it is alive.

    Raises:
        OSError: it is gone, or a zombie: bwrap's child, killed with its cgroup when a
            create fails or is cancelled, is left for the host's init to reap, which may be
            a while (or never: an init that does not reap), and the look went on until its
            deadline (15 s of a worker thread; 1-2 s of a create's unwind where it was
            awaited: BENCHMARKS.md, issue 13's fifteenth pass).
    """
    data = status.read_bytes()
    if b"\nState:\tZ" in data:
        raise ProcessLookupError(errno.ESRCH, "it has exited (a zombie)")
    return data


def _poll(pid: int, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay_s = 0.0005
    while True:
        try:
            if done():
                return
        except OSError as exc:
            raise SandboxStartError(f"the sandbox's first process {pid} exited: {exc}") from exc
        if time.monotonic() > deadline:
            raise SandboxStartError(f"the sandbox's first process {pid} did not start in time")
        time.sleep(delay_s)
        # bwrap's set-up takes a few ms: a short poll, so the sandbox's start waits little
        # past it (~20 µs of CPU a look).
        delay_s = min(delay_s * 2, 0.002)
