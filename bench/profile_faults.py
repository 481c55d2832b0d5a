"""Page faults of a sandbox's processes: the copy-on-write cost of forking them from a template.

A templated sandbox is two Python processes: the guest (the template's fork, pid 1 of the
sandbox) and its first kernel (the guest's fork). Each page either writes that it shares with
its parent is copied at its first write (a fault, ~1.3 us of copying on the 2-core VM), and
Python 3.11 writes wherever it looks: every object it touches has its reference count
changed. This runs ``--lifecycles`` cycles of create, ``run_code(--code)``, destroy in one
manager and reads each sandbox process's minor faults from ``/proc/<pid>/stat`` twice: when
the create has returned (the guest at ready, its kernel forked) and after the run. Prints
the median and p95 of each (issue 13's sixteenth pass).

Usage::

    .venv/bin/python bench/profile_faults.py [--lifecycles 40] [--code 'print(1)']
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.`

from bench.bench_core import percentile  # noqa: E402
from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402

CGROUP_FS = Path("/sys/fs/cgroup")


def sandbox_faults(cgroup_root: str) -> dict[int, int]:
    """Minor faults so far of every process in this run's sandbox cgroups (v1 lists each
    process once per hierarchy; v2 once), by pid."""
    procs_files = [*CGROUP_FS.glob(f"*/{cgroup_root}/**/cgroup.procs")]
    procs_files += CGROUP_FS.glob(f"{cgroup_root}/**/cgroup.procs")
    found = {}
    for procs in procs_files:
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            found[pid] = int(stat[stat.rindex(")") + 2 :].split()[7])  # minflt
    return found


async def run(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="sandlot-faults-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    settings = Settings(
        data_dir=root / "data",
        uid_base=args.uid_base,
        cgroup_root=args.cgroup_root,
        log_level="WARNING",
    )
    rows: dict[str, list[int]] = {"guest at ready": [], "guest after run": [], "kernel": []}
    try:
        async with SandboxManager(settings) as manager:
            for n in range(args.lifecycles + 3):  # the first three warm the template
                info = await manager.create(SandboxSpec(environment=args.environment))
                ready = sandbox_faults(args.cgroup_root)
                await manager.run_code(info.id, RunCode(code=args.code))
                after = sandbox_faults(args.cgroup_root)
                await manager.destroy(info.id)
                pids = sorted(after)
                if n < 3 or len(pids) != 2 or pids[0] not in ready:
                    continue  # not the two processes of a templated guest and its kernel
                guest, kernel = pids  # the guest forked the kernel: the lower pid (no wrap)
                rows["guest at ready"].append(ready[guest])
                rows["guest after run"].append(after[guest])
                rows["kernel"].append(after[kernel])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counted = len(rows["kernel"])
    print(
        f"{counted} of {args.lifecycles} sandboxes ({args.environment}), "
        f"run_code({args.code!r}): minor faults"
    )
    if not counted:
        sys.exit("no sandbox had a guest and one kernel (no template here?)")
    both = zip(rows["guest after run"], rows["kernel"], strict=True)
    rows["both, after run"] = [guest + kernel for guest, kernel in both]
    for name, values in rows.items():
        p50, p95 = statistics.median(values), percentile(values, 95)
        print(f"  {name:16} p50 {p50:6.0f}  p95 {p95:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lifecycles", type=int, default=40)
    parser.add_argument("--code", default="print(sum(range(10)))")
    parser.add_argument("--environment", default="python3")
    parser.add_argument("--uid-base", type=int, default=760000)
    parser.add_argument("--cgroup-root", default="sandlot-faults")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
