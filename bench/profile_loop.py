"""How much of a lifecycle the manager's event loop thread spends on CPU, at a concurrency.

With many workers a manager is bound by its one process (its event loop and worker threads
share one GIL), not by the cores. This runs ``--lifecycles`` cycles of ``create()``,
``run_code(--code)``, ``destroy()`` from ``--concurrency`` tasks at once in one manager and
prints, per lifecycle: wall, CPU of the loop's thread (``time.thread_time``), CPU of the whole
process (every thread), the rate, the own CPU of its long-lived helpers (the guest templates,
which fork for every create), the CPU of the children it reaped (the launchers, bwrap) and
of the sandboxes' cgroups, and the whole
machine's busy CPU (``/proc/stat``: kernel workers too, and whatever else runs, so only on a
quiet machine). Reaped children and the cgroups overlap where a reaped child ran in a
sandbox's cgroup: the sum of the four bounds the issue's "CPU per lifecycle" from above, short
of the kernel's own work for them (a network namespace's teardown). With ``--profile``,
cProfile's top functions by own time (Python 3.11: the loop's thread only; 3.12: every
thread); cProfile slows Python code down, so read the ranks, not the absolute times.

Usage::

    .venv/bin/python bench/profile_loop.py [--lifecycles 200] [--concurrency 16]
                                           [--profile [--top 40] [--dump FILE]]
                                           [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.` imports

from bench.bench_core import LOOPS, run_on  # noqa: E402
from bench.bench_throughput import _cgroup_usage_s, helpers_cpu_s, helpers_delta_s  # noqa: E402
from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402


async def run(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="sandlot-loop-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    settings = Settings(
        data_dir=root / "data", uid_base=args.uid_base, cgroup_root=args.cgroup_root
    )
    try:
        async with SandboxManager(settings) as manager:

            async def lifecycle() -> None:
                info = await manager.create(SandboxSpec(environment=args.environment))
                await manager.run_code(info.id, RunCode(code=args.code))
                await manager.destroy(info.id)

            for _ in range(3):  # warm: the template, the volume template, imports
                await lifecycle()
            left = args.lifecycles

            async def worker() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await lifecycle()

            profile = cProfile.Profile() if args.profile else None
            thread0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
            children0, cgroup0 = _children_s(), _cgroup_usage_s([manager])
            helpers0, machine0 = helpers_cpu_s(), _machine_busy_s()
            if profile is not None:
                profile.enable()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            # A destroy returns before its cleanup ends: the last ones' is charged here too.
            await manager.settle()
            if profile is not None:
                profile.disable()
            thread1, process1, wall1 = time.thread_time(), time.process_time(), time.perf_counter()
            children1, cgroup1 = _children_s(), _cgroup_usage_s([manager])
            helpers_s = helpers_delta_s(helpers0, helpers_cpu_s())
            machine_s = _machine_busy_s() - machine0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = args.lifecycles
    print(
        f"{n} lifecycles, {args.concurrency} at a time: wall {1000 * (wall1 - wall0) / n:.1f} ms"
        f" each, loop thread CPU {1000 * (thread1 - thread0) / n:.1f} ms, process CPU"
        f" {1000 * (process1 - process0) / n:.1f} ms, {n / (wall1 - wall0):.1f} lifecycles/s;"
        f" CPU of its helpers (templates) {1000 * helpers_s / n:.1f} ms,"
        f" of reaped children {1000 * (children1 - children0) / n:.1f} ms, of the"
        f" sandboxes' cgroups {1000 * (cgroup1 - cgroup0) / n:.1f} ms; whole machine"
        f" {1000 * machine_s / n:.1f} ms" + (" (under cProfile)" if profile is not None else "")
    )
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
        if args.dump is not None:
            profile.dump_stats(args.dump)


def _machine_busy_s() -> float:
    """CPU seconds every core has spent busy since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _children_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lifecycles", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--code", default="1")
    parser.add_argument("--environment", default="python3", help="a registry environment")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--dump", type=Path, help="with --profile: also write the raw stats here")
    # Two at once (one manager each, to compare with one manager at twice the concurrency)
    # need their own uid ranges and cgroup roots, or each sweeps the other's sandboxes.
    parser.add_argument("--uid-base", type=int, default=280_000)
    parser.add_argument("--cgroup-root", default="sandlot-profile-loop")
    parser.add_argument("--loop", choices=LOOPS, default="asyncio")
    args = parser.parse_args()
    run_on(args.loop, run(args))


if __name__ == "__main__":
    main()
