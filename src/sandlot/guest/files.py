"""The file operations, each confined to the workspace (see ``workspace.py``).

Standard library only, Python >= 3.9 (shipped into every sandbox).
"""

import base64
import os
import stat

from wire import GuestFault, write_all
from workspace import (
    WORKSPACE,
    describe_path,
    display,
    makedirs_confined,
    open_confined,
    resolve_path,
)

FILE_CHUNK_MAX_BYTES = 8 << 20


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
        path = resolve_path(request.get("path") or ".")
        depth = max(1, int(request.get("depth", 1)))
        if not os.path.isdir(path):
            raise GuestFault("not_a_directory", "%s is not a directory" % display(path))
        entries = []
        self._walk(path, depth, entries)
        return {"entries": entries}

    def _walk(self, path, depth, entries):
        with os.scandir(path) as it:
            for entry in sorted(it, key=lambda e: e.name):
                info = describe_path(entry.path)
                entries.append(info)
                if depth > 1 and info["type"] == "dir":
                    self._walk(entry.path, depth - 1, entries)

    def file_stat(self, request):
        return describe_path(resolve_path(request.get("path")))

    def file_remove(self, request):
        import shutil

        path = resolve_path(request.get("path"), follow_final=False)
        if path == WORKSPACE:
            raise GuestFault("permission_denied", "refusing to remove /workspace itself")
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            if not request.get("recursive"):
                os.rmdir(path)
            else:
                shutil.rmtree(path)
        else:
            os.unlink(path)
        return {"removed": display(path)}

    def file_mkdir(self, request):
        path = resolve_path(request.get("path"))
        makedirs_confined(path)
        return describe_path(path)
