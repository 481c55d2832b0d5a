"""The SDK's runner: service coroutines on the service's own loop, whichever loop the caller
is on (the blocking SDK's portal), and callbacks delivered back on the caller's loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from sandlot._portal import Portal
from sandlot.errors import ConfigError
from sandlot.service import BackgroundService, SandboxService, VolumeService

T = TypeVar("T")
E = TypeVar("E")


class Runner:
    """Runs service coroutines on the service's own loop, whichever loop the caller is on."""

    def __init__(self, manager: SandboxService, portal: Portal | None) -> None:
        self.manager = manager
        self.portal = portal

    async def __call__(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.portal is None:
            return await coro
        return await self.portal.run(coro)

    @property
    def background(self) -> BackgroundService:
        if not isinstance(self.manager, BackgroundService):
            raise ConfigError(f"{type(self.manager).__name__} runs no background commands")
        return self.manager

    def volumes(self) -> VolumeService:
        if not isinstance(self.manager, VolumeService):
            raise ConfigError(f"{type(self.manager).__name__} keeps no named volumes")
        return self.manager

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

    def wrap(self, callback: Callable[[E], None] | None) -> Callable[[E], None] | None:
        """Deliver streamed output on the caller's loop when the manager runs on another."""
        if callback is None or self.portal is None:
            return callback
        try:
            caller = asyncio.get_running_loop()
        except RuntimeError:
            return callback
        if caller is self.portal.loop:
            return callback

        def forward(item: E) -> None:
            caller.call_soon_threadsafe(callback, item)

        return forward
