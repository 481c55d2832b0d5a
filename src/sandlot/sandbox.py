"""The SDK: ``AsyncSandbox`` (the one implementation) and ``Sandbox`` (its blocking twin,
generated from it by :mod:`sandlot._sync`).

Embedded mode needs no server: sandboxes run under a process-wide
:class:`~sandlot.core.SandboxManager` on a background loop, or under the manager you pass in.
Each method builds its verb's typed request (:mod:`sandlot.requests`) once from friendly
keyword arguments; a bad value is a :class:`~sandlot.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import threading
from typing import Any, Literal, Self, TypeVar, overload

from sandlot._portal import Portal, get_portal, on_exit
from sandlot._runner import Runner
from sandlot._sync import SyncTwin, blocking, blocking_classmethod, constructor
from sandlot.config import get_settings
from sandlot.core import SandboxManager
from sandlot.models import (
    ArtifactInfo,
    CommandInfo,
    ExecResult,
    FileInfo,
    Listing,
    OutputCallback,
    ResourceUsage,
    ResultCallback,
    SandboxInfo,
    Volumes,
    volume_mounts,
)
from sandlot.requests import (
    FilePath,
    ListFiles,
    RemoveFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
    WriteFile,
    build,
)
from sandlot.terminal import AsyncPty, Pty
from sandlot.tools import ToolExecutor, default_registry

T = TypeVar("T")
E = TypeVar("E")  # what a streaming callback receives: a chunk of text, a Result

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


class AsyncCommandHandle:
    """A command running in the background (``commands.run(..., background=True)``).

    Every verb names it by pid and ``info.command_id``: its pid may go to a later command
    (after the sandbox's guest restarts), and a handle must never act on that one; once its
    own is no longer kept, a verb raises ``CommandNotFound``.
    """

    def __init__(self, sandbox: AsyncSandbox, info: CommandInfo) -> None:
        self._sb = sandbox
        self.info = info

    @property
    def pid(self) -> int:
        return self.info.pid

    async def wait(self, timeout_s: float | None = None) -> ExecResult:
        """Its result once it ends (same fields as a foreground run's).

        Raises:
            CommandStillRunning: it did not end within ``timeout_s`` (it runs on).
        """
        run = self._sb._run
        which = self.info.command_id
        return await run(
            run.background.wait_command(self._sb.id, self.pid, timeout_s, command_id=which)
        )

    async def kill(self) -> bool:
        """Kill it and what it started; whether it was still running."""
        run = self._sb._run
        which = self.info.command_id
        return await run(run.background.kill_command(self._sb.id, self.pid, command_id=which))

    async def send_stdin(self, data: str | bytes) -> None:
        """Write to its stdin (waits while the command does not read)."""
        raw = data.encode() if isinstance(data, str) else data
        await self._send_stdin(raw, eof=False)

    async def close_stdin(self) -> None:
        """Close its stdin: the command reads end of file."""
        await self._send_stdin(b"", eof=True)

    async def _send_stdin(self, raw: bytes, *, eof: bool) -> None:
        run = self._sb._run
        which = self.info.command_id
        await run(
            run.background.send_command_stdin(self._sb.id, self.pid, raw, eof=eof, command_id=which)
        )


class AsyncCommands:
    """Shell commands in a sandbox (``sandbox.commands``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    @overload
    async def run(
        self,
        command: str,
        *,
        background: Literal[False] = False,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        fresh: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult: ...
    @overload
    async def run(
        self,
        command: str,
        *,
        background: Literal[True],
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        fresh: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> AsyncCommandHandle: ...
    async def run(
        self,
        command: str,
        *,
        background: bool = False,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        fresh: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult | AsyncCommandHandle:
        """Run ``command`` with bash; ``cd`` and ``export`` persist within ``session``.

        ``input`` is written to the command's stdin. With ``fresh=True`` every process that
        earlier calls left is killed first and the command runs outside any session, in a
        clean environment and HOME: for checks that earlier code may influence only through
        files. A failing command is a result (check ``exit_code``), not an exception.

        With ``background=True`` it returns a handle at once (``pid``, ``wait()``,
        ``kill()``, ``send_stdin()``, ``close_stdin()``); it starts from the session's cwd
        and env without changing them, its output streams to ``on_stdout``/``on_stderr``,
        and it runs until it ends, its ``timeout_s`` passes, or the sandbox is destroyed.
        """
        request = build(
            RunCommand,
            command=command,
            session=session,
            timeout_s=timeout_s,
            env=env,
            cwd=cwd,
            input=input,
            fresh=fresh or None,
            background=background or None,
        )
        run = self._sb._run
        out, err = run.wrap(on_stdout), run.wrap(on_stderr)
        if background:
            info = await run(
                run.background.start_command(self._sb.id, request, on_stdout=out, on_stderr=err)
            )
            return AsyncCommandHandle(self._sb, info)
        return await run(
            run.manager.run_command(self._sb.id, request, on_stdout=out, on_stderr=err)
        )

    async def list(self) -> builtins.list[CommandInfo]:
        """The background commands still running (pid, command, started_at)."""
        run = self._sb._run
        return await run(run.background.list_commands(self._sb.id))

    async def connect(
        self,
        pid: int,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> AsyncCommandHandle:
        """A handle to the background command ``pid``; its further output streams to these
        callbacks too (embedded only)."""
        run = self._sb._run
        info = await run(
            run.background.connect_command(
                self._sb.id, pid, on_stdout=run.wrap(on_stdout), on_stderr=run.wrap(on_stderr)
            )
        )
        return AsyncCommandHandle(self._sb, info)

    async def kill(self, pid: int) -> bool:
        """Kill the background command ``pid``; whether it was still running."""
        run = self._sb._run
        return await run(run.background.kill_command(self._sb.id, pid))


class AsyncFiles:
    """Files in the sandbox's /workspace (``sandbox.files``); paths are relative to it."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> int:
        """Create or replace a file (parents are made); returns its size in bytes."""
        raw = data.encode() if isinstance(data, str) else data
        run = self._sb._run
        request = build(WriteFile, path=path, mode=mode)
        return await run(run.manager.write_file(self._sb.id, request, raw))

    async def read_bytes(self, path: str) -> bytes:
        """A file's content."""
        run = self._sb._run
        return await run(run.manager.read_file(self._sb.id, build(FilePath, path=path)))

    async def read(self, path: str, encoding: str = "utf-8") -> str:
        """A file's content, decoded."""
        return (await self.read_bytes(path)).decode(encoding)

    async def list(self, path: str = ".", *, depth: int = 1) -> Listing:
        """Entries below ``path``, ``depth`` levels down (a list); its ``truncated`` says
        why, where the listing stopped at its bound (100,000 entries or 4 MiB of names)."""
        run = self._sb._run
        request = build(ListFiles, path=path, depth=depth)
        return await run(run.manager.list_files(self._sb.id, request))

    async def stat(self, path: str) -> FileInfo:
        """One entry; raises FileNotFoundError (SandboxFileNotFound) if it is missing."""
        run = self._sb._run
        return await run(run.manager.stat_file(self._sb.id, build(FilePath, path=path)))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        try:
            await self.stat(path)
        except FileNotFoundError:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (its contents too with ``recursive``)."""
        run = self._sb._run
        request = build(RemoveFile, path=path, recursive=recursive)
        await run(run.manager.remove_file(self._sb.id, request))

    async def make_dir(self, path: str) -> None:
        """Create a directory and its parents."""
        run = self._sb._run
        await run(run.manager.make_dir(self._sb.id, build(FilePath, path=path)))


class AsyncSandbox:
    """One sandbox. Create with :meth:`create`; use as an async context manager."""

    def __init__(self, info: SandboxInfo, runner: Runner) -> None:
        self.info = info
        self._run = runner
        self._killed = False
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)

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
        volumes: Volumes | None = None,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> Self:
        """Start a sandbox. Unset limits take the settings (``SANDBOX_*`` variables).

        ``backend`` is ``bubblewrap`` (default), ``docker`` or ``unsafe-local``; ``runtime``
        (docker only) is ``runc`` or ``runsc`` (gVisor); ``environment`` names a YAML
        registry entry (``python3``, ``node``; images need the docker backend).
        ``volumes`` attaches named volumes (:class:`~sandlot.volume.Volume`) under
        /workspace: ``{"data": "/workspace/data"}`` (``"/workspace/data:ro"`` read-only),
        or a list of :class:`~sandlot.models.VolumeMount` (``read_only`` there).

        Embedded by default; on a server with ``api_url`` (or ``SANDLOT_URL``), sending
        ``api_key`` (or ``SANDLOT_API_KEY``).

        Raises:
            ConfigError: a limit out of range (the message names it).
            BackendUnavailable: the backend cannot run here (``sandlot doctor`` says why).
            SandboxStartError: the sandbox did not start.
        """
        spec = build(
            SandboxSpec,
            backend=backend,
            runtime=runtime,
            environment=environment,
            memory_mb=memory_mb,
            cpu_cores=cpu_cores,
            pids=pids,
            timeout_s=timeout_s,
            disk_mb=disk_mb,
            network=network,
            env=env,
            metadata=metadata,
            ttl_s=ttl_s,
            idle_timeout_s=idle_timeout_s,
            volumes=volume_mounts(volumes),
        )
        runner = await cls._runner(manager, api_url, api_key)
        async with runner.closing_on_error():
            info = await runner(runner.manager.create(spec))
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
        """Attach to a running sandbox by id (one made by another process, or on a server)."""
        runner = await cls._runner(manager, api_url, api_key)
        async with runner.closing_on_error():
            info = await runner(runner.manager.get(sandbox_id))
        return cls(info, runner)

    @classmethod
    async def list(
        cls,
        *,
        metadata: dict[str, str] | None = None,
        include_ended: bool = False,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The running sandboxes (with ``include_ended``, every recorded one) whose metadata
        holds every ``metadata`` item; on a server, those the API key may see."""
        runner = await cls._runner(manager, api_url, api_key)
        try:
            infos = await runner(runner.manager.list(include_ended=include_ended))
        finally:
            await runner.aclose()
        wanted = (metadata or {}).items()
        return [info for info in infos if wanted <= info.metadata.items()]

    async def artifacts(self) -> builtins.list[ArtifactInfo]:
        """What the sandbox left in ``/workspace/artifacts``: kept after it is destroyed (a
        destroyed sandbox's object still answers)."""
        try:
            return await self._run(self._run.manager.list_artifacts(self.id))
        finally:
            await self._close_if_killed()

    async def read_artifact(self, path: str) -> bytes:
        """The content of a kept artifact, by its path below ``artifacts/``."""
        try:
            return await self._run(self._run.manager.read_artifact(self.id, path))
        finally:
            await self._close_if_killed()

    async def _close_if_killed(self) -> None:
        # After kill() only what outlives the sandbox is asked for: a remote client opened
        # again for it is closed again, so nothing is left open.
        if self._killed:
            await self._run.aclose()

    @staticmethod
    async def _runner(
        manager: SandboxManager | None, api_url: str | None, api_key: str | None
    ) -> Runner:
        return await runner_for(manager, api_url, api_key)

    async def run_code(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> ExecResult:
        """Run Python; variables persist, and ``text`` is the last expression's repr.

        ``results`` holds the rich outputs: ``display(obj)``, matplotlib figures (PNG) and
        the last expression's value with its HTML, Markdown, image... forms (a DataFrame's
        table, say); ``on_result`` receives each as it is shown. A crash, timeout or resource
        kill of the code is a result (``ok`` is False, ``error`` and ``kill_reason`` say
        why), not an exception.
        """
        request = build(RunCode, code=code, timeout_s=timeout_s)
        run = self._run
        return await run(
            run.manager.run_code(
                self.id,
                request,
                on_stdout=run.wrap(on_stdout),
                on_stderr=run.wrap(on_stderr),
                on_result=run.wrap(on_result),
            )
        )

    async def run_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> ExecResult:
        """Run the tool ``name`` in this sandbox with ``arguments`` (``sandlot tools list``
        names them: the package's, ``SANDLOT_REGISTRY_DIR/tools``' and plugins'; over a
        server, this process's registry builds the command). A tool is one command in the
        sandbox: its failure is a result; an unknown tool or a bad argument is
        :class:`~sandlot.errors.InvalidRequest`, and then nothing ran.
        """
        run = self._run
        registry = default_registry(get_settings().registry_dir)
        executor = ToolExecutor(
            registry, lambda request: run(run.manager.run_command(self.id, request))
        )
        return await executor.run(name, arguments, timeout_s)

    async def refresh(self) -> SandboxInfo:
        """Read the sandbox's record again (status, expiry, last activity)."""
        self.info = await self._run(self._run.manager.get(self.id))
        return self.info

    async def usage(self) -> ResourceUsage:
        """Current memory, processes, CPU time and limit hits."""
        return await self._run(self._run.manager.usage(self.id))

    async def set_timeout(self, ttl_s: float) -> None:
        """Let the sandbox live ``ttl_s`` more seconds from now."""
        request = build(SetTimeout, ttl_s=ttl_s)
        self.info = await self._run(self._run.manager.extend(self.id, request))

    async def kill(self) -> None:
        """Destroy the sandbox (artifacts in /workspace/artifacts are kept)."""
        try:
            self.info = await self._run(self._run.manager.destroy(self.id))
        finally:
            self._killed = True
            await self._run.aclose()

    close = kill

    async def detach(self) -> None:
        """Let go of this object without destroying the sandbox: on a server, its client's
        connections are closed (a later call opens them again). The sandbox runs on until
        its timeout; ``connect`` finds it by id."""
        await self._run.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.kill()


# ---------------------------------------------------------------------- blocking twins
# One line per method: each is generated from its async twin (signature, docstring, types).


class CommandHandle(SyncTwin[AsyncCommandHandle]):
    """Blocking twin of :class:`AsyncCommandHandle`."""

    wait = blocking(AsyncCommandHandle.wait)
    kill = blocking(AsyncCommandHandle.kill)
    send_stdin = blocking(AsyncCommandHandle.send_stdin)
    close_stdin = blocking(AsyncCommandHandle.close_stdin)

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def info(self) -> CommandInfo:
        return self._inner.info


class Commands(SyncTwin[AsyncCommands]):
    """Blocking twin of :class:`AsyncCommands`."""

    @overload
    def run(
        self,
        command: str,
        *,
        background: Literal[False] = False,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        fresh: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult: ...
    @overload
    def run(
        self,
        command: str,
        *,
        background: Literal[True],
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        fresh: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandHandle: ...
    def run(self, command: str, *, background: bool = False, **options: Any) -> Any:
        result = self._portal.call(
            self._inner.run(command, background=background, **options)  # type: ignore[call-overload]
        )
        if isinstance(result, AsyncCommandHandle):
            return CommandHandle(result, self._portal)
        return result

    run.__doc__ = AsyncCommands.run.__doc__
    run.__signature__ = inspect.signature(AsyncCommands.run).replace(  # type: ignore[attr-defined]
        return_annotation="ExecResult | CommandHandle"
    )
    list = blocking(AsyncCommands.list)
    kill = blocking(AsyncCommands.kill)

    def connect(
        self,
        pid: int,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandHandle:
        handle = self._portal.call(
            self._inner.connect(pid, on_stdout=on_stdout, on_stderr=on_stderr)
        )
        return CommandHandle(handle, self._portal)

    connect.__doc__ = AsyncCommands.connect.__doc__


class Files(SyncTwin[AsyncFiles]):
    """Blocking twin of :class:`AsyncFiles`."""

    write = blocking(AsyncFiles.write)
    read = blocking(AsyncFiles.read)
    read_bytes = blocking(AsyncFiles.read_bytes)
    list = blocking(AsyncFiles.list)
    stat = blocking(AsyncFiles.stat)
    exists = blocking(AsyncFiles.exists)
    remove = blocking(AsyncFiles.remove)
    make_dir = blocking(AsyncFiles.make_dir)


class Sandbox(SyncTwin[AsyncSandbox]):
    """Blocking twin of :class:`AsyncSandbox` (same arguments, same results)."""

    def __init__(self, inner: AsyncSandbox, portal: Portal) -> None:
        super().__init__(inner, portal)
        self.commands = Commands(inner.commands, portal)
        self.files = Files(inner.files, portal)
        self.pty = Pty(inner.pty, portal)

    create = constructor(AsyncSandbox.create)
    connect = constructor(AsyncSandbox.connect)
    list = blocking_classmethod(AsyncSandbox.list)
    artifacts = blocking(AsyncSandbox.artifacts)
    read_artifact = blocking(AsyncSandbox.read_artifact)
    run_code = blocking(AsyncSandbox.run_code)
    run_tool = blocking(AsyncSandbox.run_tool)
    refresh = blocking(AsyncSandbox.refresh)
    usage = blocking(AsyncSandbox.usage)
    set_timeout = blocking(AsyncSandbox.set_timeout)
    kill = blocking(AsyncSandbox.kill)
    close = kill
    detach = blocking(AsyncSandbox.detach)

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> SandboxInfo:
        return self._inner.info

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


async def runner_for(
    manager: SandboxManager | None, api_url: str | None, api_key: str | None
) -> Runner:
    """What the SDK's calls run on: ``manager``; else a server at ``api_url`` (or
    SANDLOT_URL) with ``api_key``; else the process's default embedded manager."""
    if manager is not None:
        return Runner(manager, None)
    settings = get_settings()
    url = api_url or settings.api_url
    if url:
        from sandlot.client import RemoteService

        return Runner(RemoteService(url, api_key or settings.api_key), None)
    portal = get_portal()
    return Runner(await asyncio.to_thread(default_manager), portal)
