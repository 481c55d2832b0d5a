"""Server benchmark: exec round trip over HTTP, 50 concurrent clients, create and delete.

Method. The benchmark starts its own ``sandlot serve`` (a real process on a free port, a
fresh data directory under /tmp, mode 0711, removed at the end; auth on, with one API key per
client in its own tenant, and the per-key rate limit raised so it never answers 429; every
other setting is the default) and drives it with ``httpx.AsyncClient`` from this process. In
the same process, an embedded :class:`~sandlot.manager.SandboxManager` (its own data
directory) gives the same-run baseline: what a call costs without HTTP. Client, server and
sandboxes share the machine's cores.

Each round runs, in this order:

* single client, one live warmed-up sandbox per path, ``--exec-calls`` calls per series in
  blocks of 10 whose order rotates from block to block:

  - **HTTP exec**: ``POST /v1/sandboxes/{id}/code`` with ``{"code": "1"}`` (result checked),
    from an ``httpx.AsyncClient`` (what the remote SDK uses) and, as a second series, from a
    blocking ``httpx.Client``;
  - embedded exec: ``manager.run_code(id, "1")``, the baseline;
  - ``GET /health`` (no sandbox: the HTTP floor of server plus client; the client sends its
    key, which the server checks since 2026-12-06, so earlier figures are a key lookup less);
  - ``GET /v1/sandboxes/{id}`` (auth and rate limit, no sandbox call, no audit record);

* ``--clients`` clients at once (default 50), each with its own ``httpx.AsyncClient`` and its
  own sandbox (``memory_mb=64``, ``disk_mb=16``; created concurrently and warmed with one
  untimed call before the start), each making ``--calls`` (default 20) sequential
  ``POST /code`` ``1`` calls; per-call latency, wall time from the common start to the last
  answer, and throughput (calls / wall);

* ``--creates`` create cycles, alternating HTTP (``POST /v1/sandboxes`` then ``DELETE``) and
  embedded (``manager.create`` then ``destroy``), default limits on both.

Untimed warm-up first: two create cycles on each path, a few concurrent clients, and a few
exec calls. Figures are wall time from :func:`time.perf_counter` around one call, in
milliseconds; p50 and p95 interpolate linearly. The ratios against the embedded exec p50,
measured in the same run, are what to compare between runs. CPU time of the server process
(``/proc/<pid>/stat``) and of this process is summed over the timed HTTP exec calls, and the
machine's busy share (``/proc/stat``) over the concurrent calls, to say where the time goes.

Usage::

    .venv/bin/python bench/bench_server.py [--clients 50] [--calls 20] [--rounds 3]
                                           [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_", "API_", "TENANT_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.bench_core import (  # noqa: E402
    Stats,
    _ms,
    _ratio,
    command_line,
    machine_description,
    percentile,
    write_section,
)
from sandlot import RunCode, SandboxManager, Settings  # noqa: E402
from sandlot.server.auth import AuthStore  # noqa: E402

SECTION_TITLE = "## Server: HTTP exec round trip and 50-client concurrency"
EXEC_TARGET_MS = 3.0
BLOCK = 10
CONCURRENT_LIMITS = {"memory_mb": 64, "disk_mb": 16}
REQUEST_TIMEOUT_S = 120.0
SERVER_ENV = {
    # One key makes hundreds of calls a second here; the default 50/s would answer 429.
    "API_RATE_LIMIT_PER_SECOND": "1000000",
    "API_RATE_LIMIT_BURST": "1000000",
}

HTTP_EXEC = "http_exec"
SYNC_EXEC = "sync_exec"
EMBEDDED_EXEC = "embedded_exec"
HEALTH = "health"
GET_INFO = "get_info"
CONCURRENT = "concurrent"
HTTP_CREATE = "http_create"
HTTP_DELETE = "http_delete"
EMBEDDED_CREATE = "embedded_create"
EMBEDDED_DESTROY = "embedded_destroy"
LABELS = {
    HTTP_EXEC: "HTTP exec: `POST /code` `1`, one client",
    SYNC_EXEC: "the same with a blocking `httpx.Client`",
    EMBEDDED_EXEC: "embedded exec: `manager.run_code('1')` (baseline)",
    HEALTH: "HTTP floor: `GET /health` (its key checked since 2026-12-06)",
    GET_INFO: "HTTP `GET /v1/sandboxes/{id}` (auth, no sandbox call)",
    CONCURRENT: "HTTP exec, {clients} concurrent clients: per call",
    HTTP_CREATE: "HTTP create: `POST /v1/sandboxes`",
    HTTP_DELETE: "HTTP delete: `DELETE /v1/sandboxes/{id}`",
    EMBEDDED_CREATE: "embedded create: `manager.create()`",
    EMBEDDED_DESTROY: "embedded destroy: `manager.destroy()`",
}


class BenchError(RuntimeError):
    """A call did not return what the benchmark asked for."""


@dataclass
class Results:
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in LABELS})
    walls_s: list[float] = field(default_factory=list)  # one per concurrency round
    create_walls_s: list[float] = field(default_factory=list)  # the clients' creates, at once
    busy: list[float] = field(default_factory=list)  # the machine's busy share, per round
    # CPU seconds of the server process (and of this client process) during timed calls
    exec_server_cpu_s: float = 0.0
    exec_client_cpu_s: float = 0.0
    conc_server_cpu_s: float = 0.0
    conc_client_cpu_s: float = 0.0

    def add(self, key: str, seconds: float) -> None:
        self.samples[key].append(seconds * 1000.0)

    def stats(self) -> dict[str, Stats]:
        return {key: Stats.of(values) for key, values in self.samples.items() if values}


# --------------------------------------------------------------------------- the server

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_cpu_s() -> tuple[float, float]:
    """``(all, idle)`` CPU seconds of the machine so far, summed over its cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) / CLOCK_TICKS, (values[3] + values[4]) / CLOCK_TICKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def running_server(data_dir: Path, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """`sandlot serve` on a free port until the block ends; yields its URL and pid."""
    port = _free_port()
    log_path = data_dir / "server.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(port)],
            env={**os.environ, "SANDLOT_DATA_DIR": str(data_dir), **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise BenchError(f"server exited: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError("server did not answer /health within 30 s")
            time.sleep(0.1)
        yield url, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------- measurements


def _check(what: str, ok: bool, detail: object) -> None:
    if not ok:
        raise BenchError(f"{what}: {detail!r}")


async def http_create(client: httpx.AsyncClient, limits: dict[str, int] | None = None) -> str:
    response = await client.post("/v1/sandboxes", json=limits or {})
    _check("create", response.status_code == 201, response.text)
    sid: str = response.json()["id"]
    return sid


async def http_delete(client: httpx.AsyncClient, sid: str) -> None:
    response = await client.delete(f"/v1/sandboxes/{sid}")
    _check("delete", response.status_code == 200, response.text)


async def http_exec(client: httpx.AsyncClient, sid: str) -> float:
    started = time.perf_counter()
    response = await client.post(f"/v1/sandboxes/{sid}/code", json={"code": "1"})
    elapsed = time.perf_counter() - started
    _check(
        "POST /code 1",
        response.status_code == 200 and response.json()["text"] == "1",
        response.text,
    )
    return elapsed


def sync_exec_block(client: httpx.Client, sid: str, res: Results) -> None:
    """Blocking calls, on purpose: nothing else has to run on the event loop meanwhile."""
    for _ in range(BLOCK):
        started = time.perf_counter()
        response = client.post(f"/v1/sandboxes/{sid}/code", json={"code": "1"})
        res.add(SYNC_EXEC, time.perf_counter() - started)
        ok = response.status_code == 200 and response.json()["text"] == "1"
        _check("POST /code 1 (blocking client)", ok, response.text)


async def single_client_blocks(
    manager: SandboxManager,
    client: httpx.AsyncClient,
    sync_client: httpx.Client,
    http_sid: str,
    local_sid: str,
    res: Results,
    calls: int,
    server_pid: int,
) -> None:
    async def http_block() -> None:
        server_cpu, client_cpu = process_cpu_s(server_pid), time.process_time()
        for _ in range(BLOCK):
            res.add(HTTP_EXEC, await http_exec(client, http_sid))
        res.exec_server_cpu_s += process_cpu_s(server_pid) - server_cpu
        res.exec_client_cpu_s += time.process_time() - client_cpu

    async def embedded_block() -> None:
        for _ in range(BLOCK):
            started = time.perf_counter()
            result = await manager.run_code(local_sid, RunCode(code="1"))
            res.add(EMBEDDED_EXEC, time.perf_counter() - started)
            _check("run_code('1')", result.text == "1" and result.ok, result)

    async def health_block() -> None:
        for _ in range(BLOCK):
            started = time.perf_counter()
            response = await client.get("/health")
            res.add(HEALTH, time.perf_counter() - started)
            _check("GET /health", response.status_code == 200, response.text)

    async def get_block() -> None:
        for _ in range(BLOCK):
            started = time.perf_counter()
            response = await client.get(f"/v1/sandboxes/{http_sid}")
            res.add(GET_INFO, time.perf_counter() - started)
            _check("GET /v1/sandboxes/{id}", response.status_code == 200, response.text)

    async def sync_block() -> None:
        sync_exec_block(sync_client, http_sid, res)

    blocks: list[Callable[[], Awaitable[None]]] = [
        http_block,
        sync_block,
        embedded_block,
        health_block,
        get_block,
    ]
    for index in range(max(1, calls // BLOCK)):
        k = index % len(blocks)
        for block in [*blocks[k:], *blocks[:k]]:
            await block()


async def _all_ready(ready: asyncio.Semaphore, tasks: list[asyncio.Task[list[float]]]) -> None:
    """Wait for one release of ``ready`` per task; raise if a task ends first."""
    for _ in tasks:
        waiter = asyncio.create_task(ready.acquire())
        done, _ = await asyncio.wait(
            {waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED, timeout=REQUEST_TIMEOUT_S
        )
        if waiter not in done:
            waiter.cancel()
            failed = [t.exception() for t in tasks if t.done() and t.exception()]
            why = repr(failed[0]) if failed else f"not ready after {REQUEST_TIMEOUT_S:g} s"
            raise BenchError(f"a client failed before the start: {why}")


async def concurrent_clients(
    url: str, server_pid: int, keys: list[str], calls: int, res: Results, record: bool
) -> None:
    """Every client creates its sandbox, warms it, waits for the start, then makes its calls."""
    start = asyncio.Event()
    ready = asyncio.Semaphore(0)

    async def one(key: str) -> list[float]:
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S
        ) as client:
            sid = await http_create(client, CONCURRENT_LIMITS)
            try:
                await http_exec(client, sid)  # the guest's kernel starts on the first call
                ready.release()
                await start.wait()
                return [await http_exec(client, sid) for _ in range(calls)]
            finally:
                await http_delete(client, sid)

    created = time.perf_counter()
    tasks = [asyncio.create_task(one(key)) for key in keys]
    try:
        await _all_ready(ready, tasks)
        create_wall = time.perf_counter() - created
        server_cpu, client_cpu, machine = (
            process_cpu_s(server_pid),
            time.process_time(),
            machine_cpu_s(),
        )
        started = time.perf_counter()
        start.set()
        per_client = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        server_cpu = process_cpu_s(server_pid) - server_cpu
        client_cpu = time.process_time() - client_cpu
        machine_all, machine_idle = (b - a for a, b in zip(machine, machine_cpu_s(), strict=True))
    except BaseException:
        start.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if record:
        res.walls_s.append(wall)
        res.create_walls_s.append(create_wall)
        res.conc_server_cpu_s += server_cpu
        res.conc_client_cpu_s += client_cpu
        if machine_all > 0:
            res.busy.append(1.0 - machine_idle / machine_all)
        for latencies in per_client:
            for seconds in latencies:
                res.add(CONCURRENT, seconds)


async def create_cycles(
    manager: SandboxManager, client: httpx.AsyncClient, res: Results, cycles: int
) -> None:
    for cycle in range(cycles):
        for path in ("http", "embedded") if cycle % 2 == 0 else ("embedded", "http"):
            if path == "http":
                t0 = time.perf_counter()
                sid = await http_create(client)
                t1 = time.perf_counter()
                await http_delete(client, sid)
                t2 = time.perf_counter()
                res.add(HTTP_CREATE, t1 - t0)
                res.add(HTTP_DELETE, t2 - t1)
            else:
                t0 = time.perf_counter()
                info = await manager.create()
                t1 = time.perf_counter()
                await manager.destroy(info.id)
                t2 = time.perf_counter()
                res.add(EMBEDDED_CREATE, t1 - t0)
                res.add(EMBEDDED_DESTROY, t2 - t1)


async def bench(args: argparse.Namespace, root: Path) -> Results:
    res = Results()
    server_dir = root / "server"
    server_dir.mkdir(mode=0o711)
    store = AuthStore(server_dir / "sandlot.db")
    single_key = store.create_key("bench", "user", "single client")[1]
    keys = [store.create_key(f"client{i}", "user", "bench")[1] for i in range(args.clients)]
    store.close()
    settings = Settings(_env_file=None, data_dir=root / "embedded", log_level="WARNING")  # type: ignore[call-arg]
    headers = {"Authorization": f"Bearer {single_key}"}
    with (
        running_server(server_dir, SERVER_ENV) as (url, pid),
        httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as sync_client,
    ):
        async with (
            SandboxManager(settings) as manager,
            httpx.AsyncClient(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client,
        ):
            # Untimed warm-up: first-use costs (host checks, guest files) are not per call.
            warm = Results()
            await create_cycles(manager, client, warm, 2)
            await concurrent_clients(url, pid, keys[: min(4, len(keys))], 2, warm, record=False)
            http_sid = await http_create(client)
            local_sid = (await manager.create()).id
            try:
                await single_client_blocks(
                    manager, client, sync_client, http_sid, local_sid, warm, BLOCK, pid
                )
                for index in range(args.rounds):
                    started = time.perf_counter()
                    await single_client_blocks(
                        manager, client, sync_client, http_sid, local_sid, res, args.exec_calls, pid
                    )
                    await concurrent_clients(url, pid, keys, args.calls, res, record=True)
                    await create_cycles(manager, client, res, args.creates)
                    print(
                        f"round {index + 1}/{args.rounds} done in "
                        f"{time.perf_counter() - started:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                await http_delete(client, http_sid)
                await manager.destroy(local_sid)
    return res


# --------------------------------------------------------------------------- report


def render_table(res: Results, clients: int) -> str:
    stats = res.stats()
    base = stats[EMBEDDED_EXEC].p50 if EMBEDDED_EXEC in stats else math.nan
    lines = [
        "| series | n | p50 ms | p95 ms | mean ms | p50 / embedded exec p50 "
        "| p95 / embedded exec p50 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in LABELS.items():
        if key not in stats:
            continue
        s = stats[key]
        name = label.format(clients=clients) if key == CONCURRENT else label
        if key in (HTTP_EXEC, EMBEDDED_EXEC, CONCURRENT):
            name = f"**{name}**"
        lines.append(
            f"| {name} | {s.n} | {_ms(s.p50)} | {_ms(s.p95)} | {_ms(s.mean)} "
            f"| {_ratio(s.p50, base)} | {_ratio(s.p95, base)} |"
        )
    return "\n".join(lines)


def _seconds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _per_call_ms(cpu_s: float, calls: int) -> str:
    return _ms(cpu_s * 1000 / calls) if calls else "-"


def _saturation(busy_pct: float, server_core_pct: float, little_ms: float, mean_ms: float) -> str:
    server = (
        f"The server process, one event loop, used {server_core_pct:.0f}% of one core while "
        f"the calls ran"
    )
    if server_core_pct >= 90:
        return f"{server}: it is the bottleneck, and per-call latency is queueing for it."
    if busy_pct >= 85 and abs(little_ms - mean_ms) <= 0.25 * mean_ms:
        return (
            f"{server}; the machine's CPU is saturated and the mean latency is within 25% of "
            f"what Little's law gives for this throughput: per-call latency under this load is "
            f"mostly queueing for the CPU, so throughput is the figure to compare between runs."
        )
    if busy_pct < 85:
        return (
            f"{server}; neither it nor the machine was saturated, so part of the per-call "
            f"latency is waiting for something other than CPU, and the clients' own ramp "
            f"(they start together but finish apart) lowers the throughput over the interval."
        )
    return (
        f"{server}; the machine's CPU is saturated, but the measured latency departs from "
        f"Little's law by more than 25%: part of the interval ran with fewer than all clients "
        f"active (they start together but finish apart)."
    )


def reading(res: Results, args: argparse.Namespace) -> list[str]:
    """What the numbers say, written from this run's numbers."""
    stats = res.stats()
    http, local = stats[HTTP_EXEC], stats[EMBEDDED_EXEC]
    health, get = stats[HEALTH], stats[GET_INFO]
    conc = stats[CONCURRENT]
    wall = percentile(res.walls_s, 50)
    total_calls = args.clients * args.calls
    throughput = total_calls / wall
    busy = percentile(res.busy, 50) * 100 if res.busy else math.nan
    little_ms = args.clients / throughput * 1000  # Little's law: mean time in system
    server_core = res.conc_server_cpu_s / sum(res.walls_s) * 100  # % of one core
    gap = http.p50 / EXEC_TARGET_MS
    verdict = (
        f"within the {EXEC_TARGET_MS:g} ms p50 target"
        if gap <= 1
        else f"{gap:.1f}x over the {EXEC_TARGET_MS:g} ms p50 target"
    )
    lines = [
        f"One client: an exec round trip over HTTP takes {_ms(http.p50)} ms p50 / "
        f"{_ms(http.p95)} ms p95, {verdict}. The same call embedded takes {_ms(local.p50)} ms "
        f"p50, so HTTP adds {_ms(http.p50 - local.p50)} ms ({_ratio(http.p50, local.p50)} "
        f"the embedded call). With a blocking `httpx.Client` instead of the `AsyncClient` "
        f"(which the remote SDK uses) the round trip takes {_ms(stats[SYNC_EXEC].p50)} ms p50.",
        f"Where the time goes: a bare `GET /health` (client, HTTP, framework; a key check) takes "
        f"{_ms(health.p50)} ms p50 and an authenticated `GET /v1/sandboxes/{{id}}` "
        f"{_ms(get.p50)} ms. Per HTTP exec call the server process spends "
        f"{_per_call_ms(res.exec_server_cpu_s, http.n)} ms of CPU (request and response "
        f"validation, key lookup, rate limit, audit-log row, the guest protocol) and this "
        f"Python client {_per_call_ms(res.exec_client_cpu_s, http.n)} ms; the guest's share is "
        f"what the embedded call costs.",
        f"{args.clients} clients at once, {args.calls} calls each: {_ms(conc.p50)} ms p50 / "
        f"{_ms(conc.p95)} ms p95 per call; {total_calls} calls in {wall:.2f} s (median of "
        f"{len(res.walls_s)} rounds: {_seconds(res.walls_s)} s), {throughput:.0f} calls/s, "
        f"against {1000 / http.p50:.0f} calls/s for one client calling in series.",
        f"Under that load the machine was {busy:.0f}% busy (median of rounds, every process "
        f"on it) and the server process spent {_per_call_ms(res.conc_server_cpu_s, conc.n)} ms "
        f"of CPU per call, the client {_per_call_ms(res.conc_client_cpu_s, conc.n)} ms, and the "
        f"sandboxes the rest, on {len(os.sched_getaffinity(0))} cores. By Little's law "
        f"{args.clients} clients at {throughput:.0f} calls/s spend {_ms(little_ms)} ms per call "
        f"on average; measured: {_ms(conc.mean)} ms. "
        f"{_saturation(busy, server_core, little_ms, conc.mean)}",
    ]
    if HTTP_CREATE in stats and EMBEDDED_CREATE in stats:
        hc, ec = stats[HTTP_CREATE], stats[EMBEDDED_CREATE]
        hd, ed = stats[HTTP_DELETE], stats[EMBEDDED_DESTROY]
        lines.append(
            f"Create over HTTP takes {_ms(hc.p50)} ms p50 / {_ms(hc.p95)} ms p95 against "
            f"{_ms(ec.p50)} ms embedded ({_ratio(hc.p50, ec.p50)}), delete {_ms(hd.p50)} ms "
            f"against {_ms(ed.p50)} ms ({_ratio(hd.p50, ed.p50)}). The {args.clients} "
            f"clients' creates and first calls, all at once, took "
            f"{_seconds(res.create_walls_s)} s per round."
        )
    return lines


def render_section(
    res: Results, args: argparse.Namespace, started: dt.datetime, wall: float
) -> str:
    method = (
        f"{args.rounds} round(s), each: {args.exec_calls} calls per single-client series in "
        f"rotating blocks of {BLOCK}; {args.clients} clients x {args.calls} `POST /code` calls "
        f"at once (own key, tenant, `httpx.AsyncClient` and sandbox with memory_mb=64, "
        f"disk_mb=16, warmed by one untimed call); {args.creates} create+delete cycles per "
        f"path, alternating. One `sandlot serve` (auth on, default settings but the "
        f"per-key rate limit raised) and the embedded manager share the machine with the "
        f"client; wall time, ms; whole run {wall:.0f} s."
    )
    parts = [
        SECTION_TITLE,
        "",
        f"- Date: {started:%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine_description()}",
        f"- Command: `{command_line()}`",
        f"- Method: {method}",
        "",
        render_table(res, args.clients),
        "",
        "Reading:",
        "",
        *(f"- {line}" for line in reading(res, args)),
        "",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients (50)")
    parser.add_argument("--calls", type=int, default=20, help="calls per concurrent client (20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument("--output", type=Path, help="markdown file whose section to replace")
    parser.add_argument(
        "--exec-calls", type=int, default=200, help="calls per single-client series per round"
    )
    parser.add_argument("--creates", type=int, default=10, help="create cycles per path per round")
    args = parser.parse_args(argv)
    if min(args.clients, args.calls, args.rounds, args.exec_calls, args.creates) < 1:
        parser.error("every count must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    root = Path(tempfile.mkdtemp(prefix="agsb-bench-server-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    started = time.perf_counter()
    try:
        res = asyncio.run(bench(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - started
    section = render_section(res, args, started_at, wall)
    print(section)
    if args.output is not None:
        write_section(args.output, section, SECTION_TITLE)
        print(f"wrote the section to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
