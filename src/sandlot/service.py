"""What the SDK needs from whatever runs its sandboxes: the embedded
:class:`~sandlot.core.SandboxManager`, or a server reached over HTTP
(:class:`sandlot.client.RemoteService`).

Every verb takes the sandbox id and one typed request from :mod:`sandlot.requests`.
"""

from __future__ import annotations

import builtins
from typing import Any, Protocol, runtime_checkable

from sandlot.models import (
    ArtifactInfo,
    CommandInfo,
    DataCallback,
    ExecResult,
    FileInfo,
    Listing,
    OutputCallback,
    PtyOutput,
    ResourceUsage,
    ResultCallback,
    SandboxInfo,
    VolumeInfo,
)
from sandlot.requests import (
    CreateVolume,
    FilePath,
    ListFiles,
    OpenPty,
    PtySize,
    RemoveFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
    WriteFile,
)
from sandlot.tools import ToolRegistry


class SandboxService(Protocol):
    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self, *, include_ended: bool = False) -> builtins.list[SandboxInfo]: ...

    async def destroy(self, sandbox_id: str) -> SandboxInfo: ...

    async def extend(self, sandbox_id: str, request: SetTimeout) -> SandboxInfo: ...

    async def usage(self, sandbox_id: str) -> ResourceUsage: ...

    async def run_code(
        self,
        sandbox_id: str,
        request: RunCode,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> ExecResult: ...

    async def run_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_id: str, request: WriteFile, data: bytes) -> int: ...

    async def read_file(self, sandbox_id: str, request: FilePath) -> bytes: ...

    async def list_files(self, sandbox_id: str, request: ListFiles) -> Listing: ...

    async def stat_file(self, sandbox_id: str, request: FilePath) -> FileInfo: ...

    async def remove_file(self, sandbox_id: str, request: RemoveFile) -> None: ...

    async def make_dir(self, sandbox_id: str, request: FilePath) -> None: ...

    async def list_artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]: ...

    async def read_artifact(self, sandbox_id: str, path: str) -> bytes: ...


@runtime_checkable
class VolumeService(Protocol):
    """Named volumes: the embedded manager and the remote client keep them (a volume is
    attached by a create's ``SandboxSpec.volumes``)."""

    async def create_volume(self, request: CreateVolume) -> VolumeInfo: ...

    async def list_volumes(self) -> builtins.list[VolumeInfo]: ...

    async def get_volume(self, name: str) -> VolumeInfo: ...

    async def delete_volume(self, name: str) -> None: ...


@runtime_checkable
class ToolService(Protocol):
    """A service that runs registry tools itself (the server's MCP service: it audits the
    call as a tool's); others run a tool as the command it builds."""

    async def run_tool(
        self,
        sandbox_id: str,
        registry: ToolRegistry,
        name: str,
        arguments: dict[str, Any] | None,
        timeout_s: float | None,
    ) -> ExecResult: ...


@runtime_checkable
class BackgroundService(Protocol):
    """Background commands: the embedded manager and the remote client run them.

    A verb that takes a pid takes the command's ``command_id`` (from its
    :class:`~sandlot.models.CommandInfo`) too: given, it acts on that command only, or raises
    ``CommandNotFound``; a pid alone names the newest command with it (pids are reused once
    the sandbox's guest restarts). The SDK's handles always pass it.
    """

    async def start_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandInfo: ...

    async def list_commands(self, sandbox_id: str) -> builtins.list[CommandInfo]: ...

    async def connect_command(
        self,
        sandbox_id: str,
        pid: int,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        command_id: str | None = None,
    ) -> CommandInfo: ...

    async def wait_command(
        self,
        sandbox_id: str,
        pid: int,
        timeout_s: float | None = None,
        *,
        command_id: str | None = None,
    ) -> ExecResult: ...

    async def send_command_stdin(
        self,
        sandbox_id: str,
        pid: int,
        data: bytes,
        *,
        eof: bool = False,
        command_id: str | None = None,
    ) -> None: ...

    async def kill_command(
        self, sandbox_id: str, pid: int, *, command_id: str | None = None
    ) -> bool: ...

    async def start_pty(
        self, sandbox_id: str, request: OpenPty, *, on_data: DataCallback | None = None
    ) -> CommandInfo: ...

    async def resize_pty(
        self, sandbox_id: str, pid: int, size: PtySize, *, command_id: str | None = None
    ) -> None: ...

    async def send_pty_input(
        self, sandbox_id: str, pid: int, data: bytes, *, command_id: str | None = None
    ) -> None: ...

    async def pty_output(
        self, sandbox_id: str, pid: int, offset: int = 0, *, command_id: str | None = None
    ) -> PtyOutput: ...
