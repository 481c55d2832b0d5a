"""Code out of a model's reply, and the program that runs it in the sandbox."""

from __future__ import annotations

import ast
import re

from sandlot.agent.checks import SAME, harness_program
from sandlot.agent.examples import visible_examples
from sandlot.agent.models import Check, TaskSpec

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*)$", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The code of a reply: the longest fenced block, an unclosed block cut by max_tokens,
    or the whole reply when it has no fence."""
    blocks = _FENCE.findall(text)
    if blocks:
        return str(max(blocks, key=len)).strip("\n")
    unclosed = _OPEN_FENCE.search(text)
    if unclosed:
        return unclosed.group(1).strip("\n")
    return text.strip("\n")


def defines(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` at top level (by parsing, not by grep)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
        for node in tree.body
    )


def _prompt_imports(prompt: str) -> str:
    lines = []
    for line in prompt.splitlines():
        if line.startswith(("import ", "from ")):
            lines.append(line)
        elif line.startswith("def "):
            break
    return "\n".join(lines)


def candidate_program(spec: TaskSpec, code: str) -> str:
    """The candidate as a module: for a function task, a reply that only wrote the body is
    put under the prompt's signature, and the prompt's imports always come first."""
    if not spec.is_function or spec.entry_point is None:
        return code
    prompt = spec.prompt or spec.task
    if defines(code, spec.entry_point):
        imports = _prompt_imports(prompt)
        return f"{imports}\n\n{code}" if imports else code
    return prompt + code


def program_to_run(
    spec: TaskSpec, code: str, *, marker: str | None = None, run_timeout_s: float | None = None
) -> str:
    """What the sandbox runs for an attempt: the candidate plus the visible tests (the
    checks' harness when the task has checks, its verdict line led by ``marker``, its
    per-check alarm sized from ``run_timeout_s``; else ``visible_tests``)."""
    program = candidate_program(spec, code)
    if spec.checks and spec.is_function:
        return harness_program(program, spec.checks, marker=marker, run_timeout_s=run_timeout_s)
    if spec.visible_tests:
        program += "\n\n" + spec.visible_tests
    return program + "\n"


EXAMPLES_RUNNER = (
    """
# --- the task's own examples, checked: the only tests the agent may see
import builtins as _b
import sys as _sys
"""
    + SAME
    + """
_failures = []
for _call, _want in {pairs!r}:
    _got = eval(_call)
    _same, _ = _sandlot_same(_got, _want, globals(), _b)
    if not _same:
        _failures.append("%s returned %r, expected %s" % (_call, _got, _want))
for _line in _failures:
    print("example failed: " + _line, file=_sys.stderr)
if _failures:
    raise SystemExit(1)
"""
)


def example_checks(prompt: str, entry_point: str) -> list[Check]:
    return [
        Check(source=f"assert {call} == {want}", call=call, expected=want, origin="example")
        for call, want in visible_examples(prompt, entry_point)
    ]


def visible_tests_from_examples(prompt: str, entry_point: str) -> str:
    pairs = visible_examples(prompt, entry_point)
    return EXAMPLES_RUNNER.format(pairs=pairs) if pairs else ""


def function_task(prompt: str, entry_point: str, *, task_id: str | None = None) -> TaskSpec:
    """A task to complete the function ``entry_point`` whose signature and docstring are
    ``prompt``; the docstring's examples become the visible tests the loop must pass."""
    return TaskSpec(
        task=prompt,
        prompt=prompt,
        entry_point=entry_point,
        task_id=task_id,
        visible_tests=visible_tests_from_examples(prompt, entry_point),
        checks=example_checks(prompt, entry_point),
    )
