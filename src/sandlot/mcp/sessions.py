"""Each MCP session's default sandbox: made on the first tool call that names no sandbox,
destroyed when the session ends, so a client can just call ``run_code``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from sandlot.errors import SandboxError
from sandlot.requests import SandboxSpec
from sandlot.service import SandboxService

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Binding:
    """Who a tool call acts as: the service it runs on (already scoped to the caller) and
    the key its default sandboxes are filed under (an API key's id; one key for stdio)."""

    service: SandboxService
    caller: str


# Gets the HTTP request a tool call came in (None on stdio) and says whom it acts as.
Resolver = Callable[[Any], Binding]


# (the caller: an API key's id or "local", the MCP session id or "" where there is none)
SessionKey = tuple[str, str]


@dataclass
class _Entry:
    service: SandboxService
    sandbox_id: str | None = None


class DefaultSandboxes:
    """The default sandbox of every open session, by caller and session.

    A session is keyed by its caller too: a session id that leaks to another API key gives
    that key its own sandbox (made as its own tenant), never the first key's.
    """

    def __init__(self) -> None:
        self._entries: dict[SessionKey, _Entry] = {}
        self._locks: dict[SessionKey, asyncio.Lock] = {}

    def known(self, key: SessionKey) -> str | None:
        entry = self._entries.get(key)
        return entry.sandbox_id if entry else None

    async def get(self, key: SessionKey, service: SandboxService) -> tuple[str, bool]:
        """The session's sandbox id, and whether it was made by this call. Two first calls
        of one session at once make one sandbox, not two."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                entry = self._entries.get(key)
                if entry is not None and entry.sandbox_id is not None:
                    return entry.sandbox_id, False
                info = await service.create(SandboxSpec(metadata={"made_by": "mcp"}))
                self._entries[key] = _Entry(service, info.id)
                log.info("mcp default sandbox made", sandbox_id=info.id, caller=key[0])
                return info.id, True
        finally:
            # A session whose create failed (its tenant at quota) has no end registered to
            # drop its lock: dropped here once nobody waits on it, or each such session
            # left one behind for the server's life (red team, 2026-12-06).
            if key not in self._entries and not getattr(lock, "_waiters", None):
                self._locks.pop(key, None)

    def forget(self, key: SessionKey, sandbox_id: str) -> None:
        """The sandbox is gone (destroyed by a tool, or expired): the next call makes one."""
        entry = self._entries.get(key)
        if entry is not None and entry.sandbox_id == sandbox_id:
            del self._entries[key]

    async def end(self, key: SessionKey) -> None:
        """The session is over: destroy its sandbox, if it made one."""
        entry = self._entries.pop(key, None)
        self._locks.pop(key, None)
        if entry is None or entry.sandbox_id is None:
            return
        try:
            await entry.service.destroy(entry.sandbox_id)
        except SandboxError as exc:
            # Already gone (a TTL, an operator) is fine; a session's end has nobody to tell.
            log.info("mcp default sandbox gone", sandbox_id=entry.sandbox_id, code=exc.code)
        else:
            log.info("mcp default sandbox destroyed", sandbox_id=entry.sandbox_id)

    async def close(self) -> None:
        """End every session still open (the server is stopping)."""
        await asyncio.gather(*(self.end(key) for key in list(self._entries)))
