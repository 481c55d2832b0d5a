"""Every example in the README runs, as a user would run it (docs that run)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import skip_reason

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)
CLI_LINES = [
    line.split("#")[0].strip()
    for block in re.findall(r"```bash\n(.*?)```", TEXT, re.S)
    for line in block.splitlines()
    if line.startswith("agent-sandbox ")
]


@pytest.fixture
def env(data_root: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    data_dir = data_root / f"readme-{abs(hash(request.node.name))}"
    data_dir.mkdir()
    return {**os.environ, "AGENT_SANDBOX_DATA_DIR": str(data_dir)}


def test_readme_has_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 3
    assert len(CLI_LINES) >= 3


@pytest.mark.parametrize(
    "source", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))]
)
def test_python_example_runs(source: str, env: dict[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, "-c", source],
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
    argv[0] = str(Path(sys.executable).parent / "agent-sandbox")
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
