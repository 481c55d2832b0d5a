"""Red-team pass over the spawner (backends/bubblewrap/spawner.py, spawner_server.py).

Each test shows one fault found, and fails on the code as it was found:

- a spawner whose interpreter cannot be executed (``sys.executable`` empty, as in an embedded
  interpreter, or gone after an upgrade) failed every templated create instead of falling
  back to the launchers;
- a manager that is pid 1 of its pid namespace (a container's entrypoint) never got a
  spawner: the spawner took its parent for dead and exited;
- the child moved every fd above 512 on its way to bwrap: under an open-file limit of 512 or
  less (where sh and nsenter started bwrap fine) every templated create failed with EINVAL;
- a child's exit reported in the same read as the reply that named it lost its status
  (-SIGKILL stood for a 125);
- a request longer than the spawner reads was answered with no id, and its caller waited
  for ever;
- a spawner's child between fork and exec when the manager was killed went on to exec
  bwrap, whose own child was then left behind, blocked for ever, until the next sweep.

Every manager here has a data dir, a uid range and a cgroup root of its own (other test runs
may share the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.backends.bubblewrap import spawner as spawner_module
from sandlot.backends.bubblewrap.spawner import Spawner, spawn_chain
from sandlot.backends.bubblewrap.template import Template
from sandlot.config import Settings
from sandlot.errors import SandboxStartError
from sandlot.requests import RunCode, SandboxSpec
from tests.conftest import make_settings

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("root_bubblewrap")]

UID = 330_990  # outside the uid ranges of the managers below, and of every other test's
CGROUP_ROOT = "sandlot-redteam-spawner"
REPO = Path(__file__).resolve().parents[1]


def _settings(data_dir: Path, uid_base: int) -> Settings:
    data_dir.mkdir(parents=True, exist_ok=True)
    return make_settings(data_dir, uid_base=uid_base, uid_count=100, cgroup_root=CGROUP_ROOT)


@pytest.fixture
async def client() -> AsyncIterator[Template]:
    spawner = Spawner()
    found = await spawner.get()
    assert found is not None
    try:
        yield found
    finally:
        await spawner.close()


async def _true(client: Template, argv: list[str] | None = None) -> tuple[int, str]:
    """``argv`` (``/bin/true``) through the spawner, with two fds passed the way bwrap gets
    its seccomp filter and info fd; its exit status and stderr's tail."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        chain = await spawn_chain(
            client,
            argv or ["/bin/true"],
            env={"PATH": "/usr/bin:/bin"},
            cgroup_files=[],
            namespaces={},
            passed={3: r, 4: w},
            uid=UID,
        )
    finally:
        os.close(r)
        os.close(w)
    chain.close_stdin()
    async with asyncio.timeout(10):
        code = await chain.wait()
    return code, chain.stderr_tail()


@pytest.mark.parametrize("python", ["", "/nonexistent/sandlot-redteam/python3"])
async def test_a_spawner_whose_interpreter_cannot_be_executed_falls_back_to_the_launchers(
    data_root: Path, monkeypatch: pytest.MonkeyPatch, python: str
) -> None:
    """spawner.py says creates go on through sh and nsenter where the spawner cannot start
    ("no python for it, say"). Found: only a spawner that starts and then dies is caught
    (TemplateGone); an interpreter that cannot be executed at all raises an OSError from
    create_subprocess_exec, which Spawner.get lets through, unmarked: every templated create
    then failed with "sandbox failed to start: [Errno 2] No such file or directory"."""
    monkeypatch.setattr(spawner_module, "sys", types.SimpleNamespace(executable=python))
    name, uid_base = ("no-python-empty", 330_000) if not python else ("no-python-gone", 330_100)
    async with SandboxManager(_settings(data_root / f"redteam-{name}", uid_base)) as mgr:
        for _ in range(2):  # the second one too: the failure is remembered, not retried
            info = await mgr.create(SandboxSpec())
            assert (await mgr.run_code(info.id, RunCode(code="6 * 7"))).text == "42"
            await mgr.destroy(info.id)
        assert mgr._backend("bubblewrap")._spawner._failed


PID1_SCRIPT = r"""
import asyncio, os, sys
from sandlot.backends.bubblewrap.spawner import Spawner, spawn_chain

async def main():
    assert os.getpid() == 1
    spawner = Spawner()
    client = await spawner.get()
    if client is None:
        print("no spawner")
        return
    chain = await spawn_chain(client, ["/bin/true"], env={}, cgroup_files=[], namespaces={},
                              passed={}, uid=int(sys.argv[1]))
    chain.close_stdin()
    print("spawned", await asyncio.wait_for(chain.wait(), 10))
    await spawner.close()

asyncio.run(main())
"""


async def test_the_spawner_runs_under_a_manager_that_is_pid_1() -> None:
    """A manager run as a container's entrypoint is pid 1 of its pid namespace. Found: the
    spawner's check for a manager that died before its death signal was set is
    ``os.getppid() == 1``, true from the start there: it exited before saying ready, and
    every create went through sh and nsenter, with a warning that the spawner "did not
    start". (The socket's EOF already covers a manager gone early.)"""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare")
    done = await asyncio.to_thread(
        subprocess.run,
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID1_SCRIPT, str(UID)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1:] == ["spawned 0"], (done.stdout, done.stderr)


async def test_the_spawners_child_needs_no_fd_above_a_low_open_file_limit(
    client: Template,
) -> None:
    """sh and nsenter start bwrap under any open-file limit that holds its five fds. Found:
    the child moves each fd to 512 or above first (HIGH_FD) before putting it in place, and
    under a limit of 512 or less (a manager started with ``ulimit -n 400``, say: the limit
    the manager raises its soft one to is the hard one) F_DUPFD fails with EINVAL, and every
    templated create fails with status 125."""
    assert client._process is not None
    # The spawner as a manager with a hard limit of 400 would have started it.
    resource.prlimit(client._process.pid, resource.RLIMIT_NOFILE, (400, 400))
    code, stderr = await _true(client)
    assert code == 0, stderr


async def test_an_exit_read_with_its_reply_keeps_its_status(client: Template) -> None:
    """A child that fails at once (its bwrap missing, its cgroup gone) exits 125. Found:
    when its exit arrives in the same read as the reply naming it (a busy event loop, many
    creates at once), Template._dispatch resolves and drops the exit's future before
    spawn_chain asks for it (exit_of), which then makes up -SIGKILL: the chain reports a
    kill that never happened, and its real status is lost."""
    for _ in range(3):
        task = asyncio.ensure_future(
            spawn_chain(
                client,
                ["/nonexistent/sandlot-redteam/bwrap"],
                env={},
                cgroup_files=[],
                namespaces={},
                passed={},
                uid=UID,
            )
        )
        await asyncio.sleep(0)  # the request is sent; the reply is awaited
        time.sleep(0.3)  # the event loop busy elsewhere meanwhile
        chain = await task
        chain.close_stdin()
        async with asyncio.timeout(10):
            code = await chain.wait()
        assert "/nonexistent/sandlot-redteam/bwrap" in chain.stderr_tail()
        assert code == 125


async def test_a_request_longer_than_the_spawner_reads_fails_instead_of_hanging(
    client: Template,
) -> None:
    """The spawner reads at most 64 KiB a request; the socket sends far more. Found: a
    longer one arrives cut short, fails to parse before the MSG_TRUNC check, and is answered
    ``{"id": null, "error": ...}``, which no caller is waiting for: Template.spawn, which has
    no deadline, waits for ever (one 70 KB argv hung its create; 300 KB fails at once with
    EMSGSIZE). The backend's bwrap argv is a few KB, so no create reaches it today; anything
    that grows it (long data-dir or tree paths, more binds) would hang creates silently."""
    with pytest.raises(SandboxStartError):
        async with asyncio.timeout(5):
            await _true(client, ["/bin/true", "x" * 70_000])
    # And the spawner goes on.
    code, stderr = await _true(client)
    assert code == 0, stderr


# A manager in a process of its own: it asks its spawner for bwrap (as a create does: the
# info fd's reader is the manager's, read once bwrap names its child), then is killed.
# cgroup_files names a FIFO: the spawner's child, as root, waits in its open, which holds it
# where any child of a busy spawner is for a moment (between fork and exec) when the manager
# dies.
CRASHING_MANAGER = r"""
import asyncio, os, sys
from sandlot.backends.bubblewrap.spawner import Spawner, spawn_chain

async def main():
    fifo, uid, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    spawner = Spawner()
    client = await spawner.get()
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    chain = await spawn_chain(client, argv, env={"PATH": "/usr/bin:/bin"}, cgroup_files=[fifo],
                              namespaces={}, passed={4: info_w}, uid=uid)
    os.close(info_w)
    print(client._process.pid, chain.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""
CRASH_UID = 330_996
BWRAP_ARGV = [
    "/usr/bin/bwrap", "--unshare-user", "--unshare-ipc", "--unshare-uts", "--unshare-net",
    "--disable-userns", "--info-fd", "4", "--block-fd", "0", "--uid", "65534", "--gid",
    "65534", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--dir", "/proc", "--dev", "/dev",
    "--remount-ro", "/", "/bin/true",
]  # fmt: skip


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[1]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(entry.name))
    return found


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def test_a_bwrap_started_as_its_manager_dies_leaves_nothing_running(
    data_root: Path,
) -> None:
    """SECURITY.md: the spawner dies with the manager, "bwrap with it". Found: the spawner's
    child has no death signal of its own (a fork clears it, and the uid change would), so a
    child between fork and exec when the manager is killed goes on and execs bwrap after
    both are gone; that bwrap, not yet past --die-with-parent, writes its info fd, whose
    reader died with the manager, dies of SIGPIPE before it releases its child, and the
    child (the sandbox's uid, in its namespaces and cgroup) waits for ever on bwrap's
    eventfd, out of reach of every death signal and of the stdin EOF meant to end it, until
    a manager on the same data dir sweeps that cgroup. Killing a manager with 12 creates in
    flight left 8 to 31 such processes over 8 kills (2 with the sh/nsenter launchers, whose
    sh ends at the EOF while it waits for "go"; none once the child set its own death signal
    after the uid change and checked its parent)."""
    workdir = data_root / "redteam-crash"
    workdir.mkdir(parents=True, exist_ok=True)
    fifo = workdir / "hold"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo, 0o600)
    assert _processes_of(CRASH_UID) == []
    manager = subprocess.Popen(
        [sys.executable, "-c", CRASHING_MANAGER, str(fifo), str(CRASH_UID), *BWRAP_ARGV],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert manager.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(manager.stdout.readline), 20)
        spawner_pid, child_pid = map(int, line.split())
        assert Path(f"/proc/{child_pid}").exists()  # waiting in its open of the "cgroup file"
        manager.kill()
        manager.wait()
        assert await asyncio.to_thread(_wait_gone, spawner_pid, 5.0), "the spawner outlived it"
        # The child's step ends (the cgroup write takes a moment, it never blocks for long).
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            await asyncio.sleep(1.5)
        finally:
            os.close(reader)
        left = _processes_of(CRASH_UID)
        assert left == [], [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:40]) for pid in left]
    finally:
        if manager.poll() is None:
            manager.kill()
            manager.wait()
        if manager.stdout is not None:
            manager.stdout.close()
        for pid in _processes_of(CRASH_UID):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
