"""``sandlot benchmark``: a task set through the provider, single shot vs a strategy.

Strategies other than ``reflexion`` (``--strategy``) run through
:func:`~sandlot.agent.strategies.solve`: their answer is scored as the ``loop_*`` fields and
their first generation as single shot. For ``reflexion``, the loop runs for each task
(generate, run with the visible tests, critique, retry); then the scorer runs the task's
hidden tests, in a fresh sandbox, on

- the **first** attempt's code: the single-shot answer, and
- the **final** attempt's code: the loop's answer.

With greedy decoding (temperature 0, the benchmark's default) the first attempt is exactly
what a single-shot run would generate, so one loop run measures both modes; ``--separate``
runs single shot on its own instead (for sampling temperatures). Results are appended to
a JSONL file task by task, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sandlot.agent.bench.tasks import BenchTask
from sandlot.agent.config import get_agent_settings
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.loop import ReflexionLoop
from sandlot.agent.models import AgentResult, Attempt, Execution
from sandlot.agent.providers.base import Provider
from sandlot.agent.strategies import StrategyOptions, check_strategy, solve

HIDDEN_TIMEOUT_S = 20.0


class CandidateLog(BaseModel):
    sample: int
    copies: int
    tokens: int  # what writing it cost
    examples: int  # how many of ``passed`` are the prompt's examples (they come first)
    passed: str  # a 1 or 0 per check judged: the examples, then every written test
    # What it returned on each check (agreement between candidates, whatever the tests
    # expect, can be weighed afterwards); empty in rows written before it was kept.
    returned: list[str] = []
    hidden: bool
    selected: bool


class TaskOutcome(BaseModel):
    task_id: str
    difficulty: str
    single_pass: bool
    loop_pass: bool
    attempts: int
    status: str
    single_tokens: int
    loop_tokens: int
    single_llm_s: float
    loop_llm_s: float
    single_sandbox_s: float
    loop_sandbox_s: float
    wall_s: float
    error: str | None = None
    hidden_failure: str = ""
    # With --separate: whether the single-shot run wrote the same code as the loop's first
    # attempt (it must, under greedy decoding; this is how that claim is checked).
    single_same_as_first: bool | None = None
    # The strategy whose answer the loop_* fields score (single_* are always its first
    # generation: what a single shot writes).
    strategy: str = "reflexion"
    candidates: int = 0  # distinct candidates sample-and-select ran, each in its own sandbox
    candidate_sandbox_s: float = 0.0  # their mean seconds of run in the sandbox
    dropped_checks: int = 0  # written tests the vote threw out
    written_checks: int = 0  # written tests kept (the model's asserts that parsed, less those)
    # Of single_tokens and loop_tokens, the replies' (the rest is prompts); None where the
    # first attempt also carries its critique's tokens, which are not split in and out.
    single_output_tokens: int | None = None
    loop_output_tokens: int | None = None
    # Sample-and-select: each distinct candidate, scored by the hidden tests too, so that
    # selection rules can be weighed afterwards on the same samples.
    candidate_log: list[CandidateLog] = []
    sample_path: str | None = None  # why as many samples were drawn (AgentResult's)


class BenchConfig(BaseModel):
    task_set: str
    provider: str
    model: str
    max_attempts: int
    temperature: float
    retry_temperature: float
    separate_single: bool
    concurrency: int
    sandbox_options: dict[str, Any] = {}
    strategy: str = "reflexion"
    samples: int = 4
    generated_tests: int = 6
    early_stop: bool = True


def hidden_passed(run: Execution, marker: str) -> bool:
    """A scoring run passed: exit code 0, not killed, and ``marker`` printed on a line of
    its own after the hidden tests returned."""
    return run.ok and run.exit_code == 0 and marker in run.stdout.splitlines()


async def _hidden_passes(
    task: BenchTask, codes: list[str], options: dict[str, Any]
) -> list[tuple[bool, str]]:
    """Each code against the hidden tests, each in a fresh sandbox of its own (not the
    loop's); the same code is judged once (the loop's answer is usually its first). One
    sandbox for all let an earlier answer plant a hard link to the next one's judge program
    (the tests and the pass line) and the next, wrong, pass (red team, 2026-12-06)."""
    verdicts: dict[str, tuple[bool, str]] = {"": (False, "no code")}
    for code in codes:
        if code.strip() in verdicts:
            continue
        marker = f"__SANDLOT_HIDDEN_PASSED_{secrets.token_hex(16)}__"
        async with SandboxExecutor(timeout_s=HIDDEN_TIMEOUT_S, **options) as executor:
            run = await executor.run(task.scoring_program(code, marker), name="hidden_check.py")
        passed = hidden_passed(run, marker)
        summary = run.failure_summary(300) or "exited 0 before the hidden tests ended"
        verdicts[code.strip()] = (passed, "" if passed else summary)
    return [verdicts[code.strip()] for code in codes]


def _outcome(
    task: BenchTask,
    result: AgentResult,
    first: Attempt | None,
    passes: list[tuple[bool, str]],
    started: float,
    **extra: Any,
) -> TaskOutcome:
    """What a task scored: ``first`` is the single-shot answer, ``result`` the strategy's."""
    (single_pass, _), (loop_pass, hidden_failure) = passes[:2]
    return TaskOutcome(
        task_id=task.task_id,
        difficulty=task.difficulty,
        single_pass=single_pass,
        loop_pass=loop_pass,
        attempts=len(result.attempts),
        status=result.status,
        single_tokens=first.generation_tokens if first else 0,
        loop_tokens=result.total_tokens,
        single_output_tokens=(
            first.output_tokens if first is not None and not first.critique_tokens else None
        ),
        loop_output_tokens=result.output_tokens,
        single_llm_s=first.generation_llm_s if first else 0.0,
        loop_llm_s=result.llm_s,
        single_sandbox_s=(first.execution.duration_s if first and first.execution else 0.0),
        loop_sandbox_s=result.sandbox_s,
        wall_s=time.monotonic() - started,
        error=result.error,
        hidden_failure="" if loop_pass else hidden_failure,
        **extra,
    )


async def _run_strategy(task: BenchTask, provider: Provider, config: BenchConfig) -> TaskOutcome:
    """Any strategy through :func:`solve`; the first generation scores as single shot."""
    started = time.monotonic()
    options = config.sandbox_options
    async with SandboxExecutor(**options) as executor:
        result = await solve(
            check_strategy(config.strategy),
            provider,
            task.spec,
            executor,
            options=StrategyOptions.from_settings(
                get_agent_settings(),
                max_attempts=config.max_attempts,
                retry_temperature=config.retry_temperature,
                samples=config.samples,
                generated_tests=config.generated_tests,
                early_stop=config.early_stop,
            ),
            sandbox_options=options,
        )
    one = result.attempts[0] if result.attempts else None
    runs = result.candidates
    # By number: a sample lost to a provider error has no attempt, so list positions and
    # sample numbers part after it.
    by_number = {a.number: a for a in result.attempts}
    written = [by_number[c.sample + 1] for c in runs]
    codes = [a.code for a in written]
    passes = await _hidden_passes(task, [one.code if one else "", result.code, *codes], options)
    examples = len(task.spec.checks)
    log = [
        CandidateLog(
            sample=c.sample,
            copies=c.copies,
            tokens=attempt.generation_tokens,
            examples=examples,
            passed="".join("1" if ok else "0" for ok in c.passed),
            returned=c.returned,
            hidden=hidden,
            selected=c.selected,
        )
        for c, attempt, (hidden, _) in zip(runs, written, passes[2:], strict=True)
    ]
    return _outcome(
        task,
        result,
        one,
        passes,
        started,
        strategy=config.strategy,
        candidates=len(runs),
        candidate_sandbox_s=sum(c.sandbox_s for c in runs) / len(runs) if runs else 0.0,
        dropped_checks=len(result.dropped_checks),
        written_checks=sum(1 for c in result.checks if c.origin == "generated"),
        candidate_log=log,
        sample_path=result.sample_path,
    )


async def _run_swarm(task: BenchTask, provider: Provider, config: BenchConfig) -> TaskOutcome:
    """The swarm, against a single shot run on its own: the swarm's first proposal follows
    the architect's design, so it is not what a single shot writes."""
    from sandlot.agent.swarm import Swarm

    started = time.monotonic()
    options = config.sandbox_options
    async with SandboxExecutor(**options) as executor:
        swarm = Swarm(
            provider,
            executor,
            max_rounds=get_agent_settings().swarm_rounds,
            max_attempts=config.max_attempts,
        )
        result = await swarm.run(task.spec)
    single = await _single_shot(task, provider, options)
    one = single.attempts[0] if single.attempts else None
    passes = await _hidden_passes(task, [one.code if one else "", result.code], options)
    return _outcome(task, result, one, passes, started, strategy="swarm")


async def _single_shot(task: BenchTask, provider: Provider, options: dict[str, Any]) -> AgentResult:
    """One generation in a sandbox of its own: the single shot a strategy is measured
    against when it does not write one itself."""
    async with SandboxExecutor(**options) as executor:
        return await ReflexionLoop(provider, executor, max_attempts=1).run(task.spec, mode="single")


async def run_task(task: BenchTask, provider: Provider, config: BenchConfig) -> TaskOutcome:
    if config.strategy == "swarm":
        return await _run_swarm(task, provider, config)
    if config.strategy != "reflexion":
        return await _run_strategy(task, provider, config)
    started = time.monotonic()
    options = config.sandbox_options
    async with SandboxExecutor(**options) as executor:
        loop = ReflexionLoop(
            provider,
            executor,
            max_attempts=config.max_attempts,
            retry_temperature=config.retry_temperature,
        )
        result = await loop.run(task.spec, mode="loop")
    single = await _single_shot(task, provider, options) if config.separate_single else None
    first = (single or result).attempts[:1]
    one = first[0] if first else None
    passes = await _hidden_passes(task, [one.code if one else "", result.code], options)
    return _outcome(
        task,
        result,
        one,
        passes,
        started,
        single_same_as_first=(
            None
            if single is None
            else bool(single.attempts and result.attempts)
            and single.attempts[0].code == result.attempts[0].code
        ),
    )


def load_done(path: Path) -> dict[str, TaskOutcome]:
    done: dict[str, TaskOutcome] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                outcome = TaskOutcome.model_validate_json(line)
                done[outcome.task_id] = outcome
    return done


async def run_benchmark(
    tasks: list[BenchTask],
    providers: list[Provider],
    config: BenchConfig,
    results_path: Path,
    *,
    on_outcome: Callable[[TaskOutcome, int, int], Awaitable[None]] | None = None,
) -> list[TaskOutcome]:
    """Run every task not already in ``results_path``; one worker per provider."""
    results_path.parent.mkdir(parents=True, exist_ok=True)
    done = load_done(results_path)
    todo: asyncio.Queue[BenchTask] = asyncio.Queue()
    for task in tasks:
        if task.task_id not in done:
            todo.put_nowait(task)
    outcomes = [done[t.task_id] for t in tasks if t.task_id in done]
    total = len(tasks)
    write_lock = asyncio.Lock()

    async def worker(provider: Provider) -> None:
        while True:
            try:
                task = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            outcome = await run_task(task, provider, config)
            async with write_lock:
                outcomes.append(outcome)
                with results_path.open("a") as f:
                    f.write(outcome.model_dump_json() + "\n")
                if on_outcome is not None:
                    await on_outcome(outcome, len(outcomes), total)

    await asyncio.gather(*(worker(p) for p in providers))
    order = {t.task_id: i for i, t in enumerate(tasks)}
    return sorted(outcomes, key=lambda o: order.get(o.task_id, 0))
