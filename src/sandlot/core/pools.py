"""Warm pools: sandboxes started ahead of demand, handed out by :meth:`Pools.take`.

A pool holds sandboxes of one :class:`PoolKey` with the settings' default limits, network
and no extra env; a request for exactly that is served from it, and the pool refills behind.
Pooled sandboxes belong to nobody and are never stored: the start-up sweep removes a crashed
run's, so a pool always counts from zero.

A pooled sandbox may be started *for* a tenant (``GuestSpec.tenant``: its guest forks from
that tenant's template, which it shares with the tenant's other sandboxes, bubblewrap's
template.py): only that tenant's creates take it. A pool refills for the tenant whose
creates drew on it the last :data:`TENANT_AFTER` times, and for nobody (started afresh, for
anyone) when they were several; a create that finds only other tenants' sandboxes takes
none and ends the oldest of them, so that the pool follows who uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from sandlot.core.live import Live, PoolKey
from sandlot.errors import SandboxError
from sandlot.models import ResolvedLimits

log = structlog.get_logger(__name__)

MAX_POOL_SIZE = 64
POOL_RETRY_S = 1.0
# Sandboxes of one pool started at once. Two fillers were measured against one on 2 cores
# (HumanEval-164 through a pool of 2, three alternated pairs): 1.82-1.96x the bare-python
# floor against 1.60-1.80x, because both starts and the caller's task then compete for the
# same CPU. A host with cores to spare may gain from more (not measured: no such host here).
REFILL_PARALLEL = 1
# How many creates in a row from one tenant make a pool refill for that tenant.
TENANT_AFTER = 3


@dataclass
class _Pool:
    """``size`` started sandboxes of one key, refilled by ``tasks`` when ``wanted`` is set."""

    size: int
    lives: list[Live] = field(default_factory=list)
    wanted: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    starting: int = 0
    # Who asked for the last TENANT_AFTER sandboxes, taken or not.
    askers: deque[str] = field(default_factory=lambda: deque(maxlen=TENANT_AFTER))

    def tenant(self) -> str | None:
        """Whom the next refill is for: the one tenant of the last few creates, or nobody."""
        if len(self.askers) == TENANT_AFTER and len(set(self.askers)) == 1:
            return self.askers[0]
        return None


class Pools:
    """Every warm pool of one manager.

    ``make`` builds a not-yet-started sandbox of a key, for a tenant or for anyone (None);
    ``boot`` starts it (and on failure removes every trace of it).
    """

    def __init__(
        self,
        default_limits: ResolvedLimits,
        default_network: bool,
        make: Callable[[PoolKey, str | None], Live],
        boot: Callable[[Live], Awaitable[None]],
    ) -> None:
        self._limits = default_limits
        self._network = default_network
        self._make = make
        self._boot = boot
        self._pools: dict[PoolKey, _Pool] = {}
        self._booting: list[Live] = []

    def start(self, targets: dict[PoolKey, int]) -> None:
        for key, size in targets.items():
            pool = self._pools[key] = _Pool(size)
            pool.wanted.set()
            fillers = min(size, REFILL_PARALLEL)
            pool.tasks = [asyncio.create_task(self._fill(key, pool)) for _ in range(fillers)]

    def count(self) -> int:
        """Started sandboxes waiting in the pools."""
        return sum(len(pool.lives) for pool in self._pools.values())

    def reserved(self) -> list[ResolvedLimits]:
        """The limits of every pooled sandbox, started or starting (the host holds them)."""
        held = [live for pool in self._pools.values() for live in pool.lives]
        return [live.info.limits for live in [*held, *self._booting]]

    def ids(self) -> set[str]:
        """The ids of the pooled sandboxes (for introspection and tests)."""
        return {live.id for pool in self._pools.values() for live in pool.lives}

    def take(
        self,
        key: PoolKey,
        limits: ResolvedLimits,
        network: bool,
        env: dict[str, str] | None,
        owner: str,
    ) -> Live | None:
        """A pre-started sandbox, if the request is for exactly what a pool holds and one
        is there for ``owner`` or for anyone. Who asked is noted once the create is admitted
        (:meth:`asked`): a create refused, or decided twice, counts for nothing."""
        pool = self._pool_for(key, limits, network, env)
        if pool is None:
            return None
        for live in list(pool.lives):
            if live.spec.tenant not in (None, owner):
                continue
            pool.lives.remove(live)
            pool.wanted.set()
            if live.conn is not None and live.conn.alive:
                return live
            asyncio.create_task(discard(live))  # noqa: RUF006 - fire and forget
        return None

    def asked(
        self,
        key: PoolKey,
        limits: ResolvedLimits,
        network: bool,
        env: dict[str, str] | None,
        owner: str,
        *,
        served: bool,
    ) -> None:
        """An admitted create of what a pool holds, by ``owner``: whom the pool refills for.
        One that was not ``served`` while the pool held only other tenants' sandboxes ends
        the oldest of them, so that the pool follows who uses it."""
        pool = self._pool_for(key, limits, network, env)
        if pool is None:
            return
        pool.askers.append(owner)
        if not served and pool.lives:
            asyncio.create_task(discard(pool.lives.pop(0)))  # noqa: RUF006 - fire and forget
            pool.wanted.set()

    def _pool_for(
        self, key: PoolKey, limits: ResolvedLimits, network: bool, env: dict[str, str] | None
    ) -> _Pool | None:
        pool = self._pools.get(key)
        if pool is None or env or network != self._network or limits != self._limits:
            return None
        return pool

    async def close(self) -> None:
        """Stop refilling and destroy every pooled sandbox."""
        for pool in self._pools.values():
            for task in pool.tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pooled = [live for pool in self._pools.values() for live in pool.lives]
        self._pools = {}
        await asyncio.gather(*(discard(live) for live in pooled))

    async def _fill(self, key: PoolKey, pool: _Pool) -> None:
        """Keep ``pool.size`` sandboxes of ``key`` started or starting, never more: one of
        the pool's :data:`REFILL_PARALLEL` fillers, each starting one sandbox at a time.
        ``wanted`` stays set while a place is unfilled, so every filler sees it."""
        while True:
            await pool.wanted.wait()
            if len(pool.lives) + pool.starting >= pool.size:
                pool.wanted.clear()
                continue
            pool.starting += 1
            try:
                live = self._make(key, pool.tenant())
                self._booting.append(live)
                try:
                    await self._boot(live)
                finally:
                    self._booting.remove(live)
            except SandboxError as exc:
                log.warning("warm pool refill failed; retrying", pool=str(key), error=exc.message)
                await asyncio.sleep(POOL_RETRY_S)
                pool.wanted.set()  # its place is still empty
                continue
            finally:
                pool.starting -= 1
            pool.lives.append(live)


async def discard(live: Live) -> None:
    """Stop a sandbox nobody was given (pooled, or never handed out)."""
    if live.conn is not None:
        await live.conn.close()
    with contextlib.suppress(Exception):
        await live.backend.stop(live.id)
