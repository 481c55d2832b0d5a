"""Creating a sandbox on a cluster: the tenant's quota reserved in the ledger under a ticket,
a node chosen (:mod:`~sandlot.ray.routing`), and the create sent to its agent, which binds the
ticket to the new sandbox before it answers, so that a sandbox counts whatever becomes of its
caller, and destroys what it made for a caller that gave up."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any

from sandlot.config import Settings
from sandlot.errors import BackendUnavailable, NodeTimeout, SandboxError, SandboxStartError
from sandlot.models import Quota, SandboxInfo, SandboxLimits
from sandlot.ray.calls import GONE, NodeSilent, awaited, settle, unwrap
from sandlot.ray.node import CREATE_BOUND_S
from sandlot.ray.routing import NodeLoad, choose
from sandlot.requests import SandboxSpec

NO_VOLUMES_ON_RAY = "named volumes live on one host's disk: a Ray cluster does not have them yet"


class CreateVerbs:
    settings: Settings
    _ledger: Any
    _agents: dict[str, Any]
    _loads: dict[str, NodeLoad]

    # The manager's own (declared, not defined here: a mixin's stub would shadow them).
    _remember_timeout: Callable[[SandboxInfo], None]
    _emit: Callable[..., None]

    async def create(
        self, spec: SandboxSpec | None = None, *, owner: str = "local", quota: Quota | None = None
    ) -> SandboxInfo:
        """Place a sandbox on a node (warm first, else power of two choices) and start it.

        Raises:
            QuotaExceeded: the owner's sandboxes over the whole cluster are at ``quota``.
            CapacityExhausted: no node has room.
            SandboxStartError: the chosen node went away or hung during the create.
            NodeTimeout: the chosen node, alive, did not finish within CREATE_BOUND_S.
            and whatever the node's :meth:`SandboxManager.create` raises.
        """
        spec = spec or SandboxSpec()
        if spec.volumes:
            raise BackendUnavailable(NO_VOLUMES_ON_RAY)
        limits = self.settings.resolve_limits(spec.limits())
        ticket = "ticket-" + secrets.token_hex(8)
        if quota is not None:
            reserved = self._ledger.reserve.remote(ticket, owner, limits, quota)
            try:
                unwrap(await reserved)
            except asyncio.CancelledError:
                # The reservation lands anyway; this caller's next call to the ledger undoes it.
                self._ledger.release.remote(ticket)
                raise
        info = await self._place(spec, owner, limits.memory_mb, ticket, quota)
        self._remember_timeout(info)
        self._emit("created", info=info)
        return info

    async def _place(
        self, spec: SandboxSpec, owner: str, memory_mb: float, ticket: str, quota: Quota | None
    ) -> SandboxInfo:
        """Create on the chosen node; the agent binds ``ticket`` to the sandbox before it
        answers, so the sandbox counts whatever becomes of this caller. The node is given
        ``quota`` too: its manager keeps the sandbox's artifacts within the artifact quota
        (each node's store counts its own, so a tenant keeps at most that on every node)."""
        default_shape = not (spec.backend or spec.runtime or spec.environment or spec.env)
        default_shape = default_shape and spec.limits() == SandboxLimits() and spec.network is None
        warm_key = f"{self.settings.backend}/{self.settings.environment}"
        try:
            load = choose(
                list(self._loads.values()), memory_mb, warm_key if default_shape else None
            )
        except SandboxError:
            self._ledger.release.remote(ticket)
            raise
        agent = self._agents[load.node]
        # Counted at once, so that creates before the next refresh spread too.
        self._loads[load.node] = NodeLoad(
            load.node,
            load.live + 1,
            load.max_sandboxes,
            load.memory_free_mb - memory_mb,
            {k: max(0, n - 1) for k, n in load.warm.items()},
        )
        ref = agent.create.remote(spec, owner, ticket, quota)
        call_s = self.settings.ray_call_timeout_s
        try:
            envelope = await settle(awaited(ref), agent, bound_s=CREATE_BOUND_S, every_s=call_s)
        except GONE as exc:
            # The node went with the create: nothing of it counts, or runs, past its sweep.
            self._ledger.release.remote(ticket)
            self._loads.pop(load.node, None)  # no more creates there before its next load
            raise SandboxStartError(f"node {load.node} went away during the create") from exc
        except (NodeSilent, NodeTimeout, asyncio.CancelledError) as exc:
            # The agent may still make it: it destroys what it made for this ticket (and so
            # releases it) once it sees this. Only this create failed, not the node.
            agent.abandon.remote(ticket)
            if isinstance(exc, NodeSilent):
                self._loads.pop(load.node, None)
                raise SandboxStartError(f"node {load.node} stopped answering a create") from exc
            raise
        if envelope[0] != "ok":
            self._ledger.release.remote(ticket)
        info: SandboxInfo = unwrap(envelope)
        return info
