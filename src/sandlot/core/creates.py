"""The manager's create: admission (the owner's quota, the host's room, a warm pool's
sandbox or a fresh one), the named volumes' lease, and the new guest's boot.

A mixin of :class:`~sandlot.core.manager.SandboxManager`, which holds the state named below;
a refused create waits (boundedly) for the teardowns that could free its room
(:mod:`~sandlot.core.teardown`) and is decided again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import structlog

from sandlot.backends import Backend
from sandlot.core import admission, instances, placement
from sandlot.core.admission import HostCapacity
from sandlot.core.artifacts import artifact_limit_bytes
from sandlot.core.host_ledger import HostLedger, LedgerView, Reservation
from sandlot.core.instances import disks_written_mb
from sandlot.core.live import POOL_OWNER, Live, PoolKey
from sandlot.core.lookup import Lookup
from sandlot.core.pools import Pools, discard
from sandlot.core.store import Elsewhere
from sandlot.core.teardown import WAIT_FOR_ROOM_S, Teardowns
from sandlot.core.volume_verbs import VolumeVerbs
from sandlot.core.volumes import Lease, volume_totals_mb
from sandlot.errors import (
    BackendUnavailable,
    CapacityExhausted,
    QuotaExceeded,
    SandboxError,
    SandboxNotRunning,
    SandboxStartError,
)
from sandlot.models import Quota, ResolvedLimits, SandboxInfo, SandboxStatus
from sandlot.requests import SandboxSpec

log = structlog.get_logger(__name__)

# How often a refused create looks again at other processes' teardowns (a teardown takes
# a few ms; other processes do not tell us when theirs end).
HELD_ELSEWHERE_POLL_S = 0.02


class CreateVerbs(VolumeVerbs, Lookup):
    """Creating sandboxes."""

    _pools: Pools | None
    _ledger: HostLedger | None
    _capacity: HostCapacity
    _teardowns: Teardowns
    _closing: bool
    # MB that artifacts being kept now may still write (a destroy's export): promised.
    _exporting_mb: float
    _recovery_capacity: HostCapacity | None

    if TYPE_CHECKING:

        def _backend(self, name: str) -> Backend: ...

        def _emit(self, event: str, **fields: Any) -> None: ...

        def _live_infos(
            self, elsewhere: builtins.list[SandboxInfo] | None = None
        ) -> builtins.list[SandboxInfo]: ...

        def _end(
            self, info: SandboxInfo, status: SandboxStatus, reason: str, *, held: bool = False
        ) -> None: ...

    async def create(
        self,
        spec: SandboxSpec | None = None,
        *,
        owner: str = "local",
        quota: Quota | None = None,
    ) -> SandboxInfo:
        """Start a sandbox and return once its guest answers (from a warm pool where one holds
        exactly what is asked for).

        Raises:
            ConfigError: an unknown backend or an out-of-range setting.
            QuotaExceeded: ``owner`` already holds ``quota`` worth of live sandboxes.
            CapacityExhausted: the host has no room for the sandbox's limits.
            FileDescriptorsExhausted: this process has too few file descriptors left
                (a CapacityExhausted).
            BackendUnavailable: the backend cannot run on this host (or attach volumes).
            VolumeNotFound: ``owner`` has no volume of a name ``spec.volumes`` gives.
            VolumeInUse: one of them is attached to another sandbox.
            SandboxStartError: the backend failed to start the guest.
        """
        self._require_started()
        spec = spec or SandboxSpec()
        key = self.placement(spec.backend, spec.runtime, spec.environment)
        resolved = self.settings.resolve_limits(spec.limits())
        network = self.settings.network if spec.network is None else spec.network
        admission.check_metadata(spec.metadata, self.settings.max_metadata_bytes)
        # Taken before anything is admitted: the volumes are this sandbox's alone from here
        # until its destroy has halted it (or its create failed).
        lease = (
            await self._lease_volumes(self._backend(key.backend), key.runtime, owner, spec.volumes)
            if spec.volumes
            else None
        )
        try:
            return await self._create(spec, key, resolved, network, owner, quota, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    async def _create(
        self,
        spec: SandboxSpec,
        key: PoolKey,
        resolved: ResolvedLimits,
        network: bool,
        owner: str,
        quota: Quota | None,
        lease: Lease | None,
    ) -> SandboxInfo:
        fresh = False
        chosen: Live | None = None
        # Probed before the store's write lock is taken: only a filter runs under it.
        gone = instances.gone_of(self._store.live_elsewhere(), self.settings.data_dir)
        # Recorded with the sandbox: a manager that keeps its artifacts after this one died
        # (core/recovery.py) keeps them within it too.
        limit = artifact_limit_bytes(quota)

        def decide(elsewhere: Elsewhere) -> SandboxInfo:
            # Run inside the store's write transaction (no await): the other processes'
            # live records and this one's sandboxes are counted, and the new record saved,
            # before any other process on the data directory can admit one.
            nonlocal fresh, chosen
            infos = self._live_infos(instances.alive(elsewhere, gone))
            if quota is not None:
                admission.check_quota(infos, owner, resolved, quota)
            # A pooled sandbox was started without volumes: one with volumes starts afresh.
            taken = (
                self._pools.take(key, resolved, network, spec.env, owner)
                if self._pools and lease is None
                else None
            )
            if taken is not None:
                # Ownership and clocks start now for a sandbox that waited in the pool.
                self._claim(taken, spec, owner, quota)
                self._live[taken.id] = chosen = taken
                return taken.info
            # A pooled sandbox was reserved when it was started; a new one reserves now.
            with self._host_turn():
                self._check_host(infos, resolved)
                # Registered with its owner before the first await, so a concurrent create
                # of the same owner in this process counts it against the quota.
                made = self._new_live(key, resolved, network, spec.env, owner)
                if lease is not None:
                    made.spec = dataclasses.replace(made.spec, volumes=lease.volumes)
                    made.info.volumes = list(spec.volumes or [])
                    self._leases[made.id] = lease
                self._live[made.id] = chosen = made
                self._publish()
            fresh = True
            return made.info

        try:
            try:
                info = self._store.admit(decide, artifact_limit_bytes=limit)
            except (QuotaExceeded, CapacityExhausted) as refused:
                # The room may be held by sandboxes destroyed a moment ago: the owner's own
                # for its quota, anyone's for the host's. Once those teardowns end (or a
                # bound passes), decide again; with none under way, no wait.
                mine = owner if isinstance(refused, QuotaExceeded) else None
                if not await self._wait_for_room(mine, gone):
                    raise
                info = self._store.admit(decide, artifact_limit_bytes=limit)
        except BaseException:
            if chosen is not None:
                # Refused or not saved (the store failed): a new one was never started; a
                # pooled one is already the caller's in memory, so it goes.
                self._live.pop(chosen.id, None)
                self._leases.pop(chosen.id, None)  # the caller releases it
                if not fresh:
                    await discard(chosen)
            raise
        live = self._live[info.id]
        if self._pools is not None and lease is None:
            self._pools.asked(key, resolved, network, spec.env, owner, served=not fresh)
        if fresh:
            await self._boot(live)
            self._claim(live, spec, owner, quota)
            self._store.save(info)
        self._emit("created", info=info)
        log.info(
            "sandbox created",
            sandbox=info.id,
            backend=key.backend,
            runtime=key.runtime,
            environment=key.environment,
            memory_mb=resolved.memory_mb,
            network=network,
        )
        return info.model_copy()

    def _claim(self, live: Live, spec: SandboxSpec, owner: str, quota: Quota | None) -> None:
        """The sandbox is the caller's: its owner, metadata and clocks start now (also for
        one that waited in a pool)."""
        now = time.time()
        info = live.info
        info.owner = owner
        # A guest restarted later (state_lost) is the owner's from then on.
        live.spec = dataclasses.replace(live.spec, tenant=owner)
        info.metadata = spec.metadata or {}
        live.quota = quota
        info.created_at = info.last_active_at = now
        info.expires_at = now + (spec.ttl_s or self.settings.ttl_s)
        info.idle_timeout_s = spec.idle_timeout_s or self.settings.idle_timeout_s
        info.status = SandboxStatus.RUNNING

    def placement(
        self, backend: str | None, runtime: str | None, environment: str | None
    ) -> PoolKey:
        """Check the backend, runtime and environment go together; name them canonically.

        Raises:
            ConfigError: an unknown name, a combination the backend cannot run, or an
                unsafe backend without SANDBOX_ALLOW_UNSAFE.
        """
        return placement.resolve(self.settings, self._backend, backend, runtime, environment)

    def _new_live(
        self,
        key: PoolKey,
        limits: ResolvedLimits,
        network: bool,
        env: dict[str, str] | None,
        owner: str,
    ) -> Live:
        settings = self.settings
        backend = self._backend(key.backend)
        return Live.new(
            key,
            backend,
            limits,
            network,
            env,
            owner,
            ttl_s=settings.ttl_s,
            idle_timeout_s=settings.idle_timeout_s,
        )

    def _new_pooled(self, key: PoolKey, tenant: str | None) -> Live:
        """A sandbox for a pool, started for ``tenant`` (pools.py) where guests fork from a
        template per tenant; else for anyone."""
        limits = self.settings.resolve_limits(None)
        infos = self._live_infos()  # read before the host's turn: none waits on a store in it
        with self._host_turn():
            self._check_host(infos, limits)
            self._publish(also=limits)  # the pool registers it once this returns
        live = self._new_live(key, limits, self.settings.network, None, POOL_OWNER)
        if self.settings.guest_template_scope == "tenant":
            live.spec = dataclasses.replace(live.spec, tenant=tenant)
        return live

    def _host_turn(self) -> contextlib.AbstractContextManager[None]:
        return self._ledger.turn() if self._ledger is not None else contextlib.nullcontext()

    def _check_host(self, infos: builtins.list[SandboxInfo], limits: ResolvedLimits) -> None:
        """Whether the host holds one more sandbox of ``limits`` (within the host's turn):
        beside ``infos``, this process's pools and the other data directories' managers, and
        every named volume on the data directory's disk; and whether that disk, as free as it
        is now, still holds every disk and volume promised."""
        view = self._ledger.read() if self._ledger is not None else None
        reserved = self._host_reserved(infos, view)
        volumes_full, volumes_unwritten = self._volume_totals(view)
        admission.check_host(
            reserved,
            limits,
            self._capacity,
            held_here=self._held_here(),
            volumes_mb=volumes_full,
        )
        disks_mb = sum(r.disk_mb for r in reserved)
        self._check_disk_now(
            disks_mb, volumes_unwritten, limits.disk_mb, self._capacity, self._written(infos)
        )

    def _host_reserved(
        self, infos: builtins.list[SandboxInfo], view: LedgerView | None
    ) -> builtins.list[Reservation]:
        """Every sandbox the host holds: ``infos``, this process's pools, and what the other
        managers' lines in ``view`` add."""
        reserved = self._reserved(infos)
        if view is not None:
            reserved += view.elsewhere()
        return reserved

    def _written(self, infos: builtins.list[SandboxInfo]) -> Callable[[], float]:
        """What the disks of ``infos`` and this process's pools have written (MB; a look at
        each, when asked): counted at full size, whose written part the free space already
        leaves out (a tenant's writes within its disk otherwise took twice their size of the
        host's room: red team, 2026-12-07)."""

        def written_mb() -> float:
            pooled = self._pools.ids() if self._pools is not None else set()
            return disks_written_mb(self.settings.data_dir, {i.id for i in infos} | pooled)

        return written_mb

    def _check_disk_now(
        self,
        disks_mb: float,
        volumes_unwritten_mb: float,
        new_mb: float,
        capacity: HostCapacity,
        written_mb: Callable[[], float],
    ) -> None:
        """:func:`admission.check_disk_now` for ``new_mb`` beside the live disks' reserved
        ``disks_mb`` (``written_mb`` of them given back before a refusal), the volumes'
        unwritten part and the artifacts being kept now."""
        promised_mb = disks_mb + volumes_unwritten_mb + self._exporting_mb
        admission.check_disk_now(self.settings.data_dir, promised_mb, new_mb, capacity, written_mb)

    @contextlib.contextmanager
    def _disk_for_artifacts(self, want_bytes: int) -> Iterator[int]:
        """Room on the host's disk for an export of up to ``want_bytes`` of artifacts (a
        destroy's, or a crashed manager's orphan's at recovery), held (promised to it) until
        the export ends: the bytes it may copy. The sandbox's disk still holds them while
        they are copied: an export of 270 MB beside it filled the disk under another
        tenant's volume, and so did a recovery's (red team, 2026-12-07)."""
        if self._capacity is None and self._recovery_capacity is None:
            # The start's recovery, before the manager measures its own: measured once for
            # all its orphans, or each one's copy would shrink the slack for the next.
            self._recovery_capacity = HostCapacity.measure(
                self.settings, self._volumes.written_mb()
            )
        capacity = self._capacity or self._recovery_capacity
        assert capacity is not None
        infos = self._live_infos()
        want_mb = want_bytes / (1 << 20)
        with self._host_turn():
            view = self._ledger.read() if self._ledger is not None else None
            reserved = self._host_reserved(infos, view)
            _, volumes_unwritten = self._volume_totals(view)
            promised_mb = sum(r.disk_mb for r in reserved) + volumes_unwritten
            room_mb = admission.disk_room_now_mb(
                self.settings.data_dir,
                promised_mb + self._exporting_mb,
                capacity,
                want_mb=want_mb,
                written_mb=self._written(infos),
            )
            granted_mb = max(0.0, min(want_mb, room_mb))
            self._exporting_mb += granted_mb
        try:
            yield int(granted_mb * (1 << 20))
        finally:
            self._exporting_mb -= granted_mb

    def _volume_totals(self, view: LedgerView | None) -> tuple[float, float]:
        """Every named volume on the data directory's file system: this data directory's and
        those of the other live managers in ``view`` (read now from their data
        directories), full and unwritten MB."""
        full, unwritten = self._volumes.totals_mb()
        if view is not None:
            other_full, other_unwritten = view.volumes_elsewhere(volume_totals_mb)
            full, unwritten = full + other_full, unwritten + other_unwritten
        return full, unwritten

    @contextlib.contextmanager
    def _volume_room(self, size_mb: int, live_ids: set[str] | None = None) -> Iterator[None]:
        """Refuse a new volume the disk cannot hold beside every sandbox's disk and the other
        volumes (this data directory's and the others' on its file system), counted against
        the start's free space and against the free space now; hold the host's turn while it
        is made, so no sandbox is admitted against the same room (called in the volume's
        worker thread: the turn is a file lock, and what it reads of this process's state is
        copied in one step). ``live_ids``: the data directory's live sandboxes (every
        process's, from the store, read on the loop), whose disks' written part is given back
        before a refusal."""
        ledger = self._ledger  # once: a close() meanwhile sets it to None
        capacity = self._capacity
        if capacity is None:
            raise BackendUnavailable("the manager is not started: start() it first")
        with ledger.turn() if ledger is not None else contextlib.nullcontext():
            view = ledger.read() if ledger is not None else None
            volumes_full, volumes_unwritten = self._volume_totals(view)
            if view is not None:
                disks_mb = view.disk_reserved_mb()
            else:  # no ledger: this process's own, as its admission counts them
                lives = list(self._live.values())
                held = [live.info.limits for live in lives]
                held += [info.limits for info in self._teardowns.infos()]
                disks_mb = sum(limits.disk_mb for limits in held)
            admission.check_volume_room(disks_mb, volumes_full, size_mb, capacity)
            ids = live_ids if live_ids is not None else set(self._live)
            written = functools.partial(disks_written_mb, self.settings.data_dir, ids)
            self._check_disk_now(disks_mb, volumes_unwritten, size_mb, capacity, written)
            yield

    def _publish(self, also: ResolvedLimits | None = None) -> None:
        """Tell the host's ledger what this process's sandboxes reserve (within the turn):
        live and starting, pooled, and those being torn down."""
        if self._ledger is None:
            return
        held: builtins.list[Reservation] = [live.info.limits for live in self._live.values()]
        held += [info.limits for info in self._teardowns.infos()]
        unstored: builtins.list[Reservation] = [*self._pools.reserved()] if self._pools else []
        unstored += [also] if also is not None else []
        self._ledger.publish(held, unstored)

    def _reserved(self, infos: builtins.list[SandboxInfo]) -> builtins.list[Reservation]:
        """The limits of every sandbox the host holds: ``infos`` (the live ones, this
        process's and the other instances'), and the pooled and starting ones."""
        held: builtins.list[Reservation] = [info.limits for info in infos]
        if self._pools is not None:
            held += self._pools.reserved()
        return held

    def _held_here(self) -> int:
        """Sandboxes this process holds file descriptors for: live, starting and pooled."""
        return len(self._live) + (len(self._pools.reserved()) if self._pools else 0)

    async def _boot(self, live: Live) -> None:
        """Start the guest of a new sandbox; on failure remove every trace of it."""
        try:
            async with live.lock:
                await live.start_guest()
        except BaseException as exc:
            self._live.pop(live.id, None)
            with contextlib.suppress(Exception):
                await live.backend.stop(live.id)
            # Nothing of it runs: its volumes are free (the caller's release finds none).
            self._release_lease(live.id)
            self._end(live.info, SandboxStatus.FAILED, "failed")
            self._emit(
                "backend_error", backend=live.info.backend, code=getattr(exc, "code", "error")
            )
            # EMFILE (raw, or under a backend's error) is the process's limit, not the
            # sandbox's fault: say which limit.
            out_of_fds = admission.fds_exhausted_error(exc)
            if out_of_fds is not None and not isinstance(exc, asyncio.CancelledError):
                raise out_of_fds from exc
            if isinstance(exc, SandboxError | asyncio.CancelledError):
                raise
            # Not a failure any backend names: a fault of ours (an EBADF seen twice in CI,
            # 2026-11-27/28, cause not found), so its traceback goes to the log.
            log.exception("sandbox start failed unexpectedly", sandbox=live.id)
            raise SandboxStartError(f"sandbox failed to start: {exc}") from exc

    async def _wait_for_room(self, owner: str | None, gone: set[str]) -> bool:
        """Wait for the teardowns under way at the refusal that could free the room a create
        was refused (``owner``'s for a quota, anyone's for the host): this process's, then
        those of the other live processes of the data directory, seen in the store (polled:
        they tell us nothing), each at most WAIT_FOR_ROOM_S. False if there were none.

        Raises:
            SandboxNotRunning: the manager began to close meanwhile (its store may be closed
                by then: nothing more is read from it).
        """
        elsewhere = {i for i, inst in self._store.held_elsewhere(owner).items() if inst not in gone}
        waited = await self._teardowns.wait_for_room(owner)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_FOR_ROOM_S
        while elsewhere and loop.time() < deadline:
            waited = True
            await asyncio.sleep(HELD_ELSEWHERE_POLL_S)
            if self._closing:
                break
            elsewhere &= self._store.held_elsewhere(owner).keys()
        if waited and self._closing:
            raise SandboxNotRunning("the SandboxManager is closing")
        return waited
