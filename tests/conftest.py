"""Shared fixtures.

The environment is cleared of our variables before anything reads settings, so a developer's
own ``SANDBOX_*`` never leaks into a test. Sandboxes live under a fresh directory in /tmp
(sandbox uids must be able to traverse its parents, which pytest's 0700 tmp dirs forbid).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

for _key in list(os.environ):
    if _key.startswith(("SANDBOX_", "SANDLOT_", "AGENT_SANDBOX_", "LOG_")):
        del os.environ[_key]

# Two test workers (pytest-xdist, `make test`) are two runs on one host: each gets a uid
# range of its own (and its own data directories, made below), so that a check for a
# sandbox's leftover processes by uid never counts the other worker's live sandboxes (a CI run
# on two workers took another worker's sandbox, in the same uid range, for a leak:
# 2026-12-07). They share the cgroup root, where each manager's sandboxes are its instance's
# (leaks.sandbox_procs tells another instance's processes by that).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    os.environ["SANDBOX_UID_BASE"] = str(200_000 + 20_000 * int(_WORKER[2:]))
    os.environ["SANDBOX_UID_COUNT"] = "10000"

# Test targets beyond the embedded ones, e.g. TEST_BACKENDS=docker,docker+runsc (`make
# test-docker`). A target named here must run: it fails rather than skips when it cannot.
EXTRA_TARGETS = [t for t in os.environ.get("TEST_BACKENDS", "").split(",") if t.strip()]

from sandlot import Sandbox, SandboxManager, Settings  # noqa: E402
from sandlot._portal import get_portal  # noqa: E402
from sandlot.backends import KNOWN_BACKENDS, mountns, probe_backend  # noqa: E402

# The registry's embedded backends always, plus what TEST_BACKENDS asks for.
BACKENDS = [name for name, entry in KNOWN_BACKENDS.items() if entry.embedded] + EXTRA_TARGETS
ISOLATED_BACKENDS = [t for t in BACKENDS if KNOWN_BACKENDS[t.partition("+")[0]].isolating]


def placement(target: str) -> dict[str, str]:
    """The create() arguments of a test target: "docker+runsc" is docker on gVisor."""
    backend, _, runtime = target.partition("+")
    if backend == "docker":
        return {"backend": backend, "runtime": runtime or "runc"}
    return {"backend": backend}


def runtime_of(sb: Sandbox) -> str:
    """ "bubblewrap", "runc" or "runsc": which walls a sandbox has (for documented differences)."""
    return sb.info.runtime or sb.info.backend


_SKIP_REASON: dict[str, str | None] = {}


def skip_reason(target: str) -> str | None:
    """Why ``target`` ("backend" or "backend+runtime") cannot run here, as its backend's probe
    says. Only an embedded backend is skipped: an opt-in one runs because TEST_BACKENDS asked
    for it, so its absence fails the test."""
    if target not in _SKIP_REASON:
        backend, _, runtime = target.partition("+")
        settings = Settings(_env_file=None)  # type: ignore[call-arg]
        checks = probe_backend(backend, settings, runtime or None)
        missing = "; ".join(f"{c.name}: {c.detail}" for c in checks if c.required and not c.ok)
        reason = f"{backend} backend unavailable: {missing}" if missing else None
        if reason and not KNOWN_BACKENDS[backend].embedded:
            pytest.fail(f"TEST_BACKENDS asks for {target}, which cannot run: {reason}")
        _SKIP_REASON[target] = reason
    return _SKIP_REASON[target]


@pytest.fixture
def root_bubblewrap() -> None:
    """bubblewrap as root with the mount API: loop disks and the launch namespace."""
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0 or not mountns.supported():
        pytest.skip("the launch namespace is root's, with the mount API")


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
        "allow_unsafe": True,  # the fake backend is how manager logic is tested
        # Each data directory's managers count only each other: the tests' capacities are
        # set per test (test_trust_core.py shares a ledger on purpose).
        "host_ledger_dir": Path(data_dir) / ".host-ledger",
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
    sb = Sandbox.create(manager=manager, **placement(backend_name))
    yield sb
    sb.kill()


@pytest.fixture
def jail(manager: SandboxManager, isolated_backend: str) -> Iterator[Sandbox]:
    """A sandbox on an isolating backend (for limits and escape attempts)."""
    sb = Sandbox.create(manager=manager, **placement(isolated_backend), timeout_s=10)
    yield sb
    sb.kill()


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``sandlot ARGS...`` as a user runs it, in ``env``: its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "sandlot.cli", *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


# ---------------------------------------------------------------------- a real server


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    keys: dict[str, str]  # who -> API key
    log: Path

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    data_dir: Path,
    extra_env: dict[str, str] | None = None,
    *args: str,
    launcher: tuple[str, ...] = ("-m", "sandlot.cli"),
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`sandlot serve` as a real process on a free port; returns once /health answers.
    ``launcher``: how this Python runs the CLI (``("-c", code)`` for a patched one)."""
    port = _free_port()
    log_path = data_dir / "server.log"
    env = {
        **os.environ,
        "SANDLOT_DATA_DIR": str(data_dir),
        "SANDBOX_TIMEOUT_SECONDS": "10",
        "SANDBOX_DISK_LIMIT_MB": "64",
        "SANDBOX_REAPER_INTERVAL_SECONDS": "0.5",
        "LOG_LEVEL": "WARNING",
        # The suites send hundreds of bad keys from one address on purpose; the limit on
        # failed authentications has its own test (test_trust_server.py).
        "API_AUTH_FAILURES_BURST": "1000000",
        **(extra_env or {}),
    }
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, *launcher, "serve", "--port", str(port), *args],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url, log_path
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("server did not answer /health within 30 s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def live_server(data_root: Path) -> Iterator[LiveServer]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    from sandlot.server.auth import AuthStore

    data_dir = data_root / "server"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    keys = {
        "admin": store.create_key("ops", "admin")[1],
        "alice": store.create_key("acme", "user")[1],
        "alice2": store.create_key("acme", "user")[1],
        "viewer": store.create_key("acme", "viewer")[1],
        "bob": store.create_key("globex", "user")[1],
        "small": store.create_key("tiny", "user")[1],
    }
    revoked_id, keys["revoked"] = store.create_key("acme", "user")
    store.revoke_key(revoked_id)
    store.set_quota("tiny", max_sandboxes=1, max_memory_mb=300)
    store.close()
    # The suites share these keys, and a listing costs its key one request per 256 entries:
    # at the default rate one suite's large listings made the next suite's calls 429 (CI,
    # 2026-12-06). The rate's own test has a server of its own.
    rate = {"API_RATE_LIMIT_PER_SECOND": "10000", "API_RATE_LIMIT_BURST": "10000"}
    process, url, log_path = start_server(data_dir, rate)
    yield LiveServer(url=url, data_dir=data_dir, keys=keys, log=log_path)
    stop_server(process)
