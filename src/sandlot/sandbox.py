"""The SDK: ``AsyncSandbox`` (the one implementation) and ``Sandbox`` (its sync facade).

Embedded mode needs no server: sandboxes run under a process-wide
:class:`~sandlot.manager.SandboxManager` on a background loop, or under the manager you
pass in.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Self, TypeVar

from sandlot._portal import Portal, get_portal, on_exit
from sandlot.config import get_settings, make_limits
from sandlot.manager import SandboxManager
from sandlot.models import (
    ExecResult,
    FileInfo,
    ResourceUsage,
    SandboxInfo,
)
from sandlot.protocol import OutputCallback
from sandlot.service import SandboxService

T = TypeVar("T")

_default_lock = threading.Lock()
_default_manager: SandboxManager | None = None


async def _start_default() -> SandboxManager:
    manager = SandboxManager()
    await manager.start()
    return manager


def default_manager() -> SandboxManager:
    """The process-wide embedded manager (started on first use, closed at exit)."""
    global _default_manager
    with _default_lock:
        if _default_manager is None:
            _default_manager = get_portal().call(_start_default())
            on_exit(_default_manager.close)
        return _default_manager


class _Runner:
    """Runs service coroutines on the service's own loop, whichever loop the caller is on."""

    def __init__(self, manager: SandboxService, portal: Portal | None) -> None:
        self.manager = manager
        self.portal = portal

    async def __call__(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.portal is None:
            return await coro
        return await self.portal.run(coro)

    async def aclose(self) -> None:
        """Close a remote client this runner owns (the embedded manager outlives sandboxes)."""
        aclose = getattr(self.manager, "aclose", None)
        if aclose is not None:
            await aclose()

    @contextlib.asynccontextmanager
    async def closing_on_error(self) -> AsyncIterator[None]:
        try:
            yield
        except BaseException:
            await self.aclose()
            raise

    def wrap(self, callback: OutputCallback | None) -> OutputCallback | None:
        """Deliver streamed output on the caller's loop when the manager runs on another."""
        if callback is None or self.portal is None:
            return callback
        try:
            caller = asyncio.get_running_loop()
        except RuntimeError:
            return callback
        if caller is self.portal.loop:
            return callback

        def forward(text: str) -> None:
            caller.call_soon_threadsafe(callback, text)

        return forward


class AsyncCommands:
    """Shell commands in a sandbox (``sandbox.commands``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def run(
        self,
        command: str,
        *,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash; ``cd`` and ``export`` persist within ``session``."""
        run = self._sb._run
        return await run(
            run.manager.run_command(
                self._sb.id,
                command,
                session=session,
                timeout_s=timeout_s,
                env=env,
                cwd=cwd,
                input=input,
                on_stdout=run.wrap(on_stdout),
                on_stderr=run.wrap(on_stderr),
            )
        )


class AsyncFiles:
    """Files in the sandbox's /workspace (``sandbox.files``); paths are relative to it."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> int:
        """Create or replace a file (parents are made); returns its size in bytes."""
        raw = data.encode() if isinstance(data, str) else data
        run = self._sb._run
        return await run(run.manager.write_file(self._sb.id, path, raw, mode=mode))

    async def read_bytes(self, path: str) -> bytes:
        run = self._sb._run
        return await run(run.manager.read_file(self._sb.id, path))

    async def read(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read_bytes(path)).decode(encoding)

    async def list(self, path: str = ".", *, depth: int = 1) -> list[FileInfo]:
        run = self._sb._run
        entries = await run(run.manager.list_files(self._sb.id, path, depth=depth))
        return [FileInfo.model_validate(e) for e in entries]

    async def stat(self, path: str) -> FileInfo:
        run = self._sb._run
        return FileInfo.model_validate(await run(run.manager.stat_file(self._sb.id, path)))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFoundError:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        run = self._sb._run
        await run(run.manager.remove_file(self._sb.id, path, recursive=recursive))

    async def make_dir(self, path: str) -> None:
        run = self._sb._run
        await run(run.manager.make_dir(self._sb.id, path))


class AsyncSandbox:
    """One sandbox. Create with :meth:`create`; use as an async context manager."""

    def __init__(self, info: SandboxInfo, runner: _Runner) -> None:
        self.info = info
        self._run = runner
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    @classmethod
    async def create(
        cls,
        *,
        backend: str | None = None,
        runtime: str | None = None,
        environment: str | None = None,
        memory_mb: int | None = None,
        cpu_cores: float | None = None,
        pids: int | None = None,
        timeout_s: float | None = None,
        disk_mb: int | None = None,
        network: bool | None = None,
        env: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> Self:
        """Start a sandbox. Unset limits take the settings (``SANDBOX_*`` variables).

        ``backend`` is ``bubblewrap`` (default), ``docker`` or ``unsafe-local``; ``runtime``
        (docker only) is ``runc`` or ``runsc`` (gVisor); ``environment`` names a YAML
        registry entry (``python3``, ``node``; images need the docker backend).

        Embedded by default; on a server with ``api_url`` (or ``SANDLOT_URL``), sending
        ``api_key`` (or ``SANDLOT_API_KEY``).

        Raises:
            ConfigError: a limit out of range (the message names it).
            BackendUnavailable: the backend cannot run here (``sandlot doctor`` says why).
            SandboxStartError: the sandbox did not start.
        """
        limits = make_limits(
            memory_mb=memory_mb,
            cpu_cores=cpu_cores,
            pids=pids,
            timeout_s=timeout_s,
            disk_mb=disk_mb,
        )
        runner = await cls._runner(manager, api_url, api_key)
        async with runner.closing_on_error():
            info = await runner(
                runner.manager.create(
                    backend=backend,
                    runtime=runtime,
                    environment=environment,
                    limits=limits,
                    network=network,
                    env=env,
                    metadata=metadata,
                    ttl_s=ttl_s,
                    idle_timeout_s=idle_timeout_s,
                )
            )
        return cls(info, runner)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> Self:
        """Attach to a running sandbox by id."""
        runner = await cls._runner(manager, api_url, api_key)
        async with runner.closing_on_error():
            info = await runner(runner.manager.get(sandbox_id))
        return cls(info, runner)

    @staticmethod
    async def _runner(
        manager: SandboxManager | None, api_url: str | None, api_key: str | None
    ) -> _Runner:
        if manager is not None:
            return _Runner(manager, None)
        settings = get_settings()
        url = api_url or settings.api_url
        if url:
            from sandlot.client import RemoteService

            return _Runner(RemoteService(url, api_key or settings.api_key), None)
        portal = get_portal()
        return _Runner(await asyncio.to_thread(default_manager), portal)

    async def run_code(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run Python; variables persist, and ``text`` is the last expression's repr."""
        run = self._run
        return await run(
            run.manager.run_code(
                self.id,
                code,
                timeout_s=timeout_s,
                on_stdout=run.wrap(on_stdout),
                on_stderr=run.wrap(on_stderr),
            )
        )

    async def refresh(self) -> SandboxInfo:
        self.info = await self._run(self._run.manager.get(self.id))
        return self.info

    async def usage(self) -> ResourceUsage:
        return await self._run(self._run.manager.usage(self.id))

    async def set_timeout(self, ttl_s: float) -> None:
        """Let the sandbox live ``ttl_s`` more seconds from now."""
        self.info = await self._run(self._run.manager.extend(self.id, ttl_s))

    async def kill(self) -> None:
        """Destroy the sandbox (artifacts in /workspace/artifacts are kept)."""
        try:
            self.info = await self._run(self._run.manager.destroy(self.id))
        finally:
            await self._run.aclose()

    close = kill

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.kill()


# ---------------------------------------------------------------------- sync facade
# Every method below is one line that hands the async implementation to the portal.


def _blocking(portal: Portal) -> Callable[[Coroutine[Any, Any, T]], T]:
    return portal.call


class Commands:
    def __init__(self, inner: AsyncCommands, portal: Portal) -> None:
        self._inner, self._call = inner, _blocking(portal)

    def run(self, command: str, **kwargs: Any) -> ExecResult:
        """See :meth:`AsyncCommands.run`."""
        return self._call(self._inner.run(command, **kwargs))


class Files:
    def __init__(self, inner: AsyncFiles, portal: Portal) -> None:
        self._inner, self._call = inner, _blocking(portal)

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> int:
        return self._call(self._inner.write(path, data, mode=mode))

    def read(self, path: str, encoding: str = "utf-8") -> str:
        return self._call(self._inner.read(path, encoding))

    def read_bytes(self, path: str) -> bytes:
        return self._call(self._inner.read_bytes(path))

    def list(self, path: str = ".", *, depth: int = 1) -> list[FileInfo]:
        return self._call(self._inner.list(path, depth=depth))

    def stat(self, path: str) -> FileInfo:
        return self._call(self._inner.stat(path))

    def exists(self, path: str) -> bool:
        return self._call(self._inner.exists(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        return self._call(self._inner.remove(path, recursive=recursive))

    def make_dir(self, path: str) -> None:
        return self._call(self._inner.make_dir(path))


class Sandbox:
    """Blocking twin of :class:`AsyncSandbox` (same arguments, same results)."""

    def __init__(self, inner: AsyncSandbox, portal: Portal) -> None:
        self._inner, self._call = inner, _blocking(portal)
        self.commands = Commands(inner.commands, portal)
        self.files = Files(inner.files, portal)

    @classmethod
    def create(cls, **kwargs: Any) -> Sandbox:
        """See :meth:`AsyncSandbox.create`."""
        portal = get_portal()
        return cls(portal.call(AsyncSandbox.create(**kwargs)), portal)

    @classmethod
    def connect(cls, sandbox_id: str, **kwargs: Any) -> Sandbox:
        portal = get_portal()
        return cls(portal.call(AsyncSandbox.connect(sandbox_id, **kwargs)), portal)

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> SandboxInfo:
        return self._inner.info

    def run_code(self, code: str, **kwargs: Any) -> ExecResult:
        """See :meth:`AsyncSandbox.run_code`."""
        return self._call(self._inner.run_code(code, **kwargs))

    def refresh(self) -> SandboxInfo:
        return self._call(self._inner.refresh())

    def usage(self) -> ResourceUsage:
        return self._call(self._inner.usage())

    def set_timeout(self, ttl_s: float) -> None:
        return self._call(self._inner.set_timeout(ttl_s))

    def kill(self) -> None:
        return self._call(self._inner.kill())

    close = kill

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
