"""What a tool call costs over the same command run directly (issue-free: the tool system of
seeds 001 and 003). One sandbox, alternated rounds: ``sb.run_tool("search_files", ...)``
against ``sb.commands.run`` of the argv it builds, in the same shell session; median and p95
per call, and their ratio. Embedded manager, bubblewrap by default.

    .venv/bin/python bench/bench_tools.py --rounds 5 --calls 40
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

from sandlot import Sandbox
from sandlot.tools import TOOL_SESSION, ToolRegistry, ToolValidator


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    tool = ToolRegistry.load(plugins=False).get("search_files")
    arguments = {"pattern": "needle"}
    command = tool.request(ToolValidator.arguments(tool, arguments), None).command
    assert shlex.split(command)[0] == "grep"
    timings: dict[str, list[float]] = {"tool": [], "command": []}
    with Sandbox.create() as sb:
        sb.files.write("hay/a.txt", "x\nneedle\n" * 100)
        sb.run_tool("search_files", arguments)  # the session starts once
        for _ in range(args.rounds):
            for name in ("tool", "command"):
                for _ in range(args.calls):
                    started = time.perf_counter()
                    if name == "tool":
                        result = sb.run_tool("search_files", arguments)
                    else:
                        result = sb.commands.run(command, session=TOOL_SESSION)
                    timings[name].append((time.perf_counter() - started) * 1000)
                    assert result.exit_code == 0
    for name, values in timings.items():
        print(
            f"{name:8} n={len(values)} median {statistics.median(values):.2f} ms "
            f"p95 {_p95(values):.2f} ms"
        )
    ratio = statistics.median(timings["tool"]) / statistics.median(timings["command"])
    print(f"tool / command (median): {ratio:.3f}")


if __name__ == "__main__":
    main()
