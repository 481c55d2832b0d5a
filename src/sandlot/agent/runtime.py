"""``AgentRuntime``: the agent layer's one entry point (seed 000).

::

    runtime = AgentRuntime()
    result = await runtime.execute("Write a function to sort a list")

It wires a provider (``LLM_PROVIDER``), a sandbox per task (through the SDK: embedded, or a
server when ``api_url`` is given), the optional memory, and runs a task in one of three
modes: ``single`` (one generation, run once), ``loop`` (the configured
``AGENT_STRATEGY``: sample_select by default), a strategy by name (``sample_select``,
``sample_select+reflexion``) or ``swarm`` (five roles propose and vote, the winner is proven
in the sandbox).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from sandlot.agent.config import AgentSettings, Strategy, get_agent_settings
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.models import AgentResult, EventSink, Mode, TaskSpec
from sandlot.agent.providers import create_provider
from sandlot.agent.providers.base import CALLER, Provider
from sandlot.agent.strategies import StrategyOptions, check_strategy, solve
from sandlot.errors import ConfigError
from sandlot.sandbox import AsyncSandbox

log = structlog.get_logger(__name__)


class AgentRuntime:
    def __init__(
        self,
        provider: Provider | None = None,
        *,
        settings: AgentSettings | None = None,
        memory: Any | None = None,
        max_attempts: int | None = None,
        sandbox_options: dict[str, Any] | None = None,
    ) -> None:
        """``memory`` is an :class:`~sandlot.agent.memory.AgentMemory`; by default one
        is opened when ``AGENT_MEMORY`` is on. ``sandbox_options`` go to
        :meth:`AsyncSandbox.create` (``backend``, ``memory_mb``, ``api_url``...)."""
        self.settings = settings or get_agent_settings()
        self._provider = provider
        self._memory = memory
        self._memory_opened = False
        # The first tasks at once must share one open: embedded Qdrant admits one client per
        # folder, and a second open found it locked (a red team's 503s, 2026-12-07).
        self._memory_opening = asyncio.Lock()
        self.max_attempts = max_attempts or self.settings.max_reflexion_attempts
        self.sandbox_options = dict(sandbox_options or {})

    @property
    def provider(self) -> Provider:
        if self._provider is None:
            self._provider = create_provider(settings=self.settings)
        return self._provider

    async def memory(self) -> Any | None:
        """The memory: the one given, else (with ``AGENT_MEMORY`` on) one opened on first use
        and shared by every task after, those that asked at the same time included."""
        if self._memory is not None or not self.settings.memory_enabled:
            return self._memory
        async with self._memory_opening:
            if self._memory is None and not self._memory_opened:
                from sandlot.agent.memory import AgentMemory

                self._memory = await AgentMemory.open(self.settings)
                self._memory_opened = True
        return self._memory

    async def execute(
        self,
        task: str | TaskSpec,
        *,
        mode: Mode = "loop",
        on_event: EventSink | None = None,
        timeout_s: float | None = None,
        sandbox: AsyncSandbox | None = None,
        tenant: str | None = None,
        max_attempts: int | None = None,
    ) -> AgentResult:
        """Solve ``task``; the result records every attempt. A failure of the generated code
        is ``status="failed"``; a provider failure is ``status="error"``.

        Runs in a new sandbox (destroyed after), or in ``sandbox`` if given (left running).
        The memory recalls, and keeps this task under, ``tenant`` only (a server passes the
        caller's). ``max_attempts`` overrides the runtime's for this task.
        """
        spec = TaskSpec(task=task) if isinstance(task, str) else task
        if not spec.task.strip():
            raise ConfigError("the task is empty: say what the code should do")
        attempts = max_attempts or self.max_attempts
        caller = CALLER.set(tenant)
        try:
            return await self._execute(spec, mode, on_event, timeout_s, sandbox, tenant, attempts)
        finally:
            CALLER.reset(caller)

    async def _execute(
        self,
        spec: TaskSpec,
        mode: Mode,
        on_event: EventSink | None,
        timeout_s: float | None,
        sandbox: AsyncSandbox | None,
        tenant: str | None,
        attempts: int,
    ) -> AgentResult:
        memory = await self.memory()
        recalled = await self._recall(memory, spec, tenant)
        options = {"sandbox": sandbox} if sandbox is not None else self.sandbox_options
        async with SandboxExecutor(timeout_s=timeout_s, **options) as executor:
            if mode == "swarm":
                from sandlot.agent.swarm import Swarm

                swarm = Swarm(
                    self.provider,
                    executor,
                    max_rounds=self.settings.swarm_rounds,
                    max_attempts=attempts,
                    on_event=on_event,
                )
                result = await swarm.run(spec, recalled=recalled)
            else:
                strategy = self._strategy(mode)
                result = await solve(
                    strategy,
                    self.provider,
                    spec,
                    executor,
                    options=StrategyOptions.from_settings(self.settings, max_attempts=attempts),
                    # A sandbox the caller holds is the only one: candidates take turns in it.
                    sandbox_options=None if sandbox is not None else self.sandbox_options,
                    recalled=recalled,
                    on_event=on_event,
                )
        await self._remember(memory, result, tenant)
        return result

    def _strategy(self, mode: Mode) -> Strategy:
        """``loop`` is the configured strategy (AGENT_STRATEGY, sample_select by default);
        ``single`` and the strategies' own names pick one."""
        if mode == "loop":
            return self.settings.agent_strategy
        return check_strategy(mode)

    async def _recall(self, memory: Any | None, spec: TaskSpec, tenant: str | None) -> str:
        if memory is None:
            return ""
        from sandlot.agent.recall import format_recall

        hits = await memory.recall(spec.prompt or spec.task, tenant=tenant)
        return str(format_recall(hits)) if hits else ""

    async def _remember(self, memory: Any | None, result: AgentResult, tenant: str | None) -> None:
        if memory is None or result.status == "error" or not result.code:
            return
        from sandlot.agent.recall import MemoryRecord

        fix = None
        if result.success and len(result.attempts) > 1:
            fix = result.attempts[-2].critique
        await memory.remember(
            MemoryRecord(
                task=result.task,
                code=result.code,
                outcome="solved" if result.success else "failed",
                errors=result.errors[-3:],
                fix=fix,
                attempts=len(result.attempts),
                tenant=tenant,
            )
        )

    async def aclose(self) -> None:
        if self._provider is not None:
            await self._provider.aclose()
        if self._memory is not None and self._memory_opened:
            await self._memory.close()
