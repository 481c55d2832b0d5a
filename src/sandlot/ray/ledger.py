"""The cluster's quota ledger: one small named Ray actor that every API server asks before a
create, so that a tenant's quota holds across nodes and servers.

It holds, per live sandbox, its owner and limits; node agents release a sandbox when their
manager ends it (destroy, TTL, idle), the routing manager when its node is lost. A reservation
is made under a ticket before the node is chosen and bound to the sandbox id once it exists,
so two servers creating for one tenant at once cannot both pass the last slot.
"""

from __future__ import annotations

import time
from typing import Any

from sandlot.core import admission
from sandlot.core.live import node_of
from sandlot.errors import QuotaExceeded
from sandlot.models import Quota, ResolvedLimits, SandboxInfo, SandboxStatus

LEDGER_NAME = "sandlot-ledger"
# A ticket never bound (its server died mid-create) stops counting after this long.
TICKET_TTL_S = 300.0


class QuotaLedger:
    """Plain class; :func:`sandlot.ray.cluster.ensure_ledger` runs it as a Ray actor (one
    call at a time: a sync actor method is atomic, which is the point)."""

    def __init__(self) -> None:
        self._held: dict[str, SandboxInfo] = {}
        self._tickets: dict[str, float] = {}
        self._nodes: set[str] = set()

    def reserve(
        self, ticket: str, owner: str, limits: ResolvedLimits, quota: Quota
    ) -> tuple[Any, ...]:
        """Count a sandbox of ``limits`` for ``owner`` under ``ticket``: ("ok",), or
        ("err", "quota_exceeded", message) when the owner's sandboxes over the cluster, with
        this one, are over quota."""
        self._expire_tickets()
        try:
            admission.check_quota(self._held.values(), owner, limits, quota)
        except QuotaExceeded as exc:
            return ("err", exc.code, exc.message)
        now = time.time()
        self._held[ticket] = SandboxInfo(
            id=ticket,
            backend="",
            status=SandboxStatus.STARTING,
            owner=owner,
            limits=limits,
            network=False,
            created_at=now,
            last_active_at=now,
            expires_at=now + TICKET_TTL_S,
            idle_timeout_s=TICKET_TTL_S,
        )
        self._tickets[ticket] = now
        return ("ok", None)

    def add_node(self, node: str) -> None:
        """Remember that ``node`` ran an agent: a later call to one of its ids is a lost
        sandbox, not an unknown one."""
        self._nodes.add(node)

    def known_nodes(self) -> set[str]:
        return set(self._nodes)

    def bind(self, ticket: str, sandbox_id: str) -> None:
        """The ticket's sandbox exists now under ``sandbox_id``."""
        info = self._held.pop(ticket, None)
        self._tickets.pop(ticket, None)
        if info is not None:
            self._held[sandbox_id] = info.model_copy(update={"id": sandbox_id})

    def release(self, key: str, owner: str | None = None) -> bool:
        """Stop counting a ticket or sandbox (only ``owner``'s, where one is named: a caller
        that names someone else's id releases nothing); False if it was not counted."""
        info = self._held.get(key)
        if info is None or (owner is not None and info.owner != owner):
            return False
        self._tickets.pop(key, None)
        del self._held[key]
        return True

    def release_node(self, node: str) -> int:
        """Stop counting every sandbox of a lost node; return how many."""
        lost = [key for key in self._held if node_of(key) == node]
        for key in lost:
            del self._held[key]
        return len(lost)

    def held(self, owner: str | None = None) -> list[str]:
        """The counted keys (of ``owner``): for tests and operators."""
        return [k for k, info in self._held.items() if owner is None or info.owner == owner]

    def _expire_tickets(self) -> None:
        cutoff = time.time() - TICKET_TTL_S
        for ticket in [t for t, at in self._tickets.items() if at < cutoff]:
            self.release(ticket)
