"""Scale: many live sandboxes in one process started under a low open-file limit.

Method. The script lowers its own soft RLIMIT_NOFILE to ``--soft-nofile`` (as ``ulimit -n
1024`` would: the hard limit stays), then starts one manager (its own data directory, cgroup
root and uid range) and creates ``--count`` small sandboxes, ``--concurrency`` at a time, all
kept alive. It stops early at the first refused or failed create (and says why: file
descriptors, loop devices, pids, memory), or when the host's available memory falls under
``--min-available-mb`` (the host is shared: the bench must not push it into the OOM killer).
With every sandbox live it checks that a sample answers, then destroys them all and checks
that nothing leaked (``tests/leaks.py``).

Reported: sandboxes made, wall time to create and to destroy them, creates per second and
each create's latency (p50 / p95) by how many were live, the soft limit the manager
ran under, file descriptors per sandbox (``/proc/self/fd`` before and after), host memory per
sandbox (MemAvailable before and after, and the cgroups' own count), the manager's RSS.

Not in ``make test``: ``make test-scale`` runs it (minutes, and a thousand loop devices).

Usage::

    .venv/bin/python bench/scale.py --count 1000 --soft-nofile 1024
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import leaks  # noqa: E402

from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.core import admission  # noqa: E402
from sandlot.errors import SandboxError  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402

SAMPLE = 20  # sandboxes asked to run code once all are live


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def settings_for(data_dir: Path, args: argparse.Namespace) -> Settings:
    per_sandbox_pids = 16
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=data_dir,
        backend="bubblewrap",
        memory_mb=args.memory_mb,
        disk_mb=args.disk_mb,
        pids=per_sandbox_pids,
        cpu_cores=0.05,
        ttl_s=3600,
        idle_timeout_s=3600,
        uid_base=args.uid_base,
        cgroup_root="sandlot-scale",
        log_level="ERROR",
        # Idle sandboxes use a fraction of what they reserve: let the host hold them all.
        host_memory_overcommit=8.0,
        host_cpu_overcommit=64.0,
        host_pids_fraction=1.0,
    )


def by_live(create_ms: list[tuple[int, float]], count: int) -> dict[str, str]:
    """Create latency p50 / p95 (ms) in four bands of how many sandboxes were live."""
    band = max(1, count // 4)
    found: dict[str, str] = {}
    for start in range(0, count, band):
        walls = sorted(ms for live, ms in create_ms if start <= live < start + band)
        if walls:
            p95 = walls[min(len(walls) - 1, int(len(walls) * 0.95))]
            found[f"{start}-{start + band - 1}"] = f"{statistics.median(walls):.0f} / {p95:.0f}"
    return found


async def run(args: argparse.Namespace) -> dict[str, Any]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.soft_nofile, hard), hard))
    started_soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    data_dir = Path(tempfile.mkdtemp(prefix="sandlot-scale-", dir="/tmp"))
    data_dir.chmod(0o711)
    report: dict[str, Any] = {"asked": args.count, "soft_nofile_at_launch": started_soft}
    try:
        async with SandboxManager(settings_for(data_dir, args)) as manager:
            report["soft_nofile_in_manager"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            report["hard_nofile"] = hard
            fds_before, mem_before, rss_before = admission.open_fds(), mem_available_mb(), rss_mb()
            ids: list[str] = []
            create_ms: list[tuple[int, float]] = []  # (sandboxes live before it, its wall)
            stop: list[str] = []
            gate = asyncio.Semaphore(args.concurrency)

            async def one() -> None:
                async with gate:
                    if stop:
                        return
                    if mem_available_mb() < args.min_available_mb:
                        stop.append(f"host MemAvailable under {args.min_available_mb} MB")
                        return
                    t0 = time.monotonic()
                    try:
                        info = await manager.create(SandboxSpec())
                    except SandboxError as exc:
                        stop.append(f"{type(exc).__name__}: {exc}")
                        return
                    create_ms.append((len(ids), (time.monotonic() - t0) * 1000))
                    ids.append(info.id)

            t0 = time.monotonic()
            await asyncio.gather(*(one() for _ in range(args.count)))
            report["create_s"] = round(time.monotonic() - t0, 1)
            report["created"] = len(ids)
            report["creates_per_s"] = round(len(ids) / max(report["create_s"], 1e-9), 1)
            report["create_ms_by_live"] = by_live(create_ms, args.count)
            report["stopped_by"] = stop[0] if stop else None
            made = max(1, len(ids))
            report["fds_per_sandbox"] = round((admission.open_fds() - fds_before) / made, 2)
            report["fds_open"] = admission.open_fds()
            report["host_mb_per_sandbox"] = round((mem_before - mem_available_mb()) / made, 1)
            usages = [await manager.usage(sid) for sid in ids]
            cgroup_mb = sum(u.memory_bytes or 0 for u in usages) / (1 << 20)
            report["cgroup_mb_per_sandbox"] = round(cgroup_mb / made, 1)
            report["manager_rss_mb_per_sandbox"] = round((rss_mb() - rss_before) / made, 3)
            answers = await asyncio.gather(
                *(manager.run_code(sid, RunCode(code="6 * 7")) for sid in ids[:SAMPLE])
            )
            report["sample_answered"] = sum(a.text == "42" for a in answers)
            baseline = leaks.snapshot(manager)
            t0 = time.monotonic()
            await asyncio.gather(*(manager.destroy(sid) for sid in ids))
            report["destroy_s"] = round(time.monotonic() - t0, 1)
            # A destroy returns before its teardown (disk, cgroup, uid), which runs after it.
            await manager.settle()
            report["destroy_and_teardown_s"] = round(time.monotonic() - t0, 1)
            # Everything the sandboxes held must be gone: compare with an empty host.
            report["leaked"] = leaks.wait_for_baseline(manager, leaks.Snapshot(), timeout_s=10)
            report["held_while_live"] = baseline.counts()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--soft-nofile", type=int, default=1024)
    parser.add_argument("--memory-mb", type=int, default=64)
    parser.add_argument("--disk-mb", type=int, default=16)
    parser.add_argument("--uid-base", type=int, default=640_000)
    parser.add_argument("--min-available-mb", type=float, default=4096)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    for key, value in report.items():
        print(f"{key}: {value}")
    ok = report.get("created") == args.count and not report.get("leaked")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
