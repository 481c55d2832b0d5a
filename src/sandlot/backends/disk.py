"""A hard size cap on a sandbox's writable workspace: an ext4 image on a loop device.

Alternatives measured worse here: a tmpfs cap (``--size``) charges the files to the sandbox's
*memory*, so a 256 MiB sandbox could not hold a 300 MiB file on a 1 GiB disk; polling the
directory size lets a fast writer fill the host disk between two polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import secrets
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

from sandlot._fs import remove_tree
from sandlot.errors import SandboxStartError


def loop_disks_available() -> tuple[bool, str]:
    """Whether this host can cap workspaces with loop-mounted images, and why not."""
    if os.geteuid() != 0:
        return False, "needs root to mount loop devices"
    if not Path("/dev/loop-control").exists():
        return False, "/dev/loop-control is missing (no loop driver in this kernel/container)"
    if shutil.which("mkfs.ext4") is None:
        return False, "mkfs.ext4 is missing (apt-get install e2fsprogs)"
    return True, "ext4 image on a loop device"


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxStartError(
            f"{argv[0]} failed ({proc.returncode}): {err.decode(errors='replace').strip()}"
        )


# Under the data directory: the empty images new disks are copied from.
DISK_TEMPLATES = "volume-templates"
# A sandbox's disk image, in its directory (core/instances.py counts what each has written).
DISK_IMAGE = "disk.img"
# No journal and lazy tables: a scratch disk that dies with the sandbox. No resize inode
# either: nothing grows a sandbox's disk, and its reserved blocks were most of an empty
# image (a 64 MB one holds 116 KiB without them, 376 with; 1 GB: 144, 656), all of it
# copied and then written to the host's disk on every create: LOOP_CONFIGURE fsyncs the
# backing file (seen on Linux 6.18; BENCHMARKS.md, issue 13's sixteenth pass).
MKFS_ARGV = (
    "mkfs.ext4",
    "-q",
    "-F",
    "-m",
    "0",
    "-O",
    "^has_journal,^resize_inode",
    "-E",
    "root_owner=0:0,lazy_itable_init=1,nodiscard",
)
# No cache flushes: each one the sandbox's file system sends (an fsync, the unmount's sync)
# makes the loop device fsync the image on the host's disk, writing out a file that is
# deleted with the sandbox (~3 ms of a kernel worker's I/O per lifecycle, measured by
# perf's sched_switch). Nothing on it outlives the host's page cache: a sandbox never
# survives a reboot.
MOUNT_DATA = "nobarrier"
# Of these options: a change to them makes new templates instead of reusing the old.
_TEMPLATE_TAG = hashlib.sha256("\0".join(MKFS_ARGV).encode()).hexdigest()[:12]


# Templates kept per manager: a tenant asking for many disk sizes must not make one file (and
# one mkfs) per size; past this many sizes, a disk is made by mkfs.ext4 as before.
MAX_TEMPLATES = 8


async def create_loop_disk(image: Path, mountpoint: Path, size_mb: int, templates: Path) -> None:
    """Make a sparse ext4 image of ``size_mb`` and mount it on ``mountpoint`` (root-owned).

    The image is a copy of an empty one made once per size (for up to :data:`MAX_TEMPLATES`
    sizes) in ``templates``, a root-only directory of the manager's: mkfs.ext4 is a process
    and ~3.5 ms of CPU, ~4-5 ms of wall, on every create; copying the template's few hundred
    KiB of metadata is ~0.2 ms. The image is root's alone: it holds every byte of the
    sandbox's files, whatever their modes.
    """
    template = await _template(templates, size_mb)
    if template is None:
        await _make_image(image, size_mb)
    if not await asyncio.to_thread(_copy_and_mount, template, image, mountpoint, size_mb):
        await _mount_by_mount8(image, mountpoint)


def _copy_and_mount(template: Path | None, image: Path, mountpoint: Path, size_mb: int) -> bool:
    """Copy ``template`` (if any: else ``image`` is made already) and mount the image on
    ``mountpoint``, in one thread's turn; False where only mount(8) can attach it."""
    if template is not None:
        _sparse_copy(template, image, size_mb * 1024 * 1024)
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        _loop_mount(image, mountpoint)
    except NoLoopConfigure:
        return False
    _drop_lost_found(mountpoint)
    return True


async def _mount_by_mount8(image: Path, mountpoint: Path) -> None:
    await _run("mount", "-o", f"loop,nosuid,nodev,{MOUNT_DATA}", str(image), str(mountpoint))
    _drop_lost_found(mountpoint)


def _drop_lost_found(mountpoint: Path) -> None:
    with contextlib.suppress(OSError):
        (mountpoint / "lost+found").rmdir()


async def _make_image(image: Path, size_mb: int) -> None:
    """A new sparse file ``image`` of ``size_mb``, formatted ext4 (root's alone: 0600)."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.truncate(size_mb * 1024 * 1024)
    await _run(*MKFS_ARGV, str(image))


async def _template(templates: Path, size_mb: int) -> Path | None:
    """The empty, never-mounted ext4 image of ``size_mb`` in ``templates``, made on first
    use; None once :data:`MAX_TEMPLATES` other sizes have theirs. Made under a temporary name
    and renamed into place, so concurrent creates of one size never copy a half-made one."""
    template = templates / f"ext4-{size_mb}mb-{_TEMPLATE_TAG}.img"
    if template.exists():
        return template
    templates.mkdir(mode=0o700, parents=True, exist_ok=True)
    current = []
    for image in templates.glob("ext4-*.img"):
        if image.name.endswith(f"-{_TEMPLATE_TAG}.img"):
            current.append(image)
        else:  # made with other mkfs options (an older sandlot): never copied again
            with contextlib.suppress(FileNotFoundError):
                image.unlink()
    if len(current) >= MAX_TEMPLATES:
        return None
    partial = templates / f".{template.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        await _make_image(partial, size_mb)
        partial.replace(template)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return template


# copy_file_range refused (a file system or kernel without it, across devices): copy by hand.
_NO_COPY_RANGE = (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_COPY_CHUNK_BYTES = 1 << 20


def _copy_range(src: int, dst: int, position: int, end: int) -> None:
    """Copy bytes ``[position, end)`` of ``src`` to the same offsets of ``dst``."""
    while position < end:
        try:
            copied = os.copy_file_range(src, dst, end - position, position, position)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            chunk = os.pread(src, min(_COPY_CHUNK_BYTES, end - position), position)
            copied = os.pwrite(dst, chunk, position) if chunk else 0
        if copied == 0:
            raise OSError(errno.EIO, "the template shrank while copied")
        position += copied


def _sparse_copy(source: Path, target: Path, size_bytes: int) -> None:
    """Copy ``source``'s data extents into a new file ``target`` of ``size_bytes``, holes
    left as holes (a file system without SEEK_DATA reports one extent: a full copy)."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while True:
                try:
                    data = os.lseek(src, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data after offset
                        break
                    raise
                hole = os.lseek(src, data, os.SEEK_HOLE)
                _copy_range(src, dst, data, hole)
                offset = hole
            os.ftruncate(dst, size_bytes)
        finally:
            os.close(dst)
    finally:
        os.close(src)


# mount(8) took ~27 ms of wall time and ~12 ms of CPU per sandbox here (a process, libmount
# reading the mount table, its own loop set-up); the same loop set-up and mount(2) done
# directly take ~5 ms. Same result: an autoclear loop device (freed by the unmount), mounted
# ext4 with nosuid,nodev.
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A  # Linux >= 5.8; mount(8) does the same where it is missing
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_AUTOCLEAR = 4
_LOOP_INFO64_BYTES = 232
_LO_FLAGS_OFFSET = 52  # of lo_flags in struct loop_info64
_MS_NOSUID, _MS_NODEV = 2, 4
_LOOP_BUSY_RETRIES = 64


class NoLoopConfigure(Exception):
    """This kernel has no LOOP_CONFIGURE: fall back to mount(8)."""


def _loop_config(image_fd: int, flags: int = 0) -> bytes:
    """struct loop_config: the backing fd, block size 0 (default), loop_info64, reserved."""
    info = bytearray(_LOOP_INFO64_BYTES)
    struct.pack_into("I", info, _LO_FLAGS_OFFSET, _LO_FLAGS_AUTOCLEAR | flags)
    return struct.pack("II", image_fd, 0) + bytes(info) + bytes(8 * 8)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, for mount(2) and umount2(2): loaded once, on first use."""
    return ctypes.CDLL(None, use_errno=True)


def _loop_mount(image: Path, mountpoint: Path) -> None:
    """Attach ``image`` to a free loop device and mount it on ``mountpoint`` (blocking)."""
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        device, device_fd = attach_loop(image_fd)
    finally:
        os.close(image_fd)
    try:
        flags = _MS_NOSUID | _MS_NODEV
        data = MOUNT_DATA.encode()
        if _libc().mount(device.encode(), str(mountpoint).encode(), b"ext4", flags, data):
            code = ctypes.get_errno()
            # Autoclear frees the device once the last fd closes, as it is unmounted.
            raise SandboxStartError(f"could not mount {device}: {os.strerror(code)}")
    finally:
        os.close(device_fd)


def attach_loop(image_fd: int, *, read_only: bool = False) -> tuple[str, int]:
    """A free loop device backed by ``image_fd``, autoclear (freed once nothing mounts or
    holds it open): its path and an open fd of it, for the caller to close once the file
    system on it is mounted (blocking).

    Raises:
        NoLoopConfigure: this kernel or /dev cannot do it without mount(8).
        SandboxStartError: no loop device could be had.
    """
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_LOOP_BUSY_RETRIES):
            device = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
            try:
                device_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:  # no device node (a /dev without devtmpfs): mount(8)
                raise NoLoopConfigure from exc
            try:
                fcntl.ioctl(
                    device_fd,
                    _LOOP_CONFIGURE,
                    _loop_config(image_fd, _LO_FLAGS_READ_ONLY if read_only else 0),
                )
            except OSError as exc:
                os.close(device_fd)
                if exc.errno == errno.EBUSY:  # another create took it first: next one
                    continue
                if exc.errno in (errno.EINVAL, errno.ENOTTY):
                    raise NoLoopConfigure from exc
                raise SandboxStartError(f"could not attach a loop device: {exc}") from exc
            return device, device_fd
        raise SandboxStartError("no free loop device (every one taken while trying)")
    finally:
        os.close(ctl)


def mounted_below(root: Path) -> list[Path]:
    """Mountpoints at or below ``root``, deepest first (the order to unmount them in)."""
    root_str = str(root.resolve())
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            point = line.split()[1].replace("\\040", " ")
            if point == root_str or point.startswith(root_str + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


async def unmount(mountpoint: Path) -> None:
    """Unmount (lazily if something still holds it); the loop device is freed with it."""
    await asyncio.to_thread(_unmount_now, mountpoint)


def _unmount_now(mountpoint: Path) -> None:
    # umount2(2) directly: umount(8) is a process (~2 ms of CPU) for the same system call.
    if not _umount2(mountpoint, _UMOUNT_NOFOLLOW):
        _umount2(mountpoint, _UMOUNT_NOFOLLOW | _MNT_DETACH)


_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8


def _umount2(mountpoint: Path, flags: int) -> bool:
    result: int = _libc().umount2(str(mountpoint).encode(), flags)
    return result == 0


def disk_paths(root: Path) -> tuple[Path, Path]:
    """A sandbox's ``/workspace`` and ``/tmp`` on the host, inside its directory ``root``."""
    volume = root / "volume"
    return volume / "workspace", volume / "tmp"


def _private_dir(path: Path, traverse_gid: int | None) -> None:
    """Make ``path`` root's, enterable by the group ``traverse_gid`` only (if any); not root
    (rootless), it stays the user's own, mode 0700: the sandbox runs as that same user."""
    if os.geteuid() != 0:
        path.chmod(0o700)
        return
    os.chown(path, 0, 0 if traverse_gid is None else traverse_gid)
    path.chmod(0o700 if traverse_gid is None else 0o710)


async def make_sandbox_disk(
    root: Path,
    size_mb: int,
    uid: int,
    *,
    capped: bool,
    templates: Path,
    traverse_gid: int | None = None,
) -> None:
    """Create ``root`` with one disk for /workspace and /tmp, both owned by ``uid``.

    One disk for both: files in /tmp count against the disk cap, not against memory (a tmpfs
    there let a sandbox fill its own memory and stay wedged). Without loop devices
    (``capped=False``) the directories are plain ones on the host's disk.

    No other host uid may enter ``root``: only the group ``traverse_gid`` may, for a backend
    whose sandbox side bind-mounts the volume itself (bwrap runs as the sandbox's uid); a
    backend that mounts as root (docker) passes None. ``templates``: where the empty disk
    images are kept (:func:`create_loop_disk`).
    """
    template = await _template(templates, size_mb) if capped else None
    if capped and template is None:  # past MAX_TEMPLATES sizes: mkfs.ext4, a process
        _disk_root(root, traverse_gid)
        await create_loop_disk(root / DISK_IMAGE, disk_paths(root)[0].parent, size_mb, templates)
        _disk_dirs(root, uid, traverse_gid)
        return
    # The usual create: every step in one thread's turn (a turn costs the event loop a wakeup
    # and a future's callbacks; the steps are a dozen system calls).
    if not await asyncio.to_thread(_make_disk_now, root, size_mb, uid, template, traverse_gid):
        await _mount_by_mount8(root / DISK_IMAGE, disk_paths(root)[0].parent)
        _disk_dirs(root, uid, traverse_gid)


def _make_disk_now(
    root: Path, size_mb: int, uid: int, template: Path | None, traverse_gid: int | None
) -> bool:
    """:func:`make_sandbox_disk` with the disk copied from ``template`` (None: no disk); False
    where the disk is copied but only mount(8) can attach it (the rest is then left to do)."""
    _disk_root(root, traverse_gid)
    volume = disk_paths(root)[0].parent
    if template is None:
        volume.mkdir(mode=0o700)
    elif not _copy_and_mount(template, root / DISK_IMAGE, volume, size_mb):
        return False
    _disk_dirs(root, uid, traverse_gid)
    return True


def _disk_root(root: Path, traverse_gid: int | None) -> None:
    root.mkdir(mode=0o700)
    _private_dir(root, traverse_gid)


def _disk_dirs(root: Path, uid: int, traverse_gid: int | None) -> None:
    """The volume's own directory private, /workspace and /tmp in it ``uid``'s."""
    workspace, tmp = disk_paths(root)
    _private_dir(workspace.parent, traverse_gid)
    for inside in (workspace, tmp):
        inside.mkdir(mode=0o700)
        if uid != os.geteuid():  # rootless, the sandbox's uid is ours: nothing to give away
            os.chown(inside, uid, uid)
    # For people looking on the host: <sandbox dir>/workspace.
    (root / "workspace").symlink_to("volume/workspace")


_PATH_DIR = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


def _open_up(root: Path) -> None:
    """Give the owner back write and search on every directory below ``root``.

    Rootless, the sandbox's files are the user's own, and sandboxed code may leave a directory
    mode 0 or 0500, which the owner (unlike root) cannot empty. The walk goes by descriptors
    only, one name at a time relative to its parent's: a path string re-resolved later could
    meet a parent that sandboxed code (still dying) swapped for a symlink into the user's
    home, whose directories would then be changed. ``O_NOFOLLOW | O_DIRECTORY`` refuses a
    symlink at every step.
    """
    with contextlib.suppress(OSError):
        _open_up_from(os.open(root, _PATH_DIR))


def _open_up_from(top: int) -> None:
    # Depth first, one open listing per level: descriptors grow with depth, not width.
    levels: list[tuple[int, Iterator[os.DirEntry[str]]]] = []
    pending: int | None = top
    try:
        while True:
            if pending is not None:
                level = _chmod_and_list(pending)
                if level is not None:
                    levels.append(level)
                pending = None
            if not levels:
                return
            listing_fd, entries = levels[-1]
            entry = next(entries, None)
            if entry is None:
                _close_level(levels.pop())
            elif entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):  # gone, or no longer a directory
                    pending = os.open(entry.name, _PATH_DIR, dir_fd=listing_fd)
    finally:
        for level in levels:
            _close_level(level)


def _chmod_and_list(path_fd: int) -> tuple[int, Iterator[os.DirEntry[str]]] | None:
    """Make the directory of ``path_fd`` (an O_PATH fd, closed here) the owner's to change
    and list, and return a listing of it; None if it cannot be."""
    # fchmod cannot take an O_PATH fd; /proc/self/fd/N names that very directory, and
    # reopening it there reaches the same one, whatever its path has become.
    proc_path = f"/proc/self/fd/{path_fd}"
    try:
        Path(proc_path).chmod(0o700)
        listing_fd = os.open(proc_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(path_fd)
    try:
        return listing_fd, os.scandir(listing_fd)
    except OSError:
        os.close(listing_fd)
        return None


def _close_level(level: tuple[int, Iterator[os.DirEntry[str]]]) -> None:
    listing_fd, entries = level
    close = getattr(entries, "close", None)
    if close is not None:
        close()
    os.close(listing_fd)


def _remove_tree(root: Path) -> None:
    # By descriptors, no symlink followed, as deep as sandboxed code made it (_fs.py).
    if not remove_tree(root) and os.geteuid() != 0:
        _open_up(root)
        remove_tree(root)


async def remove_sandbox_disk(root: Path) -> None:
    """Unmount everything below ``root`` and delete it (idempotent)."""
    await asyncio.to_thread(remove_sandbox_disk_now, root)


def remove_sandbox_disk_now(root: Path) -> None:
    """:func:`remove_sandbox_disk`, blocking: for a caller already off the event loop."""
    # The one mount a sandbox's directory holds is its volume's: it is unmounted by name,
    # without a read of the mount table, which grows with every live sandbox (3.7 ms of the
    # event loop a destroy with 1,000 live). Nothing else is mounted there by sandlot: only
    # when someone else's mount is found on ``root`` or an entry of it, or ``root`` survives
    # (a deeper one: rmdir's EBUSY), is the table read.
    if _unmount_disk_and_remove(root):
        return
    for mountpoint in mounted_below(root):
        _unmount_now(mountpoint)
    _remove_tree(root)


def _unmount_disk_and_remove(root: Path) -> bool:
    """Unmount the volume of ``root`` if it is mounted (lazily if busy), then delete
    ``root`` unless something else is mounted on it or on an entry of it; whether it is
    gone."""
    volume = disk_paths(root)[0].parent
    if not _umount2(volume, _UMOUNT_NOFOLLOW) and ctypes.get_errno() == errno.EBUSY:
        _umount2(volume, _UMOUNT_NOFOLLOW | _MNT_DETACH)
    # Any other error says nothing is mounted there: EINVAL (not a mount point), ENOENT,
    # EPERM (not root: nothing of ours was ever mounted).
    # rmtree crosses mount points: a mount someone else made on the directory or one of its
    # few entries (an operator's bind, to look inside) is left to the table's path, which
    # unmounts it before deleting anything.
    if not os.path.lexists(root):
        return True
    try:
        foreign = _mounts_on(root)
    except OSError:
        foreign = True  # cannot tell: the table's path
    if foreign:
        return False
    _remove_tree(root)
    return not os.path.lexists(root)


def _mounts_on(root: Path) -> bool:
    """Whether something is mounted on ``root`` or on one of its entries: their mount ids
    differ from their parent's (``os.path.ismount`` misses a bind from the same filesystem)."""
    mine = _mount_id(root)
    if mine != _mount_id(root.parent):
        return True
    with os.scandir(root) as entries:
        return any(_mount_id(Path(entry.path)) != mine for entry in entries)


def _mount_id(path: Path) -> int:
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    raise OSError(errno.ENOTSUP, f"no mnt_id in /proc/self/fdinfo for {path}")


def disk_used_bytes(workspace: Path) -> int | None:
    """Bytes used on a capped workspace's disk, or None if it is gone."""
    try:
        fs = os.statvfs(workspace)
    except OSError:
        return None
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize
