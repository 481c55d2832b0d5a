"""50 concurrent clients against one real server: every answer right, nothing left behind.

A fresh `sandlot serve` process (its own data directory, auth on) gets 50 API keys in 50
tenants, so neither the per-key rate limit nor the per-tenant quota is what this test meets.
50 clients (asyncio tasks, one ``httpx.AsyncClient`` each) start at once; each creates a small
sandbox (``memory_mb=64``, ``disk_mb=16``), makes 20 calls that alternate Python
(``POST /code``, a running total kept in the sandbox's interpreter, so a call answered by
another client's sandbox or a lost call shows) and bash (``POST /commands``, ``echo``), checks
every result, and deletes the sandbox.

Then, with the server still up: no error anywhere, every result right, the 50 sandboxes ran as
50 distinct host uids, and nothing leaked: ``GET /v1/sandboxes`` (admin) is empty, and there
are no sandbox directories, mounts, loop devices, cgroups or processes of those uids left.
No timing is asserted; the run's timings are printed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import skip_reason, start_server, stop_server
from tests.leaks import CGROUP_FS, V1_CONTROLLERS, all_procs, mounts_below

CLIENTS = 50
CALLS = 20
REQUEST_TIMEOUT_S = 60.0  # 50 creates at once on 2 cores take a while; no timing is asserted
CLEANUP_WAIT_S = 5.0
SANDBOX = {"memory_mb": 64, "disk_mb": 16}
ALIVE_EVIDENCE = {"sandbox dir", "cgroup", "processes"}

pytestmark = pytest.mark.timeout(240)


@dataclass
class LoadServer:
    url: str
    data_dir: Path
    log: Path
    admin: dict[str, str] = field(repr=False)
    clients: list[dict[str, str]] = field(repr=False)  # one key per tenant
    cgroup_dirs: list[Path] = field(default_factory=list)  # <hierarchy>/<root>/<instance>
    cgroup_prefix: str = ""  # "/<root>/": every manager's sandboxes live below it
    instance: str = ""
    instance_dir: Path = Path()  # the server's instance of the data dir: its backends' state


@pytest.fixture(scope="module")
def load_server(data_root: Path) -> Iterator[LoadServer]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    from sandlot.server.auth import AuthStore

    data_dir = data_root / "load"
    data_dir.mkdir()
    data_dir.chmod(0o711)
    store = AuthStore(data_dir / "sandlot.db")
    admin = store.create_key("ops", "admin", "load test")[1]
    keys = [store.create_key(f"load{i:02d}", "user", "load test")[1] for i in range(CLIENTS)]
    store.close()
    from sandlot.backends.bubblewrap.backend import BubblewrapBackend
    from sandlot.config import Settings

    v1 = [CGROUP_FS / c for c in V1_CONTROLLERS if (CGROUP_FS / c).is_dir()]
    process, url, log = start_server(data_dir)
    try:
        (instance_dir,) = [p for p in (data_dir / "instances").iterdir() if p.name[0] != "."]
        settings = Settings(_env_file=None, data_dir=instance_dir)  # type: ignore[call-arg]
        instance = BubblewrapBackend(settings).instance
        yield LoadServer(
            url=url,
            data_dir=data_dir,
            log=log,
            admin={"Authorization": f"Bearer {admin}"},
            clients=[{"Authorization": f"Bearer {key}"} for key in keys],
            cgroup_dirs=[root / settings.cgroup_root / instance for root in v1 or [CGROUP_FS]],
            cgroup_prefix=f"/{settings.cgroup_root.strip('/')}/",
            instance=instance,
            instance_dir=instance_dir,
        )
    finally:
        stop_server(process)


@dataclass
class ClientReport:
    index: int
    sandbox_id: str | None = None
    uid: int | None = None
    seen_alive: set[str] = field(default_factory=set)  # what the leak checks look for, alive
    ok_calls: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)


def _expect(report: ClientReport, what: str, condition: bool, response: httpx.Response) -> bool:
    if not condition:
        report.errors.append(
            f"client {report.index}: {what}: {response.status_code} {response.text[:500]}"
        )
    return condition


async def _one_call(
    client: httpx.AsyncClient, report: ClientReport, sid: str, j: int, total: int
) -> int:
    """Call ``j``: Python on even ``j`` (adds ``j`` to the running total), bash on odd."""
    i = report.index
    started = time.perf_counter()
    if j % 2 == 0:
        code = f"total = {j}" if j == 0 else f"total += {j}"
        total += j
        response = await client.post(f"/v1/sandboxes/{sid}/code", json={"code": f"{code}\ntotal"})
        expected = {"exit_code": 0, "text": str(total), "error": None, "kill_reason": None}
    else:
        response = await client.post(
            f"/v1/sandboxes/{sid}/commands", json={"command": f"echo {i}-{j}"}
        )
        expected = {"exit_code": 0, "stdout": f"{i}-{j}\n", "stderr": "", "kill_reason": None}
    report.latencies_ms.append((time.perf_counter() - started) * 1000)
    if _expect(report, f"call {j} status", response.status_code == 200, response):
        body = response.json()
        got = {key: body.get(key) for key in expected}
        if _expect(report, f"call {j} gave {got}, expected {expected}", got == expected, response):
            report.ok_calls += 1
    return total


async def _client(server: LoadServer, index: int, start: asyncio.Event) -> ClientReport:
    report = ClientReport(index)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.clients[index], timeout=REQUEST_TIMEOUT_S
    ) as client:
        await start.wait()
        try:
            response = await client.post("/v1/sandboxes", json=SANDBOX)
            if not _expect(report, "create", response.status_code == 201, response):
                return report
            info = response.json()
            sid = report.sandbox_id = info["id"]
            _expect(report, "limits", info["limits"]["memory_mb"] == 64, response)
            # The host uid the sandbox runs as: the owner of its workspace.
            report.uid = (server.instance_dir / "sandboxes" / sid / "workspace").stat().st_uid
            report.seen_alive = _alive_evidence(server, sid)
            try:
                total = 0
                for j in range(CALLS):
                    total = await _one_call(client, report, sid, j, total)
            finally:
                response = await client.delete(f"/v1/sandboxes/{sid}")
                if _expect(report, "delete", response.status_code == 200, response):
                    _expect(report, "status", response.json()["status"] == "destroyed", response)
        except Exception as exc:  # every client's failure is reported, not only the first
            report.errors.append(f"client {index}: {type(exc).__name__}: {exc}")
    return report


def _alive_evidence(server: LoadServer, sid: str) -> set[str]:
    """Which of the things the leak checks look for a live sandbox shows (all of them, or the
    checks look in the wrong place)."""
    seen = set()
    if (server.instance_dir / "sandboxes" / sid).is_dir():
        seen.add("sandbox dir")
    cgroups = [d / sid for d in server.cgroup_dirs if (d / sid).is_dir()]
    if cgroups:
        seen.add("cgroup")
    if any((c / "cgroup.procs").read_text().split() for c in cgroups):
        seen.add("processes")
    return seen


def _leftovers(server: LoadServer, uids: set[int]) -> dict[str, list[str]]:
    root = server.data_dir.resolve()
    sandboxes = server.instance_dir / "sandboxes"
    ours = f"{server.cgroup_prefix}{server.instance}/"
    found: dict[str, list[str]] = {
        "sandbox dirs": sorted(p.name for p in sandboxes.iterdir()) if sandboxes.is_dir() else [],
        # The instance's launch namespace pin stays while the server runs (test_launchns.py).
        "mounts": mounts_below(root),
        "loop devices": [],
        "cgroups": [],
        # Our uids are free again once deleted, and another server on this host may hand them
        # to its sandboxes: a process in another manager's cgroups is not ours. One in ours, or
        # outside every sandbox cgroup (escaped, or a zombie), is.
        "processes": [
            str(p)
            for p in all_procs()
            if uids.intersection(p.uids)
            and (p.cgroup.startswith(ours) or not p.cgroup.startswith(server.cgroup_prefix))
        ],
    }
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            target = backing.read_text().strip()
        except OSError:
            continue
        if target.startswith(f"{root}/"):
            found["loop devices"].append(f"{backing.parent.parent.name} -> {target}")
    for instance in server.cgroup_dirs:
        if instance.is_dir():
            found["cgroups"] += [str(c) for c in instance.iterdir() if c.is_dir()]
    return {what: items for what, items in found.items() if items}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round((len(ordered) - 1) * q / 100))] if ordered else 0.0


async def test_fifty_concurrent_clients(load_server: LoadServer) -> None:
    start = asyncio.Event()
    tasks = [asyncio.create_task(_client(load_server, i, start)) for i in range(CLIENTS)]
    await asyncio.sleep(0.1)  # every client is waiting at the start line
    started = time.perf_counter()
    start.set()
    reports = await asyncio.gather(*tasks)
    wall = time.perf_counter() - started

    latencies = [ms for r in reports for ms in r.latencies_ms]
    print(
        f"\n{CLIENTS} clients x {CALLS} calls in {wall:.1f} s; per call p50 "
        f"{_percentile(latencies, 50):.1f} ms, p95 {_percentile(latencies, 95):.1f} ms, "
        f"max {max(latencies, default=0):.1f} ms"
    )
    errors = [e for r in reports for e in r.errors]
    assert not errors, f"{len(errors)} error(s):\n" + "\n".join(errors[:40])
    assert sum(r.ok_calls for r in reports) == CLIENTS * CALLS
    uids = {r.uid for r in reports if r.uid is not None}
    assert len(uids) == CLIENTS, f"{CLIENTS} live sandboxes shared host uids: {sorted(uids)}"
    assert all(uid >= 200_000 for uid in uids), sorted(uids)
    blind = {r.index: r.seen_alive for r in reports if r.seen_alive != ALIVE_EVIDENCE}
    assert not blind, f"the leak checks could not see these live sandboxes: {blind}"

    async with httpx.AsyncClient(
        base_url=load_server.url, headers=load_server.admin, timeout=REQUEST_TIMEOUT_S
    ) as admin:
        listed = await admin.get("/v1/sandboxes")
    assert listed.status_code == 200, listed.text
    assert listed.json() == [], [s["id"] for s in listed.json()]

    # The kernel and init may need a moment to reap the last processes.
    deadline = time.monotonic() + CLEANUP_WAIT_S
    while (left := _leftovers(load_server, uids)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not left, f"left behind after every sandbox was deleted: {left}"
