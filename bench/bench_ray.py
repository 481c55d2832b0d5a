"""Ray benchmark: what routing through a Ray cluster costs against the embedded manager.

Method. One process; a fresh data directory under /tmp (mode 0711, removed at the end).
A local Ray cluster (``ray.cluster_utils.Cluster``: a head without the sandlot resource and
1, 2, then 3 sandlot nodes, all on this host) runs node agents with real bubblewrap sandboxes;
the baseline is an embedded :class:`~sandlot.core.SandboxManager` in this process, measured in
the same rounds, interleaved call by call with the cluster's:

* exec round trip: ``run_code("1")`` in one warmed-up sandbox, ``--calls`` per round;
* create: ``create()`` then ``destroy()`` (only create is timed), ``--creates`` per round;
* create throughput with 1, 2 and 3 nodes: ``--burst`` creates, 4 in flight, then the same
  number of destroys; sandboxes per second. On one host the nodes share the same 2 cores, so
  more nodes cannot be faster: the figure shows routing's overhead, not scale-out.

Figures: p50 and p95 (linear interpolation) in milliseconds, and the cluster's p50 as a
multiple of the embedded p50 of the same run.

Usage::

    .venv/bin/python bench/bench_ray.py [--rounds 3] [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.ray import ClusterManager, shutdown_agents  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402

SECTION_TITLE = "## sandlot on Ray: routing overhead (issue 15)"
NAMESPACE = "sandlot-bench"


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = await call()
    return time.perf_counter() - started, value


def settings(root: Path, **extra: Any) -> Settings:
    values = {"data_dir": root, "log_level": "WARNING", "disk_mb": 64, **extra}
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


async def latency(
    embedded: SandboxManager, cluster: ClusterManager, args: argparse.Namespace
) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {k: [] for k in ("exec_e", "exec_r", "create_e", "create_r")}
    e_info = await embedded.create(SandboxSpec())
    r_info = await cluster.create(SandboxSpec())
    await embedded.run_code(e_info.id, RunCode(code="1"))
    await cluster.run_code(r_info.id, RunCode(code="1"))
    for _ in range(args.rounds):
        for _ in range(args.calls):
            series["exec_e"].append(
                (await timed(lambda: embedded.run_code(e_info.id, RunCode(code="1"))))[0]
            )
            series["exec_r"].append(
                (await timed(lambda: cluster.run_code(r_info.id, RunCode(code="1"))))[0]
            )
        for _ in range(args.creates):
            took, info = await timed(lambda: embedded.create(SandboxSpec()))
            series["create_e"].append(took)
            await embedded.destroy(info.id)
            took, info = await timed(lambda: cluster.create(SandboxSpec()))
            series["create_r"].append(took)
            await cluster.destroy(info.id)
    await embedded.destroy(e_info.id)
    await cluster.destroy(r_info.id)
    return series


async def throughput(cluster: ClusterManager, burst: int) -> float:
    gate = asyncio.Semaphore(4)

    async def one() -> str:
        async with gate:
            return (await cluster.create(SandboxSpec())).id

    started = time.perf_counter()
    ids = await asyncio.gather(*(one() for _ in range(burst)))
    rate = burst / (time.perf_counter() - started)
    await asyncio.gather(*(cluster.destroy(sid) for sid in ids))
    return rate


async def bench(
    args: argparse.Namespace, root: Path
) -> tuple[dict[str, list[float]], dict[int, list[float]]]:
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    rates: dict[int, list[float]] = {}
    try:
        ray.init(address=head.address, namespace=NAMESPACE, log_to_driver=False)
        # ray_wall_node off: this host's INPUT chain is shared (the wall is tested in
        # tests/test_ray_cluster.py, in a network namespace of its own).
        overrides = {
            "data_dir": root / "cluster",
            "log_level": "WARNING",
            "disk_mb": 64,
            "ray_wall_node": False,
        }
        head.add_node(num_cpus=1, resources={"sandlot_node": 1, "sandlot_node_b1": 1})
        async with SandboxManager(settings(root / "embedded")) as embedded:
            cfg = settings(root / "server", ray_namespace=NAMESPACE)
            async with ClusterManager(cfg, overrides) as cluster:
                series = await latency(embedded, cluster, args)
                for n in range(1, 4):
                    if n > 1:  # one more node: its agent starts on the next refresh
                        head.add_node(
                            num_cpus=1, resources={"sandlot_node": 1, f"sandlot_node_b{n}": 1}
                        )
                        await cluster.refresh()
                    assert len(cluster.nodes()) == n, cluster.nodes()
                    rates[n] = [await throughput(cluster, args.burst) for _ in range(args.rounds)]
        return series, rates
    finally:
        if ray.is_initialized():
            shutdown_agents(NAMESPACE)
            ray.shutdown()
        head.shutdown()


def render(
    series: dict[str, list[float]], rates: dict[int, list[float]], args: argparse.Namespace
) -> str:
    def row(label: str, key: str, base: str) -> str:
        s = series[key]
        ratio = percentile(s, 0.5) / percentile(series[base], 0.5)
        return (
            f"| {label} | {percentile(s, 0.5) * 1e3:.2f} | {percentile(s, 0.95) * 1e3:.2f} | "
            f"{len(s)} | {ratio:.1f}x |"
        )

    lines = [
        SECTION_TITLE,
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cores, shared.",
        f"- Command: `bench/bench_ray.py --rounds {args.rounds} --calls {args.calls} "
        f"--creates {args.creates} --burst {args.burst}`; Ray {ray.__version__}, bubblewrap, "
        "default limits; one head and three sandlot nodes on this host "
        "(`ray.cluster_utils.Cluster`).",
        "",
        "| series | p50 ms | p95 ms | n | p50 vs embedded |",
        "|---|---|---|---|---|",
        row("`run_code('1')`, embedded", "exec_e", "exec_e"),
        row("`run_code('1')`, through the cluster", "exec_r", "exec_e"),
        row("`create()`, embedded", "create_e", "create_e"),
        row("`create()`, through the cluster", "create_r", "create_e"),
        "",
        "| create throughput, 4 in flight | sandboxes/s (each round) | median |",
        "|---|---|---|",
    ]
    for n, values in rates.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        lines.append(
            f"| {n} node{'s' if n > 1 else ''} | {shown} | {statistics.median(values):.1f} |"
        )
    lines += [
        "",
        "On one host every node shares the same cores: more nodes cannot create faster here; "
        "the rows show that routing over more nodes adds no cost of its own. Scale-out comes "
        'from nodes on their own machines (README, "Scale out with Ray").',
    ]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if SECTION_TITLE in text:
        head, _, tail = text.partition(SECTION_TITLE)
        rest = tail.split("\n## ", 1)
        text = head + section + ("\n## " + rest[1] if len(rest) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n\n" + section
    path.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--creates", type=int, default=10)
    parser.add_argument("--burst", type=int, default=12)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="sandlot-bench-ray-", dir="/tmp"))
    root.chmod(0o711)
    try:
        series, rates = asyncio.run(bench(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section = render(series, rates, args)
    sys.stdout.write(section)
    if args.output:
        write_section(args.output, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
