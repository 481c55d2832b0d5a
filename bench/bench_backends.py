"""Create and exec across backends, in one run: bubblewrap, docker, docker+runsc, docker pool.

Every round measures each series interleaved, plus the same bare-subprocess baseline as
bench_core (``/usr/bin/python3 -c 'print(1)'``), so the ratios survive a noisy machine.

    python bench/bench_backends.py --rounds 5 --output BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import (
    BASELINE,
    Recorder,
    _bare_subprocess,
    render_table,
    write_section,
)
from sandlot import RunCode, SandboxManager, SandboxSpec, Settings

SECTION_TITLE = "## Backends: bubblewrap, docker, docker + gVisor, docker warm pool"
TARGETS = {  # label -> create() arguments
    "bubblewrap": {"backend": "bubblewrap"},
    "docker (runc)": {"backend": "docker", "runtime": "runc"},
    "docker + runsc (gVisor)": {"backend": "docker", "runtime": "runsc"},
}
POOLED = "docker (runc) from the warm pool"
EXECS_PER_ROUND = 10


async def _execs(rec: Recorder, manager: SandboxManager, label: str, sandbox_id: str) -> None:
    """The first call after create (it may wait for the guest's Python kernel to start) is
    a series of its own; the rest are the steady-state round trip."""
    for i in range(EXECS_PER_ROUND):
        started = time.perf_counter()
        result = await manager.run_code(sandbox_id, RunCode(code="1 + 1"))
        rec.add(f"{label}:{'first' if i == 0 else 'exec'}", time.perf_counter() - started)
        if result.text != "2":
            raise RuntimeError(f"{label}: unexpected result {result}")


async def _cycle(rec: Recorder, manager: SandboxManager, label: str, args: dict[str, str]) -> None:
    started = time.perf_counter()
    info = await manager.create(SandboxSpec(**args))
    rec.add(f"{label}:create", time.perf_counter() - started)
    try:
        await _execs(rec, manager, label, info.id)
    finally:
        await manager.destroy(info.id)


async def _pooled(rec: Recorder, pool: SandboxManager) -> None:
    while pool.pooled_count() < 1:  # noqa: ASYNC110 - the pool refills in the background
        await asyncio.sleep(0.05)
    started = time.perf_counter()
    info = await pool.create(SandboxSpec(backend="docker", runtime="runc"))
    rec.add(f"{POOLED}:create", time.perf_counter() - started)
    try:
        await _execs(rec, pool, POOLED, info.id)
    finally:
        await pool.destroy(info.id)


def _recorder() -> Recorder:
    rec = Recorder()
    rec.declare(BASELINE, "baseline: bare `subprocess` python3 -c 'print(1)'")
    for label in [*TARGETS, POOLED]:
        rec.declare(f"{label}:create", f"{label}: create")
    for label in [*TARGETS, POOLED]:
        rec.declare(f"{label}:first", f"{label}: first exec after create")
    for label in [*TARGETS, POOLED]:
        rec.declare(f"{label}:exec", f"{label}: exec `1 + 1` (later calls)")
    return rec


async def bench(rounds: int, data_dir: Path) -> Recorder:
    rec = _recorder()
    settings = Settings(_env_file=None, data_dir=data_dir, log_level="ERROR")  # type: ignore[call-arg]
    pool_settings = settings.model_copy(
        update={"data_dir": data_dir / "pool", "pools": {"docker+runc:python3": 2}}
    )
    async with SandboxManager(settings) as manager, SandboxManager(pool_settings) as pool:
        for label, args in TARGETS.items():  # untimed: first-use costs (image checks, ...)
            await _cycle(_recorder(), manager, label, args)
        for _ in range(rounds):
            for _ in range(3):
                rec.add(BASELINE, await asyncio.to_thread(_bare_subprocess))
            for label, args in TARGETS.items():
                await _cycle(rec, manager, label, args)
            await _pooled(rec, pool)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agsb-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        root.chmod(0o711)
        rec = asyncio.run(bench(args.rounds, root))
    table = render_table(rec)
    section = "\n".join(
        [
            SECTION_TITLE,
            "",
            f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
            f"({platform.machine()}, {platform.release()}), {args.rounds} rounds of "
            f"{EXECS_PER_ROUND} execs per series; command: `python bench/bench_backends.py "
            f"--rounds {args.rounds}` (part of `make bench`). Create is to a sandbox whose "
            "guest answers; docker's includes the container start, the workspace disk and the "
            "guest's exec; the pool's is taking a started container. The first exec after "
            "create is its own series: it can wait for the guest's Python kernel to start.",
            "",
            table,
            "",
        ]
    )
    print(section)
    if args.output:
        write_section(args.output, section, SECTION_TITLE)


if __name__ == "__main__":
    main()
