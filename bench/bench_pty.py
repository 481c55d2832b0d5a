"""Terminal benchmark: what a pty costs against a background command in the same sandbox.

Method. One sandbox (bubblewrap unless ``--backend``), the two series interleaved round by
round (the order alternates) so that a shared machine's load falls on both alike:

* start: from the call to the first output byte on the host's callback, of
  ``pty.create(cmd="echo ready")`` against ``commands.run("echo ready", background=True)``
  (the baseline: the same exec machinery without a terminal);
* stream: wall seconds for ``--megabytes`` MB of output (``head -c N /dev/zero | tr``) to
  reach the host through the terminal (raw bytes, base64 frames) against through a background
  command's stdout (text frames), from the call to ``wait()`` returning.

Reported: median and p95 per series, and the pty/baseline ratio of the medians.

Usage::

    .venv/bin/python bench/bench_pty.py [--rounds 15] [--megabytes 20] [--backend bubblewrap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.` imports

from bench.bench_core import percentile  # noqa: E402
from sandlot import Sandbox, SandboxManager, Settings  # noqa: E402
from sandlot._portal import get_portal  # noqa: E402


def _first_output_s(start: Callable[[Callable[[object], None]], object]) -> float:
    arrived = threading.Event()
    began = time.perf_counter()
    handle = start(lambda chunk: arrived.set())
    if not arrived.wait(60):
        raise SystemExit("no output within 60 s")
    elapsed = time.perf_counter() - began
    handle.wait(timeout_s=30)  # type: ignore[attr-defined]
    return elapsed


def _stream_s(start: Callable[[], object]) -> float:
    began = time.perf_counter()
    result = start().wait(timeout_s=600)  # type: ignore[attr-defined]
    if result.exit_code != 0:
        raise SystemExit(f"the flood failed: {result}")
    return time.perf_counter() - began


def _row(name: str, pty: list[float], base: list[float], unit: str, scale: float) -> str:
    p, b = statistics.median(pty), statistics.median(base)
    return (
        f"| {name} | {p * scale:.1f} | {percentile(pty, 95) * scale:.1f} | {b * scale:.1f} | "
        f"{percentile(base, 95) * scale:.1f} | {p / b:.2f} | {unit} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--megabytes", type=int, default=20)
    parser.add_argument("--backend", default="bubblewrap")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="sandlot-bench-pty-"))
    data_dir.chmod(0o711)
    settings = Settings(_env_file=None, data_dir=data_dir, log_level="WARNING")  # type: ignore[call-arg]
    manager = SandboxManager(settings)
    portal = get_portal()
    portal.call(manager.start())
    flood = f"head -c {args.megabytes * 1_000_000} /dev/zero | tr '\\0' x"
    series: dict[str, list[float]] = {k: [] for k in ("pty", "cmd", "pty_mb", "cmd_mb")}
    try:
        with Sandbox.create(manager=manager, backend=args.backend, timeout_s=600) as sb:
            runs: dict[str, Callable[[], float]] = {
                "pty": lambda: _first_output_s(
                    lambda cb: sb.pty.create(cmd="echo ready", on_data=cb)
                ),
                "cmd": lambda: _first_output_s(
                    lambda cb: sb.commands.run("echo ready", background=True, on_stdout=cb)
                ),
                "pty_mb": lambda: _stream_s(lambda: sb.pty.create(cmd=flood)),
                "cmd_mb": lambda: _stream_s(lambda: sb.commands.run(flood, background=True)),
            }
            for round_no in range(args.rounds):
                order = list(runs) if round_no % 2 == 0 else list(reversed(runs))
                for name in order:
                    if name.endswith("_mb") and round_no >= max(3, args.rounds // 3):
                        continue  # floods are long: a third of the rounds, at least 3
                    series[name].append(runs[name]())
    finally:
        portal.call(manager.close())
    print(f"backend {args.backend}, {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    print("| series | pty p50 | pty p95 | command p50 | command p95 | ratio | unit |")
    print("|---|---|---|---|---|---|---|")
    print(_row("first output", series["pty"], series["cmd"], "ms", 1000.0))
    print(_row(f"{args.megabytes} MB out", series["pty_mb"], series["cmd_mb"], "s", 1.0))


if __name__ == "__main__":
    main()
