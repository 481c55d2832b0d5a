"""Turns on one model shared by tenants: one call at a time, and the waiting calls served
round robin by caller (tenant), first come first served within a caller.

First come first served for all let a swarm task, which queues its five roles' calls at
once, put another tenant's one call behind up to ten of its own (two swarm tasks). Now a
call waits for at most one call of each other tenant waiting before it is served.
"""

from __future__ import annotations

import asyncio
from collections import deque


class FairTurns:
    """An asyncio lock whose waiters are served round robin by ``caller``. Belongs to one
    event loop, as an :class:`asyncio.Lock` does."""

    def __init__(self) -> None:
        self._held = False
        self._holder: str | None = None  # whose call holds the turn
        # Callers in the order they are served next: the one served moves to the end.
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}

    def locked(self) -> bool:
        return self._held

    def others_waiting(self, caller: str | None) -> bool:
        """Whether a call of another caller than ``caller`` waits for the turn; safe to ask
        from the model's own thread (the dict copied in one step), so that a long job can
        end early and queue again. A caller's own calls do not count: its job splitting for
        them would only make it read its prompt again (red team, 2026-12-06)."""
        return any(waiting != caller for waiting in list(self._waiting))

    def waiting(self) -> dict[str | None, int]:
        """How many calls each caller has waiting (for tests and metrics)."""
        return {caller: len(queue) for caller, queue in self._waiting.items()}

    async def acquire(self, caller: str | None) -> None:
        if not self._held and not self._waiting:
            self._held, self._holder = True, caller
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(caller, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed the turn just as it was cancelled: pass it on
            else:
                self._forget(caller, turn)
            raise

    def release(self) -> None:
        """Hand the turn to the next caller's first waiting call, or free it."""
        if len(self._waiting) > 1 and next(iter(self._waiting)) == self._holder:
            # The caller that just had the turn goes after the others waiting, even where it
            # queued its next call before they queued theirs.
            self._waiting[self._holder] = self._waiting.pop(self._holder)
        while self._waiting:
            caller = next(iter(self._waiting))
            queue = self._waiting.pop(caller)
            turn = queue.popleft()
            if queue:
                self._waiting[caller] = queue  # to the back of the round
            if not turn.done():
                turn.set_result(None)
                self._holder = caller
                return
        self._held = False

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
