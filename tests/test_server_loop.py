"""The server's event loop (``API_EVENT_LOOP``): asyncio's own unless uvloop is asked for.

uvicorn's default ("auto") takes uvloop wherever it is installed, and uvloop starts each
sandbox's launcher with a fork of the whole server process where asyncio's loop uses vfork: a
lifecycle through the server cost about a third more of its CPU (BENCHMARKS.md). Both loops
must serve a sandbox's whole lifecycle.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import skip_reason, start_server, stop_server


def _loaded(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any(library in line for line in maps)


@pytest.mark.parametrize("loop", ["default", "uvloop"])
def test_the_server_runs_on_the_loop_it_is_given(data_root: Path, loop: str) -> None:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    data_dir = data_root / f"loop-{loop}"
    data_dir.mkdir()
    data_dir.chmod(0o711)
    env = {"SANDBOX_AUTH_ENABLED": "false"}
    if loop != "default":
        env["API_EVENT_LOOP"] = loop
    process, url, _ = start_server(data_dir, env)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            created = client.post("/v1/sandboxes", json={})
            assert created.status_code == 201, created.text
            sandbox = created.json()["id"]
            ran = client.post(f"/v1/sandboxes/{sandbox}/code", json={"code": "6 * 7"})
            assert ran.json()["text"] == "42", ran.text
            assert client.delete(f"/v1/sandboxes/{sandbox}").status_code == 200
        assert _loaded(process.pid, "uvloop/loop.cpython") == (loop == "uvloop")
    finally:
        stop_server(process)
