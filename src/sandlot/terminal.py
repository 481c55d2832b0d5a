"""Terminals in a sandbox (``sandbox.pty``), E2B's ``sandbox.pty`` with our names.

``pty.create(cols, rows, cmd, cwd, env, on_data)`` opens a pseudo-terminal running ``cmd``
(default: an interactive bash, sh where bash is absent) and returns a handle: ``pid``,
``send_input()``, ``resize()``, ``kill()``, ``wait()`` and ``read()``. Output is raw bytes
(escape sequences included) passed to ``on_data`` as it comes; a remote client streams it
over the server's WebSocket. A terminal counts against the sandbox's cap of background
commands and ends with the sandbox.
"""

from __future__ import annotations

import base64
from typing import Protocol

from sandlot._runner import Runner
from sandlot._sync import SyncTwin, blocking
from sandlot.models import CommandInfo, DataCallback, ExecResult
from sandlot.requests import OpenPty, PtySize, build


class AsyncSandbox(Protocol):
    """What a terminal needs of its sandbox (``sandlot.sandbox.AsyncSandbox``, which imports
    this module)."""

    @property
    def id(self) -> str: ...

    @property
    def _run(self) -> Runner: ...

    @property
    def pty(self) -> AsyncPty: ...


class AsyncPtyHandle:
    """One open terminal. Every verb names it by pid and ``info.command_id`` (a pid may go to
    a later command once the sandbox's guest restarts: see ``AsyncCommandHandle``)."""

    def __init__(self, sandbox: AsyncSandbox, info: CommandInfo) -> None:
        self._sb = sandbox
        self.info = info
        self._offset = 0

    @property
    def pid(self) -> int:
        return self.info.pid

    async def send_input(self, data: str | bytes) -> None:
        """Type ``data`` (``"\\x03"`` is ^C, ``"\\r"`` Enter)."""
        raw = data.encode() if isinstance(data, str) else data
        run = self._sb._run
        which = self.info.command_id
        await run(run.background.send_pty_input(self._sb.id, self.pid, raw, command_id=which))

    async def resize(self, cols: int, rows: int) -> None:
        """Give the terminal a new size; its foreground programs get SIGWINCH."""
        size = build(PtySize, cols=cols, rows=rows)
        run = self._sb._run
        which = self.info.command_id
        await run(run.background.resize_pty(self._sb.id, self.pid, size, command_id=which))

    async def read(self) -> bytes:
        """The output since the last ``read()`` (the server keeps the newest 256 KiB)."""
        run = self._sb._run
        which = self.info.command_id
        window = await run(
            run.background.pty_output(self._sb.id, self.pid, self._offset, command_id=which)
        )
        self._offset = window.next_offset
        return base64.b64decode(window.data_b64)

    async def wait(self, timeout_s: float | None = None) -> ExecResult:
        """Its result once its process ends (``exit_code``, ``kill_reason``; ``stdout`` is
        empty: the output went to ``on_data`` and ``read()``).

        Raises:
            CommandStillRunning: it did not end within ``timeout_s`` (it runs on).
        """
        run = self._sb._run
        which = self.info.command_id
        return await run(
            run.background.wait_command(self._sb.id, self.pid, timeout_s, command_id=which)
        )

    async def kill(self) -> bool:
        """End it and every process of its session; whether it was still running."""
        run = self._sb._run
        which = self.info.command_id
        return await run(run.background.kill_command(self._sb.id, self.pid, command_id=which))


class AsyncPty:
    """Terminals in a sandbox (``sandbox.pty``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        cmd: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        on_data: DataCallback | None = None,
        timeout_s: float | None = None,
    ) -> AsyncPtyHandle:
        """Open a terminal of ``cols`` x ``rows`` running ``cmd`` (a shell command line;
        default an interactive shell) in ``cwd`` (relative to /workspace); its output goes to
        ``on_data`` as raw bytes. It runs until its process ends, it is killed, ``timeout_s``
        passes or the sandbox is destroyed.

        Raises:
            BackgroundLimitReached: the sandbox runs its most background commands already.
        """
        request = build(
            OpenPty, cols=cols, rows=rows, command=cmd, cwd=cwd, env=env, timeout_s=timeout_s
        )
        run = self._sb._run
        info = await run(run.background.start_pty(self._sb.id, request, on_data=run.wrap(on_data)))
        return AsyncPtyHandle(self._sb, info)

    async def send_input(self, pid: int, data: str | bytes) -> None:
        """Type ``data`` into terminal ``pid`` (waits while its program does not read)."""
        raw = data.encode() if isinstance(data, str) else data
        run = self._sb._run
        await run(run.background.send_pty_input(self._sb.id, pid, raw))

    async def resize(self, pid: int, cols: int, rows: int) -> None:
        size = build(PtySize, cols=cols, rows=rows)
        run = self._sb._run
        await run(run.background.resize_pty(self._sb.id, pid, size))

    async def kill(self, pid: int) -> bool:
        run = self._sb._run
        return await run(run.background.kill_command(self._sb.id, pid))


class PtyHandle(SyncTwin[AsyncPtyHandle]):
    """Blocking twin of :class:`AsyncPtyHandle`."""

    send_input = blocking(AsyncPtyHandle.send_input)
    resize = blocking(AsyncPtyHandle.resize)
    read = blocking(AsyncPtyHandle.read)
    wait = blocking(AsyncPtyHandle.wait)
    kill = blocking(AsyncPtyHandle.kill)

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def info(self) -> CommandInfo:
        return self._inner.info


class Pty(SyncTwin[AsyncPty]):
    """Blocking twin of :class:`AsyncPty`."""

    send_input = blocking(AsyncPty.send_input)
    resize = blocking(AsyncPty.resize)
    kill = blocking(AsyncPty.kill)

    def create(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        cmd: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        on_data: DataCallback | None = None,
        timeout_s: float | None = None,
    ) -> PtyHandle:
        handle = self._portal.call(
            self._inner.create(
                cols, rows, cmd=cmd, cwd=cwd, env=env, on_data=on_data, timeout_s=timeout_s
            )
        )
        return PtyHandle(handle, self._portal)

    create.__doc__ = AsyncPty.create.__doc__
