"""The manager's verbs on a sandbox's background commands and terminals: each finds the
caller's live sandbox and hands the work to its
:class:`~sandlot.core.background.BackgroundCommands`.

Each one's end is the manager's "command_ended" event (fields ``info``: the sandbox's
:class:`~sandlot.models.SandboxInfo`, ``command``: its
:class:`~sandlot.models.CommandInfo`, ``result``: its
:class:`~sandlot.models.ExecResult` or None, ``kill_reason`` and ``webhook``). A command
started with a ``webhook_url`` needs a ``webhook_check`` (the REST server's,
``server/webhooks.py``), which may refuse the URL before the command starts: an embedded
manager sends no webhooks, so it refuses such a command rather than drop its webhook.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from sandlot.core.background import BackgroundCommands, CommandEnded
from sandlot.core.live import Live
from sandlot.core.lookup import Lookup
from sandlot.errors import ConfigError
from sandlot.models import (
    CommandInfo,
    DataCallback,
    ExecResult,
    OutputCallback,
    PtyOutput,
)
from sandlot.requests import OpenPty, PtySize, RunCommand

# Checks a webhook URL before its command starts (the owner of the sandbox, the URL).
WebhookCheck = Callable[[str, str], Awaitable[None]]


class JobVerbs(Lookup):
    """Background commands and terminals, by sandbox id."""

    _background: dict[str, BackgroundCommands]
    # Set by whoever delivers webhooks (the REST server); None: a webhook_url is refused.
    webhook_check: WebhookCheck | None = None

    def _emit(self, event: str, **fields: Any) -> None:
        raise NotImplementedError  # the manager's

    def _commands(self, sandbox_id: str, owner: str | None) -> tuple[Live, BackgroundCommands]:
        live = self._get_live(sandbox_id, owner)
        commands = self._background.get(sandbox_id)
        if commands is None:
            ended = functools.partial(self._command_ended, live)
            commands = BackgroundCommands(self.settings.max_background_commands, ended)
            self._background[sandbox_id] = commands
        return live, commands

    def _command_ended(self, live: Live, ended: CommandEnded) -> None:
        self._emit(
            "command_ended",
            info=live.info,
            command=ended.info,
            result=ended.result,
            kill_reason=ended.kill_reason,
            webhook=ended.webhook,
        )

    async def start_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        """Start a command in the background (see :mod:`sandlot.core.background`).

        Raises:
            ConfigError: a ``webhook_url`` without a ``webhook_check`` to take it.
            InvalidRequest: the ``webhook_check`` refused the URL.
        """
        live, commands = self._commands(sandbox_id, owner)
        if request.webhook_url is not None:
            if self.webhook_check is None:
                raise ConfigError(
                    "this manager sends no webhooks (only `sandlot serve` running its own "
                    "sandboxes does: not an embedded manager, nor a Ray cluster's node): "
                    "leave webhook_url out, or start the command through such a server"
                )
            await self.webhook_check(live.info.owner, request.webhook_url)
        return await commands.start(live, request, on_stdout, on_stderr)

    async def list_commands(
        self, sandbox_id: str, *, owner: str | None = None
    ) -> builtins.list[CommandInfo]:
        return self._commands(sandbox_id, owner)[1].list()

    # Each verb below that takes a pid takes the command's ``command_id`` too: given, it acts
    # on that command only (a pid is reused after a guest restart); left out, on the newest
    # command with that pid.

    async def command_info(
        self,
        sandbox_id: str,
        pid: int,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        return self._commands(sandbox_id, owner)[1].info(pid, command_id)

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
        return self._commands(sandbox_id, owner)[1].listen(pid, on_stdout, on_stderr, command_id)

    async def wait_command(
        self,
        sandbox_id: str,
        pid: int,
        timeout_s: float | None = None,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        return await self._commands(sandbox_id, owner)[1].wait(pid, timeout_s, command_id)

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
        commands = self._commands(sandbox_id, owner)[1]
        await commands.send_stdin(pid, data, eof=eof, command_id=command_id)

    async def kill_command(
        self,
        sandbox_id: str,
        pid: int,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> bool:
        return await self._commands(sandbox_id, owner)[1].kill(pid, command_id)

    async def start_pty(
        self,
        sandbox_id: str,
        request: OpenPty,
        *,
        on_data: DataCallback | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        """Open a terminal; its pid takes the background verbs (wait, kill, stdin)."""
        live, commands = self._commands(sandbox_id, owner)
        return await commands.start_pty(live, request, on_data)

    async def resize_pty(
        self,
        sandbox_id: str,
        pid: int,
        size: PtySize,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        await self._commands(sandbox_id, owner)[1].resize_pty(pid, size, command_id)

    async def send_pty_input(
        self,
        sandbox_id: str,
        pid: int,
        data: bytes,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        await self._commands(sandbox_id, owner)[1].send_pty_input(pid, data, command_id)

    async def pty_output(
        self,
        sandbox_id: str,
        pid: int,
        offset: int = 0,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> PtyOutput:
        return self._commands(sandbox_id, owner)[1].pty_output(pid, offset, command_id)

    async def connect_pty(
        self,
        sandbox_id: str,
        pid: int,
        on_data: DataCallback,
        *,
        command_id: str | None = None,
        owner: str | None = None,
    ) -> CommandInfo:
        return self._commands(sandbox_id, owner)[1].listen_pty(pid, on_data, command_id)

    def disconnect_command(
        self,
        sandbox_id: str,
        pid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        *,
        command_id: str | None = None,
    ) -> None:
        """Stop streaming a background command's output to these callbacks."""
        commands = self._background.get(sandbox_id)
        if commands is not None:
            commands.unlisten(pid, on_stdout, on_stderr, command_id)

    def disconnect_pty(
        self, sandbox_id: str, pid: int, on_data: DataCallback, *, command_id: str | None = None
    ) -> None:
        commands = self._background.get(sandbox_id)
        if commands is not None:
            commands.unlisten_pty(pid, on_data, command_id)
