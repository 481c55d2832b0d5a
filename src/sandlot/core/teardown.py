"""Teardowns: what a destroyed sandbox held, released after its destroy has returned.

A destroy returns once nothing of the sandbox runs (``Backend.halt``); unmounting its disk,
removing its cgroup, network and files (``Backend.stop``, ~4-7 ms on bubblewrap) then runs
here, off the caller's path. Until a teardown ends, its sandbox still counts against its
owner's quota and the host's capacity, as it did while the destroy waited for it; a create
refused for room waits for the teardowns under way and is admitted or refused again
(``SandboxManager.create``), so destroying one sandbox and creating the next at once works at
a full quota as it always did. A manager's close waits for every teardown before its sweep.
"""

from __future__ import annotations

import asyncio

import structlog

from sandlot.core.live import Live
from sandlot.models import SandboxInfo

log = structlog.get_logger(__name__)


class Teardowns:
    """The teardowns under way in one manager."""

    def __init__(self) -> None:
        self._ending: dict[str, Live] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, live: Live) -> None:
        """Release what ``live`` holds in the background (its guest is halted already)."""
        self._ending[live.id] = live
        task = asyncio.create_task(self._stop(live), name=f"teardown {live.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def infos(self) -> list[SandboxInfo]:
        """The records of the sandboxes still being torn down (they hold their limits)."""
        return [live.info for live in self._ending.values()]

    def __len__(self) -> int:
        return len(self._tasks)

    async def settle(self) -> None:
        """Wait until every teardown started so far has ended (each logs its own failure)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _stop(self, live: Live) -> None:
        try:
            await live.backend.stop(live.id)
        except Exception as exc:
            # Whatever it left (a mount, a cgroup) is swept at close or at the next start.
            log.warning("sandbox teardown failed", sandbox=live.id, error=repr(exc))
        finally:
            self._ending.pop(live.id, None)
