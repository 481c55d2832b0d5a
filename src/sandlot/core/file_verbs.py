"""The manager's verbs on a sandbox's files (through its guest: :mod:`~sandlot.core.files`)
and on the artifacts it kept (on the host: :mod:`~sandlot.core.artifacts`)."""

from __future__ import annotations

import asyncio
import builtins
import io
import os
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

from sandlot.core import files
from sandlot.core.artifacts import Artifacts
from sandlot.core.lookup import Lookup
from sandlot.models import ArtifactInfo, FileInfo, Listing
from sandlot.requests import (
    RANGE_MAX_BYTES,
    FilePath,
    ListFiles,
    ReadRange,
    RemoveFile,
    WriteFile,
)


class FileVerbs(Lookup):
    """Files and kept artifacts, by sandbox id."""

    _artifacts: Artifacts

    async def write_file(
        self, sandbox_id: str, request: WriteFile, data: bytes, *, owner: str | None = None
    ) -> int:
        """Write ``data`` to ``request.path`` (relative to /workspace); returns its size."""
        return await self.write_file_chunks(sandbox_id, request, files.one_chunk(data), owner=owner)

    async def write_file_chunks(
        self,
        sandbox_id: str,
        request: WriteFile,
        chunks: AsyncIterable[bytes],
        *,
        max_bytes: int | None = None,
        owner: str | None = None,
    ) -> int:
        """Stream chunks into a file; past ``max_bytes`` the partial file is removed.

        Raises:
            RequestTooLarge: more than ``max_bytes`` arrived.
        """
        live = self._get_live(sandbox_id, owner)
        return await files.write_chunks(live, request, chunks, max_bytes=max_bytes)

    async def read_file_chunks(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> AsyncIterator[bytes]:
        """Stream a file out of the sandbox in chunks of at most 1 MiB."""
        live = self._get_live(sandbox_id, owner)
        async for chunk in files.read_chunks(live, request):
            yield chunk

    async def read_file(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> bytes:
        chunks = self.read_file_chunks(sandbox_id, request, owner=owner)
        return b"".join([chunk async for chunk in chunks])

    async def read_file_range(
        self, sandbox_id: str, request: ReadRange, *, owner: str | None = None
    ) -> bytes:
        """Part of a file (``b""`` past its end)."""
        return await files.read_range(self._get_live(sandbox_id, owner), request)

    async def list_files(
        self,
        sandbox_id: str,
        request: ListFiles,
        *,
        owner: str | None = None,
        checking: files.EntriesCheck | None = None,
    ) -> Listing:
        """Entries below ``request.path``; ``truncated`` says why, where the listing stopped
        at its bound. ``checking``: :func:`files.list_dir`'s."""
        return await files.list_dir(self._get_live(sandbox_id, owner), request, checking)

    async def stat_file(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> FileInfo:
        return await files.stat(self._get_live(sandbox_id, owner), request)

    async def remove_file(
        self, sandbox_id: str, request: RemoveFile, *, owner: str | None = None
    ) -> None:
        await files.remove(self._get_live(sandbox_id, owner), request)

    async def make_dir(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> None:
        await files.make_dir(self._get_live(sandbox_id, owner), request)

    # Kept artifacts: read from the host, the sandbox live or ended.

    async def list_artifacts(
        self, sandbox_id: str, *, owner: str | None = None
    ) -> builtins.list[ArtifactInfo]:
        await self.get(sandbox_id, owner=owner)
        # Up to 10,000 rows made into models (~50 ms): beside the event loop, not on it.
        return await asyncio.to_thread(self._artifacts.list, sandbox_id)

    async def artifact_path(self, sandbox_id: str, path: str, *, owner: str | None = None) -> Path:
        """Host path of a kept artifact (to inspect; serve it through :meth:`open_artifact`,
        as a path a DELETE may remove between a check and a read).

        Raises:
            SandboxNotFound: no such sandbox.
            SandboxFileNotFound: it kept no such artifact.
        """
        await self.get(sandbox_id, owner=owner)
        return self._artifacts.path(sandbox_id, path)

    async def open_artifact(
        self, sandbox_id: str, path: str, *, owner: str | None = None
    ) -> tuple[io.FileIO, os.stat_result]:
        """A kept artifact opened for reading, which the caller closes, and its ``fstat``:
        what is served comes from this one open, never from the path again (a DELETE may
        remove it meanwhile).

        Raises:
            SandboxNotFound: no such sandbox.
            SandboxFileNotFound: it kept no such artifact.
        """
        await self.get(sandbox_id, owner=owner)
        return self._artifacts.open(sandbox_id, path)

    async def read_artifact(self, sandbox_id: str, path: str, *, owner: str | None = None) -> bytes:
        """The content of a kept artifact (bounded by the tenant's artifact quota).

        Raises:
            SandboxNotFound: no such sandbox.
            SandboxFileNotFound: it kept no such artifact.
        """
        file, info = await self.open_artifact(sandbox_id, path, owner=owner)
        return await asyncio.to_thread(_read_closing, file, 0, info.st_size)

    async def read_artifact_range(
        self, sandbox_id: str, path: str, offset: int, *, owner: str | None = None
    ) -> bytes:
        """At most :data:`RANGE_MAX_BYTES` of a kept artifact from ``offset``."""
        file, _ = await self.open_artifact(sandbox_id, path, owner=owner)
        return await asyncio.to_thread(_read_closing, file, offset, RANGE_MAX_BYTES)

    async def delete_artifacts(self, sandbox_id: str, *, owner: str | None = None) -> int:
        await self.get(sandbox_id, owner=owner)
        return await self._artifacts.delete(sandbox_id)


def _read_closing(file: io.FileIO, offset: int, most: int) -> bytes:
    """Up to ``most`` bytes of ``file`` from ``offset`` (fewer only at its end); closes it
    (here, in the thread: a call cancelled before its thread ran drops it, which closes it)."""
    with file:
        parts: list[bytes] = []
        while most > 0:
            part = os.pread(file.fileno(), min(most, RANGE_MAX_BYTES), offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
            most -= len(part)
        return b"".join(parts)
