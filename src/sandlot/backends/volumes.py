"""Named volumes on the host: a tenant's ext4 image, mounted into one sandbox at a time.

A volume outlives its sandboxes, and each sandbox runs as a host uid of its own; so the files
on a volume are stored as one uid (:data:`~sandlot.backends.launch.SANDBOX_UID`, the uid a
sandbox has inside) and every attach is an *idmapped* mount that shows them as the attaching
sandbox's host uid. Nothing walks or chowns a volume's files: the host never follows a name
sandboxed code wrote there.

The mount is made detached (``fsopen``/``fsmount``). On bubblewrap it is attached only in the
sandbox's mount namespace and never appears on a host path, so no teardown of a sandbox's
directory can reach into it; docker binds it from a directory of the sandbox's (``vol-<i>``),
unmounted by name before that directory is removed. The kernel unmounts the file system (and
frees its autoclear loop device) when its last mount goes. That loop device is the truth about
whether a volume is in use (:func:`attached`), whichever process attached it.

A sandbox's uid and gid are one number (``uids.py``; docker's ``user`` is ``uid:uid``).

Needs root, loop devices and Linux >= 5.12 with ext4 idmapped mounts; :func:`available`
says whether this host has them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from sandlot.backends import mountns
from sandlot.backends.base import AttachedVolume
from sandlot.backends.disk import NoLoopConfigure, attach_loop, loop_disks_available
from sandlot.backends.launch import SANDBOX_UID
from sandlot.errors import SandboxStartError
from sandlot.guest.template import MountAttr

SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
FSOPEN_CLOEXEC = 0x1
FSMOUNT_CLOEXEC = 0x1
FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOUNT_ATTR_IDMAP = 0x00100000
MOVE_MOUNT_T_EMPTY_PATH = 0x40

# What a mount point's path inside the sandbox may be made of, one name at a time.
_PATH_DIR = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
# How long a fresh user namespace may take to appear (unshare(1) starting).
_USERNS_WAIT_S = 2.0
# How long an attach waits for a volume's previous mount to go (its sandbox's namespace
# being released by the kernel after its last process died).
DETACH_WAIT_S = 3.0


def available() -> tuple[bool, str]:
    """Whether this host can attach volumes, and why not."""
    ok, why = loop_disks_available()
    if not ok:
        return False, why
    if not mountns.supported():
        return False, "needs the kernel's mount API (Linux >= 5.12) and CAP_SYS_ADMIN"
    return True, "ext4 images on loop devices, idmapped per sandbox"


def _syscall(number: int, *args: object) -> int:
    result = int(mountns._libc.syscall(number, *args))
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


# User namespaces kept for the uids that attached volumes lately: a uid's mapping never
# changes, and making one is a process (~1.5 ms of a volume's ~8 ms on a lifecycle).
USERNS_CACHED = 64
_userns: OrderedDict[int, int] = OrderedDict()
_userns_lock = threading.Lock()


def cached_userns(host_uid: int) -> int:
    """:func:`idmap_userns` for ``host_uid``, kept (the caller must not close it): at most
    :data:`USERNS_CACHED`, the least recently used closed first."""
    key = host_uid
    with _userns_lock:
        fd = _userns.get(key)
        if fd is not None:
            _userns.move_to_end(key)
            return fd
    fd = idmap_userns(host_uid)
    with _userns_lock:
        if key in _userns:  # another thread made one meanwhile: keep theirs
            os.close(fd)
            return _userns[key]
        _userns[key] = fd
        while len(_userns) > USERNS_CACHED:
            _, oldest = _userns.popitem(last=False)
            os.close(oldest)
    return fd


def idmap_userns(host_uid: int) -> int:
    """An fd of a new user namespace whose only uid and gid are :data:`SANDBOX_UID` as
    ``host_uid``: the idmapping of a volume's mount for that sandbox.

    A process in a multithreaded program cannot unshare a user namespace itself, so a
    short-lived ``unshare --user`` child makes one; its namespace outlives it in the fd.
    """
    child = subprocess.Popen(
        ["unshare", "--user", "--", "sleep", "10"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    # The child is ours and unreaped until the wait below (a poll that finds it ended
    # reaps it, and then we stop): its pid names no other process meanwhile.
    proc = f"/proc/{child.pid}"
    try:
        mine = Path("/proc/self/ns/user").stat().st_ino
        deadline = time.monotonic() + _USERNS_WAIT_S
        while Path(f"{proc}/ns/user").stat().st_ino == mine:
            if child.poll() is not None or time.monotonic() > deadline:
                raise SandboxStartError("could not make a user namespace for a volume")
            time.sleep(0.001)
        Path(proc, "uid_map").write_text(f"{SANDBOX_UID} {host_uid} 1\n")
        Path(proc, "setgroups").write_text("deny")
        Path(proc, "gid_map").write_text(f"{SANDBOX_UID} {host_uid} 1\n")
        return os.open(f"{proc}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:  # it died between our looks: no namespace to read
        raise SandboxStartError(f"could not make a user namespace for a volume: {exc}") from exc
    finally:
        child.kill()
        child.wait()


def sandbox_userns(pid: int, host_uid: int) -> int | None:
    """An fd of ``pid``'s user namespace where it maps :data:`SANDBOX_UID` to ``host_uid``
    and nothing else, for uids and gids alike (a bubblewrap sandbox's own, read from the
    host: what its files' idmapping must be), else None. Saves making one (a process)."""
    want = [str(SANDBOX_UID), str(host_uid), "1"]
    proc = f"/proc/{pid}"
    try:
        fd = os.open(f"{proc}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # Read after the open: the namespace held is the one whose maps are read (a pid
        # gone and reused in between names another process, whose maps differ: its uid is
        # not this sandbox's, which holds ``host_uid``).
        maps = [Path(f"{proc}/{name}").read_text().split() for name in ("uid_map", "gid_map")]
    except OSError:
        maps = []
    if maps != [want, want]:
        os.close(fd)
        return None
    return fd


def open_volume(image: Path, host_uid: int, *, read_only: bool, userns: int | None = None) -> int:
    """A detached mount of the ext4 ``image``, nosuid and nodev (and read-only if asked),
    idmapped so that its files are ``host_uid``'s (by ``userns``, a user namespace mapping
    SANDBOX_UID to it, or one made or kept for it): an fd for :func:`attach_beneath`, which
    the caller closes (blocking).

    Raises:
        SandboxStartError: the image could not be opened, no loop device could be had, or
            the image would not mount (a volume whose file system is damaged).
    """
    try:
        return _open_volume(image, host_uid, read_only=read_only, userns=userns)
    except NoLoopConfigure as exc:
        raise SandboxStartError("volumes need LOOP_CONFIGURE (Linux >= 5.8)") from exc
    except OSError as exc:
        if read_only and exc.errno == errno.EROFS:
            # ext4 replays a journal only where it may write (a host crash mid-write left
            # one to replay): a read-only attach cannot.
            raise SandboxStartError(
                f"the volume {image.parent.name} was not cleanly detached and its journal "
                "needs replaying: attach it once read-write, then read-only"
            ) from exc
        raise SandboxStartError(f"could not mount the volume {image.parent.name}: {exc}") from exc


def _open_volume(image: Path, host_uid: int, *, read_only: bool, userns: int | None) -> int:
    flags = os.O_RDONLY if read_only else os.O_RDWR
    image_fd = os.open(image, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        device, device_fd = attach_loop(image_fd, read_only=read_only)
    finally:
        os.close(image_fd)
    try:
        fs = _syscall(SYS_FSOPEN, b"ext4", FSOPEN_CLOEXEC)
        try:
            _syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source", device.encode(), 0)
            if read_only:
                _syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_FLAG, b"ro", None, 0)
            _syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
            attrs = mountns.MOUNT_ATTR_NOSUID | mountns.MOUNT_ATTR_NODEV
            attrs |= mountns.MOUNT_ATTR_RDONLY if read_only else 0
            mount = _syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, attrs)
        finally:
            os.close(fs)
        try:
            idmap = userns if userns is not None else cached_userns(host_uid)
            attr = MountAttr(MOUNT_ATTR_IDMAP, 0, mountns.MS_PRIVATE, idmap)
            _syscall(
                mountns.SYS_MOUNT_SETATTR,
                mount,
                b"",
                mountns.AT_EMPTY_PATH,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            )
        except BaseException:
            os.close(mount)
            raise
        return mount
    finally:
        os.close(device_fd)  # autoclear: the device goes with the file system's last mount


def open_all(
    volumes: Sequence[AttachedVolume],
    host_uid: int,
    *,
    sandbox_pid: int | None = None,
    first: bool = False,
) -> list[tuple[int, str]]:
    """Each volume opened (:func:`open_volume`) for the sandbox of ``host_uid``, once its
    previous mounts have gone (a restarted guest's old namespace may still be ending: two
    mounts of one image through two loop devices would corrupt it): ``(fd, relative mount
    path)`` pairs for :func:`attach_all`, closed by the caller (``mountns.close_all``).
    ``sandbox_pid``: a process in the sandbox's user namespace, whose mapping serves
    (:func:`sandbox_userns`). ``first``: the sandbox's first start, just after its lease
    found the volumes free under their locks (no look again: ~1 ms a volume)."""
    if not volumes:
        return []
    userns = sandbox_userns(sandbox_pid, host_uid) if sandbox_pid is not None else None
    opened: list[tuple[int, str]] = []
    try:
        opened.extend(
            (_open_alone(v, host_uid, userns, first=first), v.relative_path) for v in volumes
        )
    except BaseException:
        for fd, _ in opened:
            os.close(fd)
        raise
    finally:
        if userns is not None:
            os.close(userns)
    return opened


def _open_alone(volume: AttachedVolume, host_uid: int, userns: int | None, *, first: bool) -> int:
    if not first and not wait_detached(volume.image, DETACH_WAIT_S, writers_only=volume.read_only):
        raise SandboxStartError(
            f"the volume {volume.image.parent.name} is still attached elsewhere"
        )
    return open_volume(volume.image, host_uid, read_only=volume.read_only, userns=userns)


def attach_all(opened: Sequence[tuple[int, str]], top: str, owner: int) -> None:
    """In the sandbox's mount namespace (``mountns.run_inside``): each opened volume at its
    path under ``top`` (the sandbox's /workspace, attached already)."""
    for fd, relative in opened:
        attach_beneath(fd, top, relative, owner)


def attach_beneath(mount_fd: int, top: str, relative: str, owner: int) -> None:
    """Attach the detached ``mount_fd`` at ``top``/``relative`` in this thread's mount
    namespace (:func:`open_beneath` makes the way)."""
    fd = open_beneath(top, relative, owner)
    try:
        _syscall(
            mountns.SYS_MOVE_MOUNT,
            mount_fd,
            b"",
            fd,
            b"",
            mountns.MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    finally:
        os.close(fd)


def open_beneath(top: str, relative: str, owner: int) -> int:
    """An O_PATH descriptor of the directory ``top``/``relative``, made where missing.

    Each name is opened relative to its parent's descriptor, never through a symlink:
    sandboxed code that left a symlink where a volume goes (a restarted guest reattaches into
    a workspace it wrote) cannot send the mount elsewhere; the link is replaced. Directories
    made are ``owner``'s (the sandbox's host uid), as the rest of its workspace.
    """
    fd = os.open(top, _PATH_DIR)
    try:
        for name in relative.split("/"):
            child = _child_dir(fd, name, owner)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _child_dir(fd: int, name: str, owner: int) -> int:
    try:
        # An O_PATH descriptor serves as the directory of an *at call.
        os.mkdir(name, mode=0o755, dir_fd=fd)
    except FileExistsError:
        pass
    else:  # the sandbox's, as its own directories are (``owner``: its host uid)
        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
    try:
        return os.open(name, _PATH_DIR, dir_fd=fd)
    except NotADirectoryError:
        # A symlink or a file the sandbox left where its volume goes: its own entry in its
        # own workspace, replaced by the mount point (unlink removes a link itself, never
        # what it names). None of its code runs meanwhile.
        os.unlink(name, dir_fd=fd)
        os.mkdir(name, mode=0o755, dir_fd=fd)
        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
        return os.open(name, _PATH_DIR, dir_fd=fd)


def attached(image: Path, *, writable_only: bool = False) -> bool:
    """Whether a loop device is backed by ``image`` (whoever attached it): a volume mounted
    in some sandbox, or one whose last sandbox is still ending. ``writable_only``: only a
    read-write device counts (read-only mounts of one image may be many at once)."""
    resolved = os.fsencode(os.path.realpath(image))
    return resolved in backing_files(writable_only=writable_only)


def backing_files(*, writable_only: bool = False) -> set[bytes]:
    """The files the host's loop devices are backed by, resolved: one look at each device
    (a sandbox's disk is one too), for every volume a listing asks about; ``writable_only``:
    those of read-write devices."""
    found: set[bytes] = set()
    try:
        devices = list(Path("/sys/block").glob("loop*"))
    except OSError:
        return found
    for device in devices:
        try:
            backing = (device / "loop/backing_file").read_bytes().rstrip(b"\n")
            if writable_only and (device / "ro").read_bytes().strip() == b"1":
                continue
        except OSError:
            continue
        found.add(backing.removesuffix(b" (deleted)"))
    return found


def wait_detached(image: Path, timeout_s: float, *, writers_only: bool = False) -> bool:
    """Wait up to ``timeout_s`` for ``image``'s loop devices to go (its last sandbox's
    namespace ending); whether they went. ``writers_only``: for a read-only attach, which
    may sit beside other read-only ones, but never beside a read-write one (two mounts of
    an ext4 where one writes would corrupt it)."""
    deadline = time.monotonic() + timeout_s
    while attached(image, writable_only=writers_only):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def mkfs_volume(image: Path, size_mb: int) -> None:
    """A new sparse image of ``size_mb``, formatted ext4 *with* a journal (a volume outlives
    the host's page cache, unlike a sandbox's scratch disk), its root directory the sandbox
    uid's and no lost+found (blocking)."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mb * 1024 * 1024)
    finally:
        os.close(fd)
    argv = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-m",
        "0",
        "-E",
        f"root_owner={SANDBOX_UID}:{SANDBOX_UID},lazy_itable_init=1,nodiscard",
        str(image),
    ]
    done = subprocess.run(argv, capture_output=True, check=False)
    if done.returncode != 0:
        raise OSError(errno.EIO, f"mkfs.ext4 failed: {done.stderr.decode(errors='replace')}")
    # lost+found is root's: seen through a sandbox's idmapping it is nobody's and in the way.
    subprocess.run(
        ["debugfs", "-w", "-R", "rmdir lost+found", str(image)], capture_output=True, check=False
    )
