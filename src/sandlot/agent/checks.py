"""Visible checks of a function task: the prompt's examples, the tests the model writes, and
the harness that runs them in the sandbox.

The harness runs each check on its own (one failing or hanging check does not hide the
others), prints one JSON line of verdicts for selection, and for the first failure writes to
stderr what a critic needs (LDB-style): the assert, the actual and the expected value, and
the last lines the candidate executed with its variables there, recorded by ``sys.settrace``
in the sandbox while the failing call is re-run.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from sandlot.agent.models import Check, TaskSpec

CHECK_TIMEOUT_S = 2  # per check: a candidate that loops forever on one input fails that one
TRACE_LINES = 8  # line events of the failing call kept for the critic
VALUE_CHARS = 80  # of each repr in the trace
VERDICTS_MARK = "__SANDLOT_CHECKS__"

HARNESS = """

# --- sandlot: the task's visible checks, each run on its own
def __sandlot_checks(cases, harness_line):
    import json, linecache, signal, sys

    def alarm(*_):
        raise TimeoutError("the check ran over {timeout_s} s")

    def same(got, want_src):
        try:
            want = eval(want_src, globals())
        except Exception:
            want = want_src  # not a Python value: compare with the printed result
        if got == want or (isinstance(want, str) and repr(got) == want):
            return True, want
        if isinstance(got, float) and isinstance(want, (int, float)):
            return abs(got - want) <= 1e-6 * max(1.0, abs(want)), want
        return False, want

    def short(value):
        text = repr(value)
        return text if len(text) <= {value_chars} else text[: {value_chars} - 3] + "..."

    def trace(call):
        lines = []

        def tracer(frame, event, arg):
            # Only the candidate's own code: lines above the harness, in this file.
            code = frame.f_code
            if code.co_filename != __file__ or code.co_firstlineno >= harness_line:
                return None
            if event in ("line", "return"):
                # The line's own text: its number in this file need not match the code the
                # critic is shown (a prompt's imports or signature may come first).
                text = linecache.getline(__file__, frame.f_lineno).strip()
                names = ", ".join(
                    "%s=%s" % (k, short(v)) for k, v in frame.f_locals.items()
                    if not k.startswith("__")
                )
                if event == "return":
                    lines.append("%s returns %s (%s)" % (code.co_name, short(arg), names))
                else:
                    lines.append("%s: `%s` with %s" % (code.co_name, text, names or "no locals"))
                del lines[: -{trace_lines}]
            return tracer

        signal.alarm({timeout_s})
        sys.settrace(tracer)
        try:
            eval(call, globals())
        except BaseException as exc:
            lines.append("raised %s: %s" % (type(exc).__name__, exc))
        finally:
            sys.settrace(None)
            signal.alarm(0)
        return lines[-{trace_lines}:]

    signal.signal(signal.SIGALRM, alarm)
    verdicts = []
    report = None
    for source, call, expected in cases:
        verdict = {{"ok": False, "actual": None}}
        signal.alarm({timeout_s})
        try:
            got = eval(call, globals())
            signal.alarm(0)
            verdict["actual"] = short(got)
            if expected is None:
                verdict["ok"] = bool(got)
                want = True
            else:
                verdict["ok"], want = same(got, expected)
        except BaseException as exc:
            signal.alarm(0)
            verdict["actual"] = "raised %s: %s" % (type(exc).__name__, exc)
            want = expected
        verdicts.append(verdict)
        if not verdict["ok"] and report is None:
            report = "check failed: %s\\n  actual:   %s\\n  expected: %s" % (
                source, verdict["actual"], short(want) if expected is not None else "a true value"
            )
            steps = trace(call)
            if steps:
                report += "\\n  last lines run (each before it ran), with the variables then:"
                report += "\\n    "
                report += "\\n    ".join(steps)
    print("{mark}" + json.dumps(verdicts))
    if report is not None:
        print(report, file=sys.stderr)
        raise SystemExit(1)


__sandlot_checks({cases!r}, {harness_line})
"""


def harness_program(candidate: str, checks: list[Check]) -> str:
    """The candidate module followed by the harness that runs ``checks`` on it."""
    body = candidate.rstrip("\n") + "\n"
    cases = [(c.source, c.call, c.expected) for c in checks]
    harness_line = body.count("\n") + 2  # the harness's first line, past the candidate's
    return body + HARNESS.format(
        cases=cases,
        harness_line=harness_line,
        timeout_s=CHECK_TIMEOUT_S,
        trace_lines=TRACE_LINES,
        value_chars=VALUE_CHARS,
        mark=VERDICTS_MARK,
    )


def verdicts(stdout: str, count: int) -> list[bool]:
    """Pass or fail per check from a harness run; all fail when it never got to print."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(VERDICTS_MARK):
            try:
                found = json.loads(line[len(VERDICTS_MARK) :])
            except ValueError:
                break
            if isinstance(found, list) and len(found) == count:
                return [bool(v.get("ok")) for v in found]
            break
    return [False] * count


def actual_values(stdout: str) -> tuple[str, ...]:
    """The values the candidate returned on each check: its behaviour, whatever the
    expectations; candidates that agree on it agree on the task."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(VERDICTS_MARK):
            try:
                return tuple(str(v.get("actual")) for v in json.loads(line[len(VERDICTS_MARK) :]))
            except (ValueError, AttributeError):
                return ()
    return ()


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
        for n in ast.walk(node)
    )


def _check_of(node: ast.Assert, entry_point: str) -> Check | None:
    if not _calls(node.test, entry_point):
        return None
    test = node.test
    source = f"assert {ast.unparse(test)}"
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and _calls(test.left, entry_point)
    ):
        return Check(
            source=source,
            call=ast.unparse(test.left),
            expected=ast.unparse(test.comparators[0]),
            origin="generated",
        )
    return Check(source=source, call=ast.unparse(test), origin="generated")


def parse_generated(code: str, entry_point: str, limit: int) -> list[Check]:
    """The asserts of ``code`` (the model's reply, out of its fence) that call
    ``entry_point``, at most ``limit``; code that does not parse whole is read line by line."""
    try:
        nodes = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)]
    except SyntaxError:
        nodes = []
        for line in code.splitlines():
            try:
                tree = ast.parse(line.strip())
            except SyntaxError:
                continue
            nodes += [n for n in tree.body if isinstance(n, ast.Assert)]
    found: dict[str, Check] = {}
    for node in nodes:
        check = _check_of(node, entry_point)
        if check is not None and check.source not in found:
            found[check.source] = check
    return list(found.values())[:limit]


def tests_prompt(spec: TaskSpec, count: int) -> str:
    return (
        f"Task:\n```python\n{spec.prompt or spec.task}\n```\n\n"
        f"Do not write the function. Write {count} assert statements that test "
        f"`{spec.entry_point}`: each calls it with concrete arguments and compares the result "
        "with the exact expected value (`assert f(...) == value`). Cover the examples' kind of "
        "input and edge cases (empty, zero, one element, negative). Work each expected value "
        "out carefully from the description. Reply with the asserts only, one per line, in "
        "one ```python block."
    )


@dataclass
class Agreement:
    """The candidate chosen, each candidate's score, and the written checks that survive."""

    best: int = 0  # index of the chosen candidate
    scores: list[tuple[int, int, int]] = field(default_factory=list)  # per candidate
    kept: list[int] = field(default_factory=list)  # indices into the checks
    dropped: list[int] = field(default_factory=list)


def dual_agreement(
    checks: list[Check],
    passes: list[list[bool]],
    weights: list[int],
    behaviours: list[tuple[str, ...]],
) -> Agreement:
    """CodeT's dual agreement, with the prompt's examples trusted.

    ``passes[c][t]``: candidate c passed check t; ``weights[c]``: how many samples wrote
    candidate c (candidates come in sample order). Each candidate scores, in this order:
    the examples it passes; CodeT's consensus, the samples that pass exactly the same
    written tests times how many those are (so a test only wrong code passes earns little);
    and the samples that returned the same values on every check (agreement on behaviour,
    whatever the expectations). The best score wins, the earliest sample among equals.

    A written test that most samples fail while most samples return one and the same value
    for its input is taken for the model's wrong expectation, and dropped unless the chosen
    candidate passes it: the samples agree on an answer the test does not. (Samples that all
    fail in different ways say nothing against the test; with one sample nothing is
    dropped.)
    """
    generated = [t for t, c in enumerate(checks) if c.origin == "generated"]
    signature = [tuple(row[t] for t in generated) for row in passes]
    result = Agreement()
    for c, row in enumerate(passes):
        examples = sum(1 for t, check in enumerate(checks) if check.origin == "example" and row[t])
        consensus = sum(w for w, sig in zip(weights, signature, strict=True) if sig == signature[c])
        written = sum(signature[c])
        behaviour = behaviours[c]
        same = sum(w for w, b in zip(weights, behaviours, strict=True) if b and b == behaviour)
        result.scores.append((examples, consensus * written, same))
    result.best = max(range(len(passes)), key=lambda c: (result.scores[c], -c)) if passes else 0
    for t, check in enumerate(checks):
        suspect = check.origin == "generated" and _contradicted(t, passes, weights, behaviours)
        if suspect and not passes[result.best][t]:
            result.dropped.append(t)
        else:
            result.kept.append(t)
    return result


def _contradicted(
    t: int, passes: list[list[bool]], weights: list[int], behaviours: list[tuple[str, ...]]
) -> bool:
    samples = sum(weights)
    if samples < 2:
        return False
    failing = sum(w for w, row in zip(weights, passes, strict=True) if not row[t])
    votes: dict[str, int] = {}
    for w, behaviour in zip(weights, behaviours, strict=True):
        # A crash is no answer to agree on.
        if len(behaviour) > t and not behaviour[t].startswith("raised "):
            votes[behaviour[t]] = votes.get(behaviour[t], 0) + w
    agreed = max(votes.values(), default=0)
    return failing * 2 > samples and agreed * 2 > samples
