"""Where sample-and-select's tokens and wins came from, read back from a benchmark's rows.

``sandlot benchmark --strategy sample_select`` writes one row a task with each distinct
candidate it ran (``candidate_log``: its verdict on every check, and whether it passes the
hidden tests). This splits the tasks by the path early stop took and reports, per path, the
tasks, how many the first (greedy) sample and the selection solved, and the tokens spent; then
selection's ceiling (tasks where some candidate was right), the tasks fixed and lost, and the
subset of tasks whose prompt holds no example the agent can parse (stated in words only:
there, only the tests the model writes can judge).

Usage (the rows of the issue-16 run)::

    .venv/bin/python bench/agent_paths.py ROWS [--tasks humaneval] [--replay-probe-stop]
        [--subset LABEL=OTHER_ROWS ...] [--rerun LATER_ROWS]

    ROWS: bench/results/agent/issue16-probe/humaneval-sample_select.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def path_of(row: dict[str, Any]) -> str:
    """Which way early stop went: as the run recorded it, or, for rows written before it
    did, guessed from the samples drawn."""
    if row.get("sample_path"):
        return str(row["sample_path"])
    drawn = sum(c["copies"] for c in row["candidate_log"])
    if drawn <= 1:
        return "first passed"
    first = next((c for c in row["candidate_log"] if c["sample"] == 0), None)
    passed_examples = first is not None and "0" not in first["passed"][: first["examples"]]
    # A probe runs only when the first passed its examples and some check at all.
    probed = passed_examples and first is not None and "1" in first["passed"]
    if drawn == 2 and probed:
        return "probe agreed"
    return "probe disagreed" if probed else "first failed"


def _line(name: str, rows: Sequence[dict[str, Any]]) -> str:
    greedy = sum(r["single_pass"] for r in rows)
    chosen = sum(r["loop_pass"] for r in rows)
    tokens = sum(r["loop_tokens"] for r in rows)
    ceiling = sum(any(c["hidden"] for c in r["candidate_log"]) for r in rows)
    per_task = f"{tokens / len(rows):,.0f}" if rows else "-"
    return f"| {name} | {len(rows)} | {greedy} | {chosen} | {ceiling} | {per_task} | {tokens:,} |"


def report(
    rows: list[dict[str, Any]],
    no_example: set[str],
    subsets: dict[str, set[str]] | None = None,
) -> str:
    logged = [r for r in rows if r.get("candidate_log")]
    if not logged:
        return "No row has a candidate log (a sample_select run of 2026-11-24 or later).\n"
    paths: dict[str, list[dict[str, Any]]] = {}
    for row in logged:
        paths.setdefault(path_of(row), []).append(row)
    lines = [
        "| path | tasks | first sample right | selection right | some candidate right | "
        "tokens / task | tokens |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_line(name, group) for name, group in sorted(paths.items())]
    lines.append(_line("all", logged))
    words = [r for r in logged if r["task_id"] in no_example]
    if words:
        lines.append(_line("no parsed example (words only)", words))
    for name, ids in (subsets or {}).items():
        lines.append(_line(name, [r for r in logged if r["task_id"] in ids]))
    single_tokens = sum(r["single_tokens"] for r in logged)
    single_solved = sum(r["single_pass"] for r in logged)
    solved = sum(r["loop_pass"] for r in logged)
    fixed = [r["task_id"] for r in logged if r["loop_pass"] and not r["single_pass"]]
    lost = [r["task_id"] for r in logged if r["single_pass"] and not r["loop_pass"]]
    ratio = (
        f"{(sum(r['loop_tokens'] for r in logged) / solved) / (single_tokens / single_solved):.2f}x"
        if solved and single_solved and single_tokens
        else "-"
    )
    lines += [
        "",
        f"Tokens per solved task against single shot's: {ratio} "
        f"({solved} solved against {single_solved}).",
        f"Fixed ({len(fixed)}): {', '.join(fixed) or '-'}",
        f"Lost ({len(lost)}): {', '.join(lost) or '-'}",
    ]
    return "\n".join(lines) + "\n"


def replay_stop_at_probe(rows: list[dict[str, Any]]) -> str:
    """What the run would have cost and solved had a disagreeing probe ended the sampling
    with the vote between the first sample and the probe (the rule that followed this run),
    replayed on the candidates it recorded. The vote between two that disagree drops no
    test: the one passing more examples, then more written tests, wins; the first on a tie.
    The tokens of later samples are taken off as logged; a later sample that repeated
    earlier code is not in the log, so its tokens stay counted (the replay errs high)."""
    logged = [r for r in rows if r.get("candidate_log")]
    single_tokens = sum(r["single_tokens"] for r in logged)
    single_solved = sum(r["single_pass"] for r in logged)
    spent = solved = changed = 0
    for row in logged:
        log = {c["sample"]: c for c in row["candidate_log"]}
        if path_of(row) != "probe disagreed" or 0 not in log or 1 not in log:
            spent += row["loop_tokens"]
            solved += row["loop_pass"]
            continue
        first, probe = log[0], log[1]
        examples = first["examples"]

        def score(c: dict[str, Any], examples: int = examples) -> tuple[int, int]:
            return c["passed"][:examples].count("1"), c["passed"][examples:].count("1")

        kept = probe if score(probe) > score(first) else first
        spent += row["loop_tokens"] - sum(c["tokens"] for n, c in log.items() if n >= 2)
        solved += kept["hidden"]
        changed += 1
    if not (solved and single_solved and single_tokens):
        return "Nothing to replay.\n"
    ratio = (spent / solved) / (single_tokens / single_solved)
    return (
        f"Replayed with a disagreeing probe ending the sampling ({changed} tasks change): "
        f"{solved} solved, {ratio:.2f}x single shot's tokens per solved task.\n"
    )


def _no_example(task_set: str) -> set[str]:
    if task_set != "humaneval":
        return set()
    from sandlot.agent.bench.tasks import humaneval_tasks

    return {t.task_id for t in humaneval_tasks() if not t.spec.checks}


def rerun(rows: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the tasks run ``again`` replaced by their later rows, in order."""
    later = {row["task_id"]: row for row in again}
    return [later.get(row["task_id"], row) for row in rows]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="a benchmark's <tasks>-<strategy>.jsonl")
    parser.add_argument("--tasks", default="humaneval", help="the task set the rows are of")
    parser.add_argument(
        "--replay-probe-stop",
        action="store_true",
        help="also replay the run as if a disagreeing probe had ended the sampling",
    )
    parser.add_argument(
        "--subset",
        action="append",
        default=[],
        metavar="LABEL=ROWS",
        help="also a line for the tasks of another run's rows (or a task file), e.g. the "
        "tasks an earlier reader found no example in",
    )
    parser.add_argument(
        "--rerun",
        type=Path,
        help="rows of a later run of some of the tasks, which replace theirs: the whole set "
        "as it would read with the tasks a change touched run again",
    )
    args = parser.parse_args()
    rows = _rows(args.rows)
    if args.rerun:
        rows = rerun(rows, _rows(args.rerun))
    subsets = {}
    for given in args.subset:
        label, _, path = given.partition("=")
        subsets[label] = {row["task_id"] for row in _rows(Path(path))}
    print(report(rows, _no_example(args.tasks), subsets), end="")
    if args.replay_probe_stop:
        print(replay_stop_at_probe(rows), end="")


if __name__ == "__main__":
    main()
