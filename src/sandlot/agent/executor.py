"""Runs the agent's candidates in a sandbox, through the public SDK only.

The agent layer is a client like any other: it creates an :class:`AsyncSandbox` (embedded,
or on a server when ``api_url`` is set) and never reaches into the manager. One sandbox
serves all attempts of a task; each attempt is written to its own file and run as a fresh
``python3`` process, so nothing one attempt defined can make a later one pass.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from sandlot.agent.models import Execution
from sandlot.sandbox import AsyncSandbox

OUTPUT_KEEP_CHARS = 4000  # of each stream, kept on the result (the tail holds the error)


class SandboxExecutor:
    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        sandbox: AsyncSandbox | None = None,
        **create_options: Any,
    ) -> None:
        """``create_options`` go to :meth:`AsyncSandbox.create` (backend, memory_mb,
        manager, api_url...); pass ``sandbox`` to run in one you already hold."""
        self.timeout_s = timeout_s
        self._options = create_options
        self._sandbox = sandbox
        self._owned = sandbox is None
        self.runs = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            self._sandbox = await AsyncSandbox.create(**self._options)
        return self._sandbox

    async def run(self, program: str, *, name: str | None = None) -> Execution:
        """Run ``program`` as a script; a crash or a kill is a result, not an exception."""
        sandbox = await self.sandbox()
        self.runs += 1
        path = name or f"attempt_{self.runs}.py"
        await sandbox.files.write(path, program)
        # A fresh process in the strict sense: no process an earlier attempt left alive (it
        # could rewrite this one's memory), no session state, and with -I no module planted
        # beside the script, no user site and no PYTHON* variables.
        result = await sandbox.commands.run(
            f"python3 -I {path}", timeout_s=self.timeout_s, fresh=True
        )
        error = None
        if result.error is not None:
            error = f"{result.error.type}: {result.error.message}"
        return Execution(
            ok=result.ok,
            exit_code=result.exit_code,
            stdout=_tail(result.stdout),
            stderr=_tail(result.stderr),
            error=error,
            kill_reason=result.kill_reason,
            duration_s=(result.duration_ms or 0.0) / 1000,
        )

    async def aclose(self) -> None:
        if self._sandbox is not None and self._owned:
            sandbox, self._sandbox = self._sandbox, None
            await sandbox.kill()


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_KEEP_CHARS else "..." + text[-OUTPUT_KEEP_CHARS:]
