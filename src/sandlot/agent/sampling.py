"""Sample and select by running: several candidates, tests the model writes, and the sandbox
as the judge.

For a function task, one call writes tests from the prompt alone while ``samples`` calls
write candidates (the first at the provider's temperature, the rest sampled). Each distinct
candidate runs in a sandbox of its own, concurrently, against the prompt's examples plus the
written tests, each check on its own (:mod:`sandlot.agent.checks`). Then CodeT's dual
agreement: a written test that most samples fail while agreeing on another answer is taken
for the model's mistake and dropped (unless the chosen candidate passes it); the candidate
kept is the one passing most examples, then with the largest consensus (samples passing the
same written tests, times their number), then whose returned values the most samples
share. A task that is not a function has no tests to write: its candidates are only run,
and the first that runs cleanly is kept.

Early stop (``AGENT_SAMPLE_EARLY_STOP``, on by default): the first, greedy candidate is
drawn and run alone with the tests. When it passes every check, the other samples are never
drawn. When it passes the prompt's examples and fails only written tests, one more sample
(the probe) is drawn and the vote is held between the two: if the probe returns the same
values on every check, the tests both fail alike are dropped. Only when an example fails
(or the run goes wrong, or the first was never written) are the remaining samples drawn,
in one ``generate_many`` call that reads the prompt once where the provider can. Most tasks
a single shot solves then cost one or two candidates and the tests, and the samples are
spent where there is something to fix.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from sandlot.agent.checks import (
    actual_values,
    dual_agreement,
    new_marker,
    parse_generated,
    tests_prompt,
    verdicts,
)
from sandlot.agent.code import extract_code, program_to_run
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.loop import _no_events, _normalized
from sandlot.agent.models import (
    AgentEvent,
    Attempt,
    CandidateRecord,
    Check,
    EventSink,
    Execution,
    SamplePath,
    TaskSpec,
)
from sandlot.agent.prompts import current_prompts, generate_prompt
from sandlot.agent.providers.base import Completion, Provider
from sandlot.errors import ProviderError

SAMPLE_TEMPERATURE = 0.8
TESTS_MAX_TOKENS = 384  # a handful of one-line asserts


# Candidate sandboxes at once, per event loop, across every task and SampleSelect on it: a
# benchmark at --concurrency c must not hold c x cpu_count sandboxes.
_SHARED_RUNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def shared_runs() -> asyncio.Semaphore:
    """The running loop's one limit on candidate sandboxes (the CPU count)."""
    loop = asyncio.get_running_loop()
    runs = _SHARED_RUNS.get(loop)
    if runs is None:
        runs = _SHARED_RUNS[loop] = asyncio.Semaphore(os.cpu_count() or 1)
    return runs


@dataclass
class Selection:
    """What sample-and-select settled on, and what it cost."""

    attempts: list[Attempt]  # every sample, in order: the first is what single shot writes
    best: int  # index into attempts
    candidates: list[CandidateRecord]
    checks: list[Check]  # the checks kept: examples and surviving written tests
    dropped: list[str]
    tests_usage: Completion | None
    passed_all: bool
    path: SamplePath  # why as many samples were drawn


class SampleSelect:
    def __init__(
        self,
        provider: Provider,
        *,
        samples: int = 4,
        generated_tests: int = 6,
        sample_temperature: float = SAMPLE_TEMPERATURE,
        sandbox_options: dict[str, Any] | None = None,
        executor: SandboxExecutor | None = None,
        on_event: EventSink | None = None,
        parallel_runs: int | None = None,
        timeout_s: float | None = None,
        early_stop: bool = True,
    ) -> None:
        """Each candidate gets a sandbox of its own made with ``sandbox_options``, at most
        ``parallel_runs`` at once (default: the CPU count, shared by every task on this
        event loop; measured on 2 loaded cores, 4 at once cost more wall per candidate than
        4 in turn), each run limited to ``timeout_s`` (default: ``executor``'s, else the
        sandbox's); with ``executor`` (one sandbox the caller holds) they run in it one
        after another. With ``early_stop``, the first (greedy) candidate is drawn and run
        alone with the tests: when it passes every check, the other samples are never
        drawn."""
        self.provider = provider
        self.early_stop = early_stop and samples > 1
        self.samples = samples
        self.generated_tests = generated_tests
        self.sample_temperature = sample_temperature
        self.sandbox_options = dict(sandbox_options or {})
        self.executor = executor
        self.emit = on_event or _no_events
        if timeout_s is None and executor is not None:
            timeout_s = executor.timeout_s
        self.timeout_s = timeout_s
        self._runs = asyncio.Semaphore(parallel_runs) if parallel_runs else None

    async def _drawn(
        self, index: int, reply: Completion | ProviderError
    ) -> Attempt | ProviderError:
        if isinstance(reply, ProviderError):
            # One sample lost (a timeout, a dropped link) leaves the others to choose from.
            await self.emit(
                AgentEvent(event="error", attempt=index + 1, data={"error": str(reply)})
            )
            return reply
        attempt = Attempt(number=index + 1, code=extract_code(reply.text))
        attempt.charge(reply)
        await self.emit(AgentEvent(event="code", attempt=index + 1, data={"code": attempt.code}))
        return attempt

    async def _greedy(self, spec: TaskSpec, recalled: str) -> list[Attempt | ProviderError]:
        """Sample 0, at the provider's own temperature: what a single shot writes."""
        reply: Completion | ProviderError
        try:
            reply = await self.provider.generate(
                generate_prompt(spec, recalled), system=current_prompts().generator
            )
        except ProviderError as exc:
            reply = exc
        return [await self._drawn(0, reply)]

    async def _sampled(
        self, spec: TaskSpec, recalled: str, indices: range
    ) -> list[Attempt | ProviderError]:
        """Samples ``indices`` (none of them 0) in one ``generate_many`` call, which reads the
        prompt once where the provider can."""
        replies = await self.provider.generate_many(
            generate_prompt(spec, recalled),
            len(indices),
            system=current_prompts().generator,
            temperature=self.sample_temperature,
        )
        return [await self._drawn(i, reply) for i, reply in zip(indices, replies, strict=True)]

    async def _draw(
        self, spec: TaskSpec, recalled: str, indices: range
    ) -> list[Attempt | ProviderError]:
        """Samples ``indices`` in order: 0 is the greedy one, the others are drawn together
        (and at the same time as it)."""
        parts = []
        if indices and indices.start == 0:
            parts.append(self._greedy(spec, recalled))
        sampled = range(max(indices.start, 1), indices.stop)
        if sampled:
            parts.append(self._sampled(spec, recalled, sampled))
        return [drawn for part in await asyncio.gather(*parts) for drawn in part]

    async def _write_tests(self, spec: TaskSpec) -> tuple[list[Check], Completion | None]:
        if not spec.is_function or spec.entry_point is None or self.generated_tests == 0:
            return [], None
        try:
            completion = await self.provider.generate(
                tests_prompt(spec, self.generated_tests),
                system=current_prompts().generator,
                max_tokens=TESTS_MAX_TOKENS,
            )
        except ProviderError as exc:
            # No written tests: the examples and agreement still judge.
            await self.emit(AgentEvent(event="error", data={"error": f"tests: {exc}"}))
            return [], None
        known = {c.source for c in spec.checks}
        written = parse_generated(
            extract_code(completion.text), spec.entry_point, self.generated_tests
        )
        return [c for c in written if c.source not in known], completion

    async def _run(self, program: str, name: str) -> Execution:
        if self.executor is not None:
            return await self.executor.run(program, name=name)
        runs = self._runs or shared_runs()
        options = {"timeout_s": self.timeout_s, **self.sandbox_options}
        async with runs, SandboxExecutor(**options) as executor:
            return await executor.run(program, name=name)

    async def select(self, spec: TaskSpec, *, recalled: str = "") -> Selection:
        tests = asyncio.ensure_future(self._write_tests(spec))
        first = 1 if self.early_stop else self.samples
        try:
            drawn = await self._draw(spec, recalled, range(first))
            written, tests_usage = await tests
        finally:
            tests.cancel()  # a failed draw leaves nobody to await it
        checks = [*spec.checks, *written]
        judged = spec.model_copy(update={"checks": checks})
        pool = _Pool()
        await self._judge(judged, drawn, pool)
        path: SamplePath = "all samples" if first == self.samples else "first passed"
        probe_group: int | None = None
        if first < self.samples and not pool.passes_all(0, checks):
            path = "first failed"
            if pool.fails_only_written(0, checks):
                # It passes the prompt's own examples and fails only tests the model wrote,
                # which are wrong about as often as the code: one more sample, and the vote
                # between the two. When the probe returns the same values on every check,
                # the vote drops the tests both fail alike. When it differs, the one that
                # passes more checks is kept: measured on HumanEval-164 (BENCHMARKS.md),
                # drawing the rest after a disagreeing probe fixed none of those tasks at
                # half their tokens; the rest pay off where an example fails.
                probe = await self._draw(spec, recalled, range(first, first + 1))
                drawn += probe
                await self._judge(judged, probe, pool)
                [sample] = probe
                if isinstance(sample, Attempt):
                    probe_group = pool.group_of(sample)
                    first = self.samples
                else:
                    first += 1  # the probe was lost: the rest, as if an example failed
            if first < self.samples:
                # The first candidate fails an example, runs badly or was never written:
                # only now the others, so a task single shot solves costs one sample (two
                # at most) and the tests.
                more = await self._draw(spec, recalled, range(first, self.samples))
                drawn += more
                await self._judge(judged, more, pool)
        if not pool.attempts:
            raise next(e for e in drawn if isinstance(e, ProviderError))
        selection = self._settle(checks, pool, tests_usage, path)
        if probe_group is not None:
            # The probe agreed when both behave the same and the vote, dropping the tests
            # both fail alike, keeps a candidate that passes every other check.
            agreed = pool.agree(0, probe_group) and selection.passed_all
            selection.path = "probe agreed" if agreed else "probe disagreed"
        return selection

    async def _judge(
        self, judged: TaskSpec, drawn: list[Attempt | ProviderError], pool: _Pool
    ) -> None:
        """Run each new distinct candidate against ``judged``'s checks; a copy of one already
        run only adds its weight."""
        fresh: list[int] = []
        for attempt in drawn:
            if not isinstance(attempt, Attempt):
                continue
            pool.attempts.append(attempt)
            key = _normalized(attempt.code)
            if key in pool.index:
                pool.groups[pool.index[key]].append(len(pool.attempts) - 1)
                continue
            pool.index[key] = len(pool.groups)
            pool.groups.append([len(pool.attempts) - 1])
            fresh.append(len(pool.groups) - 1)
        # A marker per run, made here: a candidate cannot print another's verdicts, nor guess.
        markers = [new_marker() for _ in fresh]
        runs = [
            self._run(
                program_to_run(
                    judged,
                    pool.attempts[pool.groups[g][0]].code,
                    marker=marker,
                    run_timeout_s=self.timeout_s,
                ),
                f"candidate_{pool.groups[g][0]}.py",
            )
            for g, marker in zip(fresh, markers, strict=True)
        ]
        if self.executor is not None:
            executions = [await run for run in runs]  # one sandbox: one run at a time
        else:
            executions = list(await asyncio.gather(*runs))
        count = len(judged.checks)
        for g, execution, marker in zip(fresh, executions, markers, strict=True):
            pool.executions.append(execution)
            pool.passes.append(verdicts(execution, count, marker) if count else [])
            pool.behaviours.append(actual_values(execution, count, marker) if count else ())
            event = AgentEvent(
                event="execute",
                attempt=pool.attempts[pool.groups[g][0]].number,
                data=execution.model_dump(),
            )
            await self.emit(event)
        # A copy of an earlier candidate carries its run.
        for group, execution in zip(pool.groups, pool.executions, strict=True):
            for i in group:
                pool.attempts[i].execution = execution

    def _settle(
        self,
        checks: list[Check],
        pool: _Pool,
        tests_usage: Completion | None,
        path: SamplePath,
    ) -> Selection:
        groups, executions, passes = pool.groups, pool.executions, pool.passes
        agreement = dual_agreement(checks, passes, [len(g) for g in groups], pool.behaviours)
        best = agreement.best
        if not checks:
            # Nothing to check (a program, not a function): the first that runs cleanly.
            best = next((g for g, e in enumerate(executions) if e.ok), 0)
        records = [
            CandidateRecord(
                sample=pool.attempts[group[0]].number - 1,
                copies=len(group),
                examples_passed=agreement.scores[g][0],
                generated_passed=sum(
                    passes[g][t] for t in agreement.kept if checks[t].origin == "generated"
                ),
                agreement=agreement.scores[g][2],
                sandbox_s=executions[g].duration_s,
                selected=g == best,
                passed=list(passes[g]),
                returned=list(pool.behaviours[g]),
            )
            for g, group in enumerate(groups)
        ]
        kept = [checks[t] for t in agreement.kept]
        passed_all = all(passes[best][t] for t in agreement.kept) if checks else executions[best].ok
        return Selection(
            attempts=list(pool.attempts),
            best=groups[best][0],
            candidates=records,
            checks=kept,
            dropped=[checks[t].source for t in agreement.dropped],
            tests_usage=tests_usage,
            passed_all=passed_all,
            path=path,
        )


@dataclass
class _Pool:
    """The candidates judged so far: distinct code in groups (indices into ``attempts``, in
    sample order), one run, verdicts and returned values per group."""

    attempts: list[Attempt] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    executions: list[Execution] = field(default_factory=list)
    passes: list[list[bool]] = field(default_factory=list)
    behaviours: list[tuple[str, ...]] = field(default_factory=list)

    def passes_all(self, group: int, checks: list[Check]) -> bool:
        if not self.executions:
            return False
        if not checks:
            return self.executions[group].ok
        return all(self.passes[group])

    def fails_only_written(self, group: int, checks: list[Check]) -> bool:
        """Its verdicts came back, every example passed, and a written test failed."""
        if not self.executions or not self.behaviours[group]:
            return False
        verdicts = list(zip(checks, self.passes[group], strict=True))
        return all(ok for c, ok in verdicts if c.origin == "example") and any(
            not ok for c, ok in verdicts if c.origin == "generated"
        )

    def group_of(self, attempt: Attempt) -> int:
        return self.index[_normalized(attempt.code)]

    def agree(self, group: int, other: int) -> bool:
        """Two candidates behave the same on every check (the same code does)."""
        return group == other or (
            bool(self.behaviours[group]) and self.behaviours[group] == self.behaviours[other]
        )
