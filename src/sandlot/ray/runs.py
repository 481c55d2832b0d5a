"""Runs through a node agent: output streamed back through a Ray generator, the caller's
cancel carried to the sandbox, and every run bounded, with or without a timeout of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray

from sandlot.config import Settings
from sandlot.core.live import node_of
from sandlot.errors import InvalidRequest, NodeTimeout, SandboxLost
from sandlot.models import ExecResult, OutputCallback, ResultCallback, SandboxInfo
from sandlot.ray.calls import GONE, SHORT_CALL, NodeSilent, settle, unwrap
from sandlot.requests import RunCode, RunCommand

# Sandbox timeouts remembered per id (so a run without a timeout costs no extra call); the
# oldest are forgotten past this many.
_TIMEOUTS_KEPT = 100_000


class RunVerbs:
    settings: Settings

    def __init__(self) -> None:
        self._timeouts_s: dict[str, float] = {}

    async def _agent_for(self, sandbox_id: str) -> tuple[str, Any]:
        raise NotImplementedError

    async def _call(
        self,
        sandbox_id: str,
        verb: str,
        *args: Any,
        bound_s: float | None = SHORT_CALL,
        **kwargs: Any,
    ) -> Any:
        raise NotImplementedError

    async def _lost(
        self, node: str, sandbox_id: str, owner: str | None, exc: BaseException, agent: Any
    ) -> SandboxLost:
        raise NotImplementedError

    def _emit(self, event: str, **fields: Any) -> None:
        raise NotImplementedError

    def _remember_timeout(self, info: SandboxInfo) -> None:
        if len(self._timeouts_s) >= _TIMEOUTS_KEPT:
            self._timeouts_s.pop(next(iter(self._timeouts_s)))
        self._timeouts_s[info.id] = info.limits.timeout_s

    async def _sandbox_timeout_s(self, sandbox_id: str, owner: str | None) -> float:
        """The timeout a run without one gets inside the sandbox (its limits' timeout_s)."""
        if sandbox_id not in self._timeouts_s:
            info: SandboxInfo = await self._call(sandbox_id, "get", owner=owner)
            self._remember_timeout(info)
        return self._timeouts_s[sandbox_id]

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
        # A run ends by its own timeout inside the sandbox (the sandbox's when the request has
        # none); the node gets ray_call_timeout_s on top to report it. A hung node is found
        # sooner, by the probes while the run is silent.
        timeout_s = request.timeout_s or await self._sandbox_timeout_s(sandbox_id, owner)
        call_s = self.settings.ray_call_timeout_s
        stream = agent.run.remote(verb, sandbox_id, request, owner)
        handlers: dict[str, Callable[[Any], None] | None] = {
            "stdout": on_stdout,
            "stderr": on_stderr,
            "result": on_result,
        }
        events = self._events(verb, sandbox_id, stream, handlers)
        try:
            return await settle(events, agent, bound_s=timeout_s + call_s, every_s=call_s)
        except (*GONE, NodeSilent) as exc:
            ray.cancel(stream)
            raise await self._lost(node, sandbox_id, owner, exc, agent) from exc
        except (NodeTimeout, asyncio.CancelledError):
            # The caller gave up (a cancelled task, a closed WebSocket) or the bound passed on
            # a live node: end the run there too.
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
            result: ExecResult = unwrap(event)
            self._emit("exec", sandbox_id=sandbox_id, op=verb, result=result)
            return result
        raise SandboxLost(
            f"the node of {sandbox_id} ended its run without a result", node_of(sandbox_id)
        )
