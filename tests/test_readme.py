"""Every example in the README runs, as a user would run it (docs that run)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import LiveServer, skip_reason

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
SERVER_MARK = "# needs: server"
ALL_PYTHON = re.findall(r"```python\n(.*?)```", TEXT, re.S)
ALL_BASH = re.findall(r"```bash\n(.*?)```", TEXT, re.S)
PYTHON_BLOCKS = [b for b in ALL_PYTHON if not b.startswith(SERVER_MARK)]
SERVER_BLOCKS = [b for b in ALL_PYTHON + ALL_BASH if b.startswith(SERVER_MARK)]
CLI_LINES = [
    line.split("#")[0].strip()
    for block in ALL_BASH
    if not block.startswith(SERVER_MARK)
    for line in block.splitlines()
    if line.startswith("sandlot ") and not line.startswith(("sandlot serve", "sandlot keys"))
]


@pytest.fixture
def env(data_root: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    data_dir = data_root / f"readme-{abs(hash(request.node.name))}"
    data_dir.mkdir()
    return {**os.environ, "SANDLOT_DATA_DIR": str(data_dir)}


def test_readme_has_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 3
    assert len(CLI_LINES) >= 3
    assert len(SERVER_BLOCKS) >= 3


@pytest.mark.parametrize(
    "source", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))]
)
def test_python_example_runs(source: str, env: dict[str, str], tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", source],
        cwd=tmp_path,  # what an example writes (a chart) lands there, not in the checkout
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("line", CLI_LINES)
def test_cli_example_runs(line: str, env: dict[str, str]) -> None:
    argv = shlex.split(line)
    argv[0] = str(Path(sys.executable).parent / "sandlot")
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr


def test_quickstart_example_prints_what_the_readme_says(env: dict[str, str]) -> None:
    example = README.parent / "examples" / "quickstart.py"
    run = subprocess.run(
        [sys.executable, str(example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    expected = re.search(r"`make run` prints something like:\n\n```text\n(.*?)```", TEXT, re.S)
    assert expected is not None
    assert run.stdout == expected.group(1)


@pytest.mark.parametrize(
    "source", SERVER_BLOCKS, ids=[f"server-{i}" for i in range(len(SERVER_BLOCKS))]
)
def test_server_example_runs(source: str, live_server: LiveServer) -> None:
    env = {
        **os.environ,
        "SANDLOT_URL": live_server.url,
        "SANDLOT_API_KEY": live_server.keys["alice"],
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    is_python = source in ALL_PYTHON
    argv = (
        [sys.executable, "-c", source] if is_python else ["bash", "-euo", "pipefail", "-c", source]
    )
    run = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=120, check=False, cwd=README.parent
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_server_setup_commands_run(env: dict[str, str]) -> None:
    """The two set-up lines: `keys create` prints a key; `serve` answers /health."""
    cli = str(Path(sys.executable).parent / "sandlot")
    created = subprocess.run(
        [cli, "keys", "create", "--tenant", "acme", "--role", "user"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert created.returncode == 0 and created.stdout.startswith("asb_"), created.stderr
    assert "sandlot serve" in TEXT


def test_license_is_the_one_pyproject_names() -> None:
    license_text = (README.parent / "LICENSE").read_text()
    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "MIT"  # an SPDX expression (PEP 639)
    assert license_text.startswith("MIT License\n")
    assert "Copyright (c) 2026 the sandlot authors" in license_text
