"""The verbs a routing manager forwards to the owning node agent unchanged: files, background
commands and artifacts (one call each; ``_call`` routes and maps a lost node)."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from sandlot.config import Settings
from sandlot.core.files import EntriesCheck
from sandlot.errors import InvalidRequest, RequestTooLarge
from sandlot.models import (
    ArtifactInfo,
    CommandInfo,
    DataCallback,
    ExecResult,
    FileInfo,
    Listing,
    OutputCallback,
    PtyOutput,
)
from sandlot.ray.calls import SHORT_CALL
from sandlot.requests import (
    RANGE_MAX_BYTES,
    FilePath,
    ListFiles,
    OpenPty,
    PtySize,
    ReadRange,
    RemoveFile,
    RunCommand,
    WriteFile,
)

_CALLBACKS_REFUSED = (
    "output callbacks of background commands and terminals are not routed through a Ray "
    "cluster yet: read the output with wait_command (a terminal's with pty_output)"
)


class ForwardedVerbs:
    settings: Settings

    async def _call(
        self,
        sandbox_id: str,
        verb: str,
        *args: Any,
        bound_s: float | None = SHORT_CALL,
        **kwargs: Any,
    ) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ files

    async def write_file(
        self, sandbox_id: str, request: WriteFile, data: bytes, *, owner: str | None = None
    ) -> int:
        size: int = await self._call(sandbox_id, "write_file", request, data, owner=owner)
        return size

    async def write_file_chunks(
        self,
        sandbox_id: str,
        request: WriteFile,
        chunks: AsyncIterable[bytes],
        *,
        max_bytes: int | None = None,
        owner: str | None = None,
    ) -> int:
        """Gathered here, then sent in one call (Ray moves objects whole)."""
        parts: builtins.list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise RequestTooLarge(f"the upload is over {max_bytes} bytes")
            parts.append(chunk)
        return await self.write_file(sandbox_id, request, b"".join(parts), owner=owner)

    async def read_file(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> bytes:
        data: bytes = await self._call(sandbox_id, "read_file", request, owner=owner)
        return data

    async def read_file_chunks(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> AsyncIterator[bytes]:
        """In ranged reads of at most :data:`RANGE_MAX_BYTES`: a Ray call moves its object
        whole, and one read of the whole file held up to the sandbox's disk size (512 MiB by
        default) in this server's memory per download (red team, 2026-12-06). The node
        stops a guest that sends more than the disk holds."""

        async def part(offset: int) -> bytes:
            read = ReadRange(path=request.path, offset=offset, length=RANGE_MAX_BYTES)
            data: bytes = await self._call(sandbox_id, "read_file_range", read, owner=owner)
            return data

        async for data in _in_ranges(part):
            yield data

    async def read_artifact_chunks(
        self, sandbox_id: str, path: str, *, owner: str | None = None
    ) -> AsyncIterator[bytes]:
        """A kept artifact in ranged reads, as :meth:`read_file_chunks` reads a file."""

        async def part(offset: int) -> bytes:
            data: bytes = await self._call(
                sandbox_id, "read_artifact_range", path, offset, owner=owner
            )
            return data

        async for data in _in_ranges(part):
            yield data

    async def list_files(
        self,
        sandbox_id: str,
        request: ListFiles,
        *,
        owner: str | None = None,
        checking: EntriesCheck | None = None,
    ) -> Listing:
        found: Listing = await self._call(sandbox_id, "list_files", request, owner=owner)
        if checking is not None:  # the node checked them: here, the turn's charge and debt
            async with checking(len(found)):
                pass
        return found

    async def stat_file(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> FileInfo:
        info: FileInfo = await self._call(sandbox_id, "stat_file", request, owner=owner)
        return info

    async def remove_file(
        self, sandbox_id: str, request: RemoveFile, *, owner: str | None = None
    ) -> None:
        await self._call(sandbox_id, "remove_file", request, owner=owner)

    async def make_dir(
        self, sandbox_id: str, request: FilePath, *, owner: str | None = None
    ) -> None:
        await self._call(sandbox_id, "make_dir", request, owner=owner)

    # ------------------------------------------------------------------ background

    async def start_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        if on_stdout is not None or on_stderr is not None:
            raise InvalidRequest(_CALLBACKS_REFUSED)
        info: CommandInfo = await self._call(sandbox_id, "start_command", request, owner=owner)
        return info

    async def list_commands(
        self, sandbox_id: str, *, owner: str | None = None
    ) -> builtins.list[CommandInfo]:
        found: builtins.list[CommandInfo] = await self._call(
            sandbox_id, "list_commands", owner=owner
        )
        return found

    # ``command_id`` goes to the node as given: the pid alone names the newest command with it.

    async def command_info(
        self,
        sandbox_id: str,
        pid: int,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        info: CommandInfo = await self._call(
            sandbox_id, "command_info", pid, command_id=command_id, owner=owner
        )
        return info

    async def connect_command(
        self,
        sandbox_id: str,
        pid: int,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        if on_stdout is not None or on_stderr is not None:
            raise InvalidRequest(_CALLBACKS_REFUSED)
        return await self.command_info(sandbox_id, pid, command_id=command_id, owner=owner)

    async def wait_command(
        self,
        sandbox_id: str,
        pid: int,
        timeout_s: float | None = None,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        # Bounded by its own timeout, not the short-call bound: a wait on a long command is
        # not a slow node (the probes find a hung one).
        bound_s = None if timeout_s is None else timeout_s + self.settings.ray_call_timeout_s
        result: ExecResult = await self._call(
            sandbox_id,
            "wait_command",
            pid,
            timeout_s,
            bound_s=bound_s,
            command_id=command_id,
            owner=owner,
        )
        return result

    async def send_command_stdin(
        self,
        sandbox_id: str,
        pid: int,
        data: bytes,
        *,
        eof: bool = False,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        # As long as the command takes to read it (it may never): no bound but the probes.
        await self._call(
            sandbox_id,
            "send_command_stdin",
            pid,
            data,
            eof=eof,
            bound_s=None,
            command_id=command_id,
            owner=owner,
        )

    async def kill_command(
        self,
        sandbox_id: str,
        pid: int,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> bool:
        killed: bool = await self._call(
            sandbox_id, "kill_command", pid, command_id=command_id, owner=owner
        )
        return killed

    def disconnect_command(
        self,
        sandbox_id: str,
        pid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        *,
        command_id: str | None = None,
    ) -> None:
        """Nothing to do: no callback is ever connected through the cluster."""

    # ------------------------------------------------------------------ terminals

    async def start_pty(
        self,
        sandbox_id: str,
        request: OpenPty,
        *,
        on_data: DataCallback | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        if on_data is not None:
            raise InvalidRequest(_CALLBACKS_REFUSED)
        info: CommandInfo = await self._call(sandbox_id, "start_pty", request, owner=owner)
        return info

    async def resize_pty(
        self,
        sandbox_id: str,
        pid: int,
        size: PtySize,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        await self._call(sandbox_id, "resize_pty", pid, size, command_id=command_id, owner=owner)

    async def send_pty_input(
        self,
        sandbox_id: str,
        pid: int,
        data: bytes,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        await self._call(
            sandbox_id, "send_pty_input", pid, data, command_id=command_id, owner=owner
        )

    async def pty_output(
        self,
        sandbox_id: str,
        pid: int,
        offset: int = 0,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> PtyOutput:
        output: PtyOutput = await self._call(
            sandbox_id, "pty_output", pid, offset, command_id=command_id, owner=owner
        )
        return output

    async def connect_pty(
        self,
        sandbox_id: str,
        pid: int,
        on_data: DataCallback,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        raise InvalidRequest(_CALLBACKS_REFUSED)

    def disconnect_pty(
        self, sandbox_id: str, pid: int, on_data: DataCallback, *, command_id: str | None = None
    ) -> None:
        """Nothing to do: no callback is ever connected through the cluster."""

    # ------------------------------------------------------------------ artifacts

    async def list_artifacts(
        self, sandbox_id: str, *, owner: str | None = None
    ) -> builtins.list[ArtifactInfo]:
        found: builtins.list[ArtifactInfo] = await self._call(
            sandbox_id, "list_artifacts", owner=owner
        )
        return found

    async def read_artifact(self, sandbox_id: str, path: str, *, owner: str | None = None) -> bytes:
        data: bytes = await self._call(sandbox_id, "read_artifact", path, owner=owner)
        return data

    async def delete_artifacts(self, sandbox_id: str, *, owner: str | None = None) -> int:
        count: int = await self._call(sandbox_id, "delete_artifacts", owner=owner)
        return count


async def _in_ranges(part: Callable[[int], Awaitable[bytes]]) -> AsyncIterator[bytes]:
    """Each ``part(offset)`` (at most :data:`RANGE_MAX_BYTES`) from offset 0 on, until one
    comes back empty or short: the end of the file."""
    offset = 0
    while True:
        data = await part(offset)
        if not data:
            return
        yield data
        offset += len(data)
        if len(data) < RANGE_MAX_BYTES:
            return
