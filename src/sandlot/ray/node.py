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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from sandlot.config import Settings
from sandlot.core import SandboxManager, admission
from sandlot.core.live import set_node_name
from sandlot.errors import ConfigError, SandboxError
from sandlot.models import ExecResult, Result
from sandlot.ray import wall
from sandlot.requests import RunCode, RunCommand

log = structlog.get_logger(__name__)

AGENT_PREFIX = "sandlot-node-"
# The custom resource every sandlot node offers once: an agent asks for all of it, so no node
# ever runs two.
NODE_RESOURCE = "sandlot_node"

Envelope = tuple[Any, ...]

# The manager verbs a routing server may call by name (anything else is refused).
VERBS = frozenset(
    {
        "create",
        "get",
        "list",
        "destroy",
        "extend",
        "usage",
        "write_file",
        "read_file",
        "list_files",
        "stat_file",
        "remove_file",
        "make_dir",
        "list_artifacts",
        "read_artifact",
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


def agent_name(node: str) -> str:
    return AGENT_PREFIX + node


def node_settings(node: str, overrides: dict[str, Any]) -> Settings:
    """The node's settings: its environment's, with a data directory of its own per node
    (several nodes on one host, as in tests, never share one)."""
    base = Settings(**overrides)
    data_dir = Path(overrides.get("data_dir", base.data_dir)) / "nodes" / node
    return base.model_copy(update={"data_dir": data_dir})


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

    async def start(self, ledger: Any = None) -> Envelope:
        """Start the manager (recovering this node's leftovers); idempotent."""
        async with self._started:
            self._ledger = ledger
            try:
                if self.settings.ray_wall_node:
                    walled = await asyncio.to_thread(wall.wall_off_node)
                    log.info("node walled off from its sandboxes", node=self.node, walled=walled)
                await self.manager.start()
            except SandboxError as exc:
                return ("err", exc.code, exc.message)
            if not self._memory_mb:
                capacity = await asyncio.to_thread(admission.HostCapacity.measure, self.settings)
                self._memory_mb = capacity.memory_mb
                self.manager.add_listener(self._on_event)
        return ("ok", None)

    def _on_event(self, event: str, fields: dict[str, Any]) -> None:
        # A sandbox this node ended by itself (TTL, idle) stops counting against its owner.
        if event == "destroyed" and self._ledger is not None:
            self._ledger.release.remote(fields["info"].id)

    async def load(self) -> Envelope:
        live = await self.manager.list()
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
            return ("ok", await getattr(self.manager, verb)(*args, **kwargs))
        except SandboxError as exc:
            return ("err", exc.code, exc.message)

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
        await self.manager.close()
