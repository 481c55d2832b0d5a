"""Shared fixtures.

The environment is cleared of our variables before anything reads settings, so a developer's
own ``SANDBOX_*`` never leaks into a test. Sandboxes live under a fresh directory in /tmp
(sandbox uids must be able to traverse its parents, which pytest's 0700 tmp dirs forbid).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

for _key in list(os.environ):
    if _key.startswith(("SANDBOX_", "AGENT_SANDBOX_", "LOG_")):
        del os.environ[_key]

from agent_sandbox import Sandbox, SandboxManager, Settings  # noqa: E402
from agent_sandbox._portal import get_portal  # noqa: E402
from agent_sandbox.doctor import run_checks  # noqa: E402

BACKENDS = ["bubblewrap", "unsafe-local"]
ISOLATED_BACKENDS = ["bubblewrap"]


def _bubblewrap_missing() -> str | None:
    missing = [c for c in run_checks() if c.required and not c.ok]
    if missing:
        return "bubblewrap backend unavailable: " + "; ".join(
            f"{c.name}: {c.detail}" for c in missing
        )
    return None


_SKIP_REASON: dict[str, str | None] = {}


def skip_reason(backend: str) -> str | None:
    if backend not in _SKIP_REASON:
        _SKIP_REASON[backend] = _bubblewrap_missing() if backend == "bubblewrap" else None
    return _SKIP_REASON[backend]


@pytest.fixture(scope="session")
def data_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="agsb-test-", dir="/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make_settings(data_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "data_dir": data_dir,
        "timeout_s": 10.0,
        "memory_mb": 256,
        "disk_mb": 64,
        "reaper_interval_s": 0.2,
        "log_level": "WARNING",
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(scope="session")
def manager(data_root: Path) -> Iterator[SandboxManager]:
    """One manager for the session, on the portal loop the sync SDK uses."""
    mgr = SandboxManager(make_settings(data_root / "session"))
    portal = get_portal()
    portal.call(mgr.start())
    yield mgr
    portal.call(mgr.close())


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    reason = skip_reason(name)
    if reason:
        pytest.skip(reason)
    return name


@pytest.fixture(params=ISOLATED_BACKENDS)
def isolated_backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    reason = skip_reason(name)
    if reason:
        pytest.skip(reason)
    return name


@pytest.fixture
def sandbox(manager: SandboxManager, backend_name: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(manager=manager, backend=backend_name)
    yield sb
    sb.kill()


@pytest.fixture
def jail(manager: SandboxManager, isolated_backend: str) -> Iterator[Sandbox]:
    """A sandbox on an isolating backend (for limits and escape attempts)."""
    sb = Sandbox.create(manager=manager, backend=isolated_backend, timeout_s=10)
    yield sb
    sb.kill()
