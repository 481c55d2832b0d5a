"""Unit tests of the pure parts of the checks: reading the model's tests, the verdicts, the
vote, and the limit on candidate sandboxes.
(Their real counterparts, in sandboxes, are in test_agent_strategies.py.)"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from sandlot.agent import sampling
from sandlot.agent.checks import (
    CHECK_TIMEOUT_S,
    RUN_TIMEOUT_S,
    actual_values,
    check_timeout_s,
    dual_agreement,
    parse_generated,
    verdicts,
)
from sandlot.agent.code import example_checks, function_task
from sandlot.agent.config import AgentSettings
from sandlot.agent.models import Check, Execution
from sandlot.agent.providers.scripted import ScriptedProvider
from sandlot.agent.sampling import SampleSelect
from sandlot.agent.strategies import StrategyOptions


def gen(source: str) -> Check:
    return Check(source=source, call=source, origin="generated")


def test_parse_generated_keeps_asserts_on_the_function() -> None:
    code = (
        "import math\n"
        "assert f(1) == 2\n"
        "assert f(1) == 2\n"  # a repeat counts once
        "assert g(3) == 4\n"  # another function: not a test of f
        "assert not f(0)\n"
        "def test():\n    assert f([1, 2]) == [2, 3]\n"
    )
    checks = parse_generated(code, "f", limit=10)
    assert [c.source for c in checks] == [
        "assert f(1) == 2",
        "assert not f(0)",
        "assert f([1, 2]) == [2, 3]",
    ]
    assert (checks[0].call, checks[0].expected) == ("f(1)", "2")
    assert checks[1].expected is None and checks[1].call == "not f(0)"
    assert len(parse_generated(code, "f", limit=1)) == 1


def test_parse_generated_reads_a_broken_reply_line_by_line() -> None:
    code = "assert f(1) == 2\nassert f(2) == (\nassert f(3) == 4\n"
    assert [c.source for c in parse_generated(code, "f", 5)] == [
        "assert f(1) == 2",
        "assert f(3) == 4",
    ]


def test_example_checks_from_a_docstring() -> None:
    prompt = 'def f(x):\n    """Double.\n    >>> f(2)\n    4\n    """\n'
    [check] = example_checks(prompt, "f")
    assert check.origin == "example" and (check.call, check.expected) == ("f(2)", "4")


def test_a_test_the_majority_contradicts_is_dropped() -> None:
    checks = [gen("t0"), gen("t1")]
    # Three samples (two candidates) agree f(...) is 6 where t1 expects 7; one returns 7.
    passes = [[True, False], [False, True]]
    behaviours = [("2", "6"), ("3", "7")]
    vote = dual_agreement(checks, passes, [3, 1], behaviours)
    assert vote.best == 0 and vote.dropped == [1] and vote.kept == [0]
    assert vote.scores == [(0, 3, 3), (0, 1, 1)]


def test_a_test_everyone_fails_differently_is_kept() -> None:
    checks = [gen("t0")]
    passes = [[False], [False], [False]]
    behaviours = [("1",), ("2",), ("raised ValueError: x",)]
    vote = dual_agreement(checks, passes, [1, 1, 1], behaviours)
    assert vote.dropped == [] and vote.kept == [0]


def test_consensus_beats_a_popular_wrong_answer() -> None:
    # Two samples of a wrong candidate pass nothing; the lone right one passes all three.
    checks = [gen("a"), gen("b"), gen("c")]
    passes = [[False, False, False], [True, True, True]]
    behaviours = [("9", "9", "9"), ("1", "2", "3")]
    vote = dual_agreement(checks, passes, [2, 1], behaviours)
    assert vote.best == 1 and vote.dropped == []


def test_examples_outrank_written_tests() -> None:
    checks = [Check(source="e", call="e"), gen("a"), gen("b")]
    passes = [[False, True, True], [True, False, False]]
    vote = dual_agreement(checks, passes, [3, 1], [("x", "1", "2"), ("y", "0", "0")])
    assert vote.best == 1


MARK = "__SANDLOT_CHECKS_0123abcd__"
LINE = MARK + '[{"ok": true, "actual": "1"}, {"ok": false, "actual": "2"}]'


def ran(stdout: str, exit_code: int | None = 1, kill_reason: str | None = None) -> Execution:
    return Execution(ok=exit_code == 0, exit_code=exit_code, stdout=stdout, kill_reason=kill_reason)


def test_verdicts_need_the_harness_line() -> None:
    assert verdicts(ran("noise\n" + LINE + "\n"), 2, MARK) == [True, False]
    assert actual_values(ran(LINE), 2, MARK) == ("1", "2")
    # A crash before the harness printed, or a count that does not match: all fail.
    assert verdicts(ran("Traceback ..."), 2, MARK) == [False, False]
    assert verdicts(ran(LINE), 3, MARK) == [False, False, False]
    # Another run's marker (or the bare prefix a forger knows) is not this run's.
    assert verdicts(ran(LINE), 2, "__SANDLOT_CHECKS_ffff__") == [False, False]


def test_verdicts_need_one_line_and_an_exit_code_that_agrees() -> None:
    all_pass = MARK + '[{"ok": true, "actual": "1"}]'
    assert verdicts(ran(all_pass, exit_code=0), 1, MARK) == [True]
    # A line printed twice: one of them is not the harness's.
    assert verdicts(ran(all_pass + "\n" + all_pass, exit_code=0), 1, MARK) == [False]
    # All pass but the run exited 1 (or 1 failing and the run exited 0): one of them lies.
    assert verdicts(ran(all_pass, exit_code=1), 1, MARK) == [False]
    assert verdicts(ran(LINE, exit_code=0), 2, MARK) == [False, False]
    assert verdicts(ran(all_pass, exit_code=0, kill_reason="timeout"), 1, MARK) == [False]
    assert actual_values(ran(all_pass, exit_code=1), 1, MARK) == ()


@pytest.mark.parametrize(
    "payload",
    [
        "7",
        "[1, 2]",
        '["ok", "ok"]',
        '[{"ok": "yes", "actual": "1"}, {"ok": true}]',
        "{}",
        "[",
        "null",
    ],
)
def test_a_malformed_verdict_line_is_all_fail_not_a_crash(payload: str) -> None:
    execution = ran(MARK + payload, exit_code=0)
    assert verdicts(execution, 2, MARK) == [False, False]
    assert actual_values(execution, 2, MARK) == ()


def test_the_alarm_fits_the_run() -> None:
    # Six checks and the trace must fit in a 5 s run: no check may take the 2 s cap.
    assert check_timeout_s(5.0, 6) == pytest.approx(5.0 / 8)
    assert check_timeout_s(60.0, 3) == CHECK_TIMEOUT_S
    assert check_timeout_s(None, 6) == check_timeout_s(RUN_TIMEOUT_S, 6)


class CountingExecutor:
    """A stand-in for a candidate's sandbox that counts how many are open at once (the real
    ones are in test_agent_strategies.py)."""

    open_now = 0
    most = 0
    timeouts: ClassVar[list[float | None]] = []

    def __init__(self, *, timeout_s: float | None = None, **_options: object) -> None:
        CountingExecutor.timeouts.append(timeout_s)

    async def __aenter__(self) -> CountingExecutor:
        CountingExecutor.open_now += 1
        CountingExecutor.most = max(CountingExecutor.most, CountingExecutor.open_now)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        CountingExecutor.open_now -= 1

    async def run(self, program: str, *, name: str | None = None) -> Execution:
        await asyncio.sleep(0.05)
        return Execution(ok=True, exit_code=0)


def test_candidate_sandboxes_are_limited_across_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two tasks at once (a benchmark at --concurrency 2), three candidates each, on two CPUs:
    # two sandboxes at a time in all, not two per task.
    monkeypatch.setattr(sampling, "SandboxExecutor", CountingExecutor)
    monkeypatch.setattr(CountingExecutor, "most", 0)
    monkeypatch.setattr(CountingExecutor, "timeouts", [])
    monkeypatch.setattr(sampling.os, "cpu_count", lambda: 2)
    spec = function_task('def f(x):\n    """Anything."""\n', "f")

    def sampler() -> SampleSelect:
        replies = [f"```python\ndef f(x):\n    return {i}\n```" for i in range(3)]
        return SampleSelect(
            ScriptedProvider(list(replies)),
            samples=3,
            generated_tests=0,
            timeout_s=7.0,
            early_stop=False,
        )

    async def two_tasks() -> None:
        await asyncio.gather(sampler().select(spec), sampler().select(spec))

    asyncio.run(two_tasks())
    assert CountingExecutor.most == 2
    assert CountingExecutor.timeouts == [7.0] * 6  # the caller's timeout, on every sandbox


def test_strategy_options_come_from_the_settings() -> None:
    # One reading of the settings for the runtime and the benchmark (whose copy had lost the
    # sample temperature); a benchmark's flags win.
    settings = AgentSettings(agent_sample_temperature=0.3, agent_samples=5)
    options = StrategyOptions.from_settings(settings, max_attempts=2, samples=7)
    assert (options.sample_temperature, options.samples, options.max_attempts) == (0.3, 7, 2)
    assert options.generated_tests == settings.agent_generated_tests
