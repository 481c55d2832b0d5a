"""What each wall of a bubblewrap sandbox costs the machine, start to end, by itself.

Runs ``--starts`` processes per variant, in rounds that alternate the variants, and prints the
whole machine's busy CPU per start (``/proc/stat``: every process and kernel thread, so a
network namespace's teardown in a kworker counts) and the wall time per start, the median over
rounds. The variants add one wall at a time to a bare ``/bin/true``: bwrap with no namespace,
the user and pid namespaces, ipc, uts and cgroup, the network namespace, then the guest's
interpreter (``python3 -I -S``) and the floor's (``python3 -c pass``), and bwrap's own
read-only binds over ``/proc`` entries (the manager makes its masks with the mount API
instead: bwrap re-reads the mount table for each bind). Design input for issue 13, not a
benchmark of sandlot itself: no manager, cgroup, disk or guest runs here.

Usage::

    .venv/bin/python bench/profile_walls.py [--starts 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

PYTHON = "/usr/bin/python3"
BWRAP = [
    "bwrap",
    "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64",
    "--symlink", "usr/bin", "/bin",
    "--proc", "/proc",
    "--dev", "/dev",
    "--die-with-parent",
]  # fmt: skip
NAMESPACES = ["--unshare-user", "--unshare-pid"]
MORE_NAMESPACES = [*NAMESPACES, "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
# Entries of /proc that exist on most hosts (procfs.py's masks hide more).
MASKED = ("cmdline", "kallsyms", "modules", "timer_list", "vmstat", "zoneinfo", "buddyinfo",
          "slabinfo", "diskstats", "partitions", "swaps", "interrupts", "softirqs", "locks",
          "keys", "key-users", "cgroups", "iomem", "ioports", "dma", "consoles", "kcore",
          "kpagecount", "kpageflags")  # fmt: skip


def binds(count: int) -> list[str]:
    present = [name for name in MASKED if Path("/proc", name).exists()]
    chosen = (present * (count // len(present) + 1))[:count]
    return [arg for name in chosen for arg in ("--ro-bind", "/dev/null", f"/proc/{name}")]


def variants() -> dict[str, list[str]]:
    guest = [PYTHON, "-I", "-S", "-c", "pass"]
    return {
        "`/bin/true` (no bwrap)": ["/bin/true"],
        "`python3 -I -S -c pass` (the guest's interpreter)": guest,
        "`python3 -c pass` (the floor's interpreter)": [PYTHON, "-c", "pass"],
        "bwrap, no namespace, `/bin/true`": [*BWRAP, "/bin/true"],
        "+ user and pid namespaces": [*BWRAP, *NAMESPACES, "/bin/true"],
        "+ ipc, uts and cgroup namespaces": [*BWRAP, *MORE_NAMESPACES, "/bin/true"],
        "+ network namespace (`--unshare-all`)": [*BWRAP, "--unshare-all", "/bin/true"],
        "`--unshare-all`, `python3 -I -S -c pass`": [*BWRAP, "--unshare-all", *guest],
        "`--unshare-all` + 24 bwrap binds over /proc": [
            *BWRAP, "--unshare-all", *binds(24), "/bin/true"
        ],
        "`--unshare-all` + 48 bwrap binds over /proc": [
            *BWRAP, "--unshare-all", *binds(48), "/bin/true"
        ],
    }  # fmt: skip


def busy_s() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait


def measure(argv: list[str], starts: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per start of ``argv``."""
    subprocess.run(argv, check=True)
    time.sleep(0.3)
    busy_before, started = busy_s(), time.perf_counter()
    for _ in range(starts):
        subprocess.run(argv, check=True)
    wall_ms = (time.perf_counter() - started) * 1000 / starts
    time.sleep(1.0)  # the kernel's deferred teardowns (network namespaces) land in the window
    return (busy_s() - busy_before) * 1000 / starts, wall_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    chosen = variants()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in chosen}
    for round_number in range(args.rounds):
        order = list(chosen) if round_number % 2 == 0 else list(reversed(chosen))
        for name in order:
            results[name].append(measure(chosen[name], args.starts))
    print(f"{args.starts} starts per variant, {args.rounds} rounds, medians (each round):\n")
    print("| variant | CPU ms per start, whole machine | wall ms per start |")
    print("|---|---|---|")
    for name, rows in results.items():
        cpu = [row[0] for row in rows]
        wall = [row[1] for row in rows]
        each_cpu = ", ".join(f"{c:.1f}" for c in cpu)
        print(f"| {name} | **{statistics.median(cpu):.1f}** ({each_cpu}) | "
              f"{statistics.median(wall):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
