"""Turns on something a few may hold at once, shared by callers (tenants): at most ``limit``
holders, and the waiting served round robin by caller, first come first served within one.

Used for the local model (one call at a time: ``agent/providers/local.py``) and for webhook
deliveries (a few at once: ``server/webhooks.py``). First come first served for all let a
swarm task, which queues its five roles' calls at once, put another tenant's one call behind
up to ten of its own (two swarm tasks), and one tenant's hanging receivers hold another's
deliveries behind its whole queue. Now a call waits for at most one call of each other caller
waiting before it is served.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

_OLDEST = object()  # release()'s default: the caller that has held a place longest


class FairTurns:
    """An asyncio semaphore of ``limit`` places whose waiters are served round robin by
    ``caller``. Belongs to one event loop, as an :class:`asyncio.Lock` does."""

    def __init__(self, limit: int = 1) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self._holders: list[str | None] = []  # who holds the places, in the order given
        # Callers in the order they are served next: the one served moves to the end.
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}

    @property
    def held(self) -> int:
        return len(self._holders)

    def locked(self) -> bool:
        return len(self._holders) >= self.limit

    def others_waiting(self, caller: str | None) -> bool:
        """Whether a call of another caller than ``caller`` waits for a place; safe to ask
        from another thread (the dict copied in one step), so that a long job can end early
        and queue again. A caller's own calls do not count: its job splitting for them would
        only make it read its prompt again (red team, 2026-12-06)."""
        return any(waiting != caller for waiting in list(self._waiting))

    def waiting(self) -> dict[str | None, int]:
        """How many calls each caller has waiting (for tests and metrics)."""
        return {caller: len(queue) for caller, queue in self._waiting.items()}

    async def acquire(self, caller: str | None) -> None:
        if len(self._holders) < self.limit and not self._waiting:
            self._holders.append(caller)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release(caller)  # handed a place just as it was cancelled: pass it on
            else:
                self._forget(caller, turn)
            raise

    def release(self, caller: object = _OLDEST) -> None:
        """Give back ``caller``'s place (by default the longest held): to the next caller's
        first waiting call, or free."""
        who = self._holders[0] if caller is _OLDEST else cast("str | None", caller)
        self._holders.remove(who)
        if len(self._waiting) > 1 and next(iter(self._waiting)) == who:
            # The caller that just had the place goes after the others waiting, even where
            # it queued its next call before they queued theirs.
            self._waiting[who] = self._waiting.pop(who)
        while self._waiting:
            next_caller = next(iter(self._waiting))
            queue = self._waiting.pop(next_caller)
            turn = queue.popleft()
            if queue:
                self._waiting[next_caller] = queue  # to the back of the round
            if not turn.done():
                self._holders.append(next_caller)
                turn.set_result(None)
                return

    @asynccontextmanager
    async def turn(self, caller: str | None) -> AsyncIterator[None]:
        """Hold a place for the block."""
        await self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)

    def _forget(self, caller: str | None, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(caller)
        if queue is None:
            return
        try:
            queue.remove(turn)
        except ValueError:
            return
        if not queue:
            del self._waiting[caller]
