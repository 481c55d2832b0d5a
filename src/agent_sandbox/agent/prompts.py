"""Every prompt of the agent layer, in one place to read and tune.

Prompts are short on purpose: the default model is a 1.5B one on a CPU, where each prompt
token costs time (about 30 tokens/s on one core) and a long instruction is followed less
well. The loop's three prompts share one system prompt and open the same way (task, then
code, then the failure): llama.cpp keeps the longest common prefix of the previous prompt,
so the critique and the retry do not pay again for the text they share.
"""

from __future__ import annotations

from agent_sandbox.agent.models import Attempt, TaskSpec

GENERATOR_SYSTEM = (
    "You are an expert Python programmer. You write correct, simple, self-contained Python 3 "
    "code using only the standard library. The code runs with no network and no input."
)


def _task(spec: TaskSpec) -> str:
    if spec.is_function:
        return f"Task:\n```python\n{spec.prompt or spec.task}\n```\n\n"
    return f"Task: {spec.task}\n\n"


def _failed(last: Attempt) -> str:
    failure = last.execution.failure_summary() if last.execution else "it did not run"
    return f"Code:\n```python\n{last.code}\n```\n\nRunning it failed:\n{failure}\n\n"


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


def critique_prompt(spec: TaskSpec, last: Attempt) -> str:
    return (
        f"{_task(spec)}{_failed(last)}You are the critic: explain the bug in one or two "
        "sentences and the concrete fix."
    )


def retry_prompt(spec: TaskSpec, last: Attempt, critique: str) -> str:
    what = "function and its imports" if spec.is_function else "program"
    return (
        f"{_task(spec)}{_failed(last)}Review: {critique}\n\nWrite the corrected complete "
        f"{what} in one ```python block. Do not repeat the docstring."
    )
