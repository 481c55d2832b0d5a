"""What the SDK needs from whatever runs its sandboxes: the embedded SandboxManager, or a
server reached over HTTP (:class:`sandlot.client.RemoteService`)."""

from __future__ import annotations

from typing import Any, Protocol

from sandlot.models import ExecResult, ResourceUsage, SandboxInfo, SandboxLimits
from sandlot.protocol import OutputCallback


class SandboxService(Protocol):
    async def create(
        self,
        *,
        backend: str | None = None,
        runtime: str | None = None,
        environment: str | None = None,
        limits: SandboxLimits | None = None,
        network: bool | None = None,
        env: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> SandboxInfo: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def destroy(self, sandbox_id: str) -> SandboxInfo: ...

    async def extend(self, sandbox_id: str, ttl_s: float) -> SandboxInfo: ...

    async def usage(self, sandbox_id: str) -> ResourceUsage: ...

    async def run_code(
        self,
        sandbox_id: str,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult: ...

    async def run_command(
        self,
        sandbox_id: str,
        command: str,
        *,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult: ...

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644
    ) -> int: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def list_files(
        self, sandbox_id: str, path: str = ".", *, depth: int = 1
    ) -> list[dict[str, Any]]: ...

    async def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]: ...

    async def remove_file(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None: ...

    async def make_dir(self, sandbox_id: str, path: str) -> None: ...
