"""The benchmark's table (Markdown) and charts (PNG, matplotlib)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandlot.agent.bench.runner import BenchConfig, TaskOutcome

DIFFICULTIES = ("easy", "medium", "hard")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _per_solved(values: Sequence[float], solved: int) -> str:
    return f"{sum(values) / solved:,.0f}" if solved else "-"


def _ratio(group: Sequence[TaskOutcome], single: str, strategy: str) -> str:
    """The strategy's tokens per solved task over single shot's, where both were counted."""
    counted = [o for o in group if getattr(o, single) is not None and getattr(o, strategy)]
    base_solved = sum(o.single_pass for o in counted)
    solved = sum(o.loop_pass for o in counted)
    if not (counted and base_solved and solved):
        return "-"
    base = sum(getattr(o, single) for o in counted) / base_solved
    spent = sum(getattr(o, strategy) for o in counted) / solved
    return f"{spent / base:.2f}x" if base else "-"


def _label(outcomes: Sequence[TaskOutcome]) -> str:
    strategy = outcomes[0].strategy if outcomes else "reflexion"
    # The single-shot columns are always there: a strategy's own need other names.
    return {"reflexion": "loop", "single": "single run"}.get(strategy, strategy)


def summary_rows(outcomes: Sequence[TaskOutcome]) -> list[dict[str, str]]:
    rows = []
    label = _label(outcomes)
    sampled = any(o.candidates for o in outcomes)
    groups = [("all", list(outcomes))] + [
        (d, [o for o in outcomes if o.difficulty == d]) for d in DIFFICULTIES
    ]
    for name, group in groups:
        if not group:
            continue
        single = sum(o.single_pass for o in group)
        loop = sum(o.loop_pass for o in group)
        row = {
            "tasks": f"{name} ({len(group)})",
            "single pass@1": f"{_pct(single, len(group))} ({single})",
            f"{label} pass@1": f"{_pct(loop, len(group))} ({loop})",
            "mean attempts": f"{statistics.mean(o.attempts for o in group):.2f}",
            "tokens / solved (single)": _per_solved([o.single_tokens for o in group], single),
            f"tokens / solved ({label})": _per_solved([o.loop_tokens for o in group], loop),
            "token ratio / solved": _ratio(group, "single_tokens", "loop_tokens"),
            f"sandbox s / solved ({label})": (
                f"{sum(o.loop_sandbox_s for o in group) / loop:.2f}" if loop else "-"
            ),
            f"model s / task ({label})": f"{statistics.mean(o.loop_llm_s for o in group):.1f}",
        }
        if sampled:
            runs = [o for o in group if o.candidates]
            row["candidates / task"] = f"{statistics.mean(o.candidates for o in group):.2f}"
            row["sandbox s / candidate"] = (
                f"{statistics.mean(o.candidate_sandbox_s for o in runs):.3f}" if runs else "-"
            )
            row["output-token ratio / solved"] = _ratio(
                group, "single_output_tokens", "loop_output_tokens"
            )
            # Selection's ceiling: a task where some candidate passes the hidden tests.
            logged = [o for o in group if o.candidate_log]
            right = sum(any(c.hidden for c in o.candidate_log) for o in logged)
            row["some candidate right"] = f"{_pct(right, len(logged))} ({right})" if logged else "-"
            row["written tests kept / dropped"] = (
                f"{sum(o.written_checks for o in group)} / {sum(o.dropped_checks for o in group)}"
            )
        rows.append(row)
    return rows


def markdown_table(outcomes: Sequence[TaskOutcome]) -> str:
    rows = summary_rows(outcomes)
    if not rows:
        return "(no results)\n"
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_report(
    outcomes: Sequence[TaskOutcome], config: BenchConfig, wall_s: float, command: str
) -> str:
    errors = sum(1 for o in outcomes if o.error)
    compared = [o.single_same_as_first for o in outcomes if o.single_same_as_first is not None]
    first = (
        " Single shot is scored on the strategy's first generation (its first sample, at "
        "the run's temperature)."
    )
    same = (
        f" Single shot ran on its own (--separate): its code equalled the loop's first "
        f"attempt in {sum(compared)} of {len(compared)} tasks."
        if compared
        else " Single shot is scored on the loop's first attempt (greedy decoding makes it the "
        "same generation; `--separate` runs it on its own and checks)."
        if config.strategy == "reflexion"
        else first
    )
    fixed = sum(1 for o in outcomes if o.loop_pass and not o.single_pass)
    broken = sum(1 for o in outcomes if o.single_pass and not o.loop_pass)
    label = _label(outcomes)
    sampling = (
        f"{config.samples} samples"
        + (
            " (the others only when the first fails a check, after one probe when it fails "
            "only written tests)"
            if config.early_stop
            else ""
        )
        + f", {config.generated_tests} written tests, "
        if config.strategy.startswith("sample_select")
        else ""
    )
    return (
        f"Task set `{config.task_set}`, strategy `{config.strategy}`, provider "
        f"`{config.provider}` model `{config.model}`, {sampling}"
        f"up to {config.max_attempts} attempts, temperature {config.temperature:g} "
        f"(retries {config.retry_temperature:g}), "
        f"{config.concurrency} worker(s); {len(outcomes)} tasks in {wall_s / 60:.1f} min "
        f"wall.\nCommand: `{command}`\n\n"
        + markdown_table(outcomes)
        + f"\nThe {label} fixed {fixed} task(s) the first generation failed and lost {broken} that "
        f"it passed (visible tests passed, hidden tests failed after a rewrite). "
        f"{errors} task(s) ended on a provider error.{same}\n"
    )


def write_charts(outcomes: Sequence[TaskOutcome], out_dir: Path, title: str) -> list[Path]:
    """Two PNGs: pass@1 by difficulty per mode, and tokens per solved task per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    groups = [d for d in DIFFICULTIES if any(o.difficulty == d for o in outcomes)] + ["all"]

    def members(group: str) -> list[TaskOutcome]:
        return list(outcomes) if group == "all" else [o for o in outcomes if o.difficulty == group]

    def rate(group: str, attr: str) -> float:
        m = members(group)
        return 100 * sum(getattr(o, attr) for o in m) / len(m) if m else 0.0

    def per_solved(group: str, tokens: str, passed: str) -> float:
        m = members(group)
        solved = sum(getattr(o, passed) for o in m)
        return sum(getattr(o, tokens) for o in m) / solved if solved else 0.0

    success = _paired_bars(
        plt,
        [f"{g}\n({len(members(g))})" for g in groups],
        [rate(g, "single_pass") for g in groups],
        [rate(g, "loop_pass") for g in groups],
        ylabel="pass@1 (%)",
        title=f"{title}: pass@1 by difficulty",
        path=out_dir / "benchmark_success_rate.png",
        label=_label(outcomes),
        percent=True,
    )
    cost = _paired_bars(
        plt,
        groups,
        [per_solved(g, "single_tokens", "single_pass") for g in groups],
        [per_solved(g, "loop_tokens", "loop_pass") for g in groups],
        ylabel="tokens per solved task",
        title=f"{title}: cost of a solved task",
        path=out_dir / "benchmark_tokens.png",
        label=_label(outcomes),
    )
    return [success, cost]


def _paired_bars(
    plt: Any,
    labels: list[str],
    single: list[float],
    loop: list[float],
    *,
    ylabel: str,
    title: str,
    path: Path,
    label: str,
    percent: bool = False,
) -> Path:
    """Single shot beside the strategy, one pair of bars a group; percentages are labelled."""
    xs = range(len(labels))
    width = 0.38
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - width / 2 for x in xs], single, width, label="single shot", color="#8da0cb")
    legend = "reflexion loop" if label == "loop" else label
    ax.bar([x + width / 2 for x in xs], loop, width, label=legend, color="#fc8d62")
    if percent:
        for x, s, lp in zip(xs, single, loop, strict=True):
            ax.text(x - width / 2, s + 1, f"{s:.0f}", ha="center", fontsize=8)
            ax.text(x + width / 2, lp + 1, f"{lp:.0f}", ha="center", fontsize=8)
        ax.set_ylim(0, 105)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
