"""The agent's strategies (``AGENT_STRATEGY``), behind one call.

- ``single``: one generation, run once with the visible checks;
- ``reflexion``: seed 000's loop (:class:`ReflexionLoop`), unchanged in shape;
- ``sample_select``: :class:`SampleSelect`, candidates judged by running them;
- ``sample_select+reflexion``: sample and select, then, when the best candidate still fails
  a kept check, the loop reviews and rewrites it, with the written tests that survived the
  vote as its visible tests (attempts beyond the samples: ``MAX_REFLEXION_ATTEMPTS - 1``).

The result's attempts are every generation in order (for sample-and-select, every sample,
then the loop's rewrites), so its tokens, model time and sandbox time are the strategy's
whole cost; ``attempts[0]`` is always what a single shot would have written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sandlot.agent.code import program_to_run
from sandlot.agent.config import AgentSettings, Strategy
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.loop import RETRY_TEMPERATURE, ReflexionLoop, _no_events
from sandlot.agent.models import AgentEvent, AgentResult, EventSink, TaskSpec
from sandlot.agent.providers.base import Provider
from sandlot.agent.sampling import SAMPLE_TEMPERATURE, SampleSelect
from sandlot.errors import ConfigError, ProviderError

STRATEGY_NAMES: tuple[str, ...] = get_args(Strategy)


@dataclass(frozen=True)
class StrategyOptions:
    max_attempts: int = 3
    retry_temperature: float = RETRY_TEMPERATURE
    samples: int = 4
    generated_tests: int = 6
    sample_temperature: float = SAMPLE_TEMPERATURE
    early_stop: bool = True

    @classmethod
    def from_settings(
        cls, settings: AgentSettings, *, max_attempts: int, **overrides: Any
    ) -> StrategyOptions:
        """The strategy's knobs as ``settings`` give them (``overrides`` win: a benchmark's
        flags); ``max_attempts`` is the caller's, which may differ from the settings'."""
        values: dict[str, Any] = {
            "max_attempts": max_attempts,
            "retry_temperature": settings.llm_retry_temperature,
            "samples": settings.agent_samples,
            "generated_tests": settings.agent_generated_tests,
            "sample_temperature": settings.agent_sample_temperature,
            "early_stop": settings.agent_sample_early_stop,
        }
        return cls(**{**values, **overrides})


def check_strategy(name: str) -> Strategy:
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    return name  # type: ignore[return-value]


async def solve(
    strategy: Strategy,
    provider: Provider,
    spec: TaskSpec,
    executor: SandboxExecutor,
    *,
    options: StrategyOptions | None = None,
    sandbox_options: dict[str, Any] | None = None,
    recalled: str = "",
    on_event: EventSink | None = None,
) -> AgentResult:
    """Solve ``spec`` with ``strategy``. ``executor`` holds the task's sandbox (the loop's
    attempts run there); sample-and-select's candidates each get a sandbox of their own made
    with ``sandbox_options``, or, when that is None, run one by one in ``executor``'s."""
    options = options or StrategyOptions()
    if strategy in ("single", "reflexion"):
        attempts = 1 if strategy == "single" else options.max_attempts
        loop = ReflexionLoop(
            provider,
            executor,
            max_attempts=attempts,
            retry_temperature=options.retry_temperature,
            on_event=on_event,
        )
        return await loop.run(spec, recalled=recalled, mode="single" if attempts == 1 else "loop")
    assert strategy in ("sample_select", "sample_select+reflexion")
    return await _sample_select(
        strategy, provider, spec, executor, options, sandbox_options, recalled, on_event
    )


async def _sample_select(
    strategy: Literal["sample_select", "sample_select+reflexion"],
    provider: Provider,
    spec: TaskSpec,
    executor: SandboxExecutor,
    options: StrategyOptions,
    sandbox_options: dict[str, Any] | None,
    recalled: str,
    on_event: EventSink | None,
) -> AgentResult:
    emit = on_event or _no_events
    started = time.monotonic()
    await emit(AgentEvent(event="start", data={"task": spec.task[:500]}))
    sampler = SampleSelect(
        provider,
        samples=options.samples,
        generated_tests=options.generated_tests,
        sample_temperature=options.sample_temperature,
        early_stop=options.early_stop,
        sandbox_options=sandbox_options,
        executor=executor if sandbox_options is None else None,
        on_event=on_event,
        timeout_s=executor.timeout_s,
    )
    try:
        selection = await sampler.select(spec, recalled=recalled)
    except ProviderError as exc:
        await emit(AgentEvent(event="error", data={"error": str(exc)}))
        return AgentResult(
            task=spec.task,
            task_id=spec.task_id,
            mode=strategy,
            status="error",
            success=False,
            provider=provider.name,
            model=provider.model,
            error=str(exc),
            wall_s=time.monotonic() - started,
        )
    attempts = selection.attempts
    best = attempts[selection.best]
    judged = spec.model_copy(update={"checks": selection.checks})
    result: AgentResult | None = None
    if strategy == "sample_select+reflexion" and not selection.passed_all:
        seed = best.model_copy(update={"number": 1, "input_tokens": 0, "output_tokens": 0})
        seed.llm_s = 0.0
        if selection.dropped:
            # Re-run the best against the kept checks only: its failure report must name one
            # of them, not a written test the vote threw out.
            program = program_to_run(judged, best.code, run_timeout_s=executor.timeout_s)
            rerun = await executor.run(program, name="seed.py")
            seed.execution = rerun
            extra_sandbox_s = rerun.duration_s
        else:
            extra_sandbox_s = 0.0  # it ran against these very checks: its report stands
        loop = ReflexionLoop(
            provider,
            executor,
            max_attempts=options.max_attempts,
            retry_temperature=options.retry_temperature,
            on_event=on_event,
        )
        result = await loop.run(judged, recalled=recalled, mode=strategy, seed=seed)
        rewrites = result.attempts[1:]
        for i, attempt in enumerate(rewrites):
            attempt.number = len(attempts) + i + 1
        reviewed = best.model_copy()
        if result.attempts:
            # The critique of the seed was charged to the loop's copy of it.
            reviewed.critique = result.attempts[0].critique
            reviewed.add([result.attempts[0]])
            reviewed.critique_tokens += result.attempts[0].critique_tokens
            reviewed.critique_llm_s += result.attempts[0].critique_llm_s
        attempts = [*attempts]
        attempts[selection.best] = reviewed
        attempts += rewrites
    else:
        extra_sandbox_s = 0.0
    final = result.attempts[-1] if result is not None and result.attempts else best
    success = result.success if result is not None else selection.passed_all
    final_run = final.execution
    out = AgentResult(
        task=spec.task,
        task_id=spec.task_id,
        mode=strategy,
        status=(result.status if result is not None else "solved" if success else "failed"),
        success=success,
        code=final.code,
        output=final_run.stdout if final_run else "",
        attempts=attempts,
        errors=result.errors if result is not None else [],
        critiques=result.critiques if result is not None else [],
        sandbox_s=sum(c.sandbox_s for c in selection.candidates)
        + extra_sandbox_s
        + sum(a.execution.duration_s for a in attempts[len(selection.attempts) :] if a.execution),
        wall_s=time.monotonic() - started,
        provider=provider.name,
        model=provider.model,
        error=result.error if result is not None else None,
        candidates=selection.candidates,
        checks=selection.checks,
        dropped_checks=selection.dropped,
        sample_path=selection.path,
    )
    out.add(attempts)
    if selection.tests_usage is not None:
        out.charge(selection.tests_usage)
    await emit(AgentEvent(event="final", data=out.model_dump(exclude={"attempts"})))
    return out
