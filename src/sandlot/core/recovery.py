"""Recovery: what a manager does at start for the instances whose process died.

Every other instance of the data directory whose lock can be taken has lost its process
(:mod:`sandlot.core.instances`). For each, one at a time across processes: the artifacts of
its live sandboxes are kept first, as a destroy would have kept them (read from the host side:
their guests are gone), then every backend it used is swept, so no process, cgroup, mount,
loop device or directory of theirs survives; then its directory goes. A live instance is never
touched. A data directory laid out by a sandlot from before instances (backend state at the
top) is recovered the same way, once, as one more dead instance.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from sandlot.backends import KNOWN_BACKENDS, Backend, create_backend
from sandlot.config import Settings
from sandlot.core import instances
from sandlot.core.artifacts import Artifacts, DiskRoom
from sandlot.core.store import Store
from sandlot.errors import SandboxError
from sandlot.models import SandboxInfo

log = structlog.get_logger(__name__)

# How often a running manager looks for a peer of its data directory that died: recovery ran
# only when a manager started, so a long-lived server beside crashing scripts kept their
# disks, mounts and cgroups (and their disks' room, which its capacity took for free) until
# its own restart (red team, 2026-12-07).
LOOK_EVERY_S = 60.0


class DeadPeers:
    """The reaper's look for dead peers: at most one every :data:`LOOK_EVERY_S`, the recovery
    (``recover``, the one a start runs) in a task of its own, so that a peer's slow export or
    another process's recovery holds no reaper pass."""

    def __init__(self, recover: Callable[[], Awaitable[None]], data_dir: Path, mine: str) -> None:
        self._recover = recover
        self._data_dir = data_dir
        self._mine = mine
        self._next_look = time.monotonic() + LOOK_EVERY_S
        self._task: asyncio.Task[None] | None = None

    def look(self) -> None:
        if time.monotonic() < self._next_look or (self._task is not None and not self._task.done()):
            return
        self._next_look = time.monotonic() + LOOK_EVERY_S
        self._task = asyncio.create_task(self._look())

    async def _look(self) -> None:
        try:
            if await asyncio.to_thread(instances.any_dead, self._data_dir, self._mine):
                await self._recover()
        except Exception:
            log.exception("recovering a dead peer failed")

    async def settle(self) -> None:
        """Wait for a recovery under way (cut, it would leave a dead peer half swept)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


async def recover(
    store: Store,
    artifacts: Artifacts,
    settings: Settings,
    mine: str,
    legacy_backends: set[str],
    disk_room: DiskRoom | None = None,
) -> list[SandboxInfo]:
    """Recover every dead instance but ``mine``; return the orphans' records (to be ended).

    ``legacy_backends`` (the default one and those the pools use) are swept in a
    pre-instance layout besides those its records name (its pooled sandboxes were never
    stored). ``disk_room``: what holds room on the host's disk for an orphan's artifacts
    before they are copied (the manager's count of the disk).
    """
    data_dir = settings.data_dir
    fd = await asyncio.to_thread(instances.lock_recovery, data_dir)
    try:
        orphans: list[SandboxInfo] = []
        # Off the loop: telling a live peer from a dead one waits a little on each lock.
        for dead in await asyncio.to_thread(instances.dead, data_dir, mine):
            names = dead.backends() | store.backends_used(dead.holder.instance)
            records = store.list(live_only=True, instance=dead.holder.instance)
            log.warning(
                "recovering the instance of a process that ended",
                instance=dead.holder.instance,
                pid=dead.holder.pid,
                sandboxes=len(records),
            )
            swept = False
            try:
                swept = await _recover_one(
                    records, names, dead.settings(settings), artifacts, disk_room
                )
            finally:
                dead.remove(sweep_ok=swept)
            if swept:
                store.release_instance(dead.holder.instance)
            orphans += records
        legacy = store.list(live_only=True, instance="")
        if legacy or instances.legacy_leftovers(data_dir):
            names = store.backends_used("") | legacy_backends
            if await _recover_one(legacy, names, settings, artifacts, disk_room):
                instances.remove_legacy(data_dir)
            orphans += legacy
        return orphans
    finally:
        os.close(fd)


async def _recover_one(
    records: list[SandboxInfo],
    names: set[str],
    settings: Settings,
    artifacts: Artifacts,
    disk_room: DiskRoom | None,
) -> bool:
    """Keep the records' artifacts, sweep the named backends of one dead instance (its
    ``settings.data_dir``); return whether every sweep succeeded."""
    backends: dict[str, Backend] = {}
    swept = True
    for name in sorted(names & set(KNOWN_BACKENDS)):
        try:
            backends[name] = create_backend(name, settings)
        except SandboxError as exc:
            log.warning("recovery sweep skipped", backend=name, error=str(exc))
            swept = False
    try:
        for info in records:
            await _rescue_artifacts(info, artifacts, backends.get(info.backend), disk_room)
        for name, backend in backends.items():
            try:
                removed = await backend.sweep(keep=())
            except Exception as exc:
                # Whatever a dead sandbox left behind, this manager starts (a deep tree's
                # RecursionError failed every start on its data dir: red team, 2026-12-06);
                # the instance's directory is kept for the next sweep.
                log.warning("recovery sweep skipped", backend=name, error=repr(exc))
                swept = False
                continue
            if removed:
                log.warning("removed orphaned sandboxes", backend=name, ids=removed)
    finally:
        for backend in backends.values():
            await backend.close()
    return swept


async def _rescue_artifacts(
    info: SandboxInfo, artifacts: Artifacts, backend: Backend | None, disk_room: DiskRoom | None
) -> None:
    if backend is None:
        return
    try:
        workspace = backend.workspace_on_host(info.id)
        if workspace is not None:
            await artifacts.export_from_host(info, workspace, disk_room)
    except Exception as exc:  # the orphan's remains are hostile: any failure
        log.warning("artifacts of an orphan not kept", sandbox=info.id, error=repr(exc))
