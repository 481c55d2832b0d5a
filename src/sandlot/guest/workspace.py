"""Where the workspace is, and how a user's path is confined to it.

Standard library only, Python >= 3.9 (shipped into every sandbox). Every path a request names
goes through :func:`resolve_path`; the file handlers open it with :func:`open_confined`.
"""

import errno
import os
import stat

from wire import GuestFault

WORKSPACE = os.environ.get("SANDLOT_WORKSPACE", "/workspace")


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


SYS_OPENAT2 = 437  # the same number on every architecture (Linux >= 5.6)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_OPENAT2 = []  # [callable] once looked up; [None] where the kernel or libc lacks it


def _relative(path):
    """``path`` (an absolute path :func:`resolve_path` gave) relative to the workspace."""
    return os.path.relpath(path, os.path.realpath(WORKSPACE))


def _openat2():
    if not _OPENAT2:
        try:
            import ctypes

            class OpenHow(ctypes.Structure):
                _fields_ = [(n, ctypes.c_uint64) for n in ("flags", "mode", "resolve")]

            syscall = ctypes.CDLL(None, use_errno=True).syscall
            syscall.restype = ctypes.c_long

            def call(dir_fd, rel, flags, mode):
                how = OpenHow(flags, mode if flags & os.O_CREAT else 0, 0)
                how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
                fd = syscall(
                    ctypes.c_long(SYS_OPENAT2),
                    ctypes.c_int(dir_fd),
                    ctypes.c_char_p(os.fsencode(rel)),
                    ctypes.byref(how),
                    ctypes.c_size_t(ctypes.sizeof(how)),
                )
                if fd < 0:
                    return -ctypes.get_errno()
                return fd

            _OPENAT2.append(call)
        except (OSError, AttributeError):
            _OPENAT2.append(None)
    return _OPENAT2[0]


def open_beneath(path, flags, mode=0o644):
    """Open ``path`` from the workspace without passing through any symlink on the way.

    :func:`resolve_path` checked the path, but a directory on it may have been swapped for a
    symlink since: openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) refuses that in one call;
    where the kernel lacks openat2 (or a filter hides it), each component is opened with
    O_NOFOLLOW from its parent's descriptor instead.
    """
    import errno

    rel = _relative(path)
    flags |= os.O_CLOEXEC
    root_fd = os.open(os.path.realpath(WORKSPACE), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        call = _openat2()
        fd = call(root_fd, rel, flags, mode) if call is not None else -errno.ENOSYS
        if fd >= 0:
            return fd
        if -fd not in (errno.ENOSYS, errno.EPERM):
            if -fd in (errno.ELOOP, errno.EXDEV):
                raise GuestFault(
                    "path_outside_workspace", "%s goes through a symlink" % display(path)
                )
            raise OSError(-fd, os.strerror(-fd), path)
        return _walk_open(root_fd, rel, flags, mode, path)
    finally:
        os.close(root_fd)


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_nofollow(name, dir_fd):
    """Open the directory ``name`` in ``dir_fd`` without following a symlink, and prove it.

    O_NOFOLLOW alone is not enough everywhere: gVisor's O_DIRECTORY|O_NOFOLLOW follows a
    symlink to a directory (and it has no openat2). So the entry is lstat'ed first and the
    directory opened must be that very entry (same device and inode); a symlink swapped in
    between the two is caught either way.
    """
    import errno

    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise OSError(errno.ELOOP, "a symlink", name)
    if not stat.S_ISDIR(before.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory", name)
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise OSError(errno.ELOOP, "replaced while it was opened", name)
    return fd


def _walk_open(root_fd, rel, flags, mode, path):
    parts = [] if rel == "." else rel.split("/")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            next_fd = open_dir_nofollow(part, fd)
            os.close(fd)
            fd = next_fd
        last = parts[-1] if parts else "."
        if flags & os.O_DIRECTORY:
            return open_dir_nofollow(last, fd)
        opened = os.open(last, flags | os.O_NOFOLLOW, mode, dir_fd=fd)
        # The same proof for the last component: what was opened is what the name is now.
        now = os.stat(last, dir_fd=fd, follow_symlinks=False)
        got = os.fstat(opened)
        if (now.st_dev, now.st_ino) != (got.st_dev, got.st_ino):
            os.close(opened)
            raise OSError(errno.ELOOP, "replaced while it was opened", path)
        return opened
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise GuestFault(
                "path_outside_workspace", "%s goes through a symlink" % display(path)
            ) from exc
        raise
    finally:
        os.close(fd)


def open_dir_beneath(path):
    return open_beneath(path, os.O_RDONLY | os.O_DIRECTORY)


def open_confined(path, flags, mode=0o644):
    """Open a regular file only, every component without following a symlink (see
    :func:`open_beneath`); O_NONBLOCK keeps a FIFO swapped in by sandboxed code from
    blocking us forever."""
    try:
        fd = open_beneath(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except BlockingIOError:
        # A lease (F_SETLEASE) some process of the sandbox holds: a file's fault, not the
        # pids limit that EAGAIN means elsewhere (a fork), for which the host restarts the
        # guest, its state lost (a red team's note, 2026-12-06).
        raise GuestFault(
            "file_busy",
            "%s is leased by a process in the sandbox (EAGAIN): try again once it lets go"
            % display(path),
        ) from None
    mode_now = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode_now):
        os.close(fd)
        if stat.S_ISDIR(mode_now):
            raise GuestFault("is_a_directory", "%s is a directory" % display(path))
        raise GuestFault("invalid_request", "%s is not a regular file" % display(path))
    return fd


def makedirs_confined(path):
    root = os.path.realpath(WORKSPACE)
    if not _inside(_realpath(path, path), root):
        raise GuestFault("path_outside_workspace", "%s is outside /workspace" % path)
    rel = _relative(path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [] if rel == "." else rel.split("/"):
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                next_fd = open_dir_nofollow(part, fd)
            except OSError as exc:
                import errno

                if exc.errno == errno.ELOOP:
                    raise GuestFault(
                        "path_outside_workspace", "%s goes through a symlink" % display(path)
                    ) from exc
                raise
            os.close(fd)
            fd = next_fd
    finally:
        os.close(fd)


def lstat_confined(path):
    """lstat ``path`` through a descriptor of its parent, opened beneath the workspace."""
    if path == os.path.realpath(WORKSPACE):
        return os.stat(path)
    parent = open_dir_beneath(os.path.dirname(path))
    try:
        return os.stat(os.path.basename(path), dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(parent)


def describe(name, rel, info):
    if stat.S_ISLNK(info.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(info.st_mode):
        kind = "dir"
    elif stat.S_ISREG(info.st_mode):
        kind = "file"
    else:
        kind = "other"
    return {
        "name": name,
        "path": rel,
        "type": kind,
        "size_bytes": info.st_size,
        "mtime": info.st_mtime,
        "mode": stat.S_IMODE(info.st_mode),
    }


def describe_path(path):
    return describe(os.path.basename(path) or "workspace", _relative(path), lstat_confined(path))


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
        # A FIFO or a socket at the path (no reader: ENXIO), a program running from it.
        errno.ENXIO: "invalid_request",
        errno.ETXTBSY: "file_busy",
        # The guest itself out of what it needs (a limit sandboxed code lowered, say): the
        # only errnos the host answers by restarting it (``live.guest_broken``).
        errno.EMFILE: "file_error",
        errno.ENFILE: "file_error",
        errno.ENOMEM: "file_error",
        errno.ENOBUFS: "file_error",
    }
    name = exc.filename if exc.filename is not None else ""
    where = display(name) if isinstance(name, str) and name.startswith(WORKSPACE) else name
    if exc.errno == errno.E2BIG:
        # A program the guest starts, with an argument or an environment variable (one the
        # session exported, say) past the kernel's 128 KiB: the request's fault, and the
        # guest is fine (as "file_error" it was restarted, and its state lost).
        return "invalid_request", (
            "%s: an argument or environment variable is past the kernel's limit of 128 KiB "
            "on one (E2BIG): put it in a file" % (where or "exec")
        )
    # Any other errno is the file's or the request's (EBUSY, EROFS, EFBIG, EXDEV, ...): until
    # 2026-12-06 it was "file_error", which the host reads as a broken guest and restarts it,
    # so a FIFO sandboxed code planted at a path cost the user's next write to it the
    # session's state (a red team's find).
    return codes.get(exc.errno, "io_error"), "%s: %s" % (exc.strerror or exc, where)
