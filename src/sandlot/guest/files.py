"""The file operations, each confined to the workspace (see ``workspace.py``).

Standard library only, Python >= 3.9 (shipped into every sandbox).
"""

import base64
import itertools
import os
import stat

from wire import GuestFault, encoded_size, write_all
from workspace import (
    WORKSPACE,
    describe,
    describe_path,
    display,
    makedirs_confined,
    open_confined,
    open_dir_beneath,
    open_dir_nofollow,
    os_error_code,
    resolve_path,
)

FILE_CHUNK_MAX_BYTES = 8 << 20
# A listing is one frame, which the host parses whole, so it is bounded in entries and in
# bytes: 13,000 entries under 15 nested 255-character names made a 57 MB frame, and ~240 MB
# of the host's memory a listing (red team). Its errors are bounded too.
MAX_LIST_ENTRIES = 100_000
MAX_LIST_BYTES = 4 << 20
MAX_LIST_ERRORS = 1_000
ENTRY_BYTES = 160  # an entry's JSON besides its name and path


class Files:
    """Handlers for ``file_read``, ``file_write``, ``file_list``, ``file_stat``,
    ``file_remove`` and ``file_mkdir``. Stateless: each runs in its request's own thread."""

    def file_read(self, request):
        path = resolve_path(request.get("path"))
        offset = int(request.get("offset", 0))
        length = min(int(request.get("length", FILE_CHUNK_MAX_BYTES)), FILE_CHUNK_MAX_BYTES)
        fd = open_confined(path, os.O_RDONLY)  # refuses directories and non-regular files
        try:
            info = os.fstat(fd)
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return {
            "data": base64.b64encode(data).decode("ascii"),
            "size": info.st_size,
            "eof": offset + len(data) >= info.st_size,
        }

    def file_write(self, request):
        path = resolve_path(request.get("path"))
        if path == WORKSPACE:
            raise GuestFault("is_a_directory", "/workspace is a directory")
        parent = os.path.dirname(path)
        makedirs_confined(parent)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
        fd = open_confined(path, flags, int(request.get("mode", 0o644)))
        try:
            write_all(fd, base64.b64decode(request.get("data", "")))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return {"path": display(path), "size_bytes": size}

    def file_list(self, request):
        """Every entry that can be listed, and one error per entry that cannot (a name that is
        not UTF-8, a directory we may not read, one that vanished): one odd entry must not
        lose all the others. Walked through directory descriptors, never through a path a
        swapped-in symlink could redirect."""
        path = resolve_path(request.get("path") or ".")
        depth = max(1, int(request.get("depth", 1)))
        try:
            fd = open_dir_beneath(path)
        except FileNotFoundError:
            raise GuestFault("file_not_found", "%s does not exist" % display(path)) from None
        except NotADirectoryError:
            raise GuestFault("not_a_directory", "%s is not a directory" % display(path)) from None
        listing = _Listing()
        try:
            rel = describe_path(path)["path"]
            self._walk(fd, rel, depth, listing)
        finally:
            os.close(fd)
        return {"entries": listing.entries, "errors": listing.errors}

    def _walk(self, dir_fd, rel, depth, listing):
        try:
            with os.scandir(dir_fd) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            listing.error(_error(rel, exc))
            return
        for entry in found:
            if listing.full:
                return
            entry_rel = entry.name if rel == "." else rel + "/" + entry.name
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                listing.error(
                    {
                        "path": _printable(entry_rel),
                        "code": "invalid_name",
                        "message": "the name is not valid UTF-8",
                    }
                )
                continue
            try:
                info = describe(entry.name, entry_rel, entry.stat(follow_symlinks=False))
            except OSError as exc:
                listing.error(_error(entry_rel, exc))
                continue
            if not listing.add(info, rel):
                return
            if depth > 1 and info["type"] == "dir":
                try:
                    sub = open_dir_nofollow(entry.name, dir_fd)
                except OSError as exc:
                    listing.error(_error(entry_rel, exc))
                    continue
                try:
                    self._walk(sub, entry_rel, depth - 1, listing)
                finally:
                    os.close(sub)

    def file_stat(self, request):
        return describe_path(resolve_path(request.get("path")))

    def file_remove(self, request):
        path = resolve_path(request.get("path"), follow_final=False)
        if path == os.path.realpath(WORKSPACE):
            raise GuestFault("permission_denied", "refusing to remove /workspace itself")
        parent = open_dir_beneath(os.path.dirname(path))
        name = os.path.basename(path)
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(name, dir_fd=parent)
            elif not request.get("recursive"):
                os.rmdir(name, dir_fd=parent)
            else:
                _remove_tree(parent, name)
        finally:
            os.close(parent)
        return {"removed": display(path)}

    def file_mkdir(self, request):
        path = resolve_path(request.get("path"))
        makedirs_confined(path)
        return describe_path(path)


class _Listing:
    """A listing's entries and errors, within MAX_LIST_ENTRIES, MAX_LIST_BYTES and
    MAX_LIST_ERRORS; once full it takes nothing more, and its last error says where it
    stopped."""

    def __init__(self):
        self.entries = []
        self.errors = []
        self.size_bytes = 0
        self.full = False

    def add(self, info, rel):
        """Keep ``info`` (an entry below ``rel``); False, and the listing full, if no room."""
        # As written in the frame: JSON makes a control character 6 bytes (counted as 1,
        # names of them made a listing of 19.6 MB under the 4 MiB bound: red team).
        size = ENTRY_BYTES + encoded_size(info["name"]) + encoded_size(info["path"])
        if len(self.entries) >= MAX_LIST_ENTRIES or self.size_bytes + size > MAX_LIST_BYTES:
            self.full = True
            self.errors.append(
                {
                    "path": _printable(rel),
                    "code": "too_many_entries",
                    "message": "listing stopped at %d entries (%d bytes): list a narrower path "
                    "or fewer levels" % (len(self.entries), self.size_bytes),
                }
            )
            return False
        self.entries.append(info)
        self.size_bytes += size
        return True

    def error(self, item):
        if len(self.errors) < MAX_LIST_ERRORS:
            self.errors.append(item)
        elif len(self.errors) == MAX_LIST_ERRORS:
            self.errors.append(
                {"path": item["path"], "code": "too_many_errors", "message": "more errors left out"}
            )


# A recursive removal raised RecursionError past ~1,000 levels; this one keeps at most this
# many directories open and moves deeper ones up into the tree's top.
MAX_REMOVE_DEPTH = 64
REMOVE_BATCH = 4096


def _remove_tree(parent_fd, name):
    """rmtree through directory descriptors, without recursion: a symlink swapped in is
    unlinked, never followed, and levels past MAX_REMOVE_DEPTH are renamed up into the
    tree's top, to be emptied from there."""
    top = open_dir_nofollow(name, parent_fd)
    stack = [(top, name)]
    try:
        while stack:
            fd = stack[-1][0]
            with os.scandir(fd) as it:
                batch = [
                    (e.name, e.is_dir(follow_symlinks=False))
                    for e in itertools.islice(it, REMOVE_BATCH)
                ]
            descended = False
            for child, is_dir in batch:
                if not is_dir:
                    os.unlink(child, dir_fd=fd)
                elif len(stack) >= MAX_REMOVE_DEPTH:
                    up = ".sandlot-deep-" + os.urandom(8).hex()
                    os.rename(child, up, src_dir_fd=fd, dst_dir_fd=top)
                else:
                    stack.append((open_dir_nofollow(child, fd), child))
                    descended = True
                    break
            if descended or len(batch) == REMOVE_BATCH:
                continue
            fd, own = stack.pop()
            os.close(fd)
            if stack:
                os.rmdir(own, dir_fd=stack[-1][0])
    finally:
        for fd, _ in stack:
            os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _printable(rel):
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _error(rel, exc):
    code, message = os_error_code(exc)
    return {"path": _printable(rel), "code": code, "message": message}
