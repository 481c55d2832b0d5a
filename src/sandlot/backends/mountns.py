"""Mounts the manager makes inside a sandbox's mount namespace, before any of its code runs.

bwrap makes every bind with a parse of the namespace's whole mount table (to re-apply its
flags to submounts), so its ~40 binds over ``/proc``'s host-wide entries cost ~9 ms of
CPU of its ~16 ms start, on every create (BENCHMARKS.md, issue 13). The kernel's mount API
makes the same read-only bind in three syscalls: the manager clones each mask from the host
(``open_tree``), makes the clone read-only (``mount_setattr``), enters the sandbox's mount
namespace from a short-lived thread and attaches it there (``move_mount``). The sandbox's
volume (/workspace, /tmp) is attached the same way, so that it can be made while bwrap starts,
and the devpts cap (:mod:`sandlot.backends.devpts`) runs in the same visit.

Needs CAP_SYS_ADMIN over the sandbox's user namespace (root's backends) and Linux >= 5.12
(``mount_setattr``); :func:`supported` says whether this host has both, and where it has
not, bwrap makes the binds itself as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from sandlot.guest.template import MountAttr

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
OPEN_TREE_CLONE = 0x1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MS_PRIVATE = 1 << 18
MS_BIND = 1 << 12
MS_REC = 1 << 14
MNT_DETACH = 2
# The same on every architecture (the syscalls after 424 share one table).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class Mask(NamedTuple):
    """A bind of ``source`` (a host path) over ``target`` (a path inside): read-only, unless
    cloned writable (:func:`clone_all`)."""

    source: str
    target: str


def clone_read_only(source: str) -> int:
    """A detached, read-only, nosuid, nodev, noexec bind of ``source``: an fd for
    :func:`attach`, to be closed by the caller."""
    sealed = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC
    return _clone(source, sealed, "read-only")


def clone_writable(source: str) -> int:
    """A detached, writable, nosuid, nodev bind of ``source`` (as bwrap's ``--bind`` makes
    one): an fd for :func:`attach`, to be closed by the caller."""
    return _clone(source, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, "nosuid")


def _clone(source: str, attr_set: int, what: str) -> int:
    # A symlink at ``source`` is cloned as itself, never followed: attached over a directory
    # it fails, where a followed one would mount whatever it names.
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_SYMLINK_NOFOLLOW
    fd = int(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(source), flags))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"open_tree({source})")
    # Private: a clone of a path on a shared mount (systemd's default for /) joins that
    # mount's peer group, so a mount made later on either side would reach the other
    # (bwrap's binds were receive-only slaves; a red team found the clones two-way peers).
    attr = MountAttr(attr_set, 0, MS_PRIVATE, 0)
    if (
        _libc.syscall(
            SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
        )
        < 0
    ):
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"mount_setattr({source}, {what})")
    return fd


def detach(target: str | bytes, *, missing_ok: bool = False) -> None:
    """Unmount ``target`` in this thread's mount namespace (lazily: its users keep it);
    with ``missing_ok``, nothing mounted there is no error."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if not (missing_ok and err in (errno.EINVAL, errno.ENOENT)):
            raise OSError(err, f"umount {os.fsdecode(target)}")


def attach(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` over ``target`` in this thread's mount namespace."""
    if (
        _libc.syscall(
            SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH
        )
        < 0
    ):
        raise OSError(ctypes.get_errno(), f"move_mount onto {target}")


_supported: bool | None = None
# What says "never here": no such syscall (old kernel), not allowed (no CAP_SYS_ADMIN, a
# seccomp filter), or a flag this kernel does not know. Anything else (EMFILE, ENOMEM) is
# asked again next time.
_FOR_GOOD = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP)


def supported() -> bool:
    """Whether this process can clone, seal and attach mounts (root, Linux >= 5.12)."""
    global _supported
    if _supported is None:
        try:
            os.close(clone_read_only("/"))
        except OSError as exc:
            if exc.errno not in _FOR_GOOD:
                return False  # bwrap makes the masks this once
            _supported = False
        else:
            _supported = True
    return _supported


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, from /proc (None if /proc names none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


def enter(fd: int, ns_path: str) -> None:
    """Move this thread (alone) into the mount namespace ``fd`` names (a pidfd, or an open
    namespace file), which ``ns_path`` is a path of; for a thread that ends after its work.

    Whatever runs next acts on the namespace entered: aimed at the manager's own (a pid
    still in our namespace), a devpts remount would cap the host's terminals and a mask
    would hide the host's /proc from itself. Refused before anything changes.
    """
    if Path(ns_path).stat().st_ino == Path("/proc/self/ns/mnt").stat().st_ino:
        raise OSError(errno.EINVAL, f"the mount namespace {ns_path} is the manager's own")
    if _libc.unshare(CLONE_FS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FS)")
    if _libc.setns(fd, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"setns into the mount namespace {ns_path}")


def run_inside(pid: int, work: Callable[[], None], *, parent: int | None = None) -> None:
    """Run ``work`` in ``pid``'s mount namespace (its root as ``/``); ``parent``, if given,
    must be ``pid``'s parent. Blocking (a thread's start and a few syscalls).

    The work runs in a thread of its own that ends with it: a thread that entered another
    mount namespace must never go back to a pool and run the manager's file work there.

    Raises:
        OSError: the pid is gone or not the one named, the namespace could not be entered,
            or ``work`` failed; anything else ``work`` raised, raised again here (a failure
            that ended the thread silently would let the sandbox start half-finished).
    """
    failure: list[BaseException] = []

    def visit() -> None:
        try:
            # Held by a pidfd from here on, so the pid cannot be reused under us; checked to
            # be the child of the launcher that named it (a pid that died and was reused
            # fails this).
            pidfd = os.pidfd_open(pid)
            try:
                if parent is not None and parent_of(pid) != parent:
                    raise OSError(errno.ESRCH, f"process {pid} is not the sandbox's first process")
                # A pidfd names the process, not its pid.
                enter(pidfd, f"/proc/{pid}/ns/mnt")
                work()
            finally:
                os.close(pidfd)
        except BaseException as exc:  # whatever failed, the caller must not go on as if done
            failure.append(exc)

    in_thread(visit, failure)


def in_thread(visit: Callable[[], None], failure: list[BaseException]) -> None:
    """Run ``visit`` in a thread of its own and wait; raise what it put in ``failure``."""
    thread = threading.Thread(target=visit, name="sandlot-mountns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def clone_all(masks: Sequence[Mask], *, writable: bool = False) -> list[tuple[int, str]]:
    """Each mask cloned from the host (in the manager's namespace, before entering the
    sandbox's), read-only unless ``writable``: ``(fd, target)`` pairs for
    :func:`attach_all`; close them with :func:`close_all`."""
    clone = clone_writable if writable else clone_read_only
    clones: list[tuple[int, str]] = []
    try:
        for mask in masks:
            clones.append((clone(mask.source), mask.target))
    except BaseException:
        close_all(clones)
        raise
    return clones


def attach_all(clones: Sequence[tuple[int, str]]) -> None:
    for fd, target in clones:
        attach(fd, target)


def close_all(clones: Sequence[tuple[int, str]]) -> None:
    for fd, _ in clones:
        os.close(fd)
