"""The reflexion loop and the swarm, end to end: a scripted provider (a real implementation of
the provider interface that replays given replies), real bubblewrap sandboxes, real LangGraph.

Covers what issue 5 lists: success first time, success after a fix, exhausting retries, a
sandbox timeout, invalid JSON from the model, a provider failure; the swarm's consensus,
its second round, a security veto and abstentions; memory recalled into the prompt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.agent.code import visible_tests_from_examples
from sandlot.agent.models import AgentEvent, TaskSpec
from sandlot.agent.providers.scripted import ScriptedProvider
from sandlot.agent.runtime import AgentRuntime
from sandlot.errors import ConfigError, ProviderError

from .conftest import make_settings, skip_reason

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap"),
]


def fenced(code: str) -> str:
    return f"Here is the code:\n```python\n{code}\n```\nDone."


def critique(diagnosis: str, fix: str) -> str:
    return json.dumps({"diagnosis": diagnosis, "fix": fix})


@pytest.fixture
async def manager(data_root: Path, request: pytest.FixtureRequest) -> AsyncIterator[SandboxManager]:
    manager = SandboxManager(make_settings(data_root / f"agent-{request.node.name}"))
    await manager.start()
    yield manager
    await manager.close()


def runtime(manager: SandboxManager, provider: ScriptedProvider, **kwargs: object) -> AgentRuntime:
    """A runtime whose ``loop`` mode is the reflexion loop (these tests' subject), whatever
    the default strategy is."""
    from sandlot.agent.config import AgentSettings

    kwargs.setdefault("settings", AgentSettings(agent_strategy="reflexion"))
    return AgentRuntime(provider, sandbox_options={"manager": manager}, **kwargs)  # type: ignore[arg-type]


async def test_success_first_time(manager: SandboxManager) -> None:
    provider = ScriptedProvider([fenced("print(sum(range(11)))")])
    events: list[AgentEvent] = []

    async def record(event: AgentEvent) -> None:
        events.append(event)

    result = await runtime(manager, provider).execute("sum 0..10", on_event=record)
    assert result.status == "solved" and result.success
    assert result.output == "55\n"
    assert len(result.attempts) == 1 and result.errors == [] and result.critiques == []
    assert result.code == "print(sum(range(11)))"
    assert result.input_tokens > 0 and result.output_tokens > 0
    assert result.sandbox_s > 0
    assert [e.event for e in events] == ["start", "generate", "code", "execute", "final"]
    assert provider.remaining == 0
    # Nothing is left running: the task's sandbox was destroyed.
    assert await manager.list() == []


async def test_success_after_a_fix(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        [
            fenced("values = [3, 1, 2]\nprint(values.sorted())"),
            critique("lists have no sorted() method", "use sorted(values)"),
            fenced("values = [3, 1, 2]\nprint(sorted(values))"),
        ]
    )
    result = await runtime(manager, provider).execute("print [3, 1, 2] sorted")
    assert result.success and result.output == "[1, 2, 3]\n"
    assert len(result.attempts) == 2
    first = result.attempts[0]
    assert first.execution is not None and not first.execution.ok
    assert "AttributeError" in result.errors[0]
    assert first.critique == "lists have no sorted() method Fix: use sorted(values)"
    assert result.critiques == [first.critique]
    # The retry continued the conversation: the failed code as the model's turn, then its
    # error and the critique.
    retry = provider.calls[2]
    assert [m.role for m in retry] == ["system", "user", "assistant", "user"]
    assert "values.sorted()" in retry[2].content
    assert "AttributeError" in retry[3].content and "use sorted(values)" in retry[3].content
    # The critic was asked for JSON of the Critique schema.
    assert '"diagnosis"' in provider.calls[1][-1].content
    assert result.input_tokens == sum(a.input_tokens for a in result.attempts)


async def test_exhausting_retries(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        [
            fenced("raise SystemExit(3)"),
            critique("exits 3", "exit 0"),
            fenced("raise SystemExit(4)"),
            critique("exits 4", "exit 0"),
            fenced("raise SystemExit(5)"),
        ]
    )
    result = await runtime(manager, provider, max_attempts=3).execute("exit cleanly")
    assert result.status == "failed" and not result.success
    assert len(result.attempts) == 3
    assert [e.split("\n")[0] for e in result.errors] == [
        "exit code 3",
        "exit code 4",
        "exit code 5",
    ]
    # The last failure is not critiqued: no attempt is left to use it.
    assert len(result.critiques) == 2
    assert result.attempts[-1].critique is None
    assert provider.remaining == 0


async def test_a_retry_that_repeats_failed_code_is_redrawn_not_run(
    manager: SandboxManager,
) -> None:
    broken = fenced("raise SystemExit(3)")
    # The same code with a docstring and a comment added is still the same code.
    reworded = fenced('"""Exit."""\n# exits cleanly now\nraise SystemExit(3)')
    provider = ScriptedProvider(
        [broken, critique("exits 3", "exit 0"), reworded, fenced("print('ok')")]
    )
    result = await runtime(manager, provider).execute("exit cleanly")
    assert result.success and len(result.attempts) == 2
    second = result.attempts[1]
    assert second.redraws == 1 and second.code == "print('ok')"
    # The redraw sampled hotter than the retry before it, and the first attempt used the
    # provider's own temperature.
    assert provider.temperatures == [0.0, 0.0, 0.7, pytest.approx(1.0)]
    # The repeated code never ran: two runs in all.
    assert result.errors == [result.errors[0]] and "exit code 3" in result.errors[0]


async def test_sandbox_timeout_is_a_failure_the_loop_fixes(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        [
            fenced("while True:\n    pass"),
            critique("it never ends", "print the answer directly"),
            fenced("print('done')"),
        ]
    )
    result = await runtime(manager, provider).execute("print done", timeout_s=1.0)
    assert result.success and result.output == "done\n"
    first = result.attempts[0].execution
    assert first is not None and first.kill_reason == "timeout"
    assert "timeout" in result.errors[0]


async def test_invalid_json_from_the_critic(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        [
            fenced("print(undefined_name)"),
            "The problem is the name.",  # not JSON
            "{'diagnosis': 'single quotes'}",  # still not valid JSON: the repair turn fails too
            fenced("print('defined')"),
        ]
    )
    result = await runtime(manager, provider).execute("print defined")
    assert result.success
    assert any(e.startswith("critic:") and "Critique" in e for e in result.errors)
    # The raw failure stood in for the critique.
    assert "NameError" in result.critiques[0]
    # The repair turn quoted the validation problem back to the model.
    assert "was not valid" in provider.calls[2][-1].content


async def test_provider_failure_is_an_agent_error(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        [fenced("print(1/0)"), ProviderError("groq answered HTTP 503: over capacity")]
    )
    result = await runtime(manager, provider).execute("divide")
    assert result.status == "error" and not result.success
    assert result.error is not None and "503" in result.error
    assert len(result.attempts) == 1


async def test_single_mode_makes_one_attempt(manager: SandboxManager) -> None:
    provider = ScriptedProvider([fenced("print(1/0)")])
    result = await runtime(manager, provider).execute("divide", mode="single")
    assert result.mode == "single" and result.status == "failed"
    assert len(result.attempts) == 1 and provider.remaining == 0


async def test_function_task_runs_the_prompts_examples(manager: SandboxManager) -> None:
    prompt = 'def double(x: int) -> int:\n    """Twice x.\n    >>> double(4)\n    8\n    """\n'
    spec = TaskSpec(
        task=prompt,
        prompt=prompt,
        entry_point="double",
        visible_tests=visible_tests_from_examples(prompt, "double"),
    )
    provider = ScriptedProvider(
        [
            fenced("def double(x):\n    return x + 2"),  # right for 2, wrong for 4
            critique("adds 2", "multiply by 2"),
            fenced("def double(x):\n    return x * 2"),
        ]
    )
    result = await runtime(manager, provider).execute(spec)
    assert result.success and len(result.attempts) == 2
    assert "double(4) returned 6, expected 8" in result.errors[0]


async def test_empty_task_is_refused(manager: SandboxManager) -> None:
    with pytest.raises(ConfigError, match="empty"):
        await runtime(manager, ScriptedProvider()).execute("   ")


# ---------------------------------------------------------------------------- swarm

DESIGN = "Loop over the numbers and add them."
GOOD = fenced("print(sum([1, 2, 3]))")
BAD = fenced("print(sum([1, 2, 3]) + )")


def vote(choice: int, approve: bool = True, concerns: str = "") -> str:
    return json.dumps({"choice": choice, "approve": approve, "concerns": concerns})


def revision_prompt(provider: ScriptedProvider, role: str) -> str:
    """The prompt that asked ``role`` to revise its previous proposal."""
    return next(
        call[-1].content
        for call in provider.calls
        if call[0].content.startswith(f"You are the {role}")
        and "previous proposal" in call[-1].content
    )


async def test_swarm_reaches_consensus(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(1)],
            "coder": [GOOD, vote(1)],
            "optimizer": [BAD, vote(1)],
            "critic": [vote(1)],
            "security": [vote(1)],
        }
    )
    votes: list[AgentEvent] = []

    async def record(event: AgentEvent) -> None:
        if event.event == "vote":
            votes.append(event)

    result = await runtime(manager, provider).execute("print 6", mode="swarm", on_event=record)
    assert result.mode == "swarm" and result.success
    assert result.output == "6\n" and result.code == "print(sum([1, 2, 3]))"
    assert result.swarm is not None
    assert result.swarm.consensus is True and result.swarm.winner == "coder"
    [round_one] = result.swarm.rounds
    assert [p.ok for p in round_one.proposals] == [True, False]
    assert round_one.proposals[0].approvals == 5
    assert set(round_one.votes) == {"architect", "coder", "critic", "security", "optimizer"}
    # The JSON that /execute, WS /stream and `sandlot run --json` carry.
    dumped = result.model_dump(mode="json")["swarm"]
    assert set(dumped) == {"rounds", "consensus", "winner", "winner_attempt"}
    assert (dumped["winner"], dumped["winner_attempt"]) == ("coder", 1)
    [round_json] = dumped["rounds"]
    assert set(round_json) == {"round", "proposals", "votes", "consensus"}
    assert round_json["proposals"][0] == {"role": "coder", "attempt": 1, "ok": True, "approvals": 5}
    assert round_json["votes"]["critic"] == {"choice": 1, "approve": True, "concerns": ""}
    assert [e.data for e in votes] == [round_json]
    # Both proposals ran in the sandbox: two attempts, one failed with a SyntaxError.
    assert len(result.attempts) == 2 and "SyntaxError" in " ".join(result.errors)
    assert provider.remaining == 0


async def test_swarm_revises_after_concerns_and_security_veto(manager: SandboxManager) -> None:
    risky = fenced("import os\nprint(os.popen('echo 6').read().strip())")
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(1), vote(2)],
            # Each role's calls in order: propose, vote, (revise, vote).
            "coder": [risky, vote(1), fenced("print(6)"), vote(2)],
            "optimizer": [BAD, vote(1), GOOD, vote(2)],
            "critic": [vote(1), vote(2)],
            "security": [vote(1, False, "runs a shell command"), vote(2)],
        }
    )
    result = await runtime(manager, provider).execute("print 6", mode="swarm")
    assert result.swarm is not None
    first, second = result.swarm.rounds
    # Four approvals, but security vetoed the shell: no consensus in round one.
    assert first.proposals[0].approvals == 4 and first.consensus is False
    assert second.consensus is True
    assert result.swarm.winner == "optimizer"
    assert result.success and result.output == "6\n"
    # The concerns went back to the proposers in round two.
    assert "runs a shell command" in revision_prompt(provider, "coder")
    assert len(result.attempts) == 4


async def test_swarm_abstentions_and_no_consensus(manager: SandboxManager) -> None:
    from sandlot.agent.config import AgentSettings

    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, "I like it", "{}"],  # not a Vote, twice: abstains
            "coder": [GOOD, vote(1)],
            "optimizer": [GOOD, vote(9)],  # no proposal 9: abstains
            "critic": [vote(2, approve=False, concerns="add comments")],
            "security": [vote(1)],
        }
    )
    one_round = AgentSettings(swarm_rounds=1, agent_strategy="reflexion")
    result = await runtime(manager, provider, settings=one_round).execute("print 6", mode="swarm")
    assert result.swarm is not None
    [only] = result.swarm.rounds
    assert set(only.votes) == {"coder", "critic", "security"}
    assert any("architect abstained" in e for e in result.errors)
    assert any("optimizer abstained" in e for e in result.errors)
    # Two approvals of four needed: no consensus, and the round limit ends the vote. The
    # most approved proposal wins and, having run, is the answer.
    assert only.consensus is False and result.swarm.consensus is False
    assert result.swarm.winner == "coder" and result.success
    assert provider.remaining == 0


async def test_swarm_keeps_a_passing_proposal_instead_of_rewriting_it(
    manager: SandboxManager,
) -> None:
    # Round one: the coder's code passes, the optimizer's does not; the reviewers want more
    # (no consensus). Round two rewrites only the optimizer's: the coder is not asked again,
    # and its passing code (a rewrite of it was how the swarm lost tasks) is the answer.
    wrong = fenced("print(5)")
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(1, False, "add a docstring"), vote(1)],
            "coder": [GOOD, vote(1), vote(1)],
            "optimizer": [BAD, vote(1, False, "too long"), wrong, vote(2)],
            "critic": [vote(1, False, "check empty input"), vote(1)],
            "security": [vote(1), vote(1)],
        }
    )
    result = await runtime(manager, provider).execute("print 6", mode="swarm")
    assert result.swarm is not None
    first, second = result.swarm.rounds
    assert first.consensus is False and second.consensus is True
    assert [(p.role, p.attempt, p.ok) for p in second.proposals] == [
        ("coder", 1, True),
        ("optimizer", 3, True),
    ]
    assert result.swarm.winner == "coder" and result.swarm.winner_attempt == 1
    assert result.code == "print(sum([1, 2, 3]))" and result.output == "6\n"
    # Three attempts (the kept one counted once), and the coder proposed once.
    assert [a.number for a in result.attempts] == [1, 2, 3]
    coder_prompts = [
        call
        for call in provider.calls
        if call[0].content.startswith("You are the coder")
        and "Write the complete" in call[-1].content
    ]
    assert len(coder_prompts) == 1
    assert provider.remaining == 0


async def test_swarm_stops_when_every_proposal_passed_and_none_was_vetoed(
    manager: SandboxManager,
) -> None:
    # Both pass, the vote falls short of the quorum: a second round would only rewrite
    # passing code, so the vote stands (the most approved proposal that ran).
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(2)],
            "coder": [GOOD, vote(1)],
            "optimizer": [fenced("print(6)"), vote(2)],
            "critic": [vote(1, False, "prefer a loop")],
            "security": [vote(2)],
        }
    )
    result = await runtime(manager, provider).execute("print 6", mode="swarm")
    assert result.swarm is not None and result.swarm.consensus is False
    [only] = result.swarm.rounds
    assert only.proposals[1].approvals == 3
    assert result.swarm.winner == "optimizer" and result.success and result.output == "6\n"
    assert len(result.attempts) == 2 and provider.remaining == 0


async def test_swarm_rewrites_passing_code_that_security_vetoed(manager: SandboxManager) -> None:
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(2), vote(1)],
            "coder": [GOOD, vote(2), vote(1)],
            "optimizer": [fenced("print(6)"), vote(2), fenced("print(2 * 3)"), vote(1)],
            "critic": [vote(1, False, "prefer a loop"), vote(1)],
            "security": [vote(2, False, "prints a constant"), vote(1)],
        }
    )
    result = await runtime(manager, provider).execute("print 6", mode="swarm")
    assert result.swarm is not None
    first, second = result.swarm.rounds
    assert first.consensus is False and second.consensus is True
    # The coder's passing code is kept; the optimizer's, passing but vetoed, is rewritten.
    assert [(p.role, p.attempt) for p in second.proposals] == [("coder", 1), ("optimizer", 3)]
    assert result.swarm.winner == "coder" and provider.remaining == 0
    assert "prints a constant" in revision_prompt(provider, "optimizer")


async def test_swarm_final_code_is_proven_not_voted(manager: SandboxManager) -> None:
    # Everyone approves code that does not run: the swarm must not call it solved.
    provider = ScriptedProvider(
        by_role={
            "architect": [DESIGN, vote(1), vote(1)],
            "coder": [BAD, vote(1), BAD, vote(1)],
            "optimizer": [BAD, vote(1), BAD, vote(1)],
            "critic": [vote(1), vote(1)],
            "security": [vote(1), vote(1)],
        }
    )
    result = await runtime(manager, provider).execute("print 6", mode="swarm")
    assert result.status == "failed" and not result.success
    assert result.swarm is not None and result.swarm.consensus is False
    assert len(result.swarm.rounds) == 2


# ---------------------------------------------------------------------------- memory


async def test_memory_recalls_a_past_fix_into_the_prompt(
    manager: SandboxManager, tmp_path: Path
) -> None:
    pytest.importorskip("qdrant_client")
    from sandlot.agent.config import AgentSettings
    from sandlot.agent.memory import AgentMemory

    settings = AgentSettings(
        memory_enabled=True, qdrant_path=tmp_path / "memory", agent_strategy="reflexion"
    )
    memory = await AgentMemory.open(settings)
    try:
        first = ScriptedProvider(
            [
                fenced("import json\nprint(json.dumps({'a': 1}, indentation=2))"),
                critique("dumps has no indentation argument", "use indent=2"),
                fenced("import json\nprint(json.dumps({'a': 1}, indent=2))"),
            ]
        )
        agent = AgentRuntime(
            first, settings=settings, memory=memory, sandbox_options={"manager": manager}
        )
        assert (await agent.execute("pretty print a json dict")).success
        assert await memory.count() == 1

        second = ScriptedProvider([fenced("print('{}')")])
        agent = AgentRuntime(
            second, settings=settings, memory=memory, sandbox_options={"manager": manager}
        )
        await agent.execute("pretty print a json dictionary")
        prompt = second.calls[0][-1].content
        assert "pretty print a json dict" in prompt
        assert "use indent=2" in prompt
        assert "indentation" in prompt  # the failure that the fix answered
    finally:
        await memory.close()


async def test_the_system_prompts_come_from_the_registry(
    manager: SandboxManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 001's registry/prompts: the package's system prompts (the ones the benchmarks
    ran with, word for word), any of them replaced by SANDLOT_REGISTRY_DIR/prompts/system.yaml,
    and a file that is not prompts refused by name."""
    from sandlot.agent.prompts import GENERATOR_SYSTEM, system_prompts
    from sandlot.config import get_settings

    packaged = system_prompts()
    assert packaged.generator == GENERATOR_SYSTEM and GENERATOR_SYSTEM.startswith("You are an")
    assert all(text.lower().startswith(f"you are the {r}") for r, text in packaged.roles.items())
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "system.yaml").write_text(
        "generator: You write Python for the ACME test rig.\n"
        "roles: {critic: You are the critic of ACME.}\n"
    )
    ours = system_prompts(tmp_path)
    assert ours.generator == "You write Python for the ACME test rig."
    assert ours.roles["critic"] == "You are the critic of ACME."
    assert ours.roles["coder"] == packaged.roles["coder"]  # the others stay the package's
    monkeypatch.setenv("SANDLOT_REGISTRY_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        provider = ScriptedProvider([fenced("print(55)")])
        result = await runtime(manager, provider).execute("Print 55")
        assert result.success
        assert provider.calls[0][0].content == "You write Python for the ACME test rig."
    finally:
        monkeypatch.delenv("SANDLOT_REGISTRY_DIR")
        get_settings.cache_clear()
    (tmp_path / "prompts" / "system.yaml").write_text("roles: {janitor: You are the janitor.}\n")
    with pytest.raises(ConfigError, match=r"system\.yaml"):
        system_prompts.__wrapped__(tmp_path)
