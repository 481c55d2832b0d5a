"""Teardowns: what a destroyed sandbox held, released after its destroy has returned.

A destroy returns once nothing of the sandbox runs (``Backend.halt``); unmounting its disk,
removing its cgroup, network and files (``Backend.stop``, ~4-7 ms on bubblewrap, longer for a
disk full of unwritten data) then runs here, off the caller's path. Until a teardown ends:

- its sandbox still counts against its owner's quota and this host's capacity, as it did
  while the destroy waited for it; a create refused for that room waits (boundedly) for the
  teardowns that could free it and is decided again (``SandboxManager.create``), so
  destroying one sandbox and creating the next at once works at a full quota;
- the manager says "released" only when it ends (a cluster's ledger frees the quota then).

A manager's close waits for every teardown before its sweep. Other processes on the same data
directory count the sandbox too until then: its record is saved ``held`` with its end and
released when the teardown ends (``Store.release``); a create of theirs refused for that room
polls for the release.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from sandlot.core.live import Live
from sandlot.models import SandboxInfo

log = structlog.get_logger(__name__)

# The longest a refused create waits for teardowns before it is decided again: a sandbox can
# make its own slow (a disk full of data to write back at the unmount).
WAIT_FOR_ROOM_S = 5.0


class Teardowns:
    """The teardowns under way in one manager; ``ended(info)`` is told of each as it ends."""

    def __init__(self, ended: Callable[[SandboxInfo], None]) -> None:
        self._ended = ended
        self._under_way: dict[str, tuple[Live, asyncio.Task[None]]] = {}

    def start(self, live: Live) -> None:
        """Release what ``live`` holds in the background (its guest is halted already)."""
        if live.id in self._under_way:
            return  # a second destroy of the same sandbox: one teardown
        task = asyncio.create_task(self._stop(live), name=f"teardown {live.id}")
        self._under_way[live.id] = (live, task)  # before the task first runs

    def infos(self) -> list[SandboxInfo]:
        """The records of the sandboxes still being torn down (they hold their limits)."""
        # Copied in one step first: a volume's create reads this from its worker thread.
        return [live.info for live, _ in list(self._under_way.values())]

    async def wait_for_room(self, owner: str | None) -> bool:
        """Wait, at most :data:`WAIT_FOR_ROOM_S`, for the teardowns under way now of
        ``owner`` (or of anyone, for None: the host's room is shared); False if there were
        none, so waiting could not change a refusal."""
        tasks = [
            task
            for live, task in self._under_way.values()
            if owner is None or live.info.owner == owner
        ]
        if not tasks:
            return False
        await asyncio.wait(tasks, timeout=WAIT_FOR_ROOM_S)
        return True

    async def wait(self, sandbox_id: str) -> None:
        """Wait until the teardown of ``sandbox_id`` (if one is under way) has ended."""
        under_way = self._under_way.get(sandbox_id)
        if under_way is not None:
            await asyncio.wait([under_way[1]])

    async def settle(self) -> None:
        """Wait until every teardown started so far has ended (each logs its own failure)."""
        while self._under_way:
            await asyncio.wait([task for _, task in self._under_way.values()])

    async def _stop(self, live: Live) -> None:
        try:
            await live.backend.stop(live.id)
        except Exception as exc:
            # Whatever it left (a mount, a cgroup) is swept at close or at the next start.
            log.warning("sandbox teardown failed", sandbox=live.id, error=repr(exc))
        finally:
            self._under_way.pop(live.id, None)
            self._ended(live.info)
