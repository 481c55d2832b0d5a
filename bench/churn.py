"""Four workers creating, cancelling, expiring and destroying sandboxes at random in one
manager: any error that is not a sandbox's own (an OSError of ours, say the EBADF CI saw
twice: a guest's pipes closed twice under uvloop, fixed by ``backends/pipes.py``) is printed
with its traceback and counted.

Its own data dir, uid base and cgroup root, so it can run beside the test suite.

Usage::

    .venv/bin/python bench/churn.py [--seconds 90] [--workers 4] [--seed 2]
                                    [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

from bench_core import LOOPS, run_on  # noqa: E402
from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.errors import SandboxError  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec, SetTimeout  # noqa: E402

ACTIONS = ("lifecycle", "cancel", "expire")


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="sandlot-churn-", dir="/tmp"))
    root.chmod(0o711)
    settings = Settings(
        data_dir=root / "data",
        uid_base=args.uid_base,
        cgroup_root=args.cgroup_root,
        log_level="ERROR",
        reaper_interval_s=0.1,
    )
    done: Counter[str] = Counter()
    faults: list[str] = []
    try:
        async with SandboxManager(settings) as manager:
            end = time.monotonic() + args.seconds

            async def one(action: str, owner: str) -> None:
                create = asyncio.ensure_future(
                    manager.create(SandboxSpec(memory_mb=128, disk_mb=16), owner=owner)
                )
                if action == "cancel":
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    create.cancel()
                    try:
                        info = await create
                    except asyncio.CancelledError:
                        return
                else:
                    info = await create
                if action == "expire":  # the reaper ends it, maybe while we look
                    await manager.extend(info.id, SetTimeout(ttl_s=0.001), owner=owner)
                    await asyncio.sleep(rng.uniform(0, 0.3))
                    return
                await manager.run_code(info.id, RunCode(code="6 * 7"), owner=owner)
                await manager.destroy(info.id, owner=owner)

            async def worker() -> None:
                while time.monotonic() < end:
                    action = rng.choice(ACTIONS)
                    try:
                        await one(action, rng.choice(("alice", "bob")))
                        done[action] += 1
                    except SandboxError as exc:
                        if "Errno" in str(exc):  # an OSError of ours under a start error
                            faults.append(repr(exc))
                            traceback.print_exc()
                    except Exception as exc:
                        faults.append(repr(exc))
                        traceback.print_exc()

            await asyncio.gather(*(worker() for _ in range(args.workers)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{sum(done.values())} done {dict(done)}; faults: {len(faults)} {faults[:5]}")
    return 1 if faults else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--uid-base", type=int, default=330_000)
    parser.add_argument("--cgroup-root", default="sandlot-churn")
    # The EBADF was uvloop's (the server's loop until 2026-11-28): asyncio's never showed it.
    parser.add_argument("--loop", choices=LOOPS, default="asyncio")
    args = parser.parse_args()
    return run_on(args.loop, run(args))


if __name__ == "__main__":
    sys.exit(main())
