"""What a templated sandbox's bwrap costs, by part of its argv (issue 13's eighteenth pass).

Builds the argv a template's launcher execs (``argv.Argvs.bwrap``, the python3 environment's
tree if it is built, else the host's /usr) and runs bwrap with it, and with parts of it left
out or put back, in alternated rounds of ``--runs`` each: the whole argv; with the four
identity files bound over the tree's /etc (a tree built before it carried them), with
``--remount-ro /``, with both (the argv before the nineteenth pass); with ``--dir /dev`` for
``--dev`` (no device nodes, no devpts); without ``--unshare-net``; without the identity
binds (if any), ``--dev`` and the network namespace; and ``/bin/true`` (an exec's floor). Its
seccomp, info and block fds are left out (the child runs ``/bin/true`` at once), and it runs
as root in this process's mount namespace, not as the sandbox's uid in the launch namespace,
where fewer mounts make each bind's parse of the mount table cheaper. Prints, per variant,
the median over rounds of the CPU of the runs (``RUSAGE_CHILDREN``) and of the whole machine
(``/proc/stat``: the kernel's work for them too, such as a network namespace's teardown, and
anything else running: a quiet machine only). Root only.

Usage::

    .venv/bin/python bench/bwrap_parts.py [--runs 150] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.`

from sandlot import Settings
from sandlot.backends.base import GuestSpec
from sandlot.backends.bubblewrap.argv import Argvs
from sandlot.backends.bubblewrap.box import Box
from sandlot.backends.bubblewrap.rootless import NoCgroup
from sandlot.backends.launch import install_guest
from sandlot.backends.rootfs import find_tree
from sandlot.environments import get_environment

IDENTITY = ("passwd", "group", "hosts", "nsswitch.conf")
DROPPED_FDS = {"--seccomp", "--info-fd", "--block-fd"}


def template_argv(scratch: Path) -> list[str]:
    """A templated sandbox's bwrap argv, its files under ``scratch``."""
    etc, guest = scratch / "etc", scratch / "guest"
    etc.mkdir()
    for name in IDENTITY:
        (etc / name).write_text(f"# {name}\n")
    install_guest(guest)
    tree = find_tree(get_environment("python3"), Settings(_env_file=None).rootfs_dir)  # type: ignore[call-arg]
    box = Box("bench", scratch, scratch / "workspace", 65534, None, NoCgroup(), True, system=tree)
    spec = GuestSpec(sandbox_id="bench", limits=Any)  # type: ignore[arg-type]
    argvs = Argvs(etc, guest, rootless=False)
    return argvs.bwrap(box, spec, 3, 4, manager_mounts=True, templated=True)


def without(argv: list[str], *parts: str) -> list[str]:
    """``argv`` less its fds (see the docstring) and ``parts``: "identity", "dev", or a
    flag of its own."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in DROPPED_FDS:
            i += 2
        elif "identity" in parts and arg == "--ro-bind" and argv[i + 2].startswith("/etc/"):
            i += 3
        elif "dev" in parts and arg == "--dev":
            out += ["--dir", "/dev"]
            i += 2
        elif arg in parts:
            i += 1
        else:
            out.append(arg)
            i += 1
    return out


def with_identity(argv: list[str], etc: Path) -> list[str]:
    """``argv`` with the four identity files bound over the tree's /etc, as for a tree built
    before it carried them (``rootfs.carries_identity``)."""
    if any(a == "/etc/passwd" for a in argv):
        return argv
    at = argv.index("--dir", argv.index("--ro-bind"))  # after the tree's / and --dev
    binds = [x for name in IDENTITY for x in ("--ro-bind", str(etc / name), f"/etc/{name}")]
    return argv[:at] + binds + argv[at:]


def with_remount(argv: list[str]) -> list[str]:
    """``argv`` with ``--remount-ro /`` last before its command, as before a tree's root
    was left to its read-only bind."""
    if "--remount-ro" in argv:
        return argv
    return [*argv[:-1], "--remount-ro", "/", argv[-1]]


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bwrap-parts-") as scratch:
        Path(scratch).chmod(0o755)
        full = template_argv(Path(scratch))
        variants = {
            "whole argv": without(full),
            "with the identity binds (a tree built before it carried them)": with_identity(
                without(full), Path(scratch) / "etc"
            ),
            "with --remount-ro / (before 2026-12-06)": with_remount(without(full)),
            "with both (the argv before 2026-12-06)": with_remount(
                with_identity(without(full), Path(scratch) / "etc")
            ),
            "--dir /dev for --dev": without(full, "dev"),
            "no --unshare-net": without(full, "--unshare-net"),
            "none of the three": without(full, "identity", "dev", "--unshare-net"),
            "/bin/true": ["/bin/true"],
        }
        print("argv:", " ".join(variants["whole argv"]))
        own: dict[str, list[float]] = {name: [] for name in variants}
        machine: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, argv in variants.items():
                before, busy = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy_s()
                for _ in range(args.runs):
                    subprocess.run(argv, stdin=subprocess.DEVNULL, check=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                own[name].append(cpu_s / args.runs * 1000)
                machine[name].append((machine_busy_s() - busy) / args.runs * 1000)
    print(f"{args.rounds} rounds of {args.runs} runs; ms a run, median over rounds")
    print("| variant | bwrap's CPU | whole machine | rounds (machine) |")
    print("|---|---:|---:|---|")
    for name in variants:
        rounds = ", ".join(f"{v:.2f}" for v in machine[name])
        print(
            f"| {name} | {statistics.median(own[name]):.2f} | "
            f"{statistics.median(machine[name]):.2f} | {rounds} |"
        )


if __name__ == "__main__":
    main()
