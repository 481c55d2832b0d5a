"""120 SDK clients of one process, each a create or a run at once, against a per-address cap."""
import asyncio, sys, time, os, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main")
from tests.conftest import start_server, stop_server
from sandlot.server.auth import AuthStore
from sandlot.client import RemoteService
from sandlot.requests import RunCode, SandboxSpec

def main(cap: str, n: int) -> None:
    data = Path(tempfile.mkdtemp(prefix="ta-"))
    store = AuthStore(data / "sandlot.db"); key = store.create_key("acme", "user")[1]; store.close()
    proc, url, log = start_server(data, {"API_MAX_CONNECTIONS_PER_IP": cap, "TENANT_MAX_SANDBOXES": "200", "TENANT_MAX_MEMORY_MB": "100000", "SANDBOX_MEMORY_LIMIT_MB": "64", "TENANT_MAX_PIDS": "100000", "TENANT_MAX_CPU_CORES": "1000", "TENANT_MAX_DISK_MB": "1000000"})
    try:
        async def go():
            first = RemoteService(url, key)
            sb = await first.create(SandboxSpec())
            await first.aclose()
            clients = [RemoteService(url, key) for _ in range(n)]
            t = time.monotonic()
            calls = [c.create(SandboxSpec()) for c in clients[: n // 4]] + [c.run_code(sb.id, RunCode(code="6*7")) for c in clients[n // 4:]]
            res = await asyncio.gather(*calls, return_exceptions=True)
            wall = time.monotonic() - t
            await asyncio.gather(*(c.aclose() for c in clients))
            lost = [type(r).__name__ for r in res if isinstance(r, BaseException)]; print({str(r)[:150] for r in res if isinstance(r, BaseException)})
            print(f"cap {cap}, {n} calls ({n//4} creates): lost {len(lost)} {sorted(set(lost))}, wall {wall:.2f} s")
        asyncio.run(go())
    finally:
        stop_server(proc)

main(sys.argv[1], int(sys.argv[2]))
