"""The swarm (seed 000): five roles design, propose, run, vote, and revise until consensus.

Each round:

1. the **architect** writes a short design (first round only);
2. the **coder** and the **optimizer** each propose code from it, concurrently; every
   proposal runs in the sandbox with the task's visible tests, so the vote sees evidence;
3. all five roles (architect, coder, critic, security, optimizer) vote concurrently, each
   with its own prompt, for one proposal and whether they approve it;
4. **consensus** is a proposal approved by at least ``quorum`` voters (4 of 5 by default),
   that ran successfully and that security did not veto. Without it, the voters' concerns
   go back to the proposers for the next round, but a proposal that passed its run and that
   security did not veto is kept as it is, not rewritten (a rewrite can only lose what a
   passing proposal had; measured, the rule saves a few percent of tokens and changed no
   task's outcome: BENCHMARKS.md); when every proposal is kept, another round would repeat
   this one, and the vote stands.

After ``max_rounds`` the proposal with the most approvals wins (one that ran beats one that
did not). The winner's run in the sandbox is the proof: ``success`` means it ran and passed
the visible tests, whatever the votes said (with checks, by the harness's verdict line and the
exit code together, as in the loop: ``loop.run_candidate``). A voter whose reply is not valid
JSON abstains; the abstention is recorded.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from sandlot.agent.code import extract_code
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.loop import LoopState, build_result, run_candidate
from sandlot.agent.models import (
    AgentEvent,
    AgentResult,
    AgentRole,
    Attempt,
    EventSink,
    ProposalRecord,
    Status,
    SwarmOutcome,
    SwarmRound,
    TaskSpec,
    Vote,
)
from sandlot.agent.prompts import current_prompts, system_prompts
from sandlot.agent.providers.base import Completion, Provider
from sandlot.errors import ModelOutputError, ProviderError

VOTE_MAX_TOKENS = 200
DESIGN_MAX_TOKENS = 300


# Each starts "You are the <role>": the scripted provider routes its replies by that. The
# package's; a run reads its registry's (prompts.current_prompts).
ROLE_PROMPTS: dict[AgentRole, str] = dict(system_prompts().roles)
PROPOSERS = (AgentRole.CODER, AgentRole.OPTIMIZER)


class Proposal(BaseModel):
    """A proposal while the swarm works on it: its code and run live on the attempt."""

    role: AgentRole
    attempt: Attempt


class Swarm:
    def __init__(
        self,
        provider: Provider,
        executor: SandboxExecutor,
        *,
        max_rounds: int = 2,
        max_attempts: int = 3,
        quorum: int = 4,
        on_event: EventSink | None = None,
    ) -> None:
        self.provider = provider
        self.executor = executor
        self.max_rounds = max_rounds
        self.quorum = quorum
        self.max_attempts = max_attempts
        self.on_event = on_event

    async def emit(self, event: AgentEvent) -> None:
        if self.on_event is not None:
            await self.on_event(event)

    async def run(self, spec: TaskSpec, *, recalled: str = "") -> AgentResult:
        started = time.monotonic()
        await self.emit(AgentEvent(event="start", data={"task": spec.task[:500], "swarm": True}))
        attempts: list[Attempt] = []
        rounds: list[SwarmRound] = []
        errors: list[str] = []
        winner: Proposal | None = None
        consensus = False
        try:
            design, spent = await self._design(spec, recalled)
            feedback = ""
            proposals: list[Proposal] = []
            vetoed: set[int] = set()
            for round_no in range(1, self.max_rounds + 1):
                kept = [p for p in proposals if _keeps(p, vetoed)]
                if proposals and len(kept) == len(proposals):
                    break  # every proposal passed and none was vetoed: a new round repeats this
                proposals = await self._propose(
                    spec, design, feedback, proposals, kept, len(attempts)
                )
                attempts += [p.attempt for p in proposals if p not in kept]
                votes = await self._vote(spec, proposals, errors)
                winner, consensus, tally = self._count(proposals, votes)
                rounds.append(_round_record(round_no, proposals, votes, tally, consensus))
                await self.emit(
                    AgentEvent(
                        event="vote", attempt=round_no, data=rounds[-1].model_dump(mode="json")
                    )
                )
                if consensus:
                    break
                vetoed = _vetoed(proposals, votes)
                feedback = "\n".join(
                    f"- {role}: {vote.concerns}" for role, vote in votes.items() if vote.concerns
                )
        except ProviderError as exc:
            return self._finish(
                spec, attempts, errors, rounds, None, False, started, status="error", error=str(exc)
            )
        if attempts:
            attempts[0].charge(spent)  # the design was written for the first round
        return self._finish(spec, attempts, errors, rounds, winner, consensus, started)

    # ------------------------------------------------------------------ steps

    async def _design(self, spec: TaskSpec, recalled: str) -> tuple[str, Completion]:
        memory = f"{recalled}\n\n" if recalled else ""
        completion = await self.provider.generate(
            f"{memory}Task:\n{spec.prompt or spec.task}\n\nWrite a short design (at most 8 "
            "lines): the approach, the functions, the edge cases. No code.",
            system=current_prompts().roles[AgentRole.ARCHITECT],
            max_tokens=DESIGN_MAX_TOKENS,
        )
        return completion.text.strip(), completion

    async def _propose(
        self,
        spec: TaskSpec,
        design: str,
        feedback: str,
        previous: list[Proposal],
        kept: list[Proposal],
        numbered: int,
    ) -> list[Proposal]:
        """A proposal per proposer, each run with the visible tests: ``kept`` ones (they
        passed that run and security did not veto them) as they were, the others rewritten
        with the reviewers' concerns."""
        what = (
            "function (with its imports)" if spec.is_function else "program that prints the result"
        )
        task = f"```python\n{spec.prompt}\n```" if spec.is_function and spec.prompt else spec.task

        async def one(role: AgentRole, number: int) -> Proposal:
            prompt = f"Task:\n{task}\n\nDesign:\n{design}\n\n"
            mine = next((p for p in previous if p.role == role), None)
            if mine is not None:
                run = mine.attempt.execution
                outcome = (
                    "it passed its run"
                    if run and run.ok
                    else (run.failure_summary(600) if run else "it did not run")
                )
                prompt += (
                    f"Your previous proposal:\n```python\n{mine.attempt.code}\n```\nResult: "
                    f"{outcome}\nThe reviewers said:\n{feedback or '(nothing)'}\n\n"
                )
            prompt += f"Write the complete {what} in one ```python block."
            completion = await self.provider.generate(prompt, system=current_prompts().roles[role])
            attempt = Attempt(number=number, code=extract_code(completion.text))
            attempt.charge(completion)
            await self.emit(
                AgentEvent(
                    event="code", attempt=number, data={"role": role.value, "code": attempt.code}
                )
            )
            return Proposal(role=role, attempt=attempt)

        by_role = {p.role: p for p in kept}
        fresh = [r for r in PROPOSERS if r not in by_role]
        written = await asyncio.gather(*(one(r, numbered + i + 1) for i, r in enumerate(fresh)))
        by_role.update(zip(fresh, written, strict=True))
        proposals = [by_role[r] for r in PROPOSERS]
        # One sandbox, one run at a time: each proposal gets the same conditions.
        for proposal in written:
            run = await run_candidate(self.executor, spec, proposal.attempt.code)
            proposal.attempt.execution = run
            await self.emit(
                AgentEvent(
                    event="execute",
                    attempt=proposal.attempt.number,
                    data={"role": proposal.role.value, **run.model_dump()},
                )
            )
        return proposals

    async def _vote(
        self, spec: TaskSpec, proposals: list[Proposal], errors: list[str]
    ) -> dict[AgentRole, Vote]:
        shown = "\n\n".join(
            f"Proposal {i} (by the {p.role.value}):\n```python\n{p.attempt.code}\n```\n"
            f"Test run: {_outcome(p)}"
            for i, p in enumerate(proposals, 1)
        )
        prompt = (
            f"Task:\n{spec.prompt or spec.task}\n\n{shown}\n\nVote for the best proposal and "
            "say whether you approve it."
        )

        async def one(role: AgentRole) -> tuple[AgentRole, Vote | None]:
            try:
                vote, _ = await self.provider.generate_json(
                    prompt, Vote, system=current_prompts().roles[role], max_tokens=VOTE_MAX_TOKENS
                )
            except ModelOutputError as exc:
                errors.append(f"{role.value} abstained: {exc}")
                return role, None
            if not 1 <= vote.choice <= len(proposals):
                errors.append(f"{role.value} abstained: voted for proposal {vote.choice}")
                return role, None
            return role, vote

        cast = await asyncio.gather(*(one(role) for role in AgentRole))
        return {role: vote for role, vote in cast if vote is not None}

    def _count(
        self, proposals: list[Proposal], votes: dict[AgentRole, Vote]
    ) -> tuple[Proposal, bool, list[int]]:
        tally = [0] * len(proposals)
        for vote in votes.values():
            if vote.approve:
                tally[vote.choice - 1] += 1

        def rank(i: int) -> tuple[int, bool, int]:
            run = proposals[i].attempt.execution
            # Most approvals; then a proposal that ran; then the coder's (listed first).
            return tally[i], bool(run and run.ok), -i

        best = max(range(len(proposals)), key=rank)
        security = votes.get(AgentRole.SECURITY)
        vetoed = security is not None and security.choice == best + 1 and not security.approve
        run = proposals[best].attempt.execution
        consensus = tally[best] >= self.quorum and not vetoed and bool(run and run.ok)
        return proposals[best], consensus, tally

    def _finish(
        self,
        spec: TaskSpec,
        attempts: list[Attempt],
        errors: list[str],
        rounds: list[SwarmRound],
        winner: Proposal | None,
        consensus: bool,
        started: float,
        *,
        status: Status | None = None,
        error: str | None = None,
    ) -> AgentResult:
        ran = winner.attempt.execution if winner is not None else None
        final_status = status or ("solved" if ran is not None and ran.ok else "failed")
        state: LoopState = {
            "attempts": attempts,
            "errors": errors
            + [
                a.execution.failure_summary(400)
                for a in attempts
                if a.execution is not None and not a.execution.ok
            ],
            "critiques": [],
            "status": final_status,
            "error": error,
        }
        result = build_result(
            spec,
            state,
            mode="swarm",
            provider=self.provider,
            wall_s=time.monotonic() - started,
        )
        if winner is not None:
            result.code = winner.attempt.code
            result.output = ran.stdout if ran is not None else ""
        result.swarm = SwarmOutcome(
            rounds=rounds,
            consensus=consensus,
            winner=winner.role if winner is not None else None,
            winner_attempt=winner.attempt.number if winner is not None else None,
        )
        return result


def _vetoed(proposals: list[Proposal], votes: dict[AgentRole, Vote]) -> set[int]:
    """The attempt numbers security rejected this round: those are rewritten, passing or not."""
    security = votes.get(AgentRole.SECURITY)
    if security is None or security.approve:
        return set()
    return {proposals[security.choice - 1].attempt.number}


def _keeps(proposal: Proposal, vetoed: set[int]) -> bool:
    """Whether the next round keeps ``proposal`` as it is (it passed its run, not vetoed)."""
    run = proposal.attempt.execution
    return bool(run and run.ok) and proposal.attempt.number not in vetoed


def _outcome(proposal: Proposal) -> str:
    run = proposal.attempt.execution
    if run is None:
        return "not run"
    return "passed" if run.ok else "failed: " + run.failure_summary(300)


def _round_record(
    number: int,
    proposals: list[Proposal],
    votes: dict[AgentRole, Vote],
    tally: list[int],
    consensus: bool,
) -> SwarmRound:
    return SwarmRound(
        round=number,
        proposals=[
            ProposalRecord(
                role=p.role,
                attempt=p.attempt.number,
                ok=bool(p.attempt.execution and p.attempt.execution.ok),
                approvals=n,
            )
            for p, n in zip(proposals, tally, strict=True)
        ],
        votes=votes,
        consensus=consensus,
    )
