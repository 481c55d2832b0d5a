"""The benchmark's machinery on real sandboxes with a scripted model: scoring by hidden tests,
single shot vs loop, resuming, the table and the charts. (The real run on the local model is
`make bench-agent`; its numbers are in BENCHMARKS.md.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.agent.bench.report import markdown_report, write_charts
from sandlot.agent.bench.runner import BenchConfig, run_benchmark
from sandlot.agent.bench.tasks import BUILTIN_TASKS, humaneval_tasks, load_tasks
from sandlot.agent.providers.scripted import ScriptedProvider
from sandlot.errors import ConfigError
from sandlot.sandbox import get_portal

from .conftest import make_settings, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap")

FIB = (
    "```python\ndef fibonacci(n):\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n```"
)
# Passes every example the prompt gives (fibonacci(0), (1) and (10)), not the hidden tests.
FIB_VISIBLE_ONLY = "```python\ndef fibonacci(n):\n    return 55 if n == 10 else n\n```"
PRIME_CRASH = "```python\ndef is_prime(n):\n    return n.is_prime()\n```"
PRIME = (
    "```python\ndef is_prime(n):\n    if n < 2:\n        return False\n"
    "    return all(n % d for d in range(2, int(n ** 0.5) + 1))\n```"
)
IDENTITY = "```python\ndef reverse_words(s):\n    return s\n```"
CRITIQUE = json.dumps({"diagnosis": "ints have no is_prime", "fix": "trial division"})


@pytest.fixture
def manager(data_root: Path, request: pytest.FixtureRequest) -> Iterator[SandboxManager]:
    manager = SandboxManager(make_settings(data_root / f"bench-{request.node.name}"))
    portal = get_portal()
    portal.call(manager.start())
    yield manager
    portal.call(manager.close())


def config(manager: SandboxManager) -> BenchConfig:
    return BenchConfig(
        task_set="builtin",
        provider="scripted",
        model="script",
        max_attempts=3,
        temperature=0.0,
        retry_temperature=0.7,
        separate_single=False,
        concurrency=1,
        sandbox_options={"manager": manager},
    )


def test_hidden_tests_decide_and_the_loop_gain_is_counted(
    manager: SandboxManager, tmp_path: Path
) -> None:
    tasks = BUILTIN_TASKS[:3]
    provider = ScriptedProvider(
        [
            FIB,  # fibonacci: right the first time
            PRIME_CRASH,
            CRITIQUE,
            PRIME,  # is_prime: fixed by the loop
            # reverse_words: three different wrong answers
            IDENTITY,
            CRITIQUE,
            IDENTITY.replace("return s", "return s[::-1]"),
            CRITIQUE,
            IDENTITY.replace("return s", "return s.upper()"),
        ]
    )
    results = tmp_path / "builtin.jsonl"
    outcomes = get_portal().call(run_benchmark(list(tasks), [provider], config(manager), results))
    by_id = {o.task_id: o for o in outcomes}
    assert by_id["builtin/1"].single_pass and by_id["builtin/1"].loop_pass
    assert by_id["builtin/1"].attempts == 1
    assert not by_id["builtin/2"].single_pass and by_id["builtin/2"].loop_pass
    assert by_id["builtin/2"].attempts == 2
    assert by_id["builtin/2"].loop_tokens > by_id["builtin/2"].single_tokens
    assert not by_id["builtin/3"].loop_pass and by_id["builtin/3"].attempts == 3
    assert "AssertionError" in by_id["builtin/3"].hidden_failure
    assert len(results.read_text().splitlines()) == 3

    report = markdown_report(outcomes, config(manager), 12.0, "sandlot benchmark")
    assert "| all (3) | 33.3% (1) | 66.7% (2) |" in report
    assert "The loop fixed 1 task(s)" in report
    charts = write_charts(outcomes, tmp_path / "charts", "builtin")
    for chart in charts:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resuming runs nothing again: the script is empty, any model call would fail.
    again = get_portal().call(
        run_benchmark(list(tasks), [ScriptedProvider()], config(manager), results)
    )
    assert [o.task_id for o in again] == ["builtin/1", "builtin/2", "builtin/3"]


def test_visible_tests_cannot_stand_in_for_hidden_ones(
    manager: SandboxManager, tmp_path: Path
) -> None:
    provider = ScriptedProvider([FIB_VISIBLE_ONLY])
    [outcome] = get_portal().call(
        run_benchmark([BUILTIN_TASKS[0]], [provider], config(manager), tmp_path / "r.jsonl")
    )
    # The loop saw its visible example pass and stopped; the hidden tests fail it.
    assert outcome.attempts == 1 and outcome.status == "solved"
    assert not outcome.single_pass and not outcome.loop_pass


def test_task_sets() -> None:
    human = humaneval_tasks()
    assert len(human) == 164
    assert {t.difficulty for t in human} == {"easy", "medium", "hard"}
    # The loop's visible tests never include the hidden ones.
    for task in human:
        assert "def check(" not in task.spec.visible_tests
    assert sum(1 for t in human if t.spec.visible_tests) >= 120
    assert len(load_tasks("builtin")) == 12
    with pytest.raises(ConfigError, match="--tasks"):
        load_tasks("mbpp")
