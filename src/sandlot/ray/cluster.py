"""The routing manager: what ``sandlot serve --ray`` serves and what a trainer on the cluster
calls directly (no HTTP hop). It holds no sandbox: every call goes to the node agent that the
sandbox id names (``sb-<node>-<hex>``), so any number of these, in any number of servers, serve
the same sandboxes without sharing a table.

It keeps the SandboxManager's verbs and signatures (``owner=``, callbacks), so the server's
routes, the SDK (``AsyncSandbox.create(manager=...)``) and MCP run on it unchanged.

Failure contract: a call whose node died or stopped answering raises
:class:`~sandlot.errors.SandboxLost` naming the node (Ray reports an in-flight call to a killed
node after about 3 s, and a call to a node declared dead at once); the sandbox's quota is
released; nothing is retried on another node.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import ray
import structlog
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from sandlot.config import Settings, get_settings
from sandlot.core.live import node_of
from sandlot.errors import (
    ConfigError,
    InvalidRequest,
    SandboxLost,
    SandboxNotFound,
    error_from_code,
)
from sandlot.models import (
    ExecResult,
    OutputCallback,
    Quota,
    ResourceUsage,
    ResultCallback,
    SandboxInfo,
    SandboxLimits,
)
from sandlot.ray import agents
from sandlot.ray.node import NODE_RESOURCE
from sandlot.ray.routing import NodeLoad, choose
from sandlot.ray.verbs import ForwardedVerbs
from sandlot.requests import (
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
)

log = structlog.get_logger(__name__)

# How often the loads placement reads are refreshed: stale by up to this much, which is why
# placement draws two nodes instead of taking the global least loaded (servers would herd).
REFRESH_S = 1.0
# A create boots a sandbox (about a second here; an image pull can take longer).
CREATE_BOUND_S = 120.0
_NODE_GONE = (RayActorError, ActorUnavailableError, GetTimeoutError, TimeoutError)

Listener = Callable[[str, dict[str, Any]], None]


async def _awaited(ref: Awaitable[Any]) -> Any:
    """An ObjectRef as a coroutine (what asyncio.wait_for wants)."""
    return await ref


def _unwrap(envelope: tuple[Any, ...]) -> Any:
    if envelope[0] == "ok":
        return envelope[1]
    raise error_from_code(envelope[1], envelope[2])


class ClusterManager(ForwardedVerbs):
    """SandboxManager's verbs over a Ray cluster's node agents."""

    def __init__(
        self, settings: Settings | None = None, agent_overrides: dict[str, Any] | None = None
    ) -> None:
        self.settings = settings or get_settings()
        # Settings the node agents this manager starts get (their data dir root, limits).
        self.agent_overrides = agent_overrides or {}
        self._agents: dict[str, Any] = {}
        self._known: set[str] = set()  # every node that ever ran an agent
        self._dead: set[str] = set()  # sandlot nodes Ray reports dead (and not back)
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
        except _NODE_GONE:
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
        results = await asyncio.gather(
            *(self._load_of(node, agent) for node, agent in self._agents.items()),
            return_exceptions=True,
        )
        self._loads = {load.node: load for load in results if isinstance(load, NodeLoad)}

    async def _load_of(self, node: str, agent: Any) -> NodeLoad:
        load = _unwrap(await asyncio.wait_for(_awaited(agent.load.remote()), REFRESH_S * 3))
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
            if node in self._known:
                raise await self._lost(node, sandbox_id, None)
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return node, agent

    def _lost_error(self, node: str, sandbox_id: str) -> SandboxLost:
        return SandboxLost(
            f"sandbox {sandbox_id} was on node {node}, which is lost (died or stopped "
            "answering); its state is gone: create a new sandbox",
            node=node,
        )

    async def _lost(
        self, node: str, sandbox_id: str, exc: BaseException | None, agent: Any = None
    ) -> SandboxLost:
        log.warning("sandbox lost", node=node, sandbox=sandbox_id, error=repr(exc))
        if agent is not None:
            # A hung node may answer again: lost means gone, so it destroys the sandbox then
            # (never awaited; on a dead node the call fails with it).
            agent.call.remote("destroy", (sandbox_id,), {"reason": "lost"})
        self._agents.pop(node, None)
        self._loads.pop(node, None)
        with contextlib.suppress(*_NODE_GONE):
            await asyncio.wait_for(_awaited(self._ledger.release.remote(sandbox_id)), 5)
        return self._lost_error(node, sandbox_id)

    async def _call(
        self, sandbox_id: str, verb: str, *args: Any, bound_s: float | None = None, **kwargs: Any
    ) -> Any:
        node, agent = await self._agent_for(sandbox_id)
        bound_s = bound_s or self.settings.ray_call_timeout_s
        try:
            envelope = await asyncio.wait_for(
                _awaited(agent.call.remote(verb, (sandbox_id, *args), kwargs)), bound_s
            )
        except _NODE_GONE as exc:
            raise await self._lost(node, sandbox_id, exc, agent) from exc
        return _unwrap(envelope)

    async def _run(
        self,
        verb: str,
        sandbox_id: str,
        request: RunCode | RunCommand,
        owner: str | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_result: ResultCallback | None = None,
    ) -> ExecResult:
        node, agent = await self._agent_for(sandbox_id)
        stream = agent.run.remote(verb, sandbox_id, request, owner)
        handlers: dict[str, Callable[[Any], None] | None] = {
            "stdout": on_stdout,
            "stderr": on_stderr,
            "result": on_result,
        }
        # A run ends by its own timeout inside the sandbox; a node that has not answered a
        # while after it is lost, even if Ray still counts it alive (hung, not dead). Without a
        # timeout in the request the sandbox's own applies, unknown here: Ray's detection bounds it.
        bound_s = (
            request.timeout_s + self.settings.ray_call_timeout_s if request.timeout_s else None
        )
        try:
            async with asyncio.timeout(bound_s):
                return await self._events(verb, sandbox_id, stream, handlers)
        except _NODE_GONE as exc:
            ray.cancel(stream)
            raise await self._lost(node, sandbox_id, exc, agent) from exc
        except asyncio.CancelledError:
            # The caller gave up (a cancelled task, a closed WebSocket): end the run there too.
            ray.cancel(stream)
            raise

    async def _events(
        self,
        verb: str,
        sandbox_id: str,
        stream: Any,
        handlers: dict[str, Callable[[Any], None] | None],
    ) -> ExecResult:
        async for ref in stream:
            event = await ref
            if event[0] in handlers:
                handler = handlers[event[0]]
                if handler is not None:
                    handler(event[1])
                continue
            result: ExecResult = _unwrap(event)
            self._emit("exec", sandbox_id=sandbox_id, op=verb, result=result)
            return result
        raise SandboxLost(
            f"the node of {sandbox_id} ended its run without a result", node_of(sandbox_id)
        )

    # ------------------------------------------------------------------ creating

    async def create(
        self, spec: SandboxSpec | None = None, *, owner: str = "local", quota: Quota | None = None
    ) -> SandboxInfo:
        """Place a sandbox on a node (warm first, else power of two choices) and start it.

        Raises:
            QuotaExceeded: the owner's sandboxes over the whole cluster are at ``quota``.
            CapacityExhausted: no node has room.
            and whatever the node's :meth:`SandboxManager.create` raises.
        """
        spec = spec or SandboxSpec()
        limits = self.settings.resolve_limits(spec.limits())
        ticket = "ticket-" + secrets.token_hex(8)
        if quota is not None:
            _unwrap(await self._ledger.reserve.remote(ticket, owner, limits, quota))
        try:
            info = await self._place(spec, owner, limits.memory_mb)
        except BaseException:
            self._ledger.release.remote(ticket)
            raise
        if quota is not None:
            # Awaited: a release of the id (its node ending it early) must come after this.
            await self._ledger.bind.remote(ticket, info.id)
        self._emit("created", info=info)
        return info

    async def _place(self, spec: SandboxSpec, owner: str, memory_mb: float) -> SandboxInfo:
        default_shape = not (spec.backend or spec.runtime or spec.environment or spec.env)
        default_shape = default_shape and spec.limits() == SandboxLimits() and spec.network is None
        warm_key = f"{self.settings.backend}/{self.settings.environment}"
        load = choose(list(self._loads.values()), memory_mb, warm_key if default_shape else None)
        agent = self._agents[load.node]
        # Counted at once, so that creates before the next refresh spread too.
        self._loads[load.node] = NodeLoad(
            load.node,
            load.live + 1,
            load.max_sandboxes,
            load.memory_free_mb - memory_mb,
            {k: max(0, n - 1) for k, n in load.warm.items()},
        )
        try:
            envelope = await asyncio.wait_for(
                _awaited(agent.call.remote("create", (spec,), {"owner": owner})), CREATE_BOUND_S
            )
        except _NODE_GONE as exc:
            raise await self._lost(load.node, "(new)", exc) from exc
        info: SandboxInfo = _unwrap(envelope)
        return info

    # ------------------------------------------------------------------ records

    async def get(self, sandbox_id: str, *, owner: str | None = None) -> SandboxInfo:
        info: SandboxInfo = await self._call(sandbox_id, "get", owner=owner)
        return info

    async def list(
        self, *, owner: str | None = None, include_ended: bool = False
    ) -> builtins.list[SandboxInfo]:
        """Every node's sandboxes (a lost node's are left out: they are gone)."""
        nodes = list(self._agents.items())
        kwargs = {"owner": owner, "include_ended": include_ended}
        results = await asyncio.gather(
            *(
                asyncio.wait_for(
                    _awaited(agent.call.remote("list", (), kwargs)),
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
            infos.extend(_unwrap(result))
        return infos

    async def destroy(
        self, sandbox_id: str, *, owner: str | None = None, reason: str = "user"
    ) -> SandboxInfo:
        info: SandboxInfo = await self._call(sandbox_id, "destroy", owner=owner, reason=reason)
        self._ledger.release.remote(sandbox_id)
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

    # ------------------------------------------------------------------ running

    async def run_code(
        self,
        sandbox_id: str,
        request: RunCode,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        return await self._run(
            "run_code", sandbox_id, request, owner, on_stdout, on_stderr, on_result
        )

    async def run_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        stdin: asyncio.Queue[bytes | None] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        if stdin is not None:
            raise InvalidRequest(
                "streamed stdin is not routed through a Ray cluster yet: send the input up "
                "front (input=) or use a background command's stdin"
            )
        return await self._run("run_command", sandbox_id, request, owner, on_stdout, on_stderr)
