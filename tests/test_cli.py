"""The agent-sandbox command, run as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import skip_reason

CLI = [sys.executable, "-m", "agent_sandbox.cli"]


def _run(args: list[str], data_dir: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENT_SANDBOX_DATA_DIR": str(data_dir), "SANDBOX_BACKEND": "bubblewrap"}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=120, check=False, **kwargs
    )  # type: ignore[call-overload]


@pytest.fixture
def cli_data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    path = data_root / f"cli-{request.node.name}"
    path.mkdir()
    return path


def test_doctor_reports_every_feature(cli_data_dir: Path) -> None:
    out = _run(["doctor"], cli_data_dir)
    assert out.returncode == 0, out.stderr
    for feature in ("bubblewrap", "user namespaces", "cgroups", "seccomp", "disk cap"):
        assert feature in out.stdout


def test_run_code_prints_output_and_value(cli_data_dir: Path) -> None:
    out = _run(["run-code", "print('hello'); 6 * 7"], cli_data_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello\n42\n"


def test_run_code_reads_stdin_and_fails_like_the_code(cli_data_dir: Path) -> None:
    out = _run(["run-code", "-"], cli_data_dir, input="raise ValueError('bad')\n")
    assert out.returncode == 1
    assert "ValueError: bad" in out.stderr


def test_exec_exit_status_follows_the_command(cli_data_dir: Path) -> None:
    out = _run(["exec", "echo hi; exit 3"], cli_data_dir)
    assert (out.returncode, out.stdout) == (3, "hi\n")


def test_timeout_is_reported(cli_data_dir: Path) -> None:
    out = _run(["exec", "--timeout-s", "1", "sleep 30"], cli_data_dir)
    assert out.returncode == 137
    assert "killed: timeout" in out.stderr


def test_bad_option_names_the_option(cli_data_dir: Path) -> None:
    out = _run(["exec", "--memory-mb", "1", "true"], cli_data_dir)
    assert out.returncode == 2
    assert "memory_mb" in out.stderr
