"""python-data, one environment on every backend: the same tree on bubblewrap (bound as /),
docker and gVisor (imported as the image), so the same imports work and report the same
versions, and a matplotlib figure comes back as a PNG result everywhere.

Docker targets run where dockerd answers (and must where TEST_BACKENDS names them); the tree
and image come from `make image` (`sandlot image build python-data`).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import Sandbox, SandboxManager, Settings
from sandlot.backends.rootfs import find_tree, tree_status
from sandlot.environments import get_environment
from tests.conftest import EXTRA_TARGETS, placement, skip_reason

ENV = "python-data"
TARGETS = ["bubblewrap", "docker", "docker+runsc"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VERSIONS = """
import importlib, platform
names = ("numpy", "pandas", "matplotlib", "scipy", "sklearn", "PIL")
{n: importlib.import_module(n).__version__ for n in names} | {"python": platform.python_version()}
"""
ROOTFS_DIR = Settings(_env_file=None).rootfs_dir  # type: ignore[call-arg]


def _docker_reason(target: str) -> str | None:
    """Why a docker target cannot run here: dockerd, the runtime, python-data's image."""
    from sandlot.backends.docker.dockerd import connect
    from sandlot.backends.docker.images import image_status
    from sandlot.errors import SandboxError

    try:
        with contextlib.closing(connect()) as client:
            runtime = target.partition("+")[2] or "runc"
            if runtime not in (client.info().get("Runtimes") or {}):
                return f"docker has no runtime {runtime}"
            tree = tree_status(get_environment(ENV), ROOTFS_DIR)
            status = image_status(get_environment(ENV), client, tree.build_id)
    except SandboxError as exc:
        return exc.message
    if not status.current:
        return f"{status.image} is not imported from the current tree: make image"
    return None


@pytest.fixture(scope="module", params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if find_tree(get_environment(ENV), ROOTFS_DIR) is None:
        pytest.fail(f"no {ENV} tree in {ROOTFS_DIR}: run `make image`")
    reason = skip_reason(name) if name == "bubblewrap" else _docker_reason(name)
    if reason and name in EXTRA_TARGETS:
        pytest.fail(f"TEST_BACKENDS asks for {name}, which cannot run: {reason}")
    if reason:
        pytest.skip(reason)
    return name


@pytest.fixture(scope="module")
def data_box(manager: SandboxManager, target: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(
        manager=manager, **placement(target), environment=ENV, memory_mb=512, timeout_s=60
    )
    yield sb
    sb.kill()


_versions: dict[str, dict[str, str]] = {}


def test_the_data_stack_imports(data_box: Sandbox, target: str) -> None:
    result = data_box.run_code("import pandas, sklearn, scipy.stats; sklearn.__version__")
    assert result.ok, result
    result = data_box.run_code(
        "from sklearn.linear_model import LinearRegression\n"
        "import numpy as np, pandas as pd\n"
        "x = np.arange(10).reshape(-1, 1)\n"
        "model = LinearRegression().fit(x, 3 * x.ravel() + 1)\n"
        "round(float(model.coef_[0]), 6), pd.Series([1, 2, 3]).sum()"
    )
    assert result.text == "(3.0, 6)" or result.text == "(3.0, np.int64(6))", result
    versions = data_box.run_code(VERSIONS)
    assert versions.ok, versions
    _versions[target] = ast.literal_eval(versions.text or "")


def test_a_plot_comes_back_as_an_image(data_box: Sandbox) -> None:
    result = data_box.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('squares')\n"
        "plt.show()"
    )
    assert result.ok, result
    (figure,) = result.results
    png = base64.b64decode(figure.png or "")
    assert png.startswith(PNG_MAGIC) and len(png) > 5000, len(png)
    # Text is rendered with the tree's own font, not a missing-font fallback warning.
    assert "findfont" not in result.stderr, result.stderr


def test_every_backend_runs_the_same_versions(target: str) -> None:
    """Runs after the imports test of each target: one tree, so one set of versions."""
    if target not in _versions:
        pytest.skip("the imports test did not run for this target")
    host_tree = find_tree(get_environment(ENV), ROOTFS_DIR)
    assert host_tree is not None
    # What the tree on disk holds, read with the host's dpkg: the sandbox saw this very tree.
    dpkg = subprocess.run(
        ["dpkg-query", f"--admindir={host_tree}/var/lib/dpkg", "-W", "python3-pandas"],
        capture_output=True,
        text=True,
        check=True,
    )
    pandas_deb = dpkg.stdout.split()[1]
    assert pandas_deb.startswith(_versions[target]["pandas"]), (pandas_deb, _versions)
    assert len({tuple(sorted(v.items())) for v in _versions.values()}) == 1, _versions


def test_image_list_shows_tree_and_image(data_root: Path) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "image", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SANDLOT_DATA_DIR": str(data_root / "cli")},
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    rows = {row["environment"]: row for row in json.loads(listed.stdout)}
    data = rows[ENV]
    assert data["bubblewrap"] == "tree" and data["tree"] is not None
    if data["docker_error"] is None and data["image_current"]:
        assert data["image_same_tree"] is True
