"""Candidates that try to win by lying, in real bubblewrap sandboxes: forged verdict lines for
selection, an early exit 0 for the hidden scorer and for the loop and the swarm, and checks
that never end in the candidate's own ``__eq__``. Each forger writes a wrong function (it
passes none of the written tests); an honest candidate that passes one of three must still
be chosen.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.agent.bench.runner import _hidden_passes
from sandlot.agent.bench.tasks import task_file
from sandlot.agent.checks import NOT_READ, NOT_RUN, VERDICTS_MARK, judged, new_marker
from sandlot.agent.code import function_task
from sandlot.agent.config import AgentSettings
from sandlot.agent.models import Execution
from sandlot.agent.providers.base import Message
from sandlot.agent.providers.scripted import ScriptedProvider
from sandlot.agent.runtime import AgentRuntime

from .conftest import make_settings, skip_reason
from .test_agent_strategies import scripted

pytestmark = pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap")

WORDS_ONLY = 'def add_one(n: int) -> int:\n    """Return n plus one."""\n'
TESTS = "```python\nassert add_one(1) == 2\nassert add_one(-1) == 0\nassert add_one(0) == 1\n```"
RIGHT = "def add_one(n):\n    return n + 1"
PARTLY = "def add_one(n):\n    return 1"  # passes add_one(0) == 1 only
# The line a forger would print: three passes after the marker as the harness wrote it before
# markers were made per run (it still starts with today's prefix).
OLD_MARK = "__SANDLOT_CHECKS__"
FORGED = OLD_MARK + json.dumps([{"ok": True, "actual": "1"}] * 3)

FORGERIES = {
    "atexit": (
        "import atexit\n"
        "def add_one(n):\n    return n + 2\n"
        f"atexit.register(lambda: print({FORGED!r}, flush=True))\n"
    ),
    "print then exit 0": (
        "import os\ndef add_one(n):\n    return n + 3\n"
        f"print({FORGED!r}, flush=True)\nos._exit(0)\n"
    ),
    "own eval": (
        # The old harness's eval(call) and eval(expected) both came here: 7 == 7, all pass.
        "def add_one(n):\n    return n + 4\ndef eval(source, *rest):\n    return 7\n"
    ),
    "own bool and print": (
        "def add_one(n):\n    return n + 5\n"
        "def bool(value):\n    return True\n"
        "import builtins\n"
        f"def print(*args, **kwargs):\n    builtins.print({FORGED!r}, flush=True)\n"
    ),
    "patched json.dumps": (
        "import json\ndef add_one(n):\n    return n + 6\n"
        f"json.dumps = lambda *a, **k: {FORGED[len(OLD_MARK) :]!r}\n"
    ),
    "patched stdout": (
        "import sys\ndef add_one(n):\n    return n + 7\n"
        "class Out:\n"
        "    def __init__(self, real):\n        self.real = real\n"
        "    def write(self, text):\n"
        f"        return self.real.write({FORGED!r} + '\\n' if 'CHECKS' in text else text)\n"
        "    def flush(self):\n        self.real.flush()\n"
        "sys.stdout = Out(sys.stdout)\n"
    ),
}


@pytest.fixture
async def manager(data_root: Path, request: pytest.FixtureRequest) -> AsyncIterator[SandboxManager]:
    manager = SandboxManager(make_settings(data_root / f"forge-{request.node.name}"))
    await manager.start()
    yield manager
    await manager.close()


def runtime(manager: SandboxManager, provider: ScriptedProvider, samples: int) -> AgentRuntime:
    # Every sample drawn and voted on: each forger must meet the honest candidate in the vote.
    settings = AgentSettings.model_validate(
        {"agent_samples": samples, "agent_generated_tests": 3, "agent_sample_early_stop": False}
    )
    return AgentRuntime(provider, settings=settings, sandbox_options={"manager": manager})


@pytest.mark.asyncio
async def test_no_forged_verdict_wins_selection(manager: SandboxManager) -> None:
    forgers = list(FORGERIES.values())
    provider = scripted([*forgers, PARTLY], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    agent = runtime(manager, provider, samples=len(forgers) + 1)
    result = await agent.execute(spec, mode="sample_select")
    assert result.code == PARTLY and not result.success
    passed = {c.sample: c.generated_passed for c in result.candidates}
    names = list(FORGERIES)
    assert {names[s]: n for s, n in passed.items() if s < len(names)} == dict.fromkeys(names, 0)
    assert passed[len(names)] == 1


@pytest.mark.asyncio
async def test_a_check_whose_eq_never_ends_fails_alone(manager: SandboxManager) -> None:
    # The candidate's value for 0 compares forever; the alarm must cover the comparison. Its
    # error for -1 has a huge message: the verdict is capped so that the line stays whole.
    hangs = (
        "class Forever:\n"
        "    def __eq__(self, other):\n        while True:\n            pass\n"
        "def add_one(n):\n"
        "    if n == 0:\n        return Forever()\n"
        "    if n < 0:\n        raise ValueError('x' * 100000)\n"
        "    return n + 1\n"
    )
    provider = scripted([hangs], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    result = await runtime(manager, provider, samples=1).execute(spec, mode="sample_select")
    [candidate] = result.candidates
    assert candidate.generated_passed == 1 and not result.success
    execution = result.attempts[0].execution
    assert execution is not None and execution.kill_reason is None and execution.exit_code == 1
    [line] = [x for x in execution.stdout.splitlines() if x.startswith(VERDICTS_MARK)]
    actual = [v["actual"] for v in json.loads(line[line.index("[") :])]
    assert actual[1].startswith("raised ValueError: xxx") and len(actual[1]) <= 80
    assert actual[2].startswith("raised TimeoutError")


@pytest.mark.asyncio
async def test_candidates_get_the_callers_timeout(manager: SandboxManager) -> None:
    # Four seconds at import: within the sandbox's default (10 s in these settings), over
    # the 2 s the caller asked for, which must hold for the candidates' sandboxes too.
    slow = "import time\ntime.sleep(4)\n" + RIGHT
    provider = scripted([slow], TESTS)
    spec = function_task(WORDS_ONLY, "add_one")
    agent = runtime(manager, provider, samples=1)
    result = await agent.execute(spec, mode="sample_select", timeout_s=2.0)
    execution = result.attempts[0].execution
    assert not result.success and execution is not None and execution.kill_reason is not None


@pytest.mark.asyncio
async def test_hidden_tests_pass_only_when_they_ran(
    manager: SandboxManager, tmp_path: Path
) -> None:
    path = tmp_path / "mine.jsonl"
    test = "def check(candidate):\n    assert candidate(41) == 42\n"
    path.write_text(json.dumps({"prompt": WORDS_ONLY, "entry_point": "add_one", "test": test}))
    [task] = task_file(path)
    exits_at_import = "import os\ndef add_one(n):\n    return n\nos._exit(0)\n"
    exits_under_main = (
        "import sys\ndef add_one(n):\n    return n\nif __name__ == '__main__':\n    sys.exit(0)\n"
    )
    wrong = "def add_one(n):\n    return n"
    codes = [exits_at_import, exits_under_main, wrong, RIGHT]
    verdicts = await _hidden_passes(task, codes, {"manager": manager})
    assert [passed for passed, _ in verdicts] == [False, False, False, True]
    # The candidate runs in a process of its own (judge.py): its exit ends nothing but it.
    assert "the candidate's process ended" in verdicts[0][1]


# ------------------------------------------------- an early exit 0 in the loop and the swarm

EXAMPLES = (
    'def add_one(n: int) -> int:\n    """Return n plus one.\n    >>> add_one(1)\n    2\n'
    '    >>> add_one(5)\n    6\n    """\n'
)
# Wrong code that leaves before the harness: an adversary's os._exit(0), and the everyday
# `if __name__ == "__main__": ... sys.exit(0)` a model often writes (the program runs as
# __main__, so the block runs, before the checks appended to it).
EARLY_EXITS = {
    "os._exit": "import os\ndef add_one(n):\n    return n + 100\nos._exit(0)\n",
    "main exit": (
        "import sys\ndef add_one(n):\n    return n + 100\n\n"
        "if __name__ == '__main__':\n    print(add_one(1))\n    sys.exit(0)\n"
    ),
}
# Right code that prints, at import and in a __main__ block that does not exit.
HONEST = (
    "def add_one(n):\n    return n + 1\n\nprint('loaded')\n\n"
    "if __name__ == '__main__':\n    print(add_one(1))\n"
)
CRITIQUE = json.dumps({"diagnosis": "wrong", "fix": "add one"})
APPROVE = json.dumps({"choice": 1, "approve": True, "concerns": ""})


def fence(code: str) -> str:
    return f"```python\n{code}```"


def loop_runtime(
    manager: SandboxManager, provider: ScriptedProvider, **values: object
) -> AgentRuntime:
    settings = AgentSettings.model_validate(values)
    return AgentRuntime(provider, settings=settings, sandbox_options={"manager": manager})


def swarm_provider(code: str) -> ScriptedProvider:
    """Every proposer writes ``code``, the architect a design, and all five approve 1."""

    def reply(messages: list[Message]) -> str:
        last = messages[-1].content
        if "JSON schema" in last:
            return APPROVE
        return "design" if "Write a short design" in last else fence(code)

    return ScriptedProvider([reply] * 40)


def test_only_a_believed_verdict_passes_a_run() -> None:
    """An exit 0 passes only with this run's verdict line saying every check passed."""
    marker = new_marker()
    passed = marker + json.dumps([{"ok": True, "actual": "2"}] * 2)
    believed = Execution(ok=True, exit_code=0, stdout=f"hi\n{passed}\n")
    assert judged(believed, 2, marker) is believed
    silent = judged(Execution(ok=True, exit_code=0, stdout="3\n"), 2, marker)
    assert not silent.ok and silent.error == NOT_RUN and NOT_RUN in silent.failure_summary()
    garbled = judged(Execution(ok=True, exit_code=0, stdout=f"{passed[:-1]}\n"), 2, marker)
    assert not garbled.ok and garbled.error == NOT_READ
    # Another run's marker (a forger's, or selection's for a seed) proves nothing.
    assert not judged(believed, 2, new_marker()).ok and not judged(believed, 2, None).ok
    failed = Execution(ok=False, exit_code=1, stderr="check failed: ...")
    assert judged(failed, 2, marker) is failed


@pytest.mark.asyncio
@pytest.mark.parametrize("strategy", ["single", "reflexion"])
@pytest.mark.parametrize("name", list(EARLY_EXITS))
async def test_an_early_exit_0_is_not_solved_by_the_loop(
    manager: SandboxManager, strategy: str, name: str
) -> None:
    """Failed before (red team, 2026-12-07): the loop judged a run by its exit code alone, so
    wrong code that exited 0 before the checks' harness ran was solved, no check run."""
    code = EARLY_EXITS[name]
    # Distinct rewrites: a rewrite that repeats failed code is redrawn, not run.
    rewrites = [fence(code.replace("100", n)) for n in ("200", "300")]
    provider = ScriptedProvider([fence(code), CRITIQUE, rewrites[0], CRITIQUE, rewrites[1]])
    agent = loop_runtime(manager, provider, agent_strategy=strategy)
    result = await agent.execute(function_task(EXAMPLES, "add_one"), mode="loop")
    assert not result.success and result.status == "failed"
    assert len(result.attempts) == (1 if strategy == "single" else 3)
    for attempt in result.attempts:
        assert attempt.execution is not None and attempt.execution.exit_code == 0
        assert not attempt.execution.ok and attempt.execution.error == NOT_RUN


@pytest.mark.asyncio
async def test_the_critic_hears_that_the_checks_never_ran(manager: SandboxManager) -> None:
    """Failed before (red team, 2026-12-07): an early ``sys.exit(0)`` was a success, so the
    loop never said why it was not; now its review says the checks never ran, and the
    rewrite without the exit is what solves it."""
    provider = ScriptedProvider([fence(EARLY_EXITS["main exit"]), CRITIQUE, fence(HONEST)])
    agent = loop_runtime(manager, provider, agent_strategy="reflexion")
    result = await agent.execute(function_task(EXAMPLES, "add_one"), mode="loop")
    assert result.success and result.code == HONEST.rstrip("\n")
    assert len(result.attempts) == 2 and NOT_RUN in result.errors[0]
    critic, rewrite = provider.calls[1], provider.calls[2]
    assert any(NOT_RUN in m.content for m in critic) and NOT_RUN in rewrite[-1].content


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(EARLY_EXITS))
async def test_an_early_exit_0_does_not_win_the_swarm(manager: SandboxManager, name: str) -> None:
    """Failed before (red team, 2026-12-07): the swarm's consensus and its winner's success
    read the exit code alone; five approvals of wrong code that exited 0 early solved it."""
    agent = loop_runtime(manager, swarm_provider(EARLY_EXITS[name]))
    result = await agent.execute(function_task(EXAMPLES, "add_one"), mode="swarm")
    assert not result.success and result.status == "failed"
    assert result.swarm is not None and not result.swarm.consensus
    assert all(not p.ok for r in result.swarm.rounds for p in r.proposals)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(EARLY_EXITS))
async def test_an_early_exit_0_is_not_solved_by_the_rewrites(
    manager: SandboxManager, name: str
) -> None:
    """Failed before (red team, 2026-12-07): sample_select+reflexion handed the loop its
    best candidate, which had exited 0 early; the loop took the exit code for a pass and
    called it solved without a review or a rewrite."""
    code = EARLY_EXITS[name]
    rewrites = [fence(code.replace("100", n)) for n in ("200", "300")]
    provider = scripted([code], TESTS, CRITIQUE, rewrites[0], CRITIQUE, rewrites[1])
    agent = loop_runtime(
        manager,
        provider,
        agent_samples=1,
        agent_generated_tests=3,
        agent_strategy="sample_select+reflexion",
    )
    result = await agent.execute(function_task(EXAMPLES, "add_one"), mode="loop")
    assert not result.success and result.status == "failed"
    assert len(result.attempts) == 3 and result.critiques
    assert all(a.execution is not None and not a.execution.ok for a in result.attempts[1:])


@pytest.mark.asyncio
async def test_an_early_exit_0_is_not_remembered_as_worked(
    manager: SandboxManager, tmp_path: Path
) -> None:
    """Failed before (red team, 2026-12-07): the forged success went to the memory as a
    solution that worked, to be recalled into later prompts as one."""
    pytest.importorskip("qdrant_client")
    from sandlot.agent.memory import AgentMemory

    settings = AgentSettings(
        memory_enabled=True, qdrant_path=tmp_path / "memory", agent_strategy="single"
    )
    memory = await AgentMemory.open(settings)
    try:
        provider = ScriptedProvider([fence(EARLY_EXITS["os._exit"])])
        agent = AgentRuntime(
            provider, settings=settings, memory=memory, sandbox_options={"manager": manager}
        )
        result = await agent.execute(function_task(EXAMPLES, "add_one"))
        assert not result.success and await memory.count() == 1
        hits = await memory.recall(EXAMPLES, min_score=0.0)
        assert all(record.outcome == "failed" for record, _ in hits)
    finally:
        await memory.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["single", "swarm"])
async def test_honest_code_with_a_main_block_still_passes(
    manager: SandboxManager, mode: str
) -> None:
    # What the rule must not cost: right code that prints, and whose __main__ block does
    # not exit, passes its checks in the loop and in the swarm.
    provider = swarm_provider(HONEST) if mode == "swarm" else ScriptedProvider([fence(HONEST)])
    agent = loop_runtime(manager, provider, agent_strategy="single")
    result = await agent.execute(function_task(EXAMPLES, "add_one"), mode=mode)  # type: ignore[arg-type]
    assert result.success and result.status == "solved"
    assert result.output.startswith("loaded\n2\n")
