"""python-data vs python3 on every backend: create, and create to first result.

bubblewrap runs in both of its modes: host (the host's /usr; a manager whose rootfs store is
empty) and rootfs (the environment's tree bound as /). Docker and gVisor run the image
imported from that same tree. Every round measures each series interleaved, plus the bare
subprocess baseline of bench_core, so the ratios survive a noisy machine. The trees and
images must be built first (`make image`).

    python bench/bench_environments.py --rounds 5 --output BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import (
    BASELINE,
    Recorder,
    _bare_subprocess,
    command_line,
    machine_description,
    render_table,
    write_section,
)
from sandlot import RunCode, SandboxManager, SandboxSpec, Settings

SECTION_TITLE = "## Environments: python-data vs python3, per backend and bubblewrap mode"
# label -> (which manager: "host" has an empty rootfs store, create() arguments)
SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "bubblewrap host /usr, python3": ("host", {"backend": "bubblewrap"}),
    "bubblewrap rootfs, python3": ("tree", {"backend": "bubblewrap"}),
    "bubblewrap rootfs, python-data": (
        "tree",
        {"backend": "bubblewrap", "environment": "python-data"},
    ),
    "docker, python3": ("tree", {"backend": "docker", "runtime": "runc"}),
    "docker, python-data": (
        "tree",
        {"backend": "docker", "runtime": "runc", "environment": "python-data"},
    ),
    "docker + runsc, python3": ("tree", {"backend": "docker", "runtime": "runsc"}),
    "docker + runsc, python-data": (
        "tree",
        {"backend": "docker", "runtime": "runsc", "environment": "python-data"},
    ),
}


def _recorder() -> Recorder:
    rec = Recorder()
    rec.declare(BASELINE, "baseline: bare `subprocess` python3 -c 'print(1)'")
    for what, text in (("create", "create"), ("first", "create to first result of `1 + 1`")):
        for label in SERIES:
            rec.declare(f"{label}:{what}", f"{label}: {text}")
    for label in SERIES:
        if "python-data" in label:
            rec.declare(f"{label}:import", f"{label}: then `import pandas, matplotlib` cell")
    return rec


async def _cycle(rec: Recorder, manager: SandboxManager, label: str, args: dict[str, str]) -> None:
    started = time.perf_counter()
    info = await manager.create(SandboxSpec(**args))
    rec.add(f"{label}:create", time.perf_counter() - started)
    try:
        result = await manager.run_code(info.id, RunCode(code="1 + 1"))
        rec.add(f"{label}:first", time.perf_counter() - started)
        if result.text != "2":
            raise RuntimeError(f"{label}: unexpected result {result}")
        if "python-data" in label:
            begun = time.perf_counter()
            result = await manager.run_code(
                info.id, RunCode(code="import pandas, matplotlib.pyplot; 1")
            )
            rec.add(f"{label}:import", time.perf_counter() - begun)
            if result.text != "1":
                raise RuntimeError(f"{label}: unexpected result {result}")
    finally:
        await manager.destroy(info.id)


async def bench(rounds: int, data_dir: Path) -> Recorder:
    rec = _recorder()
    tree = Settings(  # type: ignore[call-arg]
        _env_file=None, data_dir=data_dir / "tree", log_level="ERROR", timeout_s=60.0
    )
    host = tree.model_copy(update={"data_dir": data_dir / "host", "rootfs_dir": data_dir / "no"})
    async with SandboxManager(tree) as with_tree, SandboxManager(host) as host_only:
        managers = {"tree": with_tree, "host": host_only}
        for label, (which, args) in SERIES.items():  # untimed: first-use costs
            await _cycle(_recorder(), managers[which], label, args)
        for _ in range(rounds):
            for _ in range(3):
                rec.add(BASELINE, await asyncio.to_thread(_bare_subprocess))
            for label, (which, args) in SERIES.items():
                await _cycle(rec, managers[which], label, args)
    return rec


def reading(rec: Recorder) -> str:
    """What the numbers say, from this run's medians (ratios, which survive the load)."""
    p50 = {key: stats.p50 for key, stats in rec.stats().items()}

    def ratio(a: str, b: str) -> str:
        return f"{p50[a] / p50[b]:.2f}x"

    host, tree = "bubblewrap host /usr, python3", "bubblewrap rootfs, python3"
    pairs = [
        ("bubblewrap", "bubblewrap rootfs, python-data", tree),
        ("docker", "docker, python-data", "docker, python3"),
        ("gVisor", "docker + runsc, python-data", "docker + runsc, python3"),
    ]
    data = ", ".join(f"{name} {ratio(f'{d}:first', f'{p}:first')}" for name, d, p in pairs)
    return (
        f"Reading: rootfs mode against host mode (python3 on bubblewrap), create "
        f"{ratio(f'{tree}:create', f'{host}:create')} and first result "
        f"{ratio(f'{tree}:first', f'{host}:first')} of host mode's median: one bind of the "
        f"tree instead of /usr, its links and ten /etc files. python-data against python3, "
        f"create to first result: {data}. An environment is one bind (or an image already "
        f"unpacked), so its size is not paid at create; its imports are paid by the cell that "
        f"imports them (pandas and matplotlib: the last series)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agsb-bench-env-", dir="/tmp") as tmp:
        root = Path(tmp)
        root.chmod(0o711)
        rec = asyncio.run(bench(args.rounds, root))
    section = "\n".join(
        [
            SECTION_TITLE,
            "",
            f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {machine_description()}. "
            f"{args.rounds} rounds, series interleaved; command: `{command_line()}`. "
            "Create is to a sandbox whose guest answers; first result is from the start of "
            "create to the first cell's value (the guest's Python kernel starts in between). "
            "bubblewrap host mode binds the host's /usr and links; rootfs mode binds the "
            "environment's tree as / (one bind instead of about a dozen). Docker and gVisor "
            "run the image imported from that same tree.",
            "",
            render_table(rec),
            "",
            reading(rec),
            "",
        ]
    )
    print(section)
    if args.output:
        write_section(args.output, section, SECTION_TITLE)


if __name__ == "__main__":
    main()
