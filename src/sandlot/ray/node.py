"""The node agent: one long-lived async Ray actor per cluster node, wrapping that node's own
:class:`~sandlot.core.SandboxManager` (its local data directory, SQLite store, warm pools and
start-up sweep).

Every call returns an envelope, ``("ok", value)`` or ``("err", code, message)``: our errors
cross the Ray boundary the way they cross HTTP (a code from the allow-list in
:mod:`sandlot.errors`), never as pickled classes. Runs stream their events through a Ray
generator; when the caller drops it, the run inside the sandbox is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import ray
import structlog

from sandlot.backends import hostnet
from sandlot.config import Settings
from sandlot.core import SandboxManager, admission
from sandlot.core.live import set_node_name
from sandlot.errors import ConfigError, SandboxError, SandboxStartError
from sandlot.models import ExecResult, Quota, Result
from sandlot.ray import wall
from sandlot.requests import RunCode, RunCommand, SandboxSpec

log = structlog.get_logger(__name__)

AGENT_PREFIX = "sandlot-node-"
# The custom resource every sandlot node offers once: an agent asks for all of it, so no node
# ever runs two.
NODE_RESOURCE = "sandlot_node"

# Ray's memory monitor: the share of a node's memory in use past which it kills a worker
# (its default), and what sandlot keeps below that for Ray's own processes.
RAY_MEMORY_THRESHOLD = 0.95
RAY_MEMORY_HEADROOM = 0.10

Envelope = tuple[Any, ...]
# Pending ledger releases kept for a destroy to wait on; older ones have long landed.
_RELEASES_KEPT = 1024
# How long a create may take (a boot; an image pull longer) before its caller gives up.
CREATE_BOUND_S = 120.0
# How often an agent re-reads the cluster's node addresses for its FORWARD wall.
WALL_REFRESH_S = 5.0

# The manager verbs a routing server may call by name (anything else is refused).
VERBS = frozenset(
    {
        "get",
        "list",
        "destroy",
        "extend",
        "usage",
        "write_file",
        "read_file",
        "read_file_range",
        "list_files",
        "stat_file",
        "remove_file",
        "make_dir",
        "list_artifacts",
        "read_artifact",
        "read_artifact_range",
        "delete_artifacts",
        "start_command",
        "list_commands",
        "command_info",
        "wait_command",
        "send_command_stdin",
        "kill_command",
        "start_pty",
        "resize_pty",
        "send_pty_input",
        "pty_output",
    }
)


async def _awaited(ref: Any) -> Any:
    return await ref


def agent_name(node: str) -> str:
    return AGENT_PREFIX + node


def node_settings(
    node: str, overrides: dict[str, Any], environ: Mapping[str, str] = os.environ
) -> Settings:
    """The node's settings: its environment's, with a data directory of its own per node
    (several nodes on one host, as in tests, never share one), and its sandboxes' memory
    held under the share at which Ray's memory monitor kills the agent
    (:func:`ray_memory_cap_mb`)."""
    base = Settings(**overrides)
    data_dir = Path(overrides.get("data_dir", base.data_dir)) / "nodes" / node
    update: dict[str, Any] = {"data_dir": data_dir}
    cap_mb = ray_memory_cap_mb(base, environ)
    if cap_mb is not None and (base.host_memory_mb is None or cap_mb < base.host_memory_mb):
        update["host_memory_mb"] = cap_mb
        log.warning(
            "Ray's memory monitor is on: sandboxes here may reserve at most this much memory "
            "(start the node with RAY_memory_monitor_refresh_ms=0 to leave it to their cgroups)",
            node=node,
            memory_mb=round(cap_mb),
        )
    return base.model_copy(update=update)


def ray_memory_cap_mb(settings: Settings, environ: Mapping[str, str]) -> float | None:
    """What a node's sandboxes may reserve of memory while Ray's memory monitor is on (None:
    it is off). Past ``RAY_memory_usage_threshold`` (0.95) of the node's memory in use, the
    monitor kills a Ray worker, whatever process filled it, and the agent is the one worker
    here: a tenant filling its own sandbox had the agent killed and every tenant's sandboxes
    on the node swept (red team, 2026-12-07). So the sandboxes together stay
    ``RAY_MEMORY_HEADROOM`` under it, which the raylet, the agent and the object store use."""
    if environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return None
    try:
        threshold = float(environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD))
    except ValueError:
        threshold = RAY_MEMORY_THRESHOLD
    share = max(min(threshold, 1.0) - RAY_MEMORY_HEADROOM, RAY_MEMORY_HEADROOM)
    return admission.physical_memory_mb(settings) * share


class NodeAgent:
    """Plain class; :func:`sandlot.ray.cluster.ensure_agents` runs one per node as a
    detached, named async actor."""

    def __init__(self, node: str, overrides: dict[str, Any]) -> None:
        self.node = node
        settings = node_settings(node, overrides)
        set_node_name(node)
        self.manager = SandboxManager(settings)
        self.settings = settings
        self._memory_mb = 0.0
        self._started = asyncio.Lock()
        self._ledger: Any = None
        # Ledger releases of destroyed sandboxes, by id, so that a destroy answers only once
        # its release is in (a create right after it must see the slot free).
        self._releases: dict[str, asyncio.Future[Any]] = {}
        # Creates whose caller gave up: by ticket, the sandbox made (to destroy on abandon)
        # or the time of the abandon (for a create still running).
        self._made: dict[str, tuple[str, float]] = {}
        self._abandoned: dict[str, float] = {}
        self._walling: asyncio.Task[None] | None = None

    async def start(self, ledger: Any = None) -> Envelope:
        """Start the manager (recovering this node's leftovers); idempotent."""
        async with self._started:
            self._ledger = ledger
            try:
                if self.settings.ray_wall_node and self._walling is None:
                    await self._wall_off()
                await self.manager.start()
            except SandboxError as exc:
                return ("err", exc.code, exc.message)
            if not self._memory_mb:
                capacity = await asyncio.to_thread(admission.HostCapacity.measure, self.settings)
                self._memory_mb = capacity.memory_mb
                self.manager.add_listener(self._on_event)
                if ledger is not None:
                    # A new agent: the start-up sweep ended every sandbox an earlier one left
                    # here, so none of them counts any more (a dead agent cannot say so).
                    await ledger.release_node.remote(self.node)
        return ("ok", None)

    async def _wall_off(self) -> None:
        extra_cidrs = wall.parse_cidrs(self.settings.ray_wall_extra_cidrs)
        walled = await asyncio.to_thread(wall.wall_off_node)
        log.info("node walled off from its sandboxes", node=self.node, walled=walled)
        if not walled:
            return
        # The backend's FORWARD chain first, so that the cluster wall goes in ahead of it
        # (the backend only ever adds its jump when it is missing).
        await hostnet.ensure_walls(self.settings)
        await self._wall_cluster(extra_cidrs)
        self._walling = asyncio.create_task(self._wall_forever(extra_cidrs))

    async def _wall_cluster(self, extra_cidrs: list[str]) -> None:
        nodes: list[dict[str, Any]] = await asyncio.to_thread(ray.nodes)
        targets = wall.cluster_targets((n["NodeManagerAddress"] for n in nodes), extra_cidrs)
        await asyncio.to_thread(wall.wall_off_cluster, targets)

    async def _wall_forever(self, extra_cidrs: list[str]) -> None:
        # New nodes join with new addresses; a node's own wall needs no refresh.
        while True:
            await asyncio.sleep(WALL_REFRESH_S)
            try:
                await self._wall_cluster(extra_cidrs)
            except Exception:
                log.exception("refreshing the cluster wall failed", node=self.node)

    def _on_event(self, event: str, fields: dict[str, Any]) -> None:
        # The one place a destroyed sandbox (by a call, TTL or idle) stops counting: once its
        # teardown has ended (its disk, cgroup and network gone), not at its destroy.
        if event == "released" and self._ledger is not None:
            sandbox_id = fields["info"].id
            if len(self._releases) >= _RELEASES_KEPT:
                self._releases.pop(next(iter(self._releases)))
            self._releases[sandbox_id] = asyncio.ensure_future(
                _awaited(self._ledger.release.remote(sandbox_id))
            )

    async def create(
        self, spec: SandboxSpec, owner: str, ticket: str, quota: Quota | None
    ) -> Envelope:
        """Create a sandbox; the ticket of a create under a ``quota`` (its reservation in the
        ledger) is bound to it before this answers, so it counts even if the caller is gone by
        then. This node's manager checks ``quota`` again (its sandboxes are some of the
        ledger's) and keeps the sandbox's artifacts within it."""
        self._forget_old_creates()
        counted = quota is not None
        try:
            info = await self.manager.create(spec, owner=owner, quota=quota)
        except SandboxError as exc:
            if self._abandoned.pop(ticket, None) is not None and counted and self._ledger:
                # Its caller gave up and so never sees this answer, which is where a failed
                # create's ticket is released: it would count for TICKET_TTL_S (red team).
                await self._ledger.release.remote(ticket)
            return ("err", exc.code, exc.message)
        if counted and self._ledger is not None:
            await self._ledger.bind.remote(ticket, info.id)
        if self._abandoned.pop(ticket, None) is not None:
            await self._destroy_abandoned(info.id)
            return ("err", SandboxStartError.code, "the create was abandoned by its caller")
        self._made[ticket] = (info.id, time.monotonic())
        return ("ok", info)

    async def abandon(self, ticket: str) -> None:
        """The caller of the create under ``ticket`` gave up (cancel, timeout): what it made
        is destroyed, now or when the create ends."""
        made = self._made.pop(ticket, None)
        if made is None:
            self._abandoned[ticket] = time.monotonic()
        else:
            await self._destroy_abandoned(made[0])

    async def _destroy_abandoned(self, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxError):
            await self.manager.destroy(sandbox_id, reason="abandoned")
        log.info("abandoned create destroyed", node=self.node, sandbox=sandbox_id)

    def _forget_old_creates(self) -> None:
        # An abandon comes within a create's bound or never.
        cutoff = time.monotonic() - 2 * CREATE_BOUND_S
        self._made = {t: made for t, made in self._made.items() if made[1] > cutoff}
        self._abandoned = {t: at for t, at in self._abandoned.items() if at > cutoff}

    async def load(self) -> Envelope:
        # A destroyed sandbox holds its memory and slot until its teardown is done.
        live = [*await self.manager.list(), *self.manager.tearing_down()]
        default = self.settings.resolve_limits(None)
        pooled = self.manager.pooled_count()
        used_mb = sum(info.limits.memory_mb for info in live) + pooled * default.memory_mb
        warm_key = f"{self.settings.backend}/{self.settings.environment}"
        return (
            "ok",
            {
                "node": self.node,
                "live": len(live),
                "max_sandboxes": self.settings.ray_node_max_sandboxes,
                "memory_free_mb": self._memory_mb - used_mb,
                "warm": {warm_key: pooled} if pooled else {},
            },
        )

    async def call(self, verb: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
        if verb not in VERBS:
            return ("err", ConfigError.code, f"no verb {verb!r} on a node agent")
        try:
            value = await getattr(self.manager, verb)(*args, **kwargs)
        except SandboxError as exc:
            return ("err", exc.code, exc.message)
        if verb == "destroy":
            # The destroy answers once its quota is free: a create right after it must fit.
            await self.manager.settle(args[0])
            if (release := self._releases.pop(args[0], None)) is not None:
                await release
        return ("ok", value)

    async def run(
        self, verb: str, sandbox_id: str, request: RunCode | RunCommand, owner: str | None
    ) -> AsyncIterator[Envelope]:
        """Stream a run: ("stdout"|"stderr", text), ("result", Result), then ("ok", ExecResult)
        or ("err", code, message). Dropping the generator cancels the run."""
        events: asyncio.Queue[Envelope | None] = asyncio.Queue()

        def out(kind: str) -> Any:
            return lambda text: events.put_nowait((kind, text))

        def on_result(result: Result) -> None:
            events.put_nowait(("result", result))

        async def go() -> Envelope:
            try:
                if verb == "run_code" and isinstance(request, RunCode):
                    result: ExecResult = await self.manager.run_code(
                        sandbox_id,
                        request,
                        on_stdout=out("stdout"),
                        on_stderr=out("stderr"),
                        on_result=on_result,
                        owner=owner,
                    )
                elif verb == "run_command" and isinstance(request, RunCommand):
                    result = await self.manager.run_command(
                        sandbox_id,
                        request,
                        on_stdout=out("stdout"),
                        on_stderr=out("stderr"),
                        owner=owner,
                    )
                else:
                    return ("err", ConfigError.code, f"cannot {verb} a {type(request).__name__}")
            except SandboxError as exc:
                return ("err", exc.code, exc.message)
            else:
                return ("ok", result)
            finally:
                events.put_nowait(None)

        task = asyncio.create_task(go())
        try:
            while (event := await events.get()) is not None:
                yield event
            yield await task
        finally:
            # The consumer went away (cancel, disconnect): stop the run in the sandbox too.
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def shutdown(self) -> None:
        """Destroy this node's sandboxes and release its data directory instance."""
        if self._walling is not None:
            self._walling.cancel()
        await self.manager.close()
