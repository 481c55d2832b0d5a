"""What a client with no API key costs the server: a flood of keyless requests from one
address, with the limit on failed authentications per address off and on (alternated).

Starts ``sandlot serve`` (its own data directory) per series; ``--clients`` threads connect
from 127.0.0.2 and send ``GET /v1/sandboxes`` with no key, on kept-alive connections,
reconnecting whenever the server closes one, for ``--seconds``; meanwhile a keyed client on
127.0.0.1 asks the same path in turn. Prints per series: the server's CPU (its process, from
/proc) a second of flood, the 401s it answered, the connections it closed unread, how fast
its log grew (the access log is on, as a server runs), and the keyed client's p50 / p95. The
client threads share these cores: read the server's CPU, not the attack's rate.

Usage::

    .venv/bin/python bench/bench_keyless.py [--seconds 5] [--clients 4] [--rounds 2]
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

import httpx

from sandlot.server.auth import AuthStore

ATTACKER = "127.0.0.2"
KEYLESS = b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n\r\n"
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _flood(port: int, until: float, counts: dict[str, int], lock: threading.Lock) -> None:
    answered = closed = 0
    sock: socket.socket | None = None
    while time.monotonic() < until:
        try:
            if sock is None:
                sock = socket.socket()
                sock.settimeout(2)
                sock.bind((ATTACKER, 0))
                sock.connect(("127.0.0.1", port))
            sock.sendall(KEYLESS)
            data = sock.recv(65536)
            if not data:
                raise ConnectionResetError
            answered += data.count(b"HTTP/1.1 401")
            if b"connection: close" in data.lower():
                raise ConnectionResetError
        except OSError:
            closed += 1
            if sock is not None:
                sock.close()
            sock = None
    if sock is not None:
        sock.close()
    with lock:
        counts["answered"] += answered
        counts["closed"] += closed


def run_series(limit_on: bool, seconds: float, clients: int) -> dict[str, float]:
    data_dir = Path(tempfile.mkdtemp(prefix="sandlot-keyless-"))
    store = AuthStore(data_dir / "sandlot.db")
    key = store.create_key("acme", "user")[1]
    store.close()
    port = _free_port()
    env = {
        **os.environ,
        "SANDLOT_DATA_DIR": str(data_dir),
        "LOG_LEVEL": "INFO",  # the access log on, as a server runs
        "API_AUTH_FAILURES_PER_SECOND": "2" if limit_on else "0",
    }
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        counts = {"answered": 0, "closed": 0}
        lock = threading.Lock()
        cpu_before = _cpu_s(server.pid)
        started = time.monotonic()
        until = started + seconds
        threads = [
            threading.Thread(target=_flood, args=(port, until, counts, lock))
            for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        keyed_ms: list[float] = []
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}) as client:
            while time.monotonic() < until:
                t0 = time.perf_counter()
                client.get(url + "/v1/sandboxes")
                keyed_ms.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.02)
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        cpu = _cpu_s(server.pid) - cpu_before
        log_bytes = (data_dir / "server.log").stat().st_size
    finally:
        server.terminate()
        server.wait(10)
        log.close()
    keyed_ms.sort()
    return {
        "server_cpu_per_s": cpu / elapsed,
        "answered_per_s": counts["answered"] / elapsed,
        "closed_per_s": counts["closed"] / elapsed,
        "keyed_p50_ms": statistics.median(keyed_ms),
        "keyed_p95_ms": keyed_ms[int(0.95 * (len(keyed_ms) - 1))],
        "log_kb_per_s": log_bytes / 1024 / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(
        "| limit on failed authentications | round | server CPU s / s | 401s / s | "
        "connections closed / s | its log, KiB / s | keyed p50 / p95 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for n in range(args.rounds):
        for limit_on in (False, True):
            r = run_series(limit_on, args.seconds, args.clients)
            print(
                f"| {'on (2/s, burst 30)' if limit_on else 'off'} | {n + 1} | "
                f"{r['server_cpu_per_s']:.2f} | {r['answered_per_s']:,.0f} | "
                f"{r['closed_per_s']:,.0f} | {r['log_kb_per_s']:,.1f} | "
                f"{r['keyed_p50_ms']:.1f} / {r['keyed_p95_ms']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
