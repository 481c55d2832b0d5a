"""Soak: many sandbox lifecycles against one real server, a hostile program in every 10th.

Method. A fresh ``sandlot serve`` (its own data directory, cgroup root and uid range, auth on)
gets one API key per client. ``--clients`` asyncio clients then run lifecycles until
``--lifecycles`` are done or ``--minutes`` have passed: create a small sandbox, run a program,
check its result, delete. Every 10th lifecycle runs a hostile program instead, in turn: a fork
bomb (expects ``kill_reason="pids"``, or a bomb that burned out against the limit after
its shell returned: a pids-limit hit in ``usage()``), a memory bomb (``"memory"``), an output flood
(``"output_limit"``) and a disk fill (the command fails with a full disk, no kill). After the
last one the server is still up and the soak checks, on the host:

- no server error (a 5xx) and no wrong result, hostile or not;
- nothing leaked: no process of a sandbox uid, no cgroup, mount, loop device or sandbox
  directory of this server, no live row in its store (``tests/leaks.py`` counts them);
- the server's resident memory grew less than ``--rss-bound-mb`` between the end of the
  warm-up (the first 5% of lifecycles) and the end.

Every figure goes to BENCHMARKS.md (``--output``). ``make soak`` runs the full 30 minutes; CI
does not.

Usage::

    .venv/bin/python bench/soak.py --minutes 30 --lifecycles 10000 --clients 20 \\
        --output BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from tests import leaks
from tests.conftest import make_settings, start_server, stop_server

from bench.bench_core import machine_description, write_section
from sandlot.core.store import Store
from sandlot.server.auth import AuthStore

SECTION_TITLE = "## Soak: sandbox lifecycles against one server, a hostile program in every 10th"
SMALL = {"memory_mb": 64, "disk_mb": 16, "pids": 64, "timeout_s": 10}
# (name, how to run it, what the result must show)
HOSTILE = [
    ("fork bomb", ("command", "f(){ f|f& }; f; sleep 3"), "pids"),
    (
        "memory bomb",
        ("code", "b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096])"),
        "memory",
    ),
    ("output flood", ("command", "yes soak | head -c 200000000"), "output_limit"),
    ("disk fill", ("command", "dd if=/dev/zero of=fill bs=1M count=64 2>&1; exit 0"), "disk"),
]
SERVER_ENV = {
    "SANDBOX_UID_BASE": "260000",
    "SANDBOX_CGROUP_ROOT": "sandlot-soak",
    "SANDBOX_OUTPUT_FILE_LIMIT_MB": "8",
    "API_RATE_LIMIT_PER_SECOND": "1000",
    "API_RATE_LIMIT_BURST": "1000",
    "TENANT_MAX_SANDBOXES": "4",
}


@dataclass
class Tally:
    lifecycles: int = 0
    hostile: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    server_errors: int = 0
    lifecycle_s: list[float] = field(default_factory=list)


async def _lifecycle(client: httpx.AsyncClient, number: int, tally: Tally) -> None:
    started = time.perf_counter()
    response = await client.post("/v1/sandboxes", json=SMALL)
    if response.status_code >= 500:
        tally.server_errors += 1
    if response.status_code != 201:
        tally.errors.append(f"create: {response.status_code} {response.text[:200]}")
        return
    sandbox_id = response.json()["id"]
    try:
        if number % 10 == 9:
            name, (kind, program), expected = HOSTILE[(number // 10) % len(HOSTILE)]
            result = await _run(client, sandbox_id, kind, program, tally)
            if result is not None and not _as_expected(result, expected):
                # A bomb whose first shell returned before the limit stopped it has burned
                # out against the limit on its own: usage() counts the hit (the hostile
                # suite's contract too).
                usage = (await client.get(f"/v1/sandboxes/{sandbox_id}/usage")).json()
                if not (expected == "pids" and usage.get("pids_limit_hits", 0) > 0):
                    tally.errors.append(f"{name}: {_brief(result)}")
            tally.hostile[name] += 1
        else:
            result = await _run(client, sandbox_id, "code", "sum(range(1000))", tally)
            if result is not None and result.get("text") != "499500":
                tally.errors.append(f"plain run: {_brief(result)}")
    finally:
        deleted = await client.delete(f"/v1/sandboxes/{sandbox_id}")
        if deleted.status_code >= 500:
            tally.server_errors += 1
        if deleted.status_code != 200:
            tally.errors.append(f"delete: {deleted.status_code} {deleted.text[:200]}")
    tally.lifecycles += 1
    tally.lifecycle_s.append(time.perf_counter() - started)


def _as_expected(result: dict[str, object], expected: str) -> bool:
    if expected == "disk":
        return "No space left on device" in str(result.get("stdout", "")) and not result.get(
            "kill_reason"
        )
    return result.get("kill_reason") == expected


def _brief(result: dict[str, object]) -> str:
    keep = ("exit_code", "kill_reason", "state_lost", "text")
    return str({k: result.get(k) for k in keep})


async def _run(
    client: httpx.AsyncClient, sandbox_id: str, kind: str, program: str, tally: Tally
) -> dict[str, object] | None:
    if kind == "code":
        url, body = f"/v1/sandboxes/{sandbox_id}/code", {"code": program}
    else:
        url, body = f"/v1/sandboxes/{sandbox_id}/commands", {"command": program}
    response = await client.post(url, json=body)
    if response.status_code >= 500:
        tally.server_errors += 1
    if response.status_code != 200:
        tally.errors.append(f"run: {response.status_code} {response.text[:200]}")
        return None
    result: dict[str, object] = response.json()
    return result


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(args: argparse.Namespace) -> tuple[Tally, dict[str, float], dict[str, list[str]]]:
    root = Path(tempfile.mkdtemp(prefix="sandlot-soak-", dir="/tmp"))
    root.chmod(0o711)
    data_dir = root / "server"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    keys = [store.create_key(f"soak-{i}", "user")[1] for i in range(args.clients)]
    store.close()
    settings = make_settings(
        data_dir, uid_base=260_000, cgroup_root="sandlot-soak", allow_unsafe=False
    )
    process, url, _ = start_server(data_dir, SERVER_ENV)
    # The server's own instance, seen from outside (its settings name what to count): a
    # manager of this process's, never started, has none (the soak failed on it since the
    # instances came in).
    (instance_dir,) = leaks.instance_dirs(data_dir)
    accounting = leaks.Outside(settings, instance_dir)
    baseline = leaks.snapshot(accounting)
    tally = Tally()
    figures: dict[str, float] = {}
    deadline = time.monotonic() + args.minutes * 60
    numbers = iter(range(args.lifecycles))
    warmup = max(1, args.lifecycles // 20)
    started = time.monotonic()

    async def client_loop(key: str) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
            for number in numbers:
                if time.monotonic() > deadline:
                    return
                await _lifecycle(client, number, tally)
                if tally.lifecycles == warmup and "rss_warm_mb" not in figures:
                    figures["rss_warm_mb"] = _rss_mb(process.pid)

    try:
        figures["rss_start_mb"] = _rss_mb(process.pid)
        await asyncio.gather(*(client_loop(key) for key in keys))
        figures["wall_s"] = time.monotonic() - started
        figures["rss_end_mb"] = _rss_mb(process.pid)
        async with httpx.AsyncClient(base_url=url, timeout=10) as probe:
            health = await probe.get("/health")
        figures["healthy_after"] = float(health.status_code == 200)
        # While the server still runs: its close would sweep what a destroy left.
        leaked = leaks.wait_for_baseline(accounting, baseline, timeout_s=10)
    finally:
        stop_server(process)
    rows = Store(data_dir / "sandlot.db")  # the store outlives the server: read its rows
    live_rows = rows.list(live_only=True)
    rows.close()
    if live_rows:
        leaked["store_rows"] = [info.id for info in live_rows]
    shutil.rmtree(root, ignore_errors=True)
    return tally, figures, leaked


def report(
    args: argparse.Namespace, tally: Tally, figures: dict[str, float], leaked: dict[str, list[str]]
) -> str:
    durations = sorted(tally.lifecycle_s)
    p50 = durations[len(durations) // 2] * 1000 if durations else 0.0
    p95 = durations[int(len(durations) * 0.95)] * 1000 if durations else 0.0
    growth = figures.get("rss_end_mb", 0.0) - figures.get("rss_warm_mb", 0.0)
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(tally.hostile.items()))
    leaked_count = sum(len(v) for v in leaked.values())
    rss = " / ".join(
        f"{figures.get(name, 0.0):.0f}" for name in ("rss_start_mb", "rss_warm_mb", "rss_end_mb")
    )
    lines = [
        SECTION_TITLE,
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- Machine: {machine_description()}",
        f"- Command: `.venv/bin/python bench/soak.py --minutes {args.minutes:g} "
        f"--lifecycles {args.lifecycles} --clients {args.clients} --output BENCHMARKS.md`",
        f"- Method: see `bench/soak.py`; {args.clients} clients, sandboxes of "
        f"{SMALL['memory_mb']} MB, {SMALL['disk_mb']} MB disk, {SMALL['pids']} pids; a hostile "
        "program in every 10th lifecycle (fork bomb, memory bomb, output flood, disk fill).",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| lifecycles completed | {tally.lifecycles} |",
        f"| hostile runs (by kind) | {kinds} |",
        f"| wall time | {figures.get('wall_s', 0.0):.0f} s |",
        f"| lifecycle (create, run, delete) p50 / p95 | {p50:.0f} / {p95:.0f} ms |",
        f"| server errors (5xx) | {tally.server_errors} |",
        f"| wrong results or failed calls | {len(tally.errors)} |",
        f"| leaked (processes, cgroups, mounts, loop devices, dirs, store rows) | {leaked_count} |",
        f"| server RSS at start / after warm-up / at end | {rss} MiB |",
        f"| server RSS growth after warm-up (bound: {args.rss_bound_mb} MiB) | {growth:+.1f} MiB |",
        "",
    ]
    if tally.errors:
        lines += ["First errors:", "", *(f"- `{e}`" for e in tally.errors[:5]), ""]
    if leaked:
        lines += ["Leaked:", "", *(f"- {k}: {v[:5]}" for k, v in leaked.items()), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--lifecycles", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rss-bound-mb", type=int, default=64)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    for key in list(os.environ):
        if key.startswith(("SANDBOX_", "SANDLOT_", "LOG_")):
            del os.environ[key]
    tally, figures, leaked = asyncio.run(soak(args))
    text = report(args, tally, figures, leaked)
    print(text)
    if args.output:
        write_section(args.output, text, SECTION_TITLE)
    growth = figures.get("rss_end_mb", 0.0) - figures.get("rss_warm_mb", 0.0)
    ok = (
        not tally.errors
        and not tally.server_errors
        and not leaked
        and growth < args.rss_bound_mb
        and figures.get("healthy_after") == 1.0
    )
    print("soak:", "PASSED" if ok else "FAILED", f"({platform.node()})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
