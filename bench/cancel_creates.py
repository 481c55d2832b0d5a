"""Creates cancelled at random points: what each leaves open, and how long each takes to
unwind (issue 13's thirteenth pass; a red team's side find).

Starts one manager (its own data dir, uid base and cgroup root), warms its template, then
``--creates`` times starts a create, cancels it after a random 0..``--max-delay-ms`` (a create
already done is destroyed instead), and times the cancel until the create's task has ended.
Prints the manager's open descriptors by kind before and after (pidfds, pipes, uid locks,
others), the processes of its sandboxes' uids still running once the cancels have unwound
(a bwrap child orphaned by a launcher killed mid-way waits for ever: issue 13's fifteenth
pass), and the unwind's p50 / p95 / max; with ``--backend docker`` (or ``docker+runsc``),
also the containers of this manager's that are left once the cancels have unwound (a
cancelled create's container must go with it, not wait for the sweep at close).

Usage::

    .venv/bin/python bench/cancel_creates.py [--creates 80] [--max-delay-ms 40] [--seed 2]
                                             [--backend bubblewrap|docker|docker+runsc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `tests.`

from tests import leaks  # noqa: E402
from tests.conftest import placement  # noqa: E402

from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.backends.base import instance_of  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402


def containers_left(manager: SandboxManager) -> int:
    """Containers (running or not) labelled with this manager's instance."""
    from sandlot.backends.docker.dockerd import connect, labelled

    label = f"sandlot.instance={instance_of(manager.instance_dir)}"
    with contextlib.closing(connect()) as client:
        return len(labelled(client, [label]))


def open_fds() -> Counter[str]:
    kinds: Counter[str] = Counter()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target == "anon_inode:[pidfd]":
            kinds["pidfd"] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif "/uids" in target:
            kinds["uid lock"] += 1
        elif target.startswith("socket:"):
            kinds["socket"] += 1
        else:
            kinds["other"] += 1
    return kinds


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="sandlot-cancel-", dir="/tmp"))
    root.chmod(0o711)
    settings = Settings(
        data_dir=root / "data",
        uid_base=args.uid_base,
        cgroup_root=args.cgroup_root,
        log_level="WARNING",
    )
    spec = SandboxSpec(**placement(args.backend))
    left = None
    try:
        async with SandboxManager(settings) as manager:
            warm = await manager.create(spec)
            await manager.destroy(warm.id)
            await manager.settle()
            before = open_fds()
            unwind_s: list[float] = []
            completed = cancelled = 0
            for _ in range(args.creates):
                create = asyncio.ensure_future(manager.create(spec))
                await asyncio.sleep(rng.uniform(0, args.max_delay_ms / 1000))
                if create.done():
                    completed += 1
                    await manager.destroy(create.result().id)
                    continue
                started = time.perf_counter()
                create.cancel()
                try:
                    info = await create
                except asyncio.CancelledError:
                    cancelled += 1
                else:  # it finished before the cancel landed
                    completed += 1
                    await manager.destroy(info.id)
                unwind_s.append(time.perf_counter() - started)
            await manager.settle()
            await asyncio.sleep(0.5)
            after = open_fds()
            running = [
                f"{p.pid} {p.name} (uids {p.uids})"
                for p in leaks.running_in_uids(settings.uid_base, settings.uid_count)
            ]
            if spec.backend == "docker":
                left = containers_left(manager)
            check = await manager.create(spec)
            answer = await manager.run_code(check.id, RunCode(code="6 * 7"))
            await manager.destroy(check.id)
        print(
            f"{args.creates} creates: {len(unwind_s)} cancels sent, {cancelled} cancelled, "
            f"{completed} completed"
        )
        print(f"open descriptors before: {dict(sorted(before.items()))}")
        print(f"open descriptors after:  {dict(sorted(after.items()))}")
        print(f"processes of its sandboxes' uids left running: {len(running)} {running[:5]}")
        if left is not None:
            print(f"containers left after the cancels: {left}")
        if unwind_s:
            ms = sorted(1000 * s for s in unwind_s)
            p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
            print(f"unwind ms: p50 {statistics.median(ms):.0f}, p95 {p95:.0f}, max {ms[-1]:.0f}")
        print(f"a create after them: run_code('6 * 7') -> {answer.text}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=80)
    parser.add_argument("--max-delay-ms", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--uid-base", type=int, default=290_000)
    parser.add_argument("--cgroup-root", default="sandlot-cancel-creates")
    parser.add_argument(
        "--backend", default="bubblewrap", choices=("bubblewrap", "docker", "docker+runsc")
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
