"""What the command's help says, as a user sees it (rich renders the help: markup-like text
such as ``[ray]`` must be escaped, or rich swallows it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot

REGISTRY = Path(sandlot.__file__).resolve().parent / "registry" / "environments"


def _help(*args: str) -> str:
    """``sandlot ARGS --help`` in a child process, its table borders and line breaks gone."""
    out = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", *args, "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"},
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", out.stdout))


def test_serve_help_names_the_ray_extra() -> None:
    assert "Needs the [ray] extra." in _help("serve")


@pytest.mark.parametrize("command", ["run-code", "exec"])
def test_environment_help_names_every_shipped_environment(command: str) -> None:
    text = _help(command)
    names = sorted(p.stem for p in REGISTRY.glob("*.yaml"))
    assert names, REGISTRY
    for name in names:
        assert name in text, (name, text)
    assert "sandlot image list" in text
