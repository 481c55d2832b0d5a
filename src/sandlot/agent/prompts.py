"""Every prompt of the agent layer, in one place to read and tune.

Prompts are short on purpose: the default model is a 1.5B one on a CPU, where each prompt
token costs time (about 30 tokens/s on one core) and a long instruction is followed less
well. The loop is one conversation: the task, each attempt as the model's own turn, each failure
and review as the next user turn. Every call extends the previous one, and llama.cpp keeps
the longest common prefix of the last prompt in its cache, so a retry pays only for its new
turns.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandlot.agent.models import AgentRole, Attempt, TaskSpec
from sandlot.agent.providers.base import Message
from sandlot.config import explain_invalid, get_settings
from sandlot.environments import PACKAGED_REGISTRY, read_declared
from sandlot.errors import ConfigError

# The system prompts live in the registry (seed 001's registry/prompts), no logic: the
# package's, and any of them replaced by SANDLOT_REGISTRY_DIR/prompts/system.yaml.
PROMPTS_FILE = Path("prompts") / "system.yaml"
MAX_PROMPT_CHARS = 8000


class SystemPrompts(BaseModel):
    """What the generator is told, and what each role of the swarm is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generator: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    roles: dict[AgentRole, str] = Field(min_length=len(AgentRole))


class _Override(BaseModel):
    model_config = ConfigDict(extra="forbid")

    generator: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    roles: dict[AgentRole, str] = Field(default_factory=dict)


@cache
def system_prompts(registry_dir: Path | None = None) -> SystemPrompts:
    """The package's system prompts, with those ``registry_dir/prompts/system.yaml`` gives
    in their place.

    Raises:
        ConfigError: a prompts file that is not one (unknown keys or roles, empty prompts).
    """
    packaged = read_declared(PACKAGED_REGISTRY / PROMPTS_FILE, _Override, "prompts")
    generator, roles = packaged.generator, dict(packaged.roles)
    own = registry_dir / PROMPTS_FILE if registry_dir is not None else None
    if own is not None and own.is_file():
        override = read_declared(own, _Override, "prompts")
        generator = override.generator or generator
        roles.update(override.roles)
    try:
        return SystemPrompts(generator=generator or "", roles=roles)
    except ValidationError as exc:
        raise ConfigError(explain_invalid(exc, "the system prompts")) from None


def current_prompts() -> SystemPrompts:
    """The system prompts of this process's registry (``SANDLOT_REGISTRY_DIR``)."""
    return system_prompts(get_settings().registry_dir)


# The package's own, for reading and for tests.
GENERATOR_SYSTEM = system_prompts().generator


def _task(spec: TaskSpec) -> str:
    if spec.is_function:
        return f"Task:\n```python\n{spec.prompt or spec.task}\n```\n\n"
    return f"Task: {spec.task}\n\n"


def generate_prompt(spec: TaskSpec, recalled: str = "") -> str:
    memory = f"{recalled}\n\n" if recalled else ""
    if spec.is_function:
        return (
            f"{_task(spec)}{memory}Complete this function. Reply with the whole function and "
            "its imports in one ```python block. Do not repeat the docstring; no tests, no "
            "example usage."
        )
    return (
        f"{_task(spec)}{memory}Write a complete Python program that does this and prints "
        "the result. Reply with one ```python block."
    )


def _failure(attempt: Attempt) -> str:
    failure = attempt.execution.failure_summary() if attempt.execution else "it did not run"
    return f"Running it failed:\n{failure}\n\n"


def _rewrite(spec: TaskSpec, critique: str) -> str:
    what = "function and its imports" if spec.is_function else "program"
    return (
        f"Review: {critique}\n\nWrite the corrected complete {what} in one ```python "
        "block. Do not repeat the docstring."
    )


def conversation(
    spec: TaskSpec, recalled: str, attempts: list[Attempt], critiques: list[str]
) -> list[Message]:
    """The task, then each attempt's code as the model's turn and its failure and review as
    the next user turn: what the model reads to write attempt ``len(attempts) + 1``."""
    messages = [Message(role="user", content=generate_prompt(spec, recalled))]
    for attempt, critique in zip(attempts, critiques, strict=False):
        messages.append(Message(role="assistant", content=f"```python\n{attempt.code}\n```"))
        messages.append(Message(role="user", content=_failure(attempt) + _rewrite(spec, critique)))
    return messages


def critique_conversation(
    spec: TaskSpec, recalled: str, attempts: list[Attempt], critiques: list[str]
) -> list[Message]:
    """The conversation so far, the last attempt's code, and a request for a review of its
    failure. It opens like the rewrite request that follows it, so llama.cpp's prompt cache
    serves the rewrite."""
    messages = conversation(spec, recalled, attempts[:-1], critiques)
    last = attempts[-1]
    messages.append(Message(role="assistant", content=f"```python\n{last.code}\n```"))
    messages.append(
        Message(
            role="user",
            content=_failure(last) + "You are the critic: explain the bug in one or two "
            "sentences and the concrete fix.",
        )
    )
    return messages
