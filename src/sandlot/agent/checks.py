"""Visible checks of a function task: the prompt's examples, the tests the model writes, and
the harness that runs them in the sandbox.

The harness runs each check on its own (one failing or hanging check does not hide the
others), prints one JSON line of verdicts for selection, and for the first failure writes to
stderr what a critic needs (LDB-style): the assert, the actual and the expected value, and
the last lines the candidate executed with its variables there, recorded by ``sys.settrace``
in the sandbox while the failing call is re-run.

The verdicts are advisory. The candidate runs in the harness's own process, before it, so
code that sets out to can still fool it (it may read the program file, marker included);
what is cheap to stop is stopped: the harness holds the builtins, ``json.dumps`` and the
real stdout as they were before the candidate ran, the verdict line carries a marker made
on the host for this run, exactly one such line is accepted, and only when the run's exit
code agrees with it. Hidden tests, run by the scorer, are the only authority.
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from sandlot.agent.models import Check, Execution, TaskSpec

CHECK_TIMEOUT_S = 2.0  # per check at most: a candidate that loops forever on one input fails it
RUN_TIMEOUT_S = 5.0  # the sandbox's default per-call timeout, when the caller sets none
TRACE_LINES = 8  # line events of the failing call kept for the critic
VALUE_CHARS = 80  # of each repr in the verdicts and the trace
VERDICTS_MARK = "__SANDLOT_CHECKS_"

# One comparison, formatted into both the checks' harness and code.py's examples runner:
# a check's expected value is Python source, or else the printed result.
SAME = """
def _sandlot_same(got, want_src, namespace, _b):
    try:
        want = _b.eval(want_src, namespace)
    except _b.Exception:
        want = want_src  # not a Python value: compare with the printed result
    if got == want or (_b.isinstance(want, _b.str) and _b.repr(got) == want):
        return True, want
    if _b.isinstance(got, _b.float) and _b.isinstance(want, (_b.int, _b.float)):
        return _b.abs(got - want) <= 1e-6 * _b.max(1.0, _b.abs(want)), want
    return False, want
"""

# Before the candidate: what the harness needs, taken while it is still the real thing (a
# candidate may define its own print or eval, or patch json.dumps or sys.stdout).
PROLOGUE = (
    "import builtins as __sandlot_b, json as __sandlot_j, os as __sandlot_o, "
    "signal as __sandlot_s, sys as __sandlot_y\n"
    "__sandlot_keep = (__sandlot_b, __sandlot_j.dumps, __sandlot_o.write, __sandlot_y.stdout, "
    "__sandlot_y.settrace, __sandlot_s.signal, __sandlot_s.setitimer, __sandlot_s.ITIMER_REAL, "
    "__sandlot_s.SIGALRM)\n"
)

HARNESS = """

# --- sandlot: the task's visible checks, each run on its own
{same}

def __sandlot_checks(keep, cases, harness_line, check_s, mark):
    _b, dumps, write, stdout, settrace, on_signal, setitimer, timer, sigalrm = keep
    import linecache
    namespace = _b.globals()

    def alarm(*_):
        raise _b.TimeoutError("the check ran over %s s" % check_s)

    def cap(text):
        return text if _b.len(text) <= {value_chars} else text[: {value_chars} - 3] + "..."

    def short(value):
        return cap(_b.repr(value))

    def raised(exc):
        try:
            return cap("raised %s: %s" % (_b.type(exc).__name__, exc))
        except _b.BaseException:  # its text is the candidate's code too, and may not end
            return "raised %s" % _b.type(exc).__name__

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

        setitimer(timer, check_s)
        settrace(tracer)
        try:
            _b.eval(call, namespace)
        except _b.BaseException as exc:
            lines.append(raised(exc))
        finally:
            settrace(None)
            setitimer(timer, 0)
        return lines[-{trace_lines}:]

    on_signal(sigalrm, alarm)
    verdicts = []
    failed = None
    for source, call, expected in cases:
        verdict = {{"ok": False, "actual": None}}
        wanted = "a true value" if expected is None else expected
        # The alarm covers the whole case: the expected value's eval and the candidate's
        # __eq__, __repr__ and __bool__ are code that may not end either.
        setitimer(timer, check_s)
        try:
            try:
                got = _b.eval(call, namespace)
                verdict["actual"] = short(got)
                if expected is None:
                    ok = _b.bool(got)
                else:
                    same, want = _sandlot_same(got, expected, namespace, _b)
                    ok, wanted = _b.bool(same), short(want)
                verdict["ok"] = ok
            except _b.BaseException as exc:
                verdict["actual"] = raised(exc)
        except _b.BaseException as exc:  # the alarm, between the lines above
            verdict["ok"], verdict["actual"] = False, raised(exc)
        finally:
            setitimer(timer, 0)
        verdicts.append(verdict)
        if not verdict["ok"] and failed is None:
            failed = (source, call, verdict["actual"], wanted)
    try:
        stdout.flush()  # what the candidate printed comes before the verdicts, not after
    except _b.BaseException:
        pass
    line = ("\\n" + mark + dumps(verdicts) + "\\n").encode()
    while line:
        line = line[write(1, line):]
    if failed is None:
        return
    source, call, actual, wanted = failed
    report = "check failed: %s\\n  actual:   %s\\n  expected: %s" % (source, actual, wanted)
    # Traced only now: the verdicts are out whatever the re-run does.
    steps = trace(call)
    if steps:
        report += "\\n  last lines run (each before it ran), with the variables then:"
        report += "\\n    "
        report += "\\n    ".join(steps)
    report = (report + "\\n").encode("utf-8", "replace")
    while report:
        report = report[write(2, report):]
    raise _b.SystemExit(1)


__sandlot_checks(__sandlot_keep, {cases!r}, {harness_line}, {check_s!r}, {mark!r})
"""


def new_marker() -> str:
    """A verdict marker for one run, made on the host: the candidate cannot guess it, but
    it runs in the same process as the checks, so code that reads its own program can learn
    it (the checks are advisory; the hidden tests' judge, bench/judge.py, is the wall)."""
    return f"{VERDICTS_MARK}{secrets.token_hex(8)}__"


def check_timeout_s(run_timeout_s: float | None, count: int) -> float:
    """Each check's alarm, so that all of them and the trace fit in the run's timeout (with
    one share left for the interpreter's start) and the verdict line gets out."""
    budget_s = run_timeout_s if run_timeout_s is not None else RUN_TIMEOUT_S
    return max(0.05, min(CHECK_TIMEOUT_S, budget_s / (count + 2)))


def _split_future(body: str) -> tuple[str, str]:
    """``from __future__`` imports must open the module: they go above the prologue."""
    future: list[str] = []
    rest: list[str] = []
    for line in body.splitlines(keepends=True):
        (future if line.startswith("from __future__ import") else rest).append(line)
    return "".join(future), "".join(rest)


def harness_program(
    candidate: str,
    checks: list[Check],
    *,
    marker: str | None = None,
    run_timeout_s: float | None = None,
) -> str:
    """The candidate module followed by the harness that runs ``checks`` on it; the verdict
    line starts with ``marker`` (read it back with :func:`verdicts`)."""
    future, body = _split_future(candidate.rstrip("\n") + "\n")
    head = future + PROLOGUE + body
    cases = [(c.source, c.call, c.expected) for c in checks]
    harness_line = head.count("\n") + 2  # the harness's first line, past the candidate's
    return head + HARNESS.format(
        same=SAME.strip("\n"),
        cases=cases,
        harness_line=harness_line,
        check_s=check_timeout_s(run_timeout_s, len(checks)),
        trace_lines=TRACE_LINES,
        value_chars=VALUE_CHARS,
        mark=marker or new_marker(),
    )


def _verdict_line(execution: Execution, count: int, marker: str) -> list[dict[str, Any]] | None:
    """The run's verdicts, or None when they cannot be believed: no line or more than one
    with the marker, not ``count`` well-formed verdicts, a kill, or an exit code that says
    otherwise (0 when all pass, else 1)."""
    if execution.kill_reason is not None:
        return None
    lines = [line for line in execution.stdout.splitlines() if line.startswith(marker)]
    if len(lines) != 1:
        return None
    try:
        found = json.loads(lines[0][len(marker) :])
    except ValueError:
        return None
    if not isinstance(found, list) or len(found) != count:
        return None
    for verdict in found:
        if not (
            isinstance(verdict, dict)
            and isinstance(verdict.get("ok"), bool)
            and isinstance(verdict.get("actual"), str | None)
        ):
            return None
    expected_exit = 0 if all(v["ok"] for v in found) else 1
    return found if execution.exit_code == expected_exit else None


def verdicts(execution: Execution, count: int, marker: str) -> list[bool]:
    """Pass or fail per check from a harness run; all fail when its verdicts cannot be
    believed (see :func:`_verdict_line`)."""
    found = _verdict_line(execution, count, marker)
    return [bool(v["ok"]) for v in found] if found is not None else [False] * count


NOT_RUN = (
    "the program ended before its checks ran: do not exit the program or call sys.exit at "
    "module level or under `if __name__ == '__main__':`"
)
NOT_READ = (
    "the program exited 0 but its checks' verdicts could not be read back: do not exit the "
    "program, close or replace stdout, or print lines like the checks' own"
)


def judged(execution: Execution, count: int, marker: str | None) -> Execution:
    """A harness run as the loop and the swarm count it (selection's rule): passed only when
    its believed verdict line says every check passed and it exited 0. A run that exited 0
    without that is failed, its ``error`` saying why: code that ends the process early (an
    ``os._exit(0)``, or ``sys.exit(0)`` in a ``__main__`` block, which runs, since the program
    runs as ``__main__``) runs no check. ``marker`` None: the run's marker is not known (it was
    judged elsewhere), so nothing it printed is believed."""
    if not execution.ok or execution.exit_code != 0:
        return execution  # already a failure, its own report says why
    found = _verdict_line(execution, count, marker) if marker is not None else None
    if found is not None and all(v["ok"] for v in found):
        return execution
    prefix = marker or VERDICTS_MARK
    marked = any(line.startswith(prefix) for line in execution.stdout.splitlines())
    return execution.model_copy(update={"ok": False, "error": NOT_READ if marked else NOT_RUN})


def actual_values(execution: Execution, count: int, marker: str) -> tuple[str, ...]:
    """The values the candidate returned on each check: its behaviour, whatever the
    expectations; candidates that agree on it agree on the task."""
    found = _verdict_line(execution, count, marker)
    return tuple(str(v["actual"]) for v in found) if found is not None else ()


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
