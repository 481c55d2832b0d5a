"""The server on asyncio's event loop against uvloop (``API_EVENT_LOOP``), alternated.

Each round starts one ``sandlot serve`` per loop (auth on, a key per client, rate limits
raised; the loops' order alternates from round to round) and measures, in this order:

* ``--lifecycles`` sandboxes one after another, each ``POST /v1/sandboxes``, ``POST /code``
  ``1``, ``DELETE``: wall per lifecycle, and per lifecycle the CPU of the server process with
  the children it reaped (the launchers) and of the whole machine (``/proc/stat``, so the
  client and the sandboxes' teardown too), taken after a second's settling for the teardowns;
* ``--execs`` calls of ``POST /code`` ``1`` on one live sandbox (the exec round trip);
* ``--clients`` clients at once, each with its own key and sandbox, ``--calls`` calls each
  (what ``bench_server.py`` measures, with its code).

uvloop starts a subprocess with a fork of the whole server process, asyncio's loop with
vfork, and every create starts one (the sandbox's launcher).

Usage::

    .venv/bin/python bench/server_loop.py [--rounds 3] [--lifecycles 100] [--execs 200]
                                          [--clients 50] [--calls 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_", "API_", "TENANT_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.bench_core import LOOPS, Stats, command_line, machine_description  # noqa: E402
from bench.bench_server import (  # noqa: E402
    CLOCK_TICKS,
    CONCURRENT,
    SERVER_ENV,
    Results,
    concurrent_clients,
    http_create,
    http_delete,
    http_exec,
    machine_cpu_s,
    running_server,
)
from sandlot.server.auth import AuthStore  # noqa: E402

SETTLE_S = 1.0  # a DELETE returns before the teardown: its CPU is counted once it is done


def busy_s() -> float:
    """The machine's busy CPU seconds so far, summed over its cores."""
    every, idle = machine_cpu_s()
    return every - idle


def server_and_children_cpu_s(pid: int) -> float:
    """User and system CPU of process ``pid`` and of the children it has reaped."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / CLOCK_TICKS


async def one_server(args: argparse.Namespace, root: Path, loop: str) -> dict[str, list[float]]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"{loop}-", dir=root))
    data_dir.chmod(0o711)
    store = AuthStore(data_dir / "sandlot.db")
    key = store.create_key("bench", "user", "lifecycles")[1]
    keys = [store.create_key(f"client{i}", "user", "bench")[1] for i in range(args.clients)]
    store.close()
    out: dict[str, list[float]] = {"lifecycle": [], "exec": [], "server": [], "machine": []}
    with running_server(data_dir, {**SERVER_ENV, "API_EVENT_LOOP": loop}) as (url, pid):
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:

            async def lifecycle() -> float:
                started = time.perf_counter()
                sid = await http_create(client)
                await http_exec(client, sid)
                await http_delete(client, sid)
                return time.perf_counter() - started

            for _ in range(3):  # the guest template's start, the volume template's
                await lifecycle()
            await asyncio.sleep(SETTLE_S)
            server, machine = server_and_children_cpu_s(pid), busy_s()
            out["lifecycle"] = [await lifecycle() * 1000 for _ in range(args.lifecycles)]
            await asyncio.sleep(SETTLE_S)
            server = server_and_children_cpu_s(pid) - server
            machine = busy_s() - machine
            out["server"] = [server / args.lifecycles * 1000]
            out["machine"] = [machine / args.lifecycles * 1000]
            sid = await http_create(client)
            await http_exec(client, sid)
            out["exec"] = [await http_exec(client, sid) * 1000 for _ in range(args.execs)]
            await http_delete(client, sid)
        res = Results()
        await concurrent_clients(url, pid, keys, args.calls, res, record=True)
        out["concurrent"] = res.samples[CONCURRENT]
        out["calls_per_s"] = [args.clients * args.calls / res.walls_s[0]]
    shutil.rmtree(data_dir, ignore_errors=True)
    return out


def render(rounds: list[dict[str, dict[str, list[float]]]], args: argparse.Namespace) -> str:
    def pooled(loop: str, key: str) -> list[float]:
        return [v for r in rounds for v in r[loop][key]]

    def each(loop: str, key: str) -> str:
        return ", ".join(f"{r[loop][key][0]:.1f}" for r in rounds)

    rows = []
    for loop in LOOPS:
        life, ex, conc = (Stats.of(pooled(loop, k)) for k in ("lifecycle", "exec", "concurrent"))
        rows.append(
            f"| {loop} | {life.p50:.1f} / {life.p95:.1f} | {each(loop, 'server')} | "
            f"{each(loop, 'machine')} | {ex.p50:.2f} / {ex.p95:.2f} | "
            f"{conc.p50:.1f} / {conc.p95:.1f} | {each(loop, 'calls_per_s')} |"
        )
    return "\n".join(
        [
            f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
            f"- Machine: {machine_description()}",
            f"- Command: `{command_line()}`",
            "",
            "| loop | lifecycle wall, p50 / p95 ms | server + reaped children CPU, ms a "
            "lifecycle, per round | whole machine CPU, ms a lifecycle, per round | exec round "
            f"trip p50 / p95 ms | {args.clients} clients: per call p50 / p95 ms | "
            f"{args.clients} clients: calls/s, per round |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


async def bench(args: argparse.Namespace) -> str:
    root = Path(tempfile.mkdtemp(prefix="sandlot-server-loop-", dir="/tmp"))
    root.chmod(0o711)
    rounds: list[dict[str, dict[str, list[float]]]] = []
    try:
        for number in range(args.rounds):
            order = LOOPS if number % 2 == 0 else LOOPS[::-1]
            rounds.append({loop: await one_server(args, root, loop) for loop in order})
            print(f"round {number + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return render(rounds, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lifecycles", type=int, default=100)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--calls", type=int, default=20)
    print(asyncio.run(bench(parser.parse_args())))


if __name__ == "__main__":
    main()
