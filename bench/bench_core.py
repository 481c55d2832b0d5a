"""Core benchmark: create, exec and destroy of sandboxes in embedded mode.

Method. One :class:`~sandlot.manager.SandboxManager` (a fresh data directory under
/tmp, mode 0711, removed at the end) runs every series in ONE process, and the series are
interleaved so that the noise of a shared machine falls on all of them alike:

* each round runs ``--cycles`` cycles; a cycle takes one sample of every create series and
  of the baseline, in an order rotated from cycle to cycle:

  - baseline: a bare ``subprocess.run(["/usr/bin/python3", "-c", "print(1)"])``;
  - the isolating backend (``--backend``, default bubblewrap) with default limits:
    ``create``, the first ``run_code("print(1)")``, their sum (create-to-first-result), and
    ``destroy``;
  - the same backend with ``cpu_cores=2.0`` (on a 2-core host: no effective CFS throttling),
    to show what the default 0.5-core quota costs the guest's start-up;
  - ``unsafe-local`` (no isolation at all), to show what isolation costs;

* then, in one live, warmed-up sandbox per backend, ``--exec-calls`` calls of
  ``run_code("1")`` and ``--command-calls`` calls of ``run_command("true")`` per backend,
  in alternating blocks.

One untimed create cycle per backend runs first, so one-off first-use costs (host checks,
copying the guest files) stay out of the figures. Every figure is wall time from
:func:`time.perf_counter` around one awaited manager call, in milliseconds. The table gives
p50, p95 (linear interpolation), mean and n of each series and its p50 and p95 as multiples
of the baseline's p50: those ratios, measured in the same run, are what to compare between
runs. Settings come from defaults only: ``SANDBOX_*``,
``SANDLOT_*`` and ``LOG_*`` variables are removed from the environment first.

Usage::

    .venv/bin/python bench/bench_core.py [--rounds N] [--backend bubblewrap]
                                         [--output BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.requests import RunCode, RunCommand, SandboxSpec  # noqa: E402

SECTION_TITLE = "## Core: create, exec, destroy (embedded mode)"
FILE_INTRO = (
    "# Benchmarks\n"
    "\n"
    "The numbers on this page come from `make bench`. Each figure is a median (p50) or 95th "
    "percentile over several rounds in which all series are measured interleaved, round by "
    "round, on a shared 2-core machine whose background load we do not control, so absolute "
    "milliseconds drift from one run to the next. Every section also measures a baseline in "
    "the same run; the ratios against that baseline are the figures to compare across runs "
    "and machines.\n"
)
BASELINE_ARGV = ["/usr/bin/python3", "-c", "print(1)"]
LOCAL_BACKEND = "unsafe-local"
UNTHROTTLED_CORES = 2.0
CREATE_TARGET_MS = 15.0
EXEC_TARGET_MS = 1.0
EXEC_BLOCK = 10
COMMAND_BLOCK = 5
BASELINE = "baseline"

T = TypeVar("T")


# Event loops a manager may run on: asyncio's own (the SDK, the server's default) and uvloop
# (API_EVENT_LOOP=uvloop, or an application embedding the manager on its own uvloop).
LOOPS = ("asyncio", "uvloop")


class BenchError(RuntimeError):
    """A sandbox call did not return what the benchmark asked for."""


def run_on(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a fresh event loop of kind ``loop`` (one of :data:`LOOPS`)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


# --------------------------------------------------------------------------- statistics


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Stats:
    n: int
    p50: float
    p95: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        mean = sum(samples) / len(samples) if samples else math.nan
        return cls(len(samples), percentile(samples, 50), percentile(samples, 95), mean)


@dataclass
class Recorder:
    """Samples in milliseconds, by series key, in the order the series were declared."""

    labels: dict[str, str] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)

    def declare(self, key: str, label: str) -> None:
        self.labels[key] = label
        self.samples[key] = []

    def add(self, key: str, seconds: float) -> None:
        self.samples[key].append(seconds * 1000.0)

    def stats(self) -> dict[str, Stats]:
        return {key: Stats.of(values) for key, values in self.samples.items() if values}


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base <= 0:
        return "-"
    return f"{value / base:.2f}x" if value / base < 10 else f"{value / base:.1f}x"


def render_table(rec: Recorder) -> str:
    stats = rec.stats()
    base = stats[BASELINE].p50 if BASELINE in stats else math.nan
    lines = [
        "| series | n | p50 ms | p95 ms | mean ms | p50 / baseline p50 | p95 / baseline p50 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in rec.labels.items():
        if key not in stats:
            continue
        s = stats[key]
        lines.append(
            f"| {label} | {s.n} | {_ms(s.p50)} | {_ms(s.p95)} | {_ms(s.mean)} "
            f"| {_ratio(s.p50, base)} | {_ratio(s.p95, base)} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- measurements


def _key(backend: str, what: str, cores: float | None = None) -> str:
    return f"{backend}@{cores}:{what}" if cores is not None else f"{backend}:{what}"


POOL_SIZE = 2


def pooled(backend: str) -> str:
    return f"{backend}+pool"


def declare_series(rec: Recorder, backend: str) -> None:
    rec.declare(BASELINE, "baseline: `subprocess.run(python3 -c 'print(1)')`")
    who = f"{backend}, warm pool (SANDBOX_POOL_SIZE={POOL_SIZE})"
    rec.declare(_key(pooled(backend), "create"), f"{who}: create")
    rec.declare(_key(pooled(backend), "first"), f"{who}: first `run_code('print(1)')`")
    rec.declare(_key(pooled(backend), "to_result"), f"{who}: **create to first result**")
    for name, cores in ((backend, None), (backend, UNTHROTTLED_CORES), (LOCAL_BACKEND, None)):
        who = f"{name}, cpu_cores={cores}" if cores is not None else name
        rec.declare(_key(name, "create", cores), f"{who}: create")
        rec.declare(_key(name, "first", cores), f"{who}: first `run_code('print(1)')`")
        rec.declare(_key(name, "to_result", cores), f"{who}: **create to first result**")
        if cores is None:
            rec.declare(_key(name, "exec", cores), f"{who}: **exec `run_code('1')`**")
            rec.declare(_key(name, "command", cores), f"{who}: `run_command('true')`")
            rec.declare(_key(name, "destroy", cores), f"{who}: destroy")


def _bare_subprocess() -> float:
    """One baseline sample; blocking the loop is fine, nothing else runs on it meanwhile."""
    started = time.perf_counter()
    subprocess.run(BASELINE_ARGV, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


async def create_cycle(
    manager: SandboxManager,
    rec: Recorder,
    backend: str,
    cores: float | None,
    series: str | None = None,
) -> None:
    """create, first run_code and destroy of one fresh sandbox."""
    t0 = time.perf_counter()
    info = await manager.create(SandboxSpec(backend=backend, cpu_cores=cores))
    backend = series or backend
    try:
        t1 = time.perf_counter()
        result = await manager.run_code(info.id, RunCode(code="print(1)"))
        t2 = time.perf_counter()
        if result.stdout != "1\n" or not result.ok:
            raise BenchError(f"{backend}: print(1) gave {result!r}")
    finally:
        t3 = time.perf_counter()
        await manager.destroy(info.id)
        t4 = time.perf_counter()
    rec.add(_key(backend, "create", cores), t1 - t0)
    rec.add(_key(backend, "first", cores), t2 - t1)
    rec.add(_key(backend, "to_result", cores), t2 - t0)
    if cores is None and series is None:
        rec.add(_key(backend, "destroy", cores), t4 - t3)


async def pool_cycle(manager: SandboxManager, rec: Recorder, backend: str) -> None:
    """A create served from the warm pool, once the pool has refilled (not timed)."""
    deadline = time.monotonic() + 30
    while manager.pooled_count() < 1:
        if time.monotonic() > deadline:
            raise BenchError("the warm pool did not refill within 30 s")
        await asyncio.sleep(0.01)
    await create_cycle(manager, rec, backend, None, series=pooled(backend))


async def exec_calls(manager: SandboxManager, rec: Recorder, backend: str, sid: str) -> None:
    for _ in range(EXEC_BLOCK):
        started = time.perf_counter()
        result = await manager.run_code(sid, RunCode(code="1"))
        rec.add(_key(backend, "exec"), time.perf_counter() - started)
        if result.text != "1" or not result.ok:
            raise BenchError(f"{backend}: run_code('1') gave {result!r}")


async def command_calls(manager: SandboxManager, rec: Recorder, backend: str, sid: str) -> None:
    for _ in range(COMMAND_BLOCK):
        started = time.perf_counter()
        result = await manager.run_command(sid, RunCommand(command="true"))
        rec.add(_key(backend, "command"), time.perf_counter() - started)
        if not result.ok:
            raise BenchError(f"{backend}: run_command('true') gave {result!r}")


def _rotated(items: Sequence[T], by: int) -> list[T]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


async def run_round(
    manager: SandboxManager, pool: SandboxManager, rec: Recorder, args: argparse.Namespace
) -> None:
    backend: str = args.backend

    async def baseline() -> None:
        rec.add(BASELINE, _bare_subprocess())

    creates: list[Callable[[], Awaitable[None]]] = [
        baseline,
        lambda: create_cycle(manager, rec, backend, None),
        lambda: create_cycle(manager, rec, backend, UNTHROTTLED_CORES),
        lambda: create_cycle(manager, rec, LOCAL_BACKEND, None),
        lambda: pool_cycle(pool, rec, backend),
    ]
    for cycle in range(args.cycles):
        for step in _rotated(creates, cycle):
            await step()

    live: dict[str, str] = {}
    try:
        for name in (backend, LOCAL_BACKEND):
            info = await manager.create(SandboxSpec(backend=name))
            live[name] = info.id
            await manager.run_code(
                info.id, RunCode(code="print(1)")
            )  # the kernel is warm from here on
        names = list(live)
        for block in range(max(1, args.exec_calls // EXEC_BLOCK)):
            for name in _rotated(names, block):
                await exec_calls(manager, rec, name, live[name])
        for block in range(max(1, args.command_calls // COMMAND_BLOCK)):
            for name in _rotated(names, block):
                await command_calls(manager, rec, name, live[name])
    finally:
        for sid in live.values():
            await manager.destroy(sid)


# --------------------------------------------------------------------------- report


def machine_description() -> str:
    uname = subprocess.run(["uname", "-srm"], capture_output=True, text=True, check=False)
    nproc = len(os.sched_getaffinity(0))
    mem_gib = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / (1024 * 1024)
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    cgroups = "cgroups unknown"
    with contextlib.suppress(Exception):
        from sandlot.backends.cgroups import CgroupDriver

        cgroups = f"cgroup v{CgroupDriver.detect().version}"
    return (
        f"{uname.stdout.strip() or platform.platform()}; nproc {nproc}; "
        f"{mem_gib:.1f} GiB RAM; {model}; {cgroups}; Python {platform.python_version()}"
    )


def command_line() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(Path.cwd())
    return shlex.join([str(exe), *sys.argv])


def reading(stats: dict[str, Stats], backend: str) -> list[str]:
    """Three to five lines that say what the numbers mean, written from this run's numbers."""
    base = stats[BASELINE].p50
    iso = {what: stats[_key(backend, what)] for what in ("create", "first", "to_result")}
    local = {what: stats[_key(LOCAL_BACKEND, what)] for what in ("create", "first", "exec")}
    fast = {what: stats[_key(backend, what, UNTHROTTLED_CORES)] for what in ("create", "first")}
    exec_ = stats[_key(backend, "exec")]
    command = stats[_key(backend, "command")]
    destroy = stats[_key(backend, "destroy")]
    lines = [
        f"Create on {backend} takes {_ms(iso['create'].p50)} ms p50 "
        f"({_ratio(iso['create'].p50, base)} a bare Python start-up); unsafe-local, which starts "
        f"the same guest with no isolation, takes {_ms(local['create'].p50)} ms: the guest's own "
        f"start-up (a Python interpreter loading the agent and its imports, until it reports "
        f"ready) dominates, and isolation (cgroup, ext4 workspace image, bwrap namespaces) adds "
        f"{_ms(iso['create'].p50 - local['create'].p50)} ms.",
        f"The first result comes {_ms(iso['first'].p50)} ms after create (the guest starts its "
        f"Python kernel process after reporting ready); with cpu_cores={UNTHROTTLED_CORES} it "
        f"comes after {_ms(fast['first'].p50)} ms, so the default 0.5-core CFS quota costs "
        f"{_ms(iso['first'].p50 - fast['first'].p50)} ms of start-up "
        f"(create alone: {_ms(iso['create'].p50)} vs {_ms(fast['create'].p50)} ms).",
        f"An exec round trip (`run_code('1')`) takes {_ms(exec_.p50)} ms p50 on {backend} vs "
        f"{_ms(local['exec'].p50)} ms on unsafe-local; `run_command('true')` takes "
        f"{_ms(command.p50)} ms p50 / {_ms(command.p95)} ms p95; destroy {_ms(destroy.p50)} ms.",
    ]
    warm = {what: stats[_key(pooled(backend), what)] for what in ("create", "to_result")}
    lines.append(
        f"With a warm pool (SANDBOX_POOL_SIZE={POOL_SIZE}) a default create takes "
        f"{_ms(warm['create'].p50)} ms p50 / {_ms(warm['create'].p95)} ms p95 and the first "
        f"result comes {_ms(warm['to_result'].p50)} ms after asking: the pool pays the cold "
        "start in the background, while the sandbox waits unused."
    )
    create_gap = warm["create"].p50 / CREATE_TARGET_MS
    cold_gap = iso["create"].p50 / CREATE_TARGET_MS
    exec_gap = exec_.p50 / EXEC_TARGET_MS
    verdict = [
        f"create from the pool is {'within' if create_gap <= 1 else f'{create_gap:.1f}x over'} "
        f"its {CREATE_TARGET_MS:g} ms p50 target (a cold create is {cold_gap:.1f}x over)",
        f"exec is {'within' if exec_gap <= 1 else f'{exec_gap:.1f}x over'} its "
        f"{EXEC_TARGET_MS:g} ms p50 target",
    ]
    lines.append(f"Targets: {verdict[0]}, and {verdict[1]}.")
    return lines


def render_section(
    rec: Recorder, args: argparse.Namespace, started: dt.datetime, wall: float
) -> str:
    stats = rec.stats()
    method = (
        f"{args.rounds} round(s), each of {args.cycles} interleaved create cycles per series, then "
        f"{args.exec_calls} `run_code('1')` and {args.command_calls} `run_command('true')` "
        f"calls per backend in alternating blocks; wall time, ms; whole run {wall:.0f} s."
    )
    parts = [
        SECTION_TITLE,
        "",
        f"- Date: {started:%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine_description()}",
        f"- Command: `{command_line()}`",
        f"- Method: {method}",
        "",
        render_table(rec),
        "",
        "Reading:",
        "",
        *(f"- {line}" for line in reading(stats, args.backend)),
        "",
    ]
    return "\n".join(parts)


def write_section(path: Path, section: str, title: str = SECTION_TITLE) -> None:
    """Replace the section titled ``title`` in ``path`` (or add it; create the file)."""
    text = path.read_text() if path.exists() else FILE_INTRO
    lines = text.splitlines()
    try:
        start = lines.index(title)
    except ValueError:
        body = text.rstrip("\n") + "\n\n" + section
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:]).strip("\n")
        body = (before + "\n\n" if before else "") + section
        if after:
            body = body.rstrip("\n") + "\n\n" + after + "\n"
    path.write_text(body.rstrip("\n") + "\n")


# --------------------------------------------------------------------------- main


async def bench(args: argparse.Namespace, data_dir: Path) -> Recorder:
    rec = Recorder()
    declare_series(rec, args.backend)
    settings = Settings(_env_file=None, data_dir=data_dir, log_level="ERROR", allow_unsafe=True)  # type: ignore[call-arg]
    pool_settings = settings.model_copy(
        update={"data_dir": data_dir / "pool", "pool_size": POOL_SIZE}
    )
    async with SandboxManager(settings) as manager, SandboxManager(pool_settings) as pool:
        # One untimed cycle per series: first-use costs (checks, guest file copies) are not
        # what a long-running server pays per sandbox.
        warm = Recorder()
        declare_series(warm, args.backend)
        for backend, cores in ((args.backend, None), (LOCAL_BACKEND, None)):
            await create_cycle(manager, warm, backend, cores)
        for index in range(args.rounds):
            started = time.perf_counter()
            await run_round(manager, pool, rec, args)
            print(
                f"round {index + 1}/{args.rounds} done in {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return rec


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--backend", default="bubblewrap", help="isolating backend to measure")
    parser.add_argument("--output", type=Path, help="markdown file whose section to replace")
    parser.add_argument("--cycles", type=int, default=20, help="create cycles per round")
    parser.add_argument("--exec-calls", type=int, default=200, help="run_code calls per round")
    parser.add_argument("--command-calls", type=int, default=40, help="run_command calls per round")
    args = parser.parse_args(argv)
    if min(args.rounds, args.cycles, args.exec_calls, args.command_calls) < 1:
        parser.error("--rounds, --cycles, --exec-calls and --command-calls must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = dt.datetime.now(dt.UTC)
    root = Path(tempfile.mkdtemp(prefix="agsb-bench-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    started = time.perf_counter()
    try:
        rec = asyncio.run(bench(args, root / "data"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - started
    section = render_section(rec, args, started_at, wall)
    print(section)
    if args.output is not None:
        write_section(args.output, section)
        print(f"wrote the section to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
