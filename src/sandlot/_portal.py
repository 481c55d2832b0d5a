"""A background event loop that sync code (and foreign loops) hand coroutines to.

The embedded default manager lives here, so ``Sandbox`` (sync) and ``AsyncSandbox`` used from
any loop share one manager per process, and the thread that forks sandbox processes lives as
long as the process (their parent-death signal is tied to it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_portal: Portal | None = None


class Portal:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="sandlot-portal", daemon=True
        )
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the portal loop and block for its result (sync callers only)."""
        if _running_loop() is self.loop:
            coro.close()
            raise RuntimeError("Portal.call would deadlock on the portal's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the portal loop from any loop."""
        if _running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def get_portal() -> Portal:
    global _portal
    with _lock:
        if _portal is None:
            _portal = Portal()
        return _portal


_shutdown_hooks: list[Any] = []


def on_exit(coro_factory: Any) -> None:
    """Run ``coro_factory()`` on the portal at interpreter exit (e.g. close the manager)."""
    _shutdown_hooks.append(coro_factory)


@atexit.register
def _shutdown() -> None:
    if _portal is None:
        return
    for factory in reversed(_shutdown_hooks):
        # Best effort at exit: whatever is left, the next start's sweep removes.
        with contextlib.suppress(Exception):
            _portal.call(factory(), timeout_s=30)
