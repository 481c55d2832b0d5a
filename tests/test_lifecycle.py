"""Seed 001's ``orchestrator.lifecycle``: sessions with JSON records, on real sandboxes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from sandlot import (
    InvalidRequest,
    Sandbox,
    SandboxManager,
    SandboxNotFound,
    SandboxNotRunning,
)
from sandlot.lifecycle import Lifecycle, _inside
from tests.conftest import LiveServer

pytestmark = pytest.mark.usefixtures("root_bubblewrap")


@pytest.fixture
def lifecycle(manager: SandboxManager, tmp_path: Path) -> Lifecycle:
    return Lifecycle(storage_path=tmp_path / "storage", manager=manager)


def test_the_seeds_example_runs_as_written(lifecycle: Lifecycle, tmp_path: Path) -> None:
    session = lifecycle.start(
        agent_config={"type": "code_executor"}, environment="Python3", provider="e2b"
    )
    assert session["session_id"].startswith("ses-") and session["sandbox_id"].startswith("sb-")
    assert (session["provider"], session["backend"], session["status"]) == (
        "e2b",
        "bubblewrap",
        "running",
    )
    # The registry's code_executor gives the session its sandbox (256 MB, 10 s).
    info = Sandbox.connect(session["sandbox_id"], manager=lifecycle._manager).info
    assert info.limits.memory_mb == 256 and info.limits.timeout_s == 10

    result = lifecycle.sandbox_mgr.execute_code(
        session_id=session["session_id"], code="print('Hello World')"
    )
    assert result == {
        "stdout": "Hello World\n",
        "stderr": "",
        "results": [],
        "error": None,
        "artifacts": [],
        "artifacts_truncated": False,
    }
    made = lifecycle.sandbox_mgr.execute_code(
        session["session_id"],
        "import os\nos.makedirs('artifacts/plots', exist_ok=True)\n"
        "open('artifacts/plots/a.txt', 'w').write('a')\nx = 6 * 7\nx",
    )
    assert made["results"] == ["42"] and made["artifacts"] == ["artifacts/plots/a.txt"]

    stopped = lifecycle.stop(session["session_id"], session["sandbox_id"])
    assert stopped["status"] == "stopped" and stopped["executions"] == 2
    assert stopped["artifacts"] == ["plots/a.txt"]
    storage = tmp_path / "storage"
    sid = session["session_id"]
    assert (storage / "artifacts" / sid / "plots" / "a.txt").read_text() == "a"
    on_disk = json.loads((storage / "sessions" / f"{sid}.json").read_text())
    assert on_disk["status"] == "stopped" and on_disk["sandbox_id"] == session["sandbox_id"]
    log_text = (storage / "logs" / f"{sid}.jsonl").read_text()
    lines = [json.loads(line) for line in log_text.splitlines()]
    assert [line["stdout"] for line in lines] == ["Hello World\n", ""]
    for directory in ("sessions", "logs", "artifacts"):
        assert stat.S_IMODE((storage / directory).stat().st_mode) == 0o700
    # The sandbox is gone; the session answers as stopped, and stopping again changes nothing.
    assert Sandbox.connect(session["sandbox_id"], manager=lifecycle._manager).info.status != (
        "running"
    )
    with pytest.raises(SandboxNotRunning, match="stopped"):
        lifecycle.sandbox_mgr.execute_code(sid, "1")
    assert lifecycle.stop(sid) == stopped


def test_a_crash_of_the_sessions_code_is_a_result(lifecycle: Lifecycle) -> None:
    session = lifecycle.start()
    try:
        sid = session["session_id"]
        lifecycle.sandbox_mgr.execute_code(sid, "kept = 'state'")
        crashed = lifecycle.sandbox_mgr.execute_code(sid, "import os\nos._exit(3)")
        assert crashed["error"] is not None
        # A failing call stays a result too, and the session goes on.
        failed = lifecycle.sandbox_mgr.execute_code(sid, "1/0")
        assert "ZeroDivisionError" in (failed["error"] or "")
        assert lifecycle.sandbox_mgr.execute_code(sid, "print('on')")["stdout"] == "on\n"
    finally:
        lifecycle.stop(session["session_id"])


def test_bad_input_is_refused_by_name_and_starts_nothing(
    lifecycle: Lifecycle, manager: SandboxManager, tmp_path: Path
) -> None:
    live_before = {s.id for s in Sandbox.list(manager=manager)}
    with pytest.raises(InvalidRequest, match=r"unknown provider 'modal'.*e2b.*bubblewrap"):
        lifecycle.start(provider="modal")
    with pytest.raises(InvalidRequest, match=r"unknown agent 'nobody'.*code_executor"):
        lifecycle.start(agent_config={"type": "nobody"})
    assert {s.id for s in Sandbox.list(manager=manager)} == live_before
    assert lifecycle.sessions() == []
    # A session id never names a file outside the records.
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "../../etc/passwd", "ses-" + "g" * 32, "", "ses-/x"):
        with pytest.raises(InvalidRequest, match="not a session id"):
            lifecycle.get(bad)
        with pytest.raises(InvalidRequest):
            lifecycle.sandbox_mgr.execute_code(bad, "1")
    with pytest.raises(SandboxNotFound):
        lifecycle.stop("ses-" + "0" * 32)


def test_the_sandbox_manager_starts_a_session_by_its_id(lifecycle: Lifecycle) -> None:
    sid = "ses-" + "ab" * 16
    sandbox_id = lifecycle.sandbox_mgr.start_sandbox(sid, "Python3", provider="e2b")
    assert lifecycle.get(sid)["sandbox_id"] == sandbox_id
    with pytest.raises(InvalidRequest, match="started already"):
        lifecycle.sandbox_mgr.start_sandbox(sid, "Python3")
    assert lifecycle.sandbox_mgr.write_file(sid, "notes/a.txt", "hello") == 5
    assert lifecycle.sandbox_mgr.read_file(sid, "notes/a.txt") == "hello"
    names = [entry["name"] for entry in lifecycle.sandbox_mgr.list_files(sid, "notes")]
    assert names == ["a.txt"]
    lifecycle.sandbox_mgr.stop_sandbox(sandbox_id)
    assert lifecycle.get(sid)["status"] == "stopped"
    with pytest.raises(SandboxNotFound):
        lifecycle.sandbox_mgr.stop_sandbox("sb-0000000000000000")


def test_another_lifecycle_on_the_same_storage_carries_on_a_session(
    lifecycle: Lifecycle, manager: SandboxManager, tmp_path: Path
) -> None:
    first = lifecycle.start()
    lifecycle.sandbox_mgr.execute_code(first["session_id"], "x = 41")
    second = Lifecycle(storage_path=tmp_path / "storage", manager=manager)
    assert [s["session_id"] for s in second.sessions()] == [first["session_id"]]
    assert second.sandbox_mgr.execute_code(first["session_id"], "x + 1")["results"] == ["42"]
    assert second.stop(first["session_id"])["status"] == "stopped"
    # Leaving a Lifecycle lets go of what it carried on from elsewhere, and stops nothing.
    carried = lifecycle.start()
    with Lifecycle(storage_path=tmp_path / "storage", manager=manager) as third:
        third.sandbox_mgr.execute_code(carried["session_id"], "1")
    assert lifecycle.sandbox_mgr.execute_code(carried["session_id"], "2")["results"] == ["2"]
    lifecycle.stop(carried["session_id"])
    assert lifecycle.get(first["session_id"])["executions"] == 2  # both Lifecycles' calls

    # A session whose sandbox went behind its back is "lost", and says so.
    lost = lifecycle.start()
    Sandbox.connect(lost["sandbox_id"], manager=manager).kill()
    with pytest.raises(SandboxNotRunning, match="lost"):
        second.sandbox_mgr.execute_code(lost["session_id"], "1")
    assert second.get(lost["session_id"])["status"] == "lost"
    # The Lifecycle that holds it still stops it (a destroy of a destroyed sandbox is none).
    assert lifecycle.stop(lost["session_id"])["status"] == "stopped"


def test_its_own_runtime_is_closed_with_it(tmp_path: Path, data_root: Path) -> None:
    # Where a sandbox's uid may walk in: the session's test root (pytest's is 0700).
    runtime = data_root / f"lifecycle-{os.getpid()}-{tmp_path.name}"
    with Lifecycle(storage_path=tmp_path / "storage", runtime_path=runtime) as lifecycle:
        session = lifecycle.start()
        out = lifecycle.sandbox_mgr.execute_code(session["session_id"], "print(2 + 2)")
        assert out["stdout"] == "4\n"
        manager = lifecycle._manager
    # Leaving stopped the session and closed the runtime it made.
    assert lifecycle.get(session["session_id"])["status"] == "stopped"
    assert manager is not None and manager._closing
    with pytest.raises(SandboxNotFound):
        Lifecycle(storage_path=tmp_path / "storage", manager=manager, runtime_path=None).get(
            "ses-" + "1" * 32
        )
    with pytest.raises(Exception, match="runtime_path"):
        Lifecycle(tmp_path / "s2", runtime_path=runtime, api_url="http://127.0.0.1:1")


def test_artifacts_come_out_as_plain_files_below_the_sessions_folder(
    lifecycle: Lifecycle, tmp_path: Path
) -> None:
    session = lifecycle.start()
    sid = session["session_id"]
    outside = tmp_path / "outside"
    outside.mkdir()
    lifecycle.sandbox_mgr.execute_code(
        sid,
        "import os\n"
        "os.makedirs('artifacts/d', exist_ok=True)\n"
        "open('artifacts/d/ok.txt', 'w').write('ok')\n"
        "open('artifacts/odd name \\u2603.txt', 'w').write('odd')\n"
        "os.symlink('/etc/passwd', 'artifacts/passwd')\n"
        f"os.symlink({str(outside)!r}, 'artifacts/out')\n"
        "os.mkfifo('artifacts/fifo')\n",
    )
    stopped = lifecycle.stop(sid)
    assert sorted(stopped["artifacts"]) == ["d/ok.txt", "odd name \u2603.txt"]
    saved = tmp_path / "storage" / "artifacts" / sid
    found = sorted(str(p.relative_to(saved)) for p in saved.rglob("*"))
    assert found == ["d", "d/ok.txt", "odd name \u2603.txt"]
    assert all(not p.is_symlink() for p in saved.rglob("*"))
    assert list(outside.iterdir()) == []


def test_a_link_planted_in_storage_is_not_followed(lifecycle: Lifecycle, tmp_path: Path) -> None:
    session = lifecycle.start()
    sid = session["session_id"]
    lifecycle.sandbox_mgr.execute_code(
        sid, "import os\nos.makedirs('artifacts', exist_ok=True)\nopen('artifacts/a', 'w')"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "storage" / "artifacts" / sid)
    assert lifecycle.stop(sid)["artifacts"] == []  # skipped, and the session stopped
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("a.txt", True),
        ("d/e/f", True),
        ("../x", False),
        ("d/../../x", False),
        ("/etc/passwd", False),
        ("", False),
        (".", False),
        ("a\0b", False),
    ],
)
def test_an_artifacts_path_stays_below_its_folder(path: str, ok: bool, tmp_path: Path) -> None:
    target = _inside(tmp_path, path)
    assert (target is not None) == ok
    if target is not None:
        assert target.is_relative_to(tmp_path)


def test_sessions_on_a_server_keep_their_records_here(
    live_server: LiveServer, tmp_path: Path
) -> None:
    where = {"api_url": live_server.url, "api_key": live_server.keys["alice"]}
    with Lifecycle(storage_path=tmp_path / "storage", **where) as lifecycle:
        session = lifecycle.start(environment="Python3")
        sid = session["session_id"]
        out = lifecycle.sandbox_mgr.execute_code(
            sid, "import os\nos.makedirs('artifacts', exist_ok=True)\nopen('artifacts/r.txt', 'w')"
        )
        assert out["artifacts"] == ["artifacts/r.txt"] and out["error"] is None
        # Another key's tenant cannot carry on alice's session from the same records.
        other = Lifecycle(
            storage_path=tmp_path / "storage",
            api_url=live_server.url,
            api_key=live_server.keys["bob"],
        )
        with pytest.raises(SandboxNotRunning, match="lost"):
            other.sandbox_mgr.execute_code(sid, "1")
        assert lifecycle.get(sid)["status"] == "lost"  # as the records say now
        with Sandbox.connect(session["sandbox_id"], **where) as still:
            assert still.info.status == "running"  # alice's key still sees it
        # The Lifecycle holding it stops it whatever the records say, artifacts and all.
        stopped = lifecycle.stop(sid)
        assert (stopped["status"], stopped["artifacts"]) == ("stopped", ["r.txt"])
