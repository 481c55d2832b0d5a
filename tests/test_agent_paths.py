"""bench/agent_paths.py: a sample-and-select run split by early stop's path, and the replay of
the rule that stops at a disagreeing probe, on rows made up to the benchmark's shape."""

from __future__ import annotations

from typing import Any

from bench.agent_paths import path_of, replay_stop_at_probe, report, rerun


def row(
    task: str,
    single: bool,
    chosen: bool,
    log: list[tuple[int, int, str, bool]],
    *,
    tokens: int,
    path: str | None = None,
    examples: int = 1,
) -> dict[str, Any]:
    """``log``: (sample, tokens, verdicts, hidden) per distinct candidate."""
    return {
        "task_id": task,
        "single_pass": single,
        "loop_pass": chosen,
        "single_tokens": 100,
        "loop_tokens": tokens,
        "sample_path": path,
        "candidate_log": [
            {
                "sample": sample,
                "copies": 1,
                "tokens": spent,
                "examples": examples,
                "passed": passed,
                "hidden": hidden,
                "selected": False,
            }
            for sample, spent, passed, hidden in log
        ],
    }


ROWS = [
    row("t/1", True, True, [(0, 100, "111", True)], tokens=200),
    # Old rows carry no path: guessed from the samples drawn and the first's verdicts.
    row("t/2", True, True, [(0, 100, "110", True), (1, 100, "100", False)], tokens=300),
    row(
        "t/3",
        False,
        True,
        [(0, 100, "011", False), (1, 100, "111", True), (2, 50, "111", True)],
        tokens=350,
    ),
    # Disagreeing probe, all drawn: the replay keeps the first (more checks passed).
    row(
        "t/4",
        True,
        True,
        [(0, 100, "110", True), (1, 100, "101", False), (2, 60, "111", True)],
        tokens=460,
        path="probe disagreed",
    ),
]


def test_paths_recorded_or_guessed() -> None:
    assert [path_of(r) for r in ROWS] == [
        "first passed",
        "probe agreed",  # two drawn, the first passed its example
        "first failed",  # its example failed
        "probe disagreed",
    ]
    table = report(ROWS, no_example=set())
    assert "| probe disagreed | 1 | 1 | 1 | 1 | 460 | 460 |" in table
    assert "Fixed (1): t/3" in table and "Lost (0): -" in table
    # 4 solved at 1,310 tokens against 3 at 400: (1310 / 4) / (400 / 3)
    assert "2.46x" in table
    subset = report(ROWS, no_example={"t/1"}, subsets={"earlier words only": {"t/3", "t/4"}})
    assert "| no parsed example (words only) | 1 | 1 | 1 | 1 | 200 | 200 |" in subset
    assert "| earlier words only | 2 | 1 | 2 | 2 | 405 | 810 |" in subset


def test_replay_stops_at_the_probe() -> None:
    replayed = replay_stop_at_probe(ROWS)
    # t/4 costs 400 instead of 460 and is still solved: (1250 / 4) / (400 / 3)
    assert "1 tasks change" in replayed and "4 solved" in replayed and "2.34x" in replayed
    assert report([], no_example=set()).startswith("No row has a candidate log")
    assert replay_stop_at_probe([]) == "Nothing to replay.\n"


def test_a_rerun_replaces_the_tasks_it_ran_again() -> None:
    later = row("t/2", True, False, [(0, 100, "000", False)], tokens=100)
    rows = rerun(ROWS, [later])
    assert [r["task_id"] for r in rows] == ["t/1", "t/2", "t/3", "t/4"]
    assert rows[1] is later and rows[0] is ROWS[0]
