"""The routing manager: what ``sandlot serve --ray`` serves and what a trainer on the cluster
calls directly (no HTTP hop). It holds no sandbox: every call goes to the node agent that the
sandbox id names (``sb-<node>-<hex>``), so any number of these, in any number of servers, serve
the same sandboxes without sharing a table.

It keeps the SandboxManager's verbs and signatures (``owner=``, callbacks), so the server's
routes, the SDK (``AsyncSandbox.create(manager=...)``) and MCP run on it unchanged.

Failure contract: a call whose node died or hung raises :class:`~sandlot.errors.SandboxLost`
naming the node (Ray reports an in-flight call to a killed node after about 3 s, and a call to
a node declared dead at once; a hung node is found by a probe, see :mod:`~sandlot.ray.calls`);
the sandbox's quota is released; nothing is retried on another node. A slow call on a node
that answers is that call's failure (:class:`~sandlot.errors.NodeTimeout`), never the node's.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import Callable
from typing import Any

import ray
import structlog
from ray.exceptions import ActorUnavailableError

from sandlot.config import Settings, get_settings
from sandlot.core.live import node_of
from sandlot.errors import (
    BackendUnavailable,
    ConfigError,
    SandboxLost,
    SandboxNotFound,
)
from sandlot.models import Quota, ResourceUsage, SandboxInfo, VolumeInfo
from sandlot.ray import agents
from sandlot.ray.calls import DEAD, GONE, SHORT_CALL, NodeSilent, awaited, settle, unwrap
from sandlot.ray.node import NODE_RESOURCE
from sandlot.ray.placing import NO_VOLUMES_ON_RAY, CreateVerbs
from sandlot.ray.routing import NodeLoad
from sandlot.ray.runs import RunVerbs
from sandlot.ray.verbs import ForwardedVerbs
from sandlot.requests import CreateVolume, SetTimeout

log = structlog.get_logger(__name__)

# How often the loads placement reads are refreshed: stale by up to this much, which is why
# placement draws two nodes instead of taking the global least loaded (servers would herd).
REFRESH_S = 1.0

Listener = Callable[[str, dict[str, Any]], None]


class NoVolumes:
    """Named volumes live on one host's disk: a cluster has none (yet), and says so."""

    @staticmethod
    def _refuse() -> BackendUnavailable:
        return BackendUnavailable(NO_VOLUMES_ON_RAY)

    async def create_volume(
        self, request: CreateVolume, *, owner: str = "local", quota: Quota | None = None
    ) -> VolumeInfo:
        raise self._refuse()

    async def list_volumes(self, *, owner: str = "local") -> builtins.list[VolumeInfo]:
        raise self._refuse()

    async def get_volume(self, name: str, *, owner: str = "local") -> VolumeInfo:
        raise self._refuse()

    async def delete_volume(self, name: str, *, owner: str = "local") -> None:
        raise self._refuse()


class ClusterManager(RunVerbs, CreateVerbs, ForwardedVerbs, NoVolumes):
    """SandboxManager's verbs over a Ray cluster's node agents."""

    def __init__(
        self, settings: Settings | None = None, agent_overrides: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.settings = settings or get_settings()
        # Settings the node agents this manager starts get (their data dir root, limits).
        self.agent_overrides = agent_overrides or {}
        self._agents: dict[str, Any] = {}
        self._known: set[str] = set()  # every node that ever ran an agent
        self._dead: set[str] = set()  # sandlot nodes Ray reports dead (and not back)
        self._gone_agents: set[str] = set()  # agents a call found gone, until a new one runs
        self._loads: dict[str, NodeLoad] = {}
        self._ledger: Any = None
        self._refresher: asyncio.Task[None] | None = None
        self._listeners: list[Listener] = []
        self._started = False

    # ------------------------------------------------------------------ the manager itself

    async def __aenter__(self) -> ClusterManager:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Join the cluster, start a node agent on every sandlot node that has none.

        Raises:
            ConfigError: no Ray address, or the cluster has no node offering the
                ``sandlot_node`` resource.
        """
        if self._started:
            return
        # The server keeps its API keys and audit log there, as without Ray.
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        if not ray.is_initialized():
            if not self.settings.ray_address:
                raise ConfigError("no Ray cluster: set SANDLOT_RAY_ADDRESS or pass --ray")
            await asyncio.to_thread(
                ray.init,
                address=self.settings.ray_address,
                namespace=self.settings.ray_namespace,
                log_to_driver=False,
            )
        ns = self.settings.ray_namespace
        self._ledger = await asyncio.to_thread(agents.ensure_ledger, ns)
        await self.refresh()
        if not self._agents:
            raise ConfigError(
                f"the Ray cluster has no node offering the {NODE_RESOURCE!r} resource; "
                "start nodes with --resources='{\"sandlot_node\": 1}'"
            )
        self._refresher = asyncio.create_task(self._refresh_forever())
        self._started = True

    async def close(self) -> None:
        """Stop refreshing. The node agents and their sandboxes stay: they are the cluster's,
        not this server's (:func:`sandlot.ray.agents.shutdown_agents` ends them)."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        self._started = False

    async def refresh(self) -> None:
        """Start agents on new nodes, forget dead ones, and read every node's load."""
        ns = self.settings.ray_namespace
        try:
            self._known = await self._ledger.known_nodes.remote()
        except GONE:
            # The head restarted (GCS fault tolerance) without the ledger: a new, empty one
            # counts from here on (the README says what a head's loss costs).
            log.warning("quota ledger lost; starting a new one")
            self._ledger = await asyncio.to_thread(agents.ensure_ledger, ns)
        self._agents, dead = await asyncio.to_thread(
            agents.ensure_agents, ns, self.agent_overrides, self._ledger
        )
        for node in set(dead) - self._dead:
            # Once per death: every sandbox the node held is gone, and so is their quota.
            released = await self._ledger.release_node.remote(node)
            log.warning("node lost", node=node, quota_released=released)
        self._dead = set(dead)
        self._gone_agents -= set(self._agents)
        results = await asyncio.gather(
            *(self._load_of(node, agent) for node, agent in self._agents.items()),
            return_exceptions=True,
        )
        self._loads = {load.node: load for load in results if isinstance(load, NodeLoad)}

    async def _load_of(self, node: str, agent: Any) -> NodeLoad:
        load = unwrap(await asyncio.wait_for(awaited(agent.load.remote()), REFRESH_S * 3))
        return NodeLoad(**load)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception:
                log.exception("cluster refresh failed")

    def nodes(self) -> dict[str, NodeLoad]:
        """The live nodes and their last reported loads."""
        return dict(self._loads)

    def add_listener(self, listener: Listener) -> None:
        """Called with ("created" | "destroyed" | "exec", fields) for calls through here."""
        self._listeners.append(listener)

    def _emit(self, event: str, **fields: Any) -> None:
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:
                log.exception("listener failed", event=event)

    def live_count(self) -> int:
        return sum(load.live for load in self._loads.values())

    def pooled_count(self) -> int:
        return sum(sum(load.warm.values()) for load in self._loads.values())

    # ------------------------------------------------------------------ routing

    async def _agent_for(self, sandbox_id: str) -> tuple[str, Any]:
        node = node_of(sandbox_id)
        if node is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (a cluster id names its node)")
        agent = self._agents.get(node)
        if agent is None:
            if node in self._dead or node in self._gone_agents or node in self._known:
                # A node that ran an agent and runs none now: Ray declared it dead, a call
                # found its agent gone, or its new agent did not start. Its quota was released
                # where that was found (refresh, the call, the new agent's start), not here.
                raise self._lost_error(node, sandbox_id)
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return node, agent

    def _lost_error(self, node: str, sandbox_id: str) -> SandboxLost:
        return SandboxLost(
            f"sandbox {sandbox_id} was on node {node}, which is lost (died or stopped "
            "answering); its state is gone: create a new sandbox",
            node=node,
        )

    async def _lost(
        self, node: str, sandbox_id: str, owner: str | None, exc: BaseException, agent: Any
    ) -> SandboxLost:
        log.warning("sandbox lost", node=node, sandbox=sandbox_id, error=repr(exc))
        # Lost means gone: a hung node that answers again destroys the sandbox then (never
        # awaited; on a dead node the call fails with it). As the caller, so that a call to
        # someone else's id destroys nothing; the destroy releases its quota.
        agent.call.remote("destroy", (sandbox_id,), {"reason": "lost", "owner": owner})
        self._loads.pop(node, None)
        released: Any = None
        if isinstance(exc, DEAD) and not isinstance(exc, ActorUnavailableError):
            # Dead for sure, and every sandbox of the node with it (its successor's start-up
            # sweep ends them): later calls are lost at once, all their quota released now.
            self._agents.pop(node, None)
            self._gone_agents.add(node)
            released = self._ledger.release_node.remote(node)
        elif isinstance(exc, ActorUnavailableError):
            # Unreachable, perhaps for a while: this sandbox is lost (and destroyed if its
            # node answers again); the node's other sandboxes learn their fate by their calls.
            # Only its owner's call (or an admin's) releases it: the destroy above goes as the
            # caller, and another tenant's destroys nothing, so its sandbox would run on
            # uncounted (red team, 2026-12-07).
            released = self._ledger.release.remote(sandbox_id, owner)
        # A silent node releases nothing here: its sandboxes still run until it answers (and
        # destroys this one, releasing it) or Ray declares it dead (the refresh releases).
        if released is not None:
            with contextlib.suppress(TimeoutError, *GONE):
                await asyncio.wait_for(awaited(released), 5)
        return self._lost_error(node, sandbox_id)

    async def _call(
        self,
        sandbox_id: str,
        verb: str,
        *args: Any,
        bound_s: float | None = SHORT_CALL,
        **kwargs: Any,
    ) -> Any:
        """One call to the sandbox's agent, bounded by ``bound_s`` (by default the short-call
        bound; None, from a long verb: no bound but the probes)."""
        node, agent = await self._agent_for(sandbox_id)
        call_s = self.settings.ray_call_timeout_s
        if bound_s == SHORT_CALL:
            bound_s = call_s
        ref = agent.call.remote(verb, (sandbox_id, *args), kwargs)
        try:
            envelope = await settle(
                awaited(ref), agent, bound_s=bound_s, every_s=min(call_s, bound_s or call_s)
            )
        except (*GONE, NodeSilent) as exc:
            raise await self._lost(node, sandbox_id, kwargs.get("owner"), exc, agent) from exc
        return unwrap(envelope)

    # ------------------------------------------------------------------ records

    async def get(self, sandbox_id: str, *, owner: str | None = None) -> SandboxInfo:
        info: SandboxInfo = await self._call(sandbox_id, "get", owner=owner)
        return info

    async def list(
        self,
        *,
        owner: str | None = None,
        include_ended: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Every node's sandboxes (a lost node's are left out: they are gone), oldest first;
        ``limit`` of them from the ``offset``-th (None: all)."""
        nodes = list(self._agents.items())
        kwargs: dict[str, Any] = {"owner": owner, "include_ended": include_ended}
        if limit is not None:  # each node's first offset + limit; the merge takes the page
            kwargs["limit"] = offset + limit
        results = await asyncio.gather(
            *(
                asyncio.wait_for(
                    awaited(agent.call.remote("list", (), kwargs)),
                    self.settings.ray_call_timeout_s,
                )
                for _, agent in nodes
            ),
            return_exceptions=True,
        )
        infos: builtins.list[SandboxInfo] = []
        for (node, _), result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("node left out of a list", node=node, error=repr(result))
                continue
            infos.extend(unwrap(result))
        infos.sort(key=lambda info: (info.created_at, info.id))
        return infos[offset : None if limit is None else offset + limit]

    async def destroy(
        self, sandbox_id: str, *, owner: str | None = None, reason: str = "user"
    ) -> SandboxInfo:
        # The node's agent releases its quota (as for a TTL or idle end): one place, not two.
        info: SandboxInfo = await self._call(sandbox_id, "destroy", owner=owner, reason=reason)
        self._timeouts_s.pop(sandbox_id, None)
        self._emit("destroyed", info=info)
        return info

    async def extend(
        self, sandbox_id: str, request: SetTimeout, *, owner: str | None = None
    ) -> SandboxInfo:
        info: SandboxInfo = await self._call(sandbox_id, "extend", request, owner=owner)
        return info

    async def usage(self, sandbox_id: str, *, owner: str | None = None) -> ResourceUsage:
        usage: ResourceUsage = await self._call(sandbox_id, "usage", owner=owner)
        return usage
