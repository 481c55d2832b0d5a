"""What the thirteenth red-team round's attacks cost the server and another tenant.

One real ``sandlot serve`` at its default rate (50 requests/s a key, burst 100); each attack
comes from a tenant of its own, and tenant ``bob`` reads his own sandbox every 50 ms (his
latency: median, p95). Each attack runs ``--seconds`` or until it is done; the server's CPU
over it comes from /proc. Runs on whichever ``sandlot`` is importable
(``PYTHONPATH=<tree>/src`` for a tree before a change)::

    python bench/bench_round13.py [--clients 20] [--reads 8] [--listings 10]

- ``fan-out``: a terminal running ``cat /dev/urandom`` in a 0.5-core sandbox, ``--clients``
  WebSockets attached to it, each reading;
- ``mcp reads``: ``--reads`` MCP ``read_file`` calls at once, of an 8 MiB file of control
  characters;
- ``listings``: ``--listings`` listings at once of a directory of 30,000 files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.`
import contextlib

from bench.bench_answers import _auth, cpu_s, serve
from sandlot.server.auth import AuthStore

MCP_VERSION = "2025-06-18"


def _mcp_headers(key: str, session: str | None = None) -> dict[str, str]:
    headers = {
        **_auth(key),
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "mcp-protocol-version": MCP_VERSION,
    }
    if session:
        headers["mcp-session-id"] = session
    return headers


class Bob:
    """bob's GET of his own sandbox every 50 ms, on a thread, while an attack runs."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers=_auth(key), timeout=120)
        self.own = self.http.post("/v1/sandboxes", json={}).json()["id"]
        self.latencies_ms: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Bob:
        self.latencies_ms, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._loop)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.http.get(f"/v1/sandboxes/{self.own}")
            self.latencies_ms.append((time.monotonic() - started) * 1000)
            self._stop.wait(0.05)

    def seen(self) -> str:
        values = sorted(self.latencies_ms)
        if not values:
            return "-"
        p95 = values[min(len(values) - 1, int(len(values) * 0.95))]
        return f"{statistics.median(values):.1f} / {p95:.1f}"


async def fan_out(url: str, key: str, clients: int, seconds: float) -> str:
    async with httpx.AsyncClient(base_url=url, headers=_auth(key), timeout=120) as http:
        made = await http.post("/v1/sandboxes", json={"cpu_cores": 0.5})
        sid = made.json()["id"]
        pty = await http.post(f"/v1/sandboxes/{sid}/pty", json={"command": "cat /dev/urandom"})
        pid = pty.json()["pid"]
        uri = url.replace("http", "ws") + f"/v1/sandboxes/{sid}/stream"
        stop, attached, received = asyncio.Event(), [0], [0]

        async def client() -> None:
            async with websockets.connect(uri, additional_headers=_auth(key), max_size=None) as ws:
                await ws.send(json.dumps({"type": "pty", "pid": pid}))
                first = json.loads(await ws.recv())
                if first["type"] != "started":
                    return  # refused (too_many_listeners)
                attached[0] += 1
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        received[0] += len(await asyncio.wait_for(ws.recv(), 0.5))

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.delete(f"/v1/sandboxes/{sid}")
    return f"{attached[0]} of {clients} attached, {received[0] / seconds / 1e6:.1f} MB/s sent"


async def mcp_reads(url: str, key: str, reads: int) -> str:
    async with httpx.AsyncClient(
        base_url=url, timeout=300, limits=httpx.Limits(max_connections=reads + 4)
    ) as http:
        hello = {"protocolVersion": MCP_VERSION, "capabilities": {}}
        hello["clientInfo"] = {"name": "bench", "version": "1"}
        opened = await http.post(
            "/mcp",
            headers=_mcp_headers(key),
            json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        )
        session = opened.headers["mcp-session-id"]
        headers = _mcp_headers(key, session)
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        await http.post("/mcp", headers=headers, json=note)

        async def call(n: int, tool: str, arguments: dict[str, Any]) -> httpx.Response:
            params = {"name": tool, "arguments": arguments}
            body = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params}
            return await http.post("/mcp", headers=headers, json=body)

        write = "python3 -c \"import sys; sys.stdout.buffer.write(b'\\x01' * (8 << 20))\" > f"
        await call(2, "run_command", {"command": write})
        answers = await asyncio.gather(
            *(call(10 + n, "read_file", {"path": "f"}) for n in range(reads))
        )
        await http.delete("/mcp", headers=headers)
    largest = max(len(a.content) for a in answers)
    refused = sum(1 for a in answers if a.status_code == 429 or b'"isError":true' in a.content)
    return f"{refused} of {reads} refused, largest answer {largest / 1e6:.1f} MB"


async def listings(url: str, key: str, count: int) -> str:
    async with httpx.AsyncClient(
        base_url=url, headers=_auth(key), timeout=300, limits=httpx.Limits(max_connections=64)
    ) as http:
        made = await http.post("/v1/sandboxes", json={"disk_mb": 256, "memory_mb": 1024})
        sid = made.json()["id"]
        code = "import os\nos.mkdir('d')\nfor i in range(30000):\n    open('d/%d' % i, 'w').close()"
        await http.post(f"/v1/sandboxes/{sid}/code", json={"code": code})
        await asyncio.sleep(2.5)  # the key's burst back
        path = f"/v1/sandboxes/{sid}/files"
        answers = await asyncio.gather(
            *(http.get(path, params={"path": "d"}) for _ in range(count))
        )
        await http.delete(f"/v1/sandboxes/{sid}")
    made = sum(1 for a in answers if a.status_code == 200)
    others = sorted({f"{a.status_code} {a.text[:80]}" for a in answers if a.status_code != 200})
    return f"{made} of {count} made" + (f" (others: {others[0]})" if others else "")


def measure(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="sandlot-round13-", dir="/tmp"))
    root.chmod(0o711)
    # Each attack from a key (and tenant) of its own: before the fixes an attack left its
    # key in debt for minutes, and the next attack's create was refused.
    store = AuthStore(root / "sandlot.db")
    attackers = {name: store.create_key(name, "user")[1] for name in ("fan", "mcp", "list")}
    store.close()
    process, url, keys = serve(root, 50.0)
    try:
        bob = Bob(url, keys["bob"])
        print("| attack | what happened | server CPU (s) | bob's GET p50 / p95 (ms) |")
        print("|---|---|---:|---:|")
        with bob:
            time.sleep(3)
        print(f"| none (bob alone, 3 s) | | | {bob.seen()} |")
        attacks = {
            f"fan-out, {args.clients} clients, {args.seconds:g} s": lambda: fan_out(
                url, attackers["fan"], args.clients, args.seconds
            ),
            f"MCP read_file x {args.reads}": lambda: mcp_reads(url, attackers["mcp"], args.reads),
            f"listings x {args.listings}": lambda: listings(url, attackers["list"], args.listings),
        }
        for name, attack in attacks.items():
            time.sleep(3)  # alice's burst back
            before = cpu_s(process.pid)
            with bob:
                said = asyncio.run(attack())
            print(f"| {name} | {said} | {cpu_s(process.pid) - before:.1f} | {bob.seen()} |")
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--reads", type=int, default=8)
    parser.add_argument("--listings", type=int, default=10)
    measure(parser.parse_args())


if __name__ == "__main__":
    main()
