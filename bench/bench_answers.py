"""What a large answer costs the server, and another tenant meanwhile (red team, 2026-12-06).

One real ``sandlot serve``; tenant ``alice`` has a sandbox whose ``d/`` holds ``--files``
empty files (a listing of ~26,000 entries at 30,000: the guest's 4 MiB bound), and an ended
sandbox that kept ``--artifacts`` files. For each kind of call, ``--calls`` of them one after
another (the server's CPU a call, from /proc), then ``--flood-s`` seconds of them from two
threads while tenant ``bob`` reads his own sandbox every 50 ms (his latency: median, p95).

Runs on whichever ``sandlot`` is importable (``PYTHONPATH=<tree>/src`` for a tree before a
change). The key's rate is ``--rate`` (high by default, to measure the cost of each call
rather than the limit; 50 is the server's default)::

    python bench/bench_answers.py [--files 30000] [--artifacts 10000] [--rate 100000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from sandlot.server.auth import AuthStore

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def serve(data: Path, rate: float) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    store = AuthStore(data / "sandlot.db")
    keys = {who: store.create_key(who, "user")[1] for who in ("alice", "bob")}
    store.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "SANDLOT_DATA_DIR": str(data),
        "SANDBOX_UID_BASE": "540000",
        "SANDBOX_CGROUP_ROOT": "sandlot-bench-answers",
        "LOG_LEVEL": "WARNING",
        "API_RATE_LIMIT_PER_SECOND": str(rate),
        "API_RATE_LIMIT_BURST": str(max(100, int(rate))),
    }
    log = (data / "server.log").open("ab")
    cmd = [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return process, url, keys


def fill(http: httpx.Client, files: int, artifacts: int) -> tuple[str, str, str]:
    """alice's live sandbox (``d/`` of ``files``), her ended one (``artifacts`` kept)."""
    live = http.post("/v1/sandboxes", json={"disk_mb": 256}).json()["id"]
    code = f"import os\nos.mkdir('d')\nfor i in range({files}):\n    open('d/%d' % i, 'w').close()"
    assert http.post(f"/v1/sandboxes/{live}/code", json={"code": code}).is_success
    ended = http.post("/v1/sandboxes", json={"disk_mb": 256}).json()["id"]
    code = code.replace("'d'", "'artifacts'").replace("'d/%d'", "'artifacts/f%05d'")
    code = code.replace(str(files), str(artifacts))
    assert http.post(f"/v1/sandboxes/{ended}/code", json={"code": code}).is_success
    assert http.delete(f"/v1/sandboxes/{ended}").is_success
    return live, ended, "f00042"


def measure(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="sandlot-answers-", dir="/tmp"))
    root.chmod(0o711)
    process, url, keys = serve(root, args.rate)
    try:
        alice = httpx.Client(base_url=url, headers=_auth(keys["alice"]), timeout=120)
        bob = httpx.Client(base_url=url, headers=_auth(keys["bob"]), timeout=120)
        live, ended, one = fill(alice, args.files, args.artifacts)
        own = bob.post("/v1/sandboxes", json={}).json()["id"]
        calls: dict[str, tuple[str, dict[str, Any]]] = {
            "listing": (f"/v1/sandboxes/{live}/files", {"path": "d"}),
            "artifact list": (f"/v1/sandboxes/{ended}/artifacts", {}),
            "artifact download (empty file)": (f"/v1/sandboxes/{ended}/artifacts/{one}", {}),
        }
        print("| call | answer | server CPU a call (ms, median) | bob's GET p50 / p95 (ms) |")
        print("|---|---:|---:|---:|")
        quiet = _latencies(bob, own, 2.0)
        print(f"| none (bob alone) | | | {_p(quiet)} |")
        for name, (path, params) in calls.items():
            spent, size = [], 0
            for _ in range(args.calls):
                before = cpu_s(process.pid)
                answer = alice.get(path, params=params)
                spent.append((cpu_s(process.pid) - before) * 1000)
                size = len(answer.content)
            flood = _flood(alice, path, params, lambda: _latencies(bob, own, args.flood_s))
            print(f"| {name} | {size:,} B | {statistics.median(spent):.0f} | {_p(flood)} |")
    finally:
        process.terminate()
        process.wait(30)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _latencies(bob: httpx.Client, own: str, seconds: float) -> list[float]:
    out: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        bob.get(f"/v1/sandboxes/{own}")
        out.append((time.perf_counter() - started) * 1000)
        time.sleep(0.05)
    return out


def _flood(http: httpx.Client, path: str, params: dict[str, Any], meanwhile: Any) -> list[float]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            http.get(path, params=params)

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        return list(meanwhile())
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def _p(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"{statistics.median(ordered):.1f} / {p95:.1f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=30_000)
    parser.add_argument("--artifacts", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--flood-s", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=100_000.0)
    measure(parser.parse_args())
