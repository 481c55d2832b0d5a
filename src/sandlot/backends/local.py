"""``unsafe-local``: the guest agent as a plain child process, with NO isolation.

For unit tests of the manager and SDK, and for development on a machine without bubblewrap.
It runs the very same guest program as every other backend (from the package's own
``sandlot/guest``, with the host's interpreter, see :mod:`sandlot.backends.launch`), so
everything but the walls (limits, namespaces, seccomp) behaves the same. Never point it at
untrusted code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Collection
from pathlib import Path
from typing import ClassVar

import structlog

from sandlot._fs import remove_tree
from sandlot.backends.base import Check, GuestProcess, GuestSpec
from sandlot.backends.launch import GUEST_SOURCE_DIR, guest_argv, guest_env
from sandlot.config import Settings
from sandlot.models import ResourceUsage

log = structlog.get_logger(__name__)


class LocalBackend:
    name: ClassVar[str] = "unsafe-local"
    any_environment: ClassVar[bool] = False
    runtimes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, settings: Settings) -> None:
        self.root = settings.data_dir.resolve() / "local-sandboxes"
        self._guests: dict[str, GuestProcess] = {}

    @classmethod
    def probe(cls, settings: Settings, runtime: str | None = None) -> list[Check]:
        # It needs only the interpreter running this code; allow_unsafe is the manager's call.
        return []

    def _workspace(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "workspace"

    async def start(self, spec: GuestSpec) -> GuestProcess:
        old = self._guests.pop(spec.sandbox_id, None)
        if old is not None:
            await self._kill(old)
        else:
            log.warning("sandbox without isolation", backend=self.name, sandbox=spec.sandbox_id)
        workspace = self._workspace(spec.sandbox_id)
        # Its code runs as the server's own uid: no other host uid needs to enter (0700).
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for directory in (workspace.parent, workspace):
            directory.mkdir(mode=0o700, exist_ok=True)
        env = guest_env(
            spec.env,
            workspace=str(workspace),
            path=os.environ.get("PATH", "/usr/bin:/bin"),
            shell_state=str(workspace.parent / "shells"),
            shared_pids=True,
        )
        process = await asyncio.create_subprocess_exec(
            *guest_argv(sys.executable, str(GUEST_SOURCE_DIR)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workspace,
            env=env,
            start_new_session=True,
            limit=1 << 20,
        )
        guest = GuestProcess(process)
        self._guests[spec.sandbox_id] = guest
        return guest

    @staticmethod
    async def _kill(guest: GuestProcess) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(guest.pid, signal.SIGKILL)
        # Children that left the group (kernel, shells) are in their own sessions.
        guest.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(guest.wait(), 5.0)

    async def started(self, sandbox_id: str) -> None:
        """Nothing was relaxed for the start: this backend sets no limits."""

    async def halt(self, sandbox_id: str) -> None:
        guest = self._guests.get(sandbox_id)
        if guest is not None:
            await self._kill(guest)

    async def stop(self, sandbox_id: str) -> None:
        guest = self._guests.pop(sandbox_id, None)
        if guest is not None:
            await self._kill(guest)
        await asyncio.to_thread(remove_tree, self.root / sandbox_id)

    async def usage(self, sandbox_id: str, *, full: bool = True) -> ResourceUsage:
        return ResourceUsage()

    def volumes_available(self, runtime: str | None = None) -> tuple[bool, str]:
        return False, "unsafe-local runs sandboxes in no mount namespace of their own"

    def workspace_on_host(self, sandbox_id: str) -> Path | None:
        workspace = self._workspace(sandbox_id)
        return workspace if workspace.is_dir() else None

    async def sweep(self, keep: Collection[str]) -> list[str]:
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for path in self.root.iterdir():
                if path.name not in keep and path.name not in self._guests:
                    await asyncio.to_thread(remove_tree, path)
                    removed.append(path.name)
        return removed

    async def close(self) -> None:
        self._guests.clear()
