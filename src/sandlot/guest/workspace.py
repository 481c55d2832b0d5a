"""Where the workspace is, and how a user's path is confined to it.

Standard library only, Python >= 3.9 (shipped into every sandbox). Every path a request names
goes through :func:`resolve_path`; the file handlers open it with :func:`open_confined`.
"""

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


def open_confined(path, flags, mode=0o644):
    """Open a regular file only. O_NOFOLLOW closes the window between the check and the
    open; O_NONBLOCK keeps a FIFO swapped in by sandboxed code from blocking us forever."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
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
    os.makedirs(path, exist_ok=True)


def describe_path(path):
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(info.st_mode):
        kind = "dir"
    elif stat.S_ISREG(info.st_mode):
        kind = "file"
    else:
        kind = "other"
    return {
        "name": os.path.basename(path) or "workspace",
        "path": os.path.relpath(path, os.path.realpath(WORKSPACE)),
        "type": kind,
        "size_bytes": info.st_size,
        "mtime": info.st_mtime,
        "mode": stat.S_IMODE(info.st_mode),
    }


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
    }
    name = exc.filename if exc.filename is not None else ""
    where = display(name) if isinstance(name, str) and name.startswith(WORKSPACE) else name
    return codes.get(exc.errno, "file_error"), "%s: %s" % (exc.strerror or exc, where)
