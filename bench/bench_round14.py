"""What the fourteenth red-team round's fixes cost a sandbox's lifecycle.

A networked bubblewrap sandbox's flows are now deleted from the host's table when it ends and
before its /30 is given again (``hostnet.forget_flows``: a ``conntrack -D`` each time), and
every frame to a guest goes through one lock. This times, in one embedded manager, whole
lifecycles (create, one ``run_code``, destroy, its teardown waited for), networked and not,
alternated round by round, and the exec round trip. Runs on whichever ``sandlot`` is
importable (``PYTHONPATH=<tree>/src`` for a tree before a change)::

    python bench/bench_round14.py [--rounds 5] [--lifecycles 20] [--execs 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `tests.`

from tests.conftest import make_settings

from sandlot import SandboxManager
from sandlot.requests import RunCode, SandboxSpec


def _summary(samples_ms: list[float]) -> str:
    ordered = sorted(samples_ms)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"median {statistics.median(ordered):7.2f} ms  p95 {p95:7.2f} ms  (n={len(ordered)})"


async def _lifecycles(mgr: SandboxManager, count: int, network: bool) -> list[float]:
    taken = []
    for _ in range(count):
        start = time.perf_counter()
        info = await mgr.create(SandboxSpec(backend="bubblewrap", network=network))
        await mgr.run_code(info.id, RunCode(code="1"))
        await mgr.destroy(info.id)
        await mgr.settle(info.id)
        taken.append((time.perf_counter() - start) * 1000)
    return taken


async def _round_trips(mgr: SandboxManager, count: int) -> list[float]:
    info = await mgr.create(SandboxSpec(backend="bubblewrap"))
    try:
        await mgr.run_code(info.id, RunCode(code="1"))
        taken = []
        for _ in range(count):
            start = time.perf_counter()
            await mgr.run_code(info.id, RunCode(code="1"))
            taken.append((time.perf_counter() - start) * 1000)
        return taken
    finally:
        await mgr.destroy(info.id)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lifecycles", type=int, default=20)
    parser.add_argument("--execs", type=int, default=200)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="sandlot-round14-", dir="/var/tmp"))
    data_dir.chmod(0o711)
    settings = make_settings(data_dir, uid_base=380_000, cgroup_root="sandlot-bench14")
    found: dict[str, list[float]] = {"networked": [], "offline": [], "exec": []}
    async with SandboxManager(settings) as mgr:
        await _lifecycles(mgr, 3, True)  # warm: templates, walls
        for _ in range(args.rounds):
            found["networked"] += await _lifecycles(mgr, args.lifecycles, True)
            found["offline"] += await _lifecycles(mgr, args.lifecycles, False)
            found["exec"] += await _round_trips(mgr, args.execs)
    import sandlot

    print(f"sandlot from {Path(sandlot.__file__).parent}")
    for name, samples in found.items():
        print(f"{name:10s} {_summary(samples)}")


if __name__ == "__main__":
    asyncio.run(main())
