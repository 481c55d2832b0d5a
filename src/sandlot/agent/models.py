"""What the agent layer takes and gives: a task, its attempts, and the result.

One result schema for the loop, the swarm and single-shot runs, so the CLI, the server and
the benchmark read the same fields.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, Field

from sandlot.agent.usage import Usage

Status = Literal["solved", "failed", "error"]
Mode = Literal["single", "loop", "swarm", "sample_select", "sample_select+reflexion"]


class Check(BaseModel):
    """One visible test of a function task: an assert, split so the sandbox can report the
    actual value beside the expected one when it fails.

    ``call`` is evaluated for the actual value; ``expected`` is the source of the value it
    must equal, or None when the assert is not an equality (then ``call`` must be truthy).
    """

    source: str
    call: str
    expected: str | None = None
    origin: Literal["example", "generated"] = "example"


class TaskSpec(BaseModel):
    """A coding task.

    ``prompt`` is what the model reads. For a function task (HumanEval), ``entry_point``
    names the function, ``prompt`` is its signature and docstring, and ``visible_tests`` is
    Python appended to the candidate when it runs: the only checks the loop may see (the
    prompt's own examples). Hidden tests are the benchmark's business, never the loop's.
    """

    task: str
    prompt: str | None = None
    entry_point: str | None = None
    visible_tests: str = ""
    checks: list[Check] = Field(
        default_factory=list,
        description="Visible tests as asserts; when set they replace visible_tests: the "
        "sandbox runs each on its own and reports actual values and a trace of a failure.",
    )
    task_id: str | None = None

    @property
    def is_function(self) -> bool:
        return self.entry_point is not None


class Execution(BaseModel):
    """How one candidate ran in the sandbox (a summary of the SDK's ExecResult)."""

    ok: bool
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    kill_reason: str | None = None
    duration_s: float = 0.0

    def failure_summary(self, limit_chars: int = 1200) -> str:
        """What went wrong, tail first: the traceback's last lines name the error."""
        if self.ok:
            return ""
        parts = []
        if self.kill_reason:
            parts.append(f"killed: {self.kill_reason}")
        if self.exit_code not in (0, None):
            parts.append(f"exit code {self.exit_code}")
        detail = (self.error or self.stderr or "").strip()
        if len(detail) > limit_chars:
            detail = "..." + detail[-limit_chars:]
        return "; ".join(parts) + ("\n" + detail if detail else "")


class Critique(BaseModel):
    """The critic's reading of a failure, as the model is asked to give it."""

    diagnosis: str = Field(description="What went wrong and why, in one or two sentences.")
    fix: str = Field(description="The concrete change to make to the code.")


class AgentRole(StrEnum):
    ARCHITECT = "architect"
    CODER = "coder"
    CRITIC = "critic"
    SECURITY = "security"
    OPTIMIZER = "optimizer"


class Vote(BaseModel):
    """A swarm voter's ballot, as the model is asked to give it."""

    choice: int = Field(description="Number of the proposal you vote for (1-based).")
    approve: bool = Field(description="Whether that proposal is good enough to ship.")
    concerns: str = Field(default="", description="What must change, if anything.")


class ProposalRecord(BaseModel):
    """One proposal of a swarm round, as the round's record shows it."""

    role: AgentRole
    attempt: int = Field(description="The number of the attempt that holds its code.")
    ok: bool = Field(description="Whether its run in the sandbox passed.")
    approvals: int


class SwarmRound(BaseModel):
    round: int
    proposals: list[ProposalRecord]
    votes: dict[AgentRole, Vote] = Field(description="The ballots cast; abstainers are absent.")
    consensus: bool


class SwarmOutcome(BaseModel):
    """How the swarm decided: every round, and the proposal that won."""

    rounds: list[SwarmRound] = Field(default_factory=list)
    consensus: bool = False
    winner: AgentRole | None = None
    winner_attempt: int | None = None


class Attempt(BaseModel, Usage):
    number: int
    code: str
    execution: Execution | None = None
    critique: str | None = None
    redraws: int = Field(
        default=0, description="Samples thrown away for repeating code that already failed."
    )
    input_tokens: int = 0
    output_tokens: int = 0
    llm_s: float = 0.0
    critique_tokens: int = Field(
        default=0, description="Of the tokens, those of the critique of this attempt."
    )
    critique_llm_s: float = Field(default=0.0, description="Of llm_s, the critique's.")

    @property
    def generation_tokens(self) -> int:
        """What writing the code cost: a single shot's cost, without the review."""
        return self.total_tokens - self.critique_tokens

    @property
    def generation_llm_s(self) -> float:
        return self.llm_s - self.critique_llm_s


# Why sample-and-select drew as many samples as it did: early stop off; the first passed
# every check; it failed only written tests and the probe agreed with it, or did not; it
# failed otherwise (an example, a bad run, never written).
SamplePath = Literal[
    "all samples", "first passed", "probe agreed", "probe disagreed", "first failed"
]


class CandidateRecord(BaseModel):
    """One sampled candidate of sample-and-select, as its run in its own sandbox scored it."""

    sample: int = Field(description="Index of the sample (0: the provider's own temperature).")
    copies: int = Field(description="Samples that wrote the same code (run once).")
    examples_passed: int
    generated_passed: int = Field(description="Generated checks passed, of those kept.")
    agreement: int = Field(description="Candidates that returned the same values on every check.")
    sandbox_s: float = Field(description="Seconds its run took in the sandbox.")
    selected: bool = False
    passed: list[bool] = Field(
        default_factory=list,
        description="Its verdict on each check judged: the prompt's examples, then every "
        "written test (those the vote dropped included).",
    )
    returned: list[str] = Field(
        default_factory=list,
        description="What it returned (or raised) on each check judged, as the verdicts "
        "show it (a repr, cut at 80 characters); empty when its run gave no verdicts.",
    )


class AgentResult(BaseModel, Usage):
    task: str
    task_id: str | None = None
    mode: Mode
    status: Status
    success: bool
    code: str = ""
    output: str = Field(default="", description="stdout of the final run.")
    attempts: list[Attempt] = Field(default_factory=list)
    errors: list[str] = Field(default_factory=list, description="Each failed run's summary.")
    critiques: list[str] = Field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    llm_s: float = 0.0
    sandbox_s: float = 0.0
    wall_s: float = 0.0
    provider: str = ""
    model: str = ""
    error: str | None = Field(
        default=None,
        description="Why the agent itself stopped (status error): a provider "
        "failure, never a failure of the generated code.",
    )
    swarm: SwarmOutcome | None = None
    candidates: list[CandidateRecord] = Field(
        default_factory=list, description="Sample-and-select's candidates, when it ran."
    )
    checks: list[Check] = Field(
        default_factory=list, description="The visible checks the answer was judged by."
    )
    dropped_checks: list[str] = Field(
        default_factory=list,
        description="Generated checks that most candidates failed: taken for the test's fault.",
    )
    sample_path: SamplePath | None = Field(
        default=None,
        description="Sample-and-select: why it drew as many samples as it did (early stop).",
    )


class AgentEvent(BaseModel):
    """Progress, for the CLI and ``WS /stream``: one per step of the loop or swarm."""

    event: Literal["start", "generate", "code", "execute", "critique", "vote", "final", "error"]
    attempt: int = 0
    data: dict[str, Any] = Field(default_factory=dict)


EventSink = Callable[[AgentEvent], Awaitable[None]]
