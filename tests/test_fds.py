"""File descriptors: the manager raises its open-file limit, and refuses a create it cannot
hold with a typed error that names the limit, leaving nothing behind.

Each case runs a manager in a child process started under the limits it needs (``prlimit``),
so this test process keeps its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot import SandboxManager
from sandlot.core import admission
from sandlot.core.store import Store
from sandlot.errors import FileDescriptorsExhausted
from sandlot.requests import RunCode, SandboxSpec
from tests import leaks
from tests.conftest import make_settings, skip_reason, start_server, stop_server

REPO = Path(__file__).resolve().parent.parent
UID_BASE = 620_000  # its own uids: other runs on this host never hold them

# Creates up to ``count`` sandboxes, stops at the first error, reports, destroys them all.
# With "bypass", the admission check is switched off and the soft limit lowered to just above
# what is open once the manager has started: the start itself then runs out of descriptors.
CREATOR = """
import asyncio, errno, json, resource, sys
from sandlot import SandboxManager
from sandlot.core import admission
from sandlot.errors import SandboxError
from sandlot.requests import RunCode, SandboxSpec
from tests.conftest import make_settings

data_dir, count, mode, uid_base = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])

async def main():
    settings = make_settings(data_dir, memory_mb=64, disk_mb=16, uid_base=uid_base)
    report = {"created": 0, "error": None}
    async with SandboxManager(settings) as manager:
        report["soft_at_start"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if mode == "bypass":
            admission.check_fds = lambda held, fds_at_start: None
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (admission.open_fds() + 6, hard))
        ids = []
        try:
            for _ in range(count):
                ids.append((await manager.create(SandboxSpec(backend="bubblewrap"))).id)
        except SandboxError as exc:
            report["error"] = {"type": type(exc).__name__, "code": exc.code, "message": str(exc)}
        except OSError as exc:
            report["error"] = {"type": type(exc).__name__, "code": None, "message": str(exc)}
        report["created"] = len(ids)
        report["fds_open"] = admission.open_fds()
        report["live"] = manager.live_count()
        report["instance"] = str(manager.instance_dir)
        if mode == "bypass":
            resource.setrlimit(resource.RLIMIT_NOFILE, (report["soft_at_start"], hard))
        for sandbox_id in ids:
            await manager.destroy(sandbox_id)
    print(json.dumps(report), flush=True)

asyncio.run(main())
"""


def _require_bubblewrap() -> None:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)


def _create_under(data_dir: Path, nofile: str, count: int, mode: str = "") -> dict[str, Any]:
    """Run CREATOR under ``prlimit --nofile=soft:hard``; return its report."""
    argv = [sys.executable, "-c", CREATOR, str(data_dir), str(count), mode, str(UID_BASE)]
    proc = subprocess.run(
        ["prlimit", f"--nofile={nofile}", "--", *argv],
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return report


def _assert_nothing_left(data_dir: Path, instance_dir: Path) -> None:
    """The process that used ``instance_dir`` is gone: so must be all it made."""
    observer = leaks.Outside(make_settings(data_dir, uid_base=UID_BASE), instance_dir)
    left = leaks.wait_for_baseline(observer, leaks.Snapshot(), orphans=leaks.no_orphans)
    assert not left, f"left behind: {left}"
    assert not instance_dir.exists(), "the instance was not released"


async def _sweep(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, uid_base=UID_BASE)):
        pass


@pytest.fixture
def data_dir(data_root: Path, request: pytest.FixtureRequest) -> Any:
    """A data dir of the test's own, swept afterwards of whatever a failure left."""
    path = data_root / f"fds-{request.node.name}"
    yield path
    if path.is_dir():
        asyncio.run(_sweep(path))


def test_the_soft_limit_is_raised_to_the_hard_one(data_dir: Path) -> None:
    _require_bubblewrap()
    soft = 256
    count = soft // max(admission.FDS_PER_SANDBOX.values()) + 10
    report = _create_under(data_dir, f"{soft}:4096", count)
    assert report["soft_at_start"] == 4096
    assert report["error"] is None, report
    # Past what the soft limit it was started with could hold.
    assert report["created"] == count
    _assert_nothing_left(data_dir, Path(report["instance"]))


def test_a_create_past_the_limit_is_refused_before_it_starts(data_dir: Path) -> None:
    _require_bubblewrap()
    report = _create_under(data_dir, "128:128", 100)
    assert report["soft_at_start"] == 128
    error = report["error"]
    assert error is not None and error["type"] == "FileDescriptorsExhausted", report
    assert error["code"] == "fds_exhausted"
    assert "RLIMIT_NOFILE" in error["message"] and "128" in error["message"]
    assert "LimitNOFILE" in error["message"]  # what to change
    # Refused while there was still room to work: some were made, none half-made.
    assert report["created"] >= 1
    assert report["live"] == report["created"]
    store = Store(data_dir / "sandlot.db")
    try:
        records = store.list()
    finally:
        store.close()
    assert len(records) == report["created"]  # the refused one never got a record
    _assert_nothing_left(data_dir, Path(report["instance"]))


def test_running_out_while_starting_is_typed_and_leaves_nothing(data_dir: Path) -> None:
    _require_bubblewrap()
    # Admission off: the start itself meets EMFILE somewhere (a pipe, a lock file, a spawn).
    report = _create_under(data_dir, "1024:1024", 3, "bypass")
    error = report["error"]
    assert error is not None, report
    assert error["type"] == "FileDescriptorsExhausted", report
    assert "RLIMIT_NOFILE" in error["message"]
    assert report["live"] == report["created"] == 0
    _assert_nothing_left(data_dir, Path(report["instance"]))


def test_emfile_under_a_backend_error_is_named(data_root: Path) -> None:
    """Unit level, next to the real case above: the cause chain is searched for EMFILE."""
    from sandlot.errors import SandboxStartError

    try:
        try:
            raise OSError(24, "Too many open files")
        except OSError as exc:
            raise SandboxStartError("mkfs.ext4 failed") from exc
    except SandboxStartError as wrapped:
        typed = admission.fds_exhausted_error(wrapped)
    assert isinstance(typed, FileDescriptorsExhausted)
    assert "RLIMIT_NOFILE" in str(typed)
    assert admission.fds_exhausted_error(SandboxStartError("bwrap: no permission")) is None


def test_the_server_answers_503_with_the_typed_error(data_root: Path) -> None:
    _require_bubblewrap()
    data_dir = data_root / "fds-server"
    data_dir.mkdir()
    env = {"SANDBOX_UID_BASE": str(UID_BASE), "SANDBOX_MEMORY_LIMIT_MB": "64"}
    process, url, _ = start_server(data_dir, env, "--no-auth")
    (instance_dir,) = leaks.instance_dirs(data_dir)
    try:
        # Lowered under the running server (for good: raising a hard limit needs
        # CAP_SYS_RESOURCE): the next creates must see it.
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (160, 160))
        statuses = []
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(40):
                response = client.post("/v1/sandboxes", json={})
                statuses.append(response.status_code)
                if response.status_code != 201:
                    break
        assert statuses[-1] == 503, statuses
        assert set(statuses[:-1]) <= {201}
        body = response.json()["error"]
        assert body["code"] == "fds_exhausted"
        assert "RLIMIT_NOFILE" in body["message"]
    finally:
        stop_server(process)
    try:
        _assert_nothing_left(data_dir, instance_dir)
    finally:
        asyncio.run(_sweep(data_dir))


def test_admission_counts_sandboxes_starting_at_once() -> None:
    """Unit level: the bound is by sandboxes held, so creates in flight cannot all pass."""
    soft, _ = admission.nofile_limits()
    fds_at_start = admission.open_fds()
    allowed = admission.sandboxes_allowed(soft, fds_at_start)
    assert allowed > 0
    admission.check_fds(allowed - 1, fds_at_start)
    with pytest.raises(FileDescriptorsExhausted):
        admission.check_fds(allowed, fds_at_start)


def test_open_descriptors_are_counted_only_near_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Listing /proc/self/fd is skipped while the sandboxes held leave a wide margin (it cost
    every create 3.8 ms with 600 live), and done near the limit, where a process holding
    descriptors for anything else is refused before it starts."""
    listed: list[int] = []
    open_now = 950

    def counted() -> int:
        listed.append(open_now)
        return open_now

    monkeypatch.setattr(admission, "open_fds", counted)
    monkeypatch.setattr(admission, "nofile_limits", lambda: (20_000, 20_000))
    admission.check_fds(10, fds_at_start=20)
    assert listed == []
    monkeypatch.setattr(admission, "nofile_limits", lambda: (1_000, 20_000))
    with pytest.raises(FileDescriptorsExhausted, match="950 of its 1000 open"):
        admission.check_fds(10, fds_at_start=20)
    assert listed == [950]


def test_manager_refuses_with_the_typed_error_in_process(data_root: Path) -> None:
    """The same refusal through the manager's create, on the fake backend (no fds needed)."""

    async def main() -> None:
        settings = make_settings(data_root / "fds-unit")
        async with SandboxManager(settings) as manager:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            # Room for the process, not for one more sandbox's start.
            tight = admission.open_fds() + admission.FDS_RESERVE
            resource.setrlimit(resource.RLIMIT_NOFILE, (tight, hard))
            try:
                with pytest.raises(FileDescriptorsExhausted, match="RLIMIT_NOFILE"):
                    await manager.create(SandboxSpec(backend="unsafe-local"))
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert manager.live_count() == 0
            assert await manager.list(include_ended=True) == []

    asyncio.run(main())


@pytest.mark.usefixtures("root_bubblewrap")
def test_a_live_sandbox_holds_no_more_descriptors_than_admission_counts(
    data_root: Path,
) -> None:
    """``FDS_PER_SANDBOX`` bounds creates by the open-file limit: a sandbox holding more than
    it says lets creates past the check run out of descriptors instead (the launcher's pidfd
    was held for a templated sandbox's life: 6 a sandbox against the 5 counted)."""

    async def main() -> None:
        settings = make_settings(data_root / "fds-held", uid_base=UID_BASE + 500)
        async with SandboxManager(settings) as manager:
            first = await manager.create(SandboxSpec(backend="bubblewrap"))
            await manager.run_code(first.id, RunCode(code="1"))
            before = admission.open_fds()
            for _ in range(10):
                info = await manager.create(SandboxSpec(backend="bubblewrap"))
                await manager.run_code(info.id, RunCode(code="1"))
            held = (admission.open_fds() - before) / 10
            assert held <= admission.FDS_PER_SANDBOX["bubblewrap"], held

    asyncio.run(main())
