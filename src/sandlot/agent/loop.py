"""The reflexion loop: a LangGraph state machine (seed 000's graph).

::

    generate -> execute --success--> finalize
                   |--failure, attempts left--> critique -> retry --> generate
                   |--failure, none left / agent error--> finalize

- **generate** asks the model for code and takes it out of the reply. The loop is one
  conversation: each attempt is the model's turn, its failure and review the next user turn.
  Retries sample (``LLM_RETRY_TEMPERATURE``, 0.7): decoded greedily, a 1.5B model rewrote the
  very code that had failed, whatever the review said (0 of 10 fixed on HumanEval's first
  63). A retry that still repeats failed code is redrawn (twice at most), not run again;
- **execute** runs the candidate plus the task's visible tests in a sandbox, through the SDK.
  For a task with checks, an attempt passes when the harness's verdict line (with a marker
  made for this run) says every check passed and the run exited 0, selection's rule
  (:func:`run_candidate`): the exit code alone would pass code that ends the process before
  the checks run (``sys.exit(0)`` in a ``__main__`` block, an ``os._exit(0)``);
- **critique** asks the model, for a JSON :class:`Critique`, what went wrong; a reply that
  is not valid JSON (after one repair turn) is recorded and the raw error stands in for it;
- **retry** sends the loop back to generate while attempts remain (``MAX_REFLEXION_ATTEMPTS``);
- **finalize** sets the status. The last failed attempt is not critiqued: nothing would read it.

A provider failure ends the run with ``status="error"`` and the message: it is the agent's
failure, never the code's. Everything is recorded on the :class:`AgentResult`: each attempt's
code, run and critique, errors, critiques, tokens, model time and sandbox time.
"""

from __future__ import annotations

import ast
import time
from typing import Any, Literal, TypedDict

from sandlot.agent.checks import judged, new_marker
from sandlot.agent.code import extract_code, program_to_run
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.models import (
    AgentEvent,
    AgentResult,
    Attempt,
    Critique,
    EventSink,
    Execution,
    Mode,
    TaskSpec,
)
from sandlot.agent.prompts import (
    conversation,
    critique_conversation,
    current_prompts,
)
from sandlot.agent.providers.base import Provider
from sandlot.errors import ModelOutputError, ProviderError

CRITIQUE_MAX_TOKENS = 256  # a diagnosis and a fix: longer only costs decoding time
RETRY_TEMPERATURE = 0.7
DUPLICATE_REDRAWS = 2  # new samples drawn when a retry rewrites code that already failed
REDRAW_TEMPERATURE_STEP = 0.3


def _normalized(code: str) -> str:
    """The code without docstrings, comments and layout: a retry that only rewords the
    docstring it repeated is the same code."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def has_checks(spec: TaskSpec) -> bool:
    """Whether ``spec`` runs with the checks' harness (see ``program_to_run``)."""
    return bool(spec.checks) and spec.is_function


async def run_candidate(executor: SandboxExecutor, spec: TaskSpec, code: str) -> Execution:
    """Run ``code`` with ``spec``'s visible tests. With checks, ``ok`` is the harness's
    believed verdict (:func:`judged`), not the exit code: a run that never reached its checks
    fails, and says so to the critic."""
    marker = new_marker()
    execution = await executor.run(
        program_to_run(spec, code, marker=marker, run_timeout_s=executor.timeout_s)
    )
    return judged(execution, len(spec.checks), marker) if has_checks(spec) else execution


class LoopState(TypedDict, total=False):
    spec: TaskSpec
    max_attempts: int
    recalled: str
    attempts: list[Attempt]
    critiques: list[str]
    errors: list[str]
    status: Literal["running", "solved", "failed", "error"]
    error: str | None


async def _no_events(_event: AgentEvent) -> None:
    return None


class ReflexionLoop:
    """Generate, execute, critique, retry: until the code passes or attempts run out."""

    def __init__(
        self,
        provider: Provider,
        executor: SandboxExecutor,
        *,
        max_attempts: int = 3,
        retry_temperature: float = RETRY_TEMPERATURE,
        on_event: EventSink | None = None,
    ) -> None:
        self.provider = provider
        self.executor = executor
        self.max_attempts = max_attempts
        self.retry_temperature = retry_temperature
        self.emit = on_event or _no_events
        self.graph = self._build()

    def _build(self) -> Any:
        try:
            from langgraph.graph import END, START, StateGraph
        except ImportError as exc:  # pragma: no cover - the agent extra is missing
            from sandlot.errors import ConfigError

            raise ConfigError(
                "the agent layer needs LangGraph: pip install 'sandlot[agent]'"
            ) from exc
        graph = StateGraph(LoopState)
        graph.add_node("generate", self._generate)
        graph.add_node("execute", self._execute)
        graph.add_node("critique", self._critique)
        graph.add_node("retry", self._retry)
        graph.add_node("finalize", self._finalize)
        graph.add_conditional_edges(
            START,
            self._first,
            {"generate": "generate", "critique": "critique", "finalize": "finalize"},
        )
        graph.add_conditional_edges(
            "generate", self._after_generate, {"execute": "execute", "finalize": "finalize"}
        )
        graph.add_conditional_edges(
            "execute",
            self._after_execute,
            {"success": "finalize", "critique": "critique", "end": "finalize"},
        )
        graph.add_edge("critique", "retry")
        graph.add_conditional_edges(
            "retry", self._after_retry, {"generate": "generate", "end": "finalize"}
        )
        graph.add_edge("finalize", END)
        return graph.compile()

    # ------------------------------------------------------------------ nodes

    async def _generate(self, state: LoopState) -> LoopState:
        spec = state["spec"]
        attempts = list(state.get("attempts", []))
        number = len(attempts) + 1
        await self.emit(AgentEvent(event="generate", attempt=number))
        messages = conversation(
            spec, state.get("recalled", ""), attempts, state.get("critiques", [])
        )
        # The first attempt decodes at the provider's temperature (greedy in the benchmark);
        # a retry samples, or a small model rewrites the same code whatever the review says.
        temperature = None if not attempts else self.retry_temperature
        attempt = Attempt(number=number, code="")
        tried = {_normalized(a.code) for a in attempts}
        for _ in range(1 + (DUPLICATE_REDRAWS if attempts else 0)):
            try:
                completion = await self.provider.generate(
                    messages, system=current_prompts().generator, temperature=temperature
                )
            except ProviderError as exc:
                await self.emit(AgentEvent(event="error", attempt=number, data={"error": str(exc)}))
                return {"status": "error", "error": str(exc)}
            attempt.code = extract_code(completion.text)
            attempt.charge(completion)
            if _normalized(attempt.code) not in tried:
                break
            # The same code already failed: running it again would teach nothing.
            attempt.redraws += 1
            temperature = min((temperature or 0.0) + REDRAW_TEMPERATURE_STEP, 1.5)
        await self.emit(AgentEvent(event="code", attempt=number, data={"code": attempt.code}))
        return {"attempts": [*attempts, attempt]}

    async def _execute(self, state: LoopState) -> LoopState:
        attempts = list(state["attempts"])
        attempt = attempts[-1].model_copy()
        execution = await run_candidate(self.executor, state["spec"], attempt.code)
        attempt.execution = execution
        attempts[-1] = attempt
        await self.emit(
            AgentEvent(event="execute", attempt=attempt.number, data=execution.model_dump())
        )
        errors = list(state.get("errors", []))
        if not execution.ok:
            errors.append(execution.failure_summary(400))
        return {"attempts": attempts, "errors": errors}

    async def _critique(self, state: LoopState) -> LoopState:
        attempts = list(state["attempts"])
        attempt = attempts[-1].model_copy()
        errors = list(state.get("errors", []))
        messages = critique_conversation(
            state["spec"], state.get("recalled", ""), attempts, state.get("critiques", [])
        )
        try:
            critique, completion = await self.provider.generate_json(
                messages,
                Critique,
                system=current_prompts().generator,
                max_tokens=CRITIQUE_MAX_TOKENS,
            )
            text = f"{critique.diagnosis} Fix: {critique.fix}"
            attempt.charge(completion)
            attempt.critique_tokens += completion.input_tokens + completion.output_tokens
            attempt.critique_llm_s += completion.duration_s
        except ModelOutputError as exc:
            # The critic's reply did not parse: the error itself is the best review we have.
            errors.append(f"critic: {exc}")
            failure = attempt.execution.failure_summary(600) if attempt.execution else ""
            text = f"The code failed as shown; fix the cause of: {failure}"
        except ProviderError as exc:
            return {"status": "error", "error": str(exc)}
        attempt.critique = text
        attempts[-1] = attempt
        await self.emit(
            AgentEvent(event="critique", attempt=attempt.number, data={"critique": text})
        )
        return {
            "attempts": attempts,
            "critiques": [*state.get("critiques", []), text],
            "errors": errors,
        }

    async def _retry(self, state: LoopState) -> LoopState:
        return {}

    async def _finalize(self, state: LoopState) -> LoopState:
        if state.get("status") == "error":
            return {}
        attempts = state.get("attempts", [])
        last = attempts[-1].execution if attempts else None
        return {"status": "solved" if last is not None and last.ok else "failed"}

    # ------------------------------------------------------------------ edges

    def _first(self, state: LoopState) -> str:
        # A run seeded with a failed attempt (sample-and-select's best) starts by reviewing it.
        attempts = state.get("attempts", [])
        if not attempts:
            return "generate"
        execution = attempts[-1].execution
        if execution is not None and execution.ok:
            return "finalize"
        return "critique" if len(attempts) < state["max_attempts"] else "finalize"

    def _after_generate(self, state: LoopState) -> str:
        return "finalize" if state.get("status") == "error" else "execute"

    def _after_execute(self, state: LoopState) -> str:
        execution = state["attempts"][-1].execution
        if execution is not None and execution.ok:
            return "success"
        return "critique" if len(state["attempts"]) < state["max_attempts"] else "end"

    def _after_retry(self, state: LoopState) -> str:
        if state.get("status") == "error":
            return "end"
        return "generate" if len(state["attempts"]) < state["max_attempts"] else "end"

    # ------------------------------------------------------------------ run

    async def run(
        self,
        spec: TaskSpec,
        *,
        recalled: str = "",
        mode: Mode | None = None,
        seed: Attempt | None = None,
    ) -> AgentResult:
        """``seed``: an attempt already run and failed (counted as attempt 1), to review and
        rewrite instead of generating from scratch."""
        started = time.monotonic()
        if seed is not None and seed.execution is not None and has_checks(spec):
            # Its verdict line's marker was made by whoever ran it: an exit 0 proves nothing.
            execution = judged(seed.execution, len(spec.checks), None)
            seed = seed.model_copy(update={"execution": execution})
        attempts = [seed] if seed is not None else []
        errors = [seed.execution.failure_summary(400)] if seed and seed.execution else []
        await self.emit(AgentEvent(event="start", data={"task": spec.task[:500]}))
        state: LoopState = await self.graph.ainvoke(
            {
                "spec": spec,
                "max_attempts": self.max_attempts,
                "recalled": recalled,
                "attempts": attempts,
                "critiques": [],
                "errors": errors,
                "status": "running",
                "error": None,
            },
            # Each attempt passes through at most four nodes.
            config={"recursion_limit": 4 * self.max_attempts + 8},
        )
        result = build_result(
            spec,
            state,
            mode=mode or ("single" if self.max_attempts == 1 else "loop"),
            provider=self.provider,
            wall_s=time.monotonic() - started,
        )
        await self.emit(AgentEvent(event="final", data=result.model_dump(exclude={"attempts"})))
        return result


def build_result(
    spec: TaskSpec, state: LoopState, *, mode: Mode, provider: Provider, wall_s: float
) -> AgentResult:
    attempts = state.get("attempts", [])
    status = state.get("status", "failed")
    last = attempts[-1] if attempts else None
    result = AgentResult(
        task=spec.task,
        task_id=spec.task_id,
        mode=mode,
        status="failed" if status == "running" else status,
        success=status == "solved",
        code=last.code if last else "",
        output=last.execution.stdout if last and last.execution else "",
        attempts=attempts,
        errors=state.get("errors", []),
        critiques=state.get("critiques", []),
        sandbox_s=sum(a.execution.duration_s for a in attempts if a.execution),
        wall_s=wall_s,
        provider=provider.name,
        model=provider.model,
        error=state.get("error"),
    )
    result.add(attempts)
    return result
