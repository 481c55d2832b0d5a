"""What the trust walls of 2026-11-24 cost: sealing a frame, capping a sandbox's terminals,
and a guest restart on gVisor (a container restart) against one on runc.

Prints medians and p95; run as root with bubblewrap (and docker with runc and runsc for the
restart series): ``.venv/bin/python bench/bench_trust.py [--rounds N] [--no-docker]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from sandlot import Sandbox
from sandlot.backends.devpts import BWRAP_OPTIONS, cap_ptys
from sandlot.guest.seal import KEY_BYTES, TO_HOST, Seal


def _summary(name: str, samples_ms: list[float]) -> None:
    ordered = sorted(samples_ms)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    print(f"{name}: p50 {statistics.median(ordered):.3f} ms, p95 {p95:.3f} ms, n={len(ordered)}")


def _timed(fn: Callable[[], object], times: int) -> list[float]:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def seal_cost(rounds: int) -> None:
    seal = Seal(os.urandom(KEY_BYTES), TO_HOST)
    body = b"x" * 200
    # ms per 1,000 frames is us per frame.
    per_frame_us = _timed(lambda: [seal.seal(body) for _ in range(1000)], rounds)
    print(f"seal one 200-byte frame: p50 {statistics.median(per_frame_us):.2f} us")


def supervisor_pid(sb: Sandbox) -> int:
    """The host pid of ``sb``'s guest supervisor: the process of its cgroup that is pid 1 of
    its pid namespace (forked from a template, its command line is the template's; started
    by bwrap, it is bwrap's ``--as-pid-1``)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if sb.id not in (proc / "cgroup").read_text():
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        nspid = next(
            (line.split() for line in status.splitlines() if line.startswith("NSpid:")), []
        )
        if len(nspid) > 2 and nspid[-1] == "1":
            return int(proc.name)
    raise RuntimeError(f"no supervisor of {sb.id} found")


def cap_cost(rounds: int) -> None:
    with Sandbox.create(backend="bubblewrap") as sb:
        pid = supervisor_pid(sb)
        _summary(
            "cap_ptys (thread, setns, remount)",
            _timed(lambda: cap_ptys(pid, 32, BWRAP_OPTIONS), rounds * 20),
        )
        cpu_started = time.process_time()
        for _ in range(rounds * 20):
            cap_ptys(pid, 32, BWRAP_OPTIONS)
        cpu_ms = (time.process_time() - cpu_started) / (rounds * 20) * 1000
        print(f"cap_ptys CPU: {cpu_ms:.3f} ms per call")


def restart_cost(runtime: str, rounds: int) -> None:
    with Sandbox.create(backend="docker", runtime=runtime) as sb:
        samples = []
        for _ in range(rounds):
            sb.run_code("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", timeout_s=10)
            started = time.perf_counter()
            result = sb.commands.run("echo ok")
            samples.append((time.perf_counter() - started) * 1000)
            assert result.stdout == "ok\n", result
        _summary(f"docker {runtime}: first call after the guest was killed", samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-docker", action="store_true")
    args = parser.parse_args()
    seal_cost(args.rounds * 20)
    cap_cost(args.rounds)
    if not args.no_docker:
        for runtime in ("runc", "runsc", "runc", "runsc"):
            restart_cost(runtime, args.rounds)


if __name__ == "__main__":
    main()
