"""Where one sandbox lifecycle's wall time and CPU go (bubblewrap, embedded).

Runs ``--lifecycles`` cycles of ``manager.create()``, ``run_code('1')``, ``destroy()`` in a
fresh data directory and prints the p50 of each phase: the backend's private steps are wrapped
with timers (this is a profile, not a benchmark with a stable interface), plus CPU per
lifecycle from ``os.times()`` (this process; the children it reaped) and from ``cpuacct.usage``
of the sandboxes' cgroups (cgroup v1 with cpuacct; read after ready and after the first
result). To compare two trees, run it alternately with each tree's ``src`` on PYTHONPATH.

Usage::

    .venv/bin/python bench/profile_lifecycle.py [--lifecycles 15] [--cpu-cores 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

for _var in list(os.environ):
    if _var.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
        del os.environ[_var]

import sandlot.backends.bubblewrap.backend as bw  # noqa: E402
import sandlot.core.guest_link as guest_link  # noqa: E402
import sandlot.core.live as live_module  # noqa: E402
from sandlot import SandboxManager, Settings  # noqa: E402
from sandlot.requests import RunCode, SandboxSpec  # noqa: E402

PHASES_MS: dict[str, list[float]] = {}
# Each step's begin and end, in ms since its lifecycle's create began (the timeline).
SPANS_MS: dict[str, list[tuple[float, float]]] = {}
LIFECYCLE_T0 = [0.0]


def record(name: str, ms: float) -> None:
    PHASES_MS.setdefault(name, []).append(ms)


def _recorded(name: str, started: float) -> None:
    ended = time.perf_counter()
    record(name, (ended - started) * 1000)
    t0 = LIFECYCLE_T0[0]
    SPANS_MS.setdefault(name, []).append(((started - t0) * 1000, (ended - t0) * 1000))


def timed(owner: Any, attr: str, name: str) -> None:
    """Replace ``owner.attr`` (sync or async, static or not) by a wrapper that records its
    wall time; an ``attr`` this tree lacks is left out (to compare two trees)."""
    if not hasattr(owner, attr):
        return
    original: Callable[..., Any] = getattr(owner, attr)
    wrapped: Callable[..., Any]
    if asyncio.iscoroutinefunction(original):

        @functools.wraps(original)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                _recorded(name, started)

        wrapped = async_wrapper
    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _recorded(name, started)

        wrapped = wrapper
    if isinstance(inspect.getattr_static(owner, attr), staticmethod):
        setattr(owner, attr, staticmethod(wrapped))
    else:
        setattr(owner, attr, wrapped)


def instrument() -> None:
    timed(live_module.Live, "start_guest", "create: backend.start + the guest's ready")
    timed(bw.BubblewrapBackend, "start", "create: backend.start")
    timed(bw.BubblewrapBackend, "_provision", "create: provision (cgroup, volume, /proc files)")
    timed(bw, "make_sandbox_disk", "create: the workspace volume (mkfs, loop, mount)")
    timed(bw, "write_proc_files", "create: /proc files")
    timed(bw.BubblewrapBackend, "_spawn", "create: spawn the bwrap chain")
    timed(bw.BubblewrapBackend, "_go", "create: 'go' to the launcher")
    timed(bw.BubblewrapBackend, "_first_pid", "create: bwrap's namespace, until the guest's exec")
    timed(bw.BubblewrapBackend, "_mount_inside", "create: the manager's mounts inside")
    # The template guest's (absent from a tree without it, and from a --no-template run).
    timed(bw.BubblewrapBackend, "_template", "create: the template, taken")
    timed(bw.BubblewrapBackend, "_join", "create: the template's guest forked and joined")
    timed(guest_link.GuestConnection, "wait_ready", "create: the guest's ready")
    timed(bw.BubblewrapBackend, "stop", "destroy: backend.stop")
    timed(bw.BubblewrapBackend, "_end_guest", "destroy: end the guest")
    timed(bw, "remove_sandbox_disk", "destroy: unmount and remove the volume")


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _busy_s() -> float:
    """The machine's CPU time spent not idle (all CPUs, since boot), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def _cpuacct_s(cgroup: Any) -> float:
    return int((cgroup.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9


async def profile(args: argparse.Namespace, data_dir: Path) -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, data_dir=data_dir, log_level="ERROR", guest_template=args.template
    )
    spec = SandboxSpec(cpu_cores=args.cpu_cores) if args.cpu_cores else None
    async with SandboxManager(settings) as manager:
        info = await manager.create(spec)  # untimed: first-use costs
        await manager.destroy(info.id)
        PHASES_MS.clear()
        backend: Any = manager._backend("bubblewrap")
        instance = backend.cgroups.path(*backend._cgroup_prefix, backend.instance)
        await manager.settle()
        before, cgroups_before, machine_before = os.times(), _cpuacct_s(instance), _busy_s()
        SPANS_MS.clear()
        for _ in range(args.lifecycles):
            t0 = LIFECYCLE_T0[0] = time.perf_counter()
            info = await manager.create(spec)
            t1 = time.perf_counter()
            own = backend.cgroups.path(*backend._cgroup_parts(info.id))
            record("guest CPU: until ready (bwrap, supervisor)", _cpuacct_s(own) * 1000)
            result = await manager.run_code(info.id, RunCode(code="1"))
            t2 = time.perf_counter()
            record("guest CPU: at the first result (+ kernel, cell)", _cpuacct_s(own) * 1000)
            if result.text != "1":
                raise SystemExit(f"run_code('1') gave {result!r}")
            await manager.destroy(info.id)
            t3 = time.perf_counter()
            record("TOTAL create", (t1 - t0) * 1000)
            record("TOTAL first run_code('1')", (t2 - t1) * 1000)
            record("TOTAL destroy", (t3 - t2) * 1000)
            record("TOTAL lifecycle", (t3 - t0) * 1000)
        await manager.settle()  # the last destroy's teardown, which returned before it
        after, cgroups_after, machine_after = os.times(), _cpuacct_s(instance), _busy_s()
    n = args.lifecycles
    for name, values in sorted(PHASES_MS.items()):
        ordered = sorted(values)
        print(f"{name:55s} p50 {ordered[len(ordered) // 2]:7.1f} ms  n={len(ordered)}")
    # The destroy's steps are left out: they run after it returns, during the next create.
    print("the create's timeline, p50 ms since it began: begins -> ends")
    creates = [(n, spans) for n, spans in SPANS_MS.items() if n.startswith("create:")]
    for name, spans in sorted(creates, key=lambda item: _p50([b for b, _ in item[1]])):
        begins, ends = _p50([b for b, _ in spans]), _p50([e for _, e in spans])
        print(f"  {name:53s} {begins:6.1f} -> {ends:6.1f}")
    own_cpu = after.user + after.system - before.user - before.system
    children = (
        after.children_user + after.children_system - before.children_user - before.children_system
    )
    print(
        f"CPU per lifecycle: this process {own_cpu * 1000 / n:.1f} ms; reaped children "
        f"{children * 1000 / n:.1f} ms; sandbox cgroups "
        f"{(cgroups_after - cgroups_before) * 1000 / n:.1f} ms"
    )
    # The sum above counts bwrap's first process twice (in its cgroup, and in this process's
    # reaped children, as bwrap waits for the sandbox's processes) and leaves out the kernel's
    # own threads (loop devices, a network namespace's cleanup): the machine's busy time
    # counts each CPU second once, everything else running included (a quiet machine).
    machine_ms = (machine_after - machine_before) * 1000 / n
    print(f"CPU per lifecycle, the whole machine: {machine_ms:.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--lifecycles", type=int, default=15)
    parser.add_argument("--cpu-cores", type=float, help="instead of the default quota")
    parser.add_argument(
        "--no-template",
        dest="template",
        action="store_false",
        help="start every guest afresh (SANDBOX_GUEST_TEMPLATE=false) instead of forking it "
        "from the template",
    )
    args = parser.parse_args(argv)
    instrument()
    root = Path(tempfile.mkdtemp(prefix="agsb-prof-", dir="/tmp"))
    root.chmod(0o711)  # sandbox uids must traverse it to reach their workspaces
    try:
        asyncio.run(profile(args, root / "data"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
