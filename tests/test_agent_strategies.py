"""The strategies of issue 16 end to end: a scripted provider, real bubblewrap sandboxes (one
per candidate), real LangGraph.

Selection picks the candidate that passes; written tests that contradict the majority are
dropped; the critic reads actual and expected values and a trace taken in the sandbox; the
loop goes on from the best candidate; the strategy setting and the task-file loader.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sandlot import SandboxManager
from sandlot.agent.bench.runner import BenchConfig, TaskOutcome, run_benchmark
from sandlot.agent.bench.tasks import load_tasks, task_file
from sandlot.agent.code import function_task
from sandlot.agent.config import AgentSettings
from sandlot.agent.providers.base import Message
from sandlot.agent.providers.scripted import ScriptedProvider
from sandlot.agent.runtime import AgentRuntime
from sandlot.errors import ConfigError, ProviderError

from .conftest import make_settings, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap")

# Stated in words only: no example the loop could check, as in the held-out set.
WORDS_ONLY = 'def add_one(n: int) -> int:\n    """Return n plus one."""\n'
RIGHT = "def add_one(n):\n    return n + 1"
RIGHT_TOO = "def add_one(n):\n    result = n\n    result += 1\n    return result"
OFF_BY_ONE = "def add_one(n):\n    return n + 2"
CRASH = "def add_one(n):\n    return n.succ()"
TESTS = "```python\nassert add_one(1) == 2\nassert add_one(-1) == 0\nassert add_one(0) == 1\n```"


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def scripted(candidates: list[str], tests: str, *extra: str) -> ScriptedProvider:
    """Replies by what is asked (samples and the test writer are called concurrently): the
    test-writing prompt gets ``tests``, each generation the next candidate, then ``extra``
    in order (critiques, rewrites)."""
    queue = [fenced(c) for c in candidates]
    later = list(extra)

    def reply(messages: list[Message]) -> str:
        if "Do not write the function" in messages[-1].content:
            return tests
        return queue.pop(0) if queue else later.pop(0)

    count = len(candidates) + len(extra) + (1 if tests else 0)
    replies: list[Callable[[list[Message]], str]] = [reply] * count
    return ScriptedProvider(replies)


@pytest.fixture
async def manager(data_root: Path, request: pytest.FixtureRequest) -> AsyncIterator[SandboxManager]:
    manager = SandboxManager(make_settings(data_root / f"strat-{request.node.name}"))
    await manager.start()
    yield manager
    await manager.close()


def runtime(
    manager: SandboxManager, provider: ScriptedProvider, **settings: object
) -> AgentRuntime:
    values: dict[str, object] = {"agent_samples": 4, "agent_generated_tests": 4, **settings}
    return AgentRuntime(
        provider,
        settings=AgentSettings.model_validate(values),
        sandbox_options={"manager": manager},
    )


@pytest.mark.asyncio
async def test_selection_picks_the_candidate_that_passes(manager: SandboxManager) -> None:
    provider = scripted([OFF_BY_ONE, CRASH, RIGHT, OFF_BY_ONE], TESTS)
    spec = function_task(WORDS_ONLY, "add_one", task_id="t/1")
    assert spec.checks == []  # nothing to check but what the model writes
    agent = runtime(manager, provider, agent_sample_early_stop=False)  # all four, voted on
    result = await agent.execute(spec, mode="sample_select")
    assert result.mode == "sample_select" and result.status == "solved" and result.success
    assert result.code == RIGHT
    assert [c.source for c in result.checks] == [
        "assert add_one(1) == 2",
        "assert add_one(-1) == 0",
        "assert add_one(0) == 1",
    ]
    # The two identical wrong samples ran once, as one candidate of weight two.
    assert sorted((c.sample, c.copies) for c in result.candidates) == [(0, 2), (1, 1), (2, 1)]
    chosen = [c for c in result.candidates if c.selected]
    assert [c.sample for c in chosen] == [2] and chosen[0].generated_passed == 3
    assert all(c.sandbox_s > 0 for c in result.candidates)
    assert result.sandbox_s == pytest.approx(sum(c.sandbox_s for c in result.candidates))
    # Every sample and the test writer are paid for.
    assert len(result.attempts) == 4 and provider.remaining == 0
    [writer] = [c for c in provider.calls if "Do not write the function" in c[-1].content]
    tests_tokens = sum(len(m.content.split()) for m in writer) + len(TESTS.split())
    assert result.total_tokens == sum(a.total_tokens for a in result.attempts) + tests_tokens
    # Each candidate ran in a sandbox of its own, all destroyed after.
    assert await manager.list() == []


@pytest.mark.asyncio
async def test_written_tests_against_the_majority_are_dropped(manager: SandboxManager) -> None:
    # The model's third test expects add_one(5) == 7: three of four samples fail it.
    wrong = "```python\nassert add_one(1) == 2\nassert add_one(5) == 7\nassert add_one(0) == 1\n```"
    provider = scripted([RIGHT, OFF_BY_ONE, RIGHT_TOO, RIGHT], wrong)
    batches = count_batches(provider)
    spec = function_task(WORDS_ONLY, "add_one")
    agent = runtime(manager, provider, agent_sample_early_stop=False)
    result = await agent.execute(spec, mode="sample_select")
    assert result.dropped_checks == ["assert add_one(5) == 7"]
    assert "assert add_one(5) == 7" not in [c.source for c in result.checks]
    # The greedy sample and the other three at once, in one call.
    assert batches == [3]
    # The off-by-one candidate passed the wrong test; without the vote it would have won.
    assert result.success and result.code == RIGHT
    scores = {c.sample: (c.generated_passed, c.agreement) for c in result.candidates}
    # RIGHT (twice) and RIGHT_TOO return the same values: three samples agree.
    assert scores[0] == (2, 3) and scores[2] == (2, 3) and scores[1] == (0, 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("early_stop", [True, False])
async def test_a_first_candidate_that_passes_every_check_stops_the_sampling(
    manager: SandboxManager, early_stop: bool
) -> None:
    # Single shot already solves it: with early stop the other three samples are never
    # drawn (their tokens never spent); without, all four are drawn, run and voted on.
    provider = scripted([RIGHT, OFF_BY_ONE, CRASH, RIGHT_TOO], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    agent = runtime(manager, provider, agent_sample_early_stop=early_stop)
    result = await agent.execute(spec, mode="sample_select")
    assert result.success and result.code == RIGHT
    drawn = 1 if early_stop else 4
    assert len(result.attempts) == drawn and len(provider.calls) == drawn + 1  # + the tests
    assert len(result.candidates) == drawn and result.candidates[0].selected
    assert [c.source for c in result.checks] == [
        "assert add_one(1) == 2",
        "assert add_one(-1) == 0",
        "assert add_one(0) == 1",
    ]


def count_batches(provider: ScriptedProvider) -> list[int]:
    """The size of each ``generate_many`` call made on ``provider`` from now on."""
    counts: list[int] = []
    real = provider.generate_many

    async def many(prompt: Any, count: int, **options: Any) -> Any:
        counts.append(count)
        return await real(prompt, count, **options)

    provider.generate_many = many  # type: ignore[method-assign]
    return counts


WRONG_TEST = (
    "```python\nassert add_one(1) == 2\nassert add_one(5) == 7\nassert add_one(0) == 1\n```"
)


@pytest.mark.asyncio
async def test_a_probe_that_agrees_with_the_first_candidate_stops_the_sampling(
    manager: SandboxManager,
) -> None:
    # The first candidate is right and fails only a written test that is wrong. One more
    # sample returns the same values on every check: two samples agree against the test,
    # the vote drops it, and the last two samples are never drawn.
    provider = scripted([RIGHT, RIGHT_TOO, OFF_BY_ONE, CRASH], WRONG_TEST)
    batches = count_batches(provider)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider).execute(spec, mode="sample_select")
    assert result.success and result.code == RIGHT
    assert result.dropped_checks == ["assert add_one(5) == 7"]
    assert batches == [1] and len(result.attempts) == 2
    assert len(provider.calls) == 3 and provider.remaining == 2  # + the tests
    assert result.sample_path == "probe agreed"
    assert [(c.sample, c.passed) for c in result.candidates] == [
        (0, [True, False, True]),
        (1, [True, False, True]),
    ]
    assert [c.returned for c in result.candidates] == [["2", "6", "1"]] * 2


@pytest.mark.asyncio
async def test_a_probe_that_disagrees_ends_the_sampling_with_a_vote_of_two(
    manager: SandboxManager,
) -> None:
    # The first fails a written test; the probe returns other values and passes them all:
    # the vote between the two keeps the probe, and no third sample is drawn.
    provider = scripted([OFF_BY_ONE, RIGHT, RIGHT_TOO, CRASH], TESTS)
    batches = count_batches(provider)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider).execute(spec, mode="sample_select")
    assert result.success and result.code == RIGHT
    assert batches == [1] and len(result.attempts) == 2 and provider.remaining == 2
    assert result.sample_path == "probe disagreed"
    assert [(c.sample, c.selected) for c in result.candidates] == [(0, False), (1, True)]


@pytest.mark.asyncio
async def test_a_probe_that_crashes_alike_on_a_test_drops_nothing(manager: SandboxManager) -> None:
    # Both samples (the same code) raise on a written test: a crash is no answer the vote
    # drops a test for, so the test stands and the task is reported failed, not solved.
    crashing = "```python\nassert add_one(1) == 2\nassert add_one(None) == 1\n```"
    provider = scripted([RIGHT, RIGHT, RIGHT_TOO, OFF_BY_ONE], crashing)
    batches = count_batches(provider)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider).execute(spec, mode="sample_select")
    assert batches == [1] and len(result.attempts) == 2
    assert result.sample_path == "probe disagreed" and result.dropped_checks == []
    assert not result.success and result.status == "failed"


EXAMPLE = (
    'def add_one(n: int) -> int:\n    """Return n plus one.\n    >>> add_one(1)\n    2\n    """\n'
)


@pytest.mark.asyncio
async def test_a_first_candidate_failing_an_example_draws_the_rest_at_once(
    manager: SandboxManager,
) -> None:
    # An example failed: no probe, the three other samples in one call.
    provider = scripted([OFF_BY_ONE, OFF_BY_ONE, RIGHT, CRASH], TESTS)
    batches = count_batches(provider)
    spec = function_task(EXAMPLE, "add_one")
    assert [c.origin for c in spec.checks] == ["example"]
    result = await runtime(manager, provider).execute(spec, mode="sample_select")
    assert result.success and result.code == RIGHT
    assert batches == [3] and len(result.attempts) == 4
    assert result.sample_path == "first failed"


@pytest.mark.asyncio
async def test_a_lone_sample_keeps_every_written_test(manager: SandboxManager) -> None:
    # With one sample there is no majority to judge a test by: none is dropped.
    provider = scripted([OFF_BY_ONE], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider, agent_samples=1).execute(spec, mode="sample_select")
    assert result.dropped_checks == [] and not result.success and result.status == "failed"


@pytest.mark.asyncio
async def test_the_critic_reads_values_and_a_trace(manager: SandboxManager) -> None:
    prompt = (
        'def total(xs: list[int]) -> int:\n    """Sum of xs.\n    >>> total([1, 2, 3])\n'
        '    6\n    """\n'
    )
    buggy = "def total(xs):\n    acc = 0\n    for x in xs[1:]:\n        acc += x\n    return acc"
    fixed = "def total(xs):\n    return sum(xs)"
    review = json.dumps({"diagnosis": "skips the first item", "fix": "iterate over xs"})
    provider = ScriptedProvider([fenced(buggy), review, fenced(fixed)])
    spec = function_task(prompt, "total")
    result = await runtime(manager, provider).execute(spec, mode="reflexion")
    assert result.success and len(result.attempts) == 2
    critic = "\n".join(m.content for m in provider.calls[1])
    assert "check failed: assert total([1, 2, 3]) == 6" in critic
    assert "actual:   5" in critic and "expected: 6" in critic
    # The variables at the lines that ran, recorded by sys.settrace in the sandbox.
    assert "last lines run (each before it ran), with the variables then" in critic
    assert "total: `acc += x` with xs=[1, 2, 3], acc=2, x=3" in critic
    assert "total returns 5" in critic
    # The first attempt's cost is split: its generation (a single shot's cost) and its review.
    first = result.attempts[0]
    generation = sum(len(m.content.split()) for m in provider.calls[0]) + len(buggy.split()) + 2
    assert first.generation_tokens == generation
    assert first.critique_tokens == first.total_tokens - generation > 0


@pytest.mark.asyncio
async def test_a_check_that_hangs_fails_alone(manager: SandboxManager) -> None:
    # The candidate never returns for 0; the per-check alarm cuts it and the rest are judged.
    hangs = "def add_one(n):\n    while n == 0:\n        pass\n    return n + 1"
    provider = scripted([hangs, RIGHT], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider, agent_samples=2).execute(spec, mode="sample_select")
    scores = {c.sample: c.generated_passed for c in result.candidates}
    assert scores == {0: 2, 1: 3} and result.code == RIGHT


@pytest.mark.asyncio
async def test_the_loop_goes_on_from_the_best_candidate(manager: SandboxManager) -> None:
    review = json.dumps({"diagnosis": "adds two", "fix": "add one"})
    provider = scripted([OFF_BY_ONE, CRASH], TESTS, review, fenced(RIGHT))
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider, agent_samples=2).execute(
        spec, mode="sample_select+reflexion"
    )
    assert result.mode == "sample_select+reflexion" and result.success
    assert result.code == RIGHT
    # Two samples, then one rewrite; the review is on the sample it started from.
    assert [a.number for a in result.attempts] == [1, 2, 3]
    assert result.attempts[0].critique and "adds two" in result.attempts[0].critique
    critic = "\n".join(m.content for m in provider.calls[-2])
    assert "actual:   3" in critic and "expected: 2" in critic
    assert provider.remaining == 0
    assert result.total_tokens > sum(a.total_tokens for a in result.attempts[:2])
    # No written test was dropped: the best's run in selection is the loop's first, not re-run.
    rewrite = result.attempts[2].execution
    assert not result.dropped_checks and rewrite is not None
    candidates_s = sum(c.sandbox_s for c in result.candidates)
    assert result.sandbox_s == pytest.approx(candidates_s + rewrite.duration_s)


@pytest.mark.asyncio
async def test_the_strategy_setting_picks_the_strategy(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_STRATEGY", "sample_select")
    monkeypatch.setenv("AGENT_SAMPLES", "2")
    monkeypatch.setenv("AGENT_SAMPLE_EARLY_STOP", "false")  # both samples, though RIGHT passes
    settings = AgentSettings(agent_generated_tests=3)
    assert settings.agent_strategy == "sample_select" and settings.agent_samples == 2
    assert not settings.agent_sample_early_stop
    provider = scripted([RIGHT, OFF_BY_ONE], TESTS)
    agent = AgentRuntime(provider, settings=settings, sandbox_options={"manager": manager})
    # mode="loop" is "the configured strategy".
    result = await agent.execute(function_task(WORDS_ONLY, "add_one"), mode="loop")
    assert result.mode == "sample_select" and len(result.candidates) == 2
    monkeypatch.setenv("AGENT_STRATEGY", "best_of_all")
    with pytest.raises(ValueError, match="agent_strategy"):
        AgentSettings()
    with pytest.raises(ConfigError, match="unknown strategy"):
        await agent.execute(function_task(WORDS_ONLY, "add_one"), mode="majority")  # type: ignore[arg-type]


def test_task_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [
        {
            "prompt": WORDS_ONLY,
            "entry_point": "add_one",
            "test": "def check(candidate):\n    assert candidate(1) == 2\n",
            "difficulty": "easy",
        },
        {"prompt": WORDS_ONLY, "entry_point": "add_one", "test": "assert add_one(2) == 3"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = load_tasks(str(path))
    assert [t.task_id for t in tasks] == ["mine/1", "mine/2"]
    assert [t.difficulty for t in tasks] == ["easy", "medium"]
    # A HumanEval-style check is called on the function; a plain assert runs as it is.
    assert tasks[0].hidden_tests.rstrip().endswith("check(add_one)")
    assert tasks[1].hidden_tests == "assert add_one(2) == 3"
    assert "assert" not in tasks[0].spec.task.split('"""')[0]  # the hidden test is not shown
    assert len(task_file(path, limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "entry_point": "f"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: not a task"):
        task_file(bad)
    bad.write_text(json.dumps({**rows[1], "difficulty": "brutal"}) + "\n")
    with pytest.raises(ConfigError, match="difficulty"):
        task_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        task_file(tmp_path / "absent.jsonl")


def lost_first_sample() -> Callable[[list[Message]], str]:
    """A reply that loses the first generation to the provider, then writes RIGHT (and the
    tests when asked for them)."""
    lost = [True]

    def reply(messages: list[Message]) -> str:
        if "Do not write the function" in messages[-1].content:
            return TESTS
        if lost:
            lost.pop()
            raise ProviderError("the model timed out")
        return fenced(RIGHT)

    return reply


def bench_add_one(
    tmp_path: Path, data_root: Path, provider: ScriptedProvider, **config: Any
) -> tuple[list[TaskOutcome], str]:
    """The benchmark on one add_one task from a task file (hidden test: 41 gives 42), on real
    sandboxes; the outcomes and the report."""
    from sandlot.agent.bench.report import markdown_report
    from sandlot.sandbox import get_portal

    path = tmp_path / "mine.jsonl"
    test = "def check(candidate):\n    assert candidate(41) == 42\n"
    path.write_text(json.dumps({"prompt": WORDS_ONLY, "entry_point": "add_one", "test": test}))
    manager = SandboxManager(make_settings(data_root / f"bench-{tmp_path.name}"))
    portal = get_portal()
    portal.call(manager.start())
    try:
        values: dict[str, Any] = {
            "task_set": str(path),
            "provider": "scripted",
            "model": "script",
            "max_attempts": 3,
            "temperature": 0.0,
            "retry_temperature": 0.7,
            "separate_single": False,
            "concurrency": 1,
            "sandbox_options": {"manager": manager},
            **config,
        }
        settings = BenchConfig(**values)
        outcomes = portal.call(
            run_benchmark(load_tasks(str(path)), [provider], settings, tmp_path / "out.jsonl")
        )
    finally:
        portal.call(manager.close())
    return outcomes, markdown_report(outcomes, settings, 1.0, f"sandlot benchmark {config}")


def test_benchmark_runs_a_strategy_on_a_task_file(tmp_path: Path, data_root: Path) -> None:
    provider = scripted([OFF_BY_ONE, RIGHT, RIGHT_TOO], TESTS)
    outcomes, report = bench_add_one(
        tmp_path,
        data_root,
        provider,
        strategy="sample_select",
        samples=3,
        generated_tests=3,
        early_stop=False,  # all three, voted on
    )
    [outcome] = outcomes
    assert outcome.strategy == "sample_select" and outcome.candidates == 3
    assert not outcome.single_pass and outcome.loop_pass  # the first sample was wrong
    assert outcome.candidate_sandbox_s > 0 and outcome.loop_tokens > outcome.single_tokens
    assert outcome.written_checks == 3 and outcome.dropped_checks == 0
    assert "sample_select pass@1" in report and "sandbox s / candidate" in report
    assert "| 3 / 0 |" in report  # written tests kept / dropped
    assert "The sample_select fixed 1 task(s)" in report


@pytest.mark.asyncio
async def test_a_lost_sample_leaves_the_others(manager: SandboxManager) -> None:
    provider = ScriptedProvider([lost_first_sample()] * 3)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider, agent_samples=2).execute(spec, mode="sample_select")
    assert result.success and result.code == RIGHT
    assert [(c.sample, c.copies) for c in result.candidates] == [(1, 1)]
    # Every sample lost: the agent's failure, not the code's.
    provider = ScriptedProvider([ProviderError("down")] * 3)
    result = await runtime(manager, provider, agent_samples=2).execute(spec, mode="sample_select")
    assert result.status == "error" and result.error == "down" and not result.success


def test_benchmark_runs_the_swarm_against_a_single_shot(tmp_path: Path, data_root: Path) -> None:
    def vote(choice: int) -> str:
        return json.dumps({"choice": choice, "approve": True, "concerns": ""})

    # The roles answer by their system prompt; the single shot, run on its own, is the only
    # call without one of theirs.
    provider = ScriptedProvider(
        [fenced(OFF_BY_ONE)],
        by_role={
            "architect": ["Add one to n.", vote(1)],
            "coder": [fenced(RIGHT), vote(1)],
            "optimizer": [fenced(OFF_BY_ONE), vote(1)],
            "critic": [vote(1)],
            "security": [vote(1)],
        },
    )
    outcomes, report = bench_add_one(
        tmp_path, data_root, provider, strategy="swarm", separate_single=True
    )
    [outcome] = outcomes
    assert outcome.strategy == "swarm" and outcome.error is None
    assert not outcome.single_pass and outcome.loop_pass  # the coder's proposal won
    assert outcome.attempts == 2 and provider.remaining == 0
    # The swarm's tokens are its own: the design, two proposals and five votes.
    assert outcome.loop_tokens > outcome.single_tokens > 0
    assert "swarm pass@1" in report and "The swarm fixed 1 task(s)" in report


def test_benchmark_logs_candidates_after_a_lost_sample(tmp_path: Path, data_root: Path) -> None:
    # The first sample is lost to the provider: candidates are found by sample number, not
    # by position among the attempts that came back.
    provider = ScriptedProvider([lost_first_sample()] * 3)
    outcomes, report = bench_add_one(
        tmp_path, data_root, provider, strategy="sample_select", samples=2, generated_tests=3
    )
    [outcome] = outcomes
    assert outcome.loop_pass and outcome.sample_path == "first failed"
    assert [(c.sample, c.passed, c.hidden) for c in outcome.candidate_log] == [(1, "111", True)]
    assert outcome.candidate_log[0].returned == ["2", "0", "1"]  # add_one(1), (-1), (0)
    assert "sample_select pass@1" in report
