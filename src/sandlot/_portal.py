"""A background event loop that sync code (and foreign loops) hand coroutines to.

The embedded default manager lives here, so ``Sandbox`` (sync) and ``AsyncSandbox`` used from
any loop share one manager per process, and the thread that forks sandbox processes lives as
long as the process (their parent-death signal is tied to it). When the process ends, at exit
or on SIGTERM, the exit hooks (:func:`on_exit`) release what it holds.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine
from types import FrameType
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
            _release_before_executors_stop()
    _guard_sigterm()
    return _portal


_shutdown_hooks: list[Callable[[], Coroutine[Any, Any, object]]] = []
_releasing = False
_sigterm_decided = False
RELEASE_TIMEOUT_S = 30.0


def on_exit(coro_factory: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """Run ``coro_factory()`` on the portal when the process ends, normally or by SIGTERM
    (e.g. close the embedded manager: its pool and the sandboxes a script forgot)."""
    _shutdown_hooks.append(coro_factory)


def _release() -> None:
    """Run the exit hooks once, newest first."""
    global _releasing
    if _portal is None:
        return
    _releasing = True
    while _shutdown_hooks:
        factory = _shutdown_hooks.pop()
        # Best effort at exit: whatever is left, the next start's sweep removes.
        with contextlib.suppress(Exception):
            _portal.call(factory(), timeout_s=RELEASE_TIMEOUT_S)


def _release_before_executors_stop() -> None:
    """Run the hooks before the interpreter stops thread pools, not in a plain atexit hook.

    Closing a sandbox needs the portal loop's thread pool (``asyncio.to_thread``), and
    concurrent.futures refuses new work from its own exit hook on, which runs before atexit's:
    there the pool could not be released and its sandboxes stayed until the next start's
    sweep. Threading's exit hooks run in reverse order of registration, so registering after
    concurrent.futures.thread is imported puts this one first. A non-daemon thread still
    using the embedded SDK after the main thread returned loses it here; it could not have
    created or destroyed a sandbox past the pools' shutdown anyway.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # raised once the interpreter is exiting
            register(_release)


@atexit.register
def _release_at_exit() -> None:
    # For a portal made while the interpreter was already exiting; a no-op after _release.
    _release()


def _guard_sigterm() -> None:
    """Release the hooks on SIGTERM too, which would otherwise end the process at once.

    Only over the default action, and only from the main thread (the only one that may set a
    handler): an app that ignores SIGTERM or handles it keeps its choice, and its handler's
    exit (sys.exit) runs the hooks through the exit path above.
    """
    global _sigterm_decided
    if _sigterm_decided or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_decided = True
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _releasing:
        return  # the process is already ending through _release: let it finish
    _release()
    # Then die of the signal, as the default action would have made it.
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
