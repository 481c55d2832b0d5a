"""What the fourteenth red-team round's fixes cost a sandbox's lifecycle.

A networked bubblewrap sandbox's flows are now deleted from the host's table when it ends and
before its /30 is given again (``hostnet.forget_flows``: a ``conntrack -D`` each time), and
every frame to a guest goes through one lock. This times, in one embedded manager, whole
lifecycles (create, one ``run_code``, destroy, its teardown waited for), networked and not,
alternated round by round, and the exec round trip. Runs on whichever ``sandlot`` is
importable (``PYTHONPATH=<tree>/src`` for a tree before a change)::

    python bench/bench_round14.py [--rounds 5] [--lifecycles 20] [--execs 200]
    python bench/bench_round14.py --starved [--writes 60]

``--starved``: what a guest starved by its own sandbox costs the server. One real ``sandlot
serve``; tenant alice's 0.25-core sandbox puts its guest's threads at the lowest priority
(``SCHED_IDLE``, nice 19: same uid) behind 150 busy loops, then sends ``--writes`` MCP
``write_file`` calls of 7 MiB, each hanging up once its answer's head came. The server's RSS
before and after, alice's destroy, and tenant bob's reads of his own sandbox meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

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


STARVE = r"""
import os, time
def idle_guest():
    for tid in os.listdir("/proc/1/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
for _ in range(150):
    if os.fork() == 0:
        while True:
            pass
while True:  # each new guest thread (one a request) idle too
    idle_guest()
    time.sleep(0.02)
"""
MCP_VERSION = "2025-06-18"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _post_and_hang_up(url: str, headers: dict[str, str], body: dict[str, Any]) -> bytes:
    """POST ``body`` on a raw socket; hang up once the answer's head came (or 3 s)."""
    host, port = url.split("//")[1].split(":")
    data = json.dumps(body).encode()
    head = {**headers, "Host": "x", "Content-Type": "application/json"}
    head["Content-Length"] = str(len(data))
    request = "POST /mcp HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request.encode() + b"\r\n" + data)
        sock.settimeout(3)
        try:
            return sock.recv(200)
        except TimeoutError:
            return b""


def starved(writes: int) -> None:
    from bench.bench_answers import _auth, serve

    data = Path(tempfile.mkdtemp(prefix="sandlot-round14-", dir="/var/tmp"))
    data.chmod(0o711)
    process, url, keys = serve(data, 50)
    try:
        alice = httpx.Client(base_url=url, headers=_auth(keys["alice"]), timeout=60)
        bob = httpx.Client(base_url=url, headers=_auth(keys["bob"]), timeout=60)
        spec = {"memory_mb": 256, "cpu_cores": 0.25, "pids": 256}
        own, theirs = (c.post("/v1/sandboxes", json=spec).json()["id"] for c in (bob, alice))
        path = f"/v1/sandboxes/{theirs}"
        alice.put(f"{path}/files/content", params={"path": "s.py"}, content=STARVE.encode())
        alice.post(f"{path}/commands", json={"command": "python3 s.py", "background": True})
        time.sleep(5)
        mcp = {**_auth(keys["alice"]), "Accept": "application/json, text/event-stream"}
        mcp["mcp-protocol-version"] = MCP_VERSION
        hello = {"protocolVersion": MCP_VERSION, "capabilities": {}, "clientInfo": {"name": "b"}}
        opened = alice.post(
            "/mcp",
            headers=mcp,
            json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        )
        mcp["mcp-session-id"] = opened.headers["mcp-session-id"]
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        alice.post("/mcp", headers=mcp, json=initialized)
        before = _rss_mb(process.pid)
        latencies: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                bob.get(f"/v1/sandboxes/{own}")
                latencies.append((time.perf_counter() - started) * 1000)
                time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        content = "a" * (7 << 20)
        sent, started = 0, time.monotonic()
        while sent < writes and time.monotonic() - started < 150:
            arguments = {"path": f"m{sent}", "content": content, "sandbox_id": theirs}
            call = {"name": "write_file", "arguments": arguments}
            body = {"jsonrpc": "2.0", "id": 10 + sent, "method": "tools/call", "params": call}
            if b" 429 " in _post_and_hang_up(url, mcp, body)[:20]:
                time.sleep(0.3)
                continue
            sent += 1
        print(f"{sent} MCP writes of 7 MiB sent in {time.monotonic() - started:.0f} s")
        for wait_s in (0, 10, 20, 30):
            time.sleep(wait_s and 10)
            grown = _rss_mb(process.pid) - before
            print(f"  +{wait_s:2d} s: the server's RSS {grown:+7.0f} MB (from {before:.0f})")
        stop.set()
        prober.join()
        print(f"bob's reads meanwhile: {_summary(latencies)}")
        started = time.monotonic()
        gone = alice.delete(path, timeout=300).status_code
        print(f"alice's destroy: {gone} in {time.monotonic() - started:.1f} s")
        time.sleep(3)
        print(f"the server's RSS after it: {_rss_mb(process.pid) - before:+.0f} MB")
    finally:
        process.terminate()
        process.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lifecycles", type=int, default=20)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--starved", action="store_true")
    parser.add_argument("--writes", type=int, default=60)
    args = parser.parse_args()
    if args.starved:
        import sandlot

        print(f"sandlot from {Path(sandlot.__file__).parent}")
        await asyncio.to_thread(starved, args.writes)
        return
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
