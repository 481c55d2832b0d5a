"""A process that embeds sandlot leaves nothing behind when it ends, and reaps its own children.

- A script that forgets its sandboxes (and holds a warm pool) releases them all at normal exit
  and on SIGTERM; an app's own SIGTERM handler is kept. (kill -9 is test_recovery's.)
- Ending a guest never collects its exit status behind asyncio's back: asyncio's child watcher
  must be the only reaper, else it logs "Unknown child process pid N, will report returncode
  255" (or "exit status already read") and a signal could reach a recycled pid.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandlot import SandboxManager, SandboxStatus
from sandlot.backends.uids import UID_LOCK_DIR
from sandlot.core.store import Store
from tests import leaks
from tests.conftest import make_settings, skip_reason

REPO = Path(__file__).resolve().parent.parent
POOL_SIZE = 2
# A range of host uids of its own, so that the uid locks it checks are no other run's.
UID_BASE = 610_000

# A script as a user writes it: the embedded SDK's default manager, a warm pool, one sandbox it
# never destroys. It says which sandbox it made and the host uids its sandboxes hold, then
# ends as the test asks.
FORGETFUL = """
import json, os, sys, time
from sandlot import Sandbox
from sandlot.sandbox import default_manager

sb = Sandbox.create()
assert sb.run_code("print(6 * 7)").stdout == "42\\n"
while default_manager().pooled_count() < {pool_size}:
    time.sleep(0.05)
instance = default_manager().instance_dir
uids = [(d / "workspace").stat().st_uid for d in (instance / "sandboxes").iterdir()]
print(json.dumps({{"id": sb.id, "uids": uids, "instance": str(instance)}}), flush=True)
if sys.argv[1] == "wait":
    time.sleep(3600)
"""


def _require_bubblewrap() -> None:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)


def _script_env(data_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
        "SANDLOT_DATA_DIR": str(data_dir),
        "SANDBOX_POOL_SIZE": str(POOL_SIZE),
        "SANDBOX_UID_BASE": str(UID_BASE),
        "SANDBOX_MEMORY_LIMIT_MB": "64",
        "SANDBOX_DISK_LIMIT_MB": "16",
        "LOG_LEVEL": "WARNING",
    }


@dataclass
class Script:
    proc: subprocess.Popen[str]
    sandbox_id: str
    uids: list[int]
    instance_dir: Path


@pytest.fixture
def run_script(data_root: Path) -> Iterator[Callable[[str, str, str], Script]]:
    """Start a script on its own data dir; afterwards sweep whatever a failure left there."""
    data_dirs: list[Path] = []

    def start(name: str, script: str, mode: str) -> Script:
        data_dir = data_root / name
        data_dirs.append(data_dir)
        proc = subprocess.Popen(
            [sys.executable, "-c", script, mode],
            cwd=REPO,
            env=_script_env(data_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("{"):
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the script did not start its sandbox: {err[-3000:]}")
        said = json.loads(line)
        assert len(said["uids"]) == 1 + POOL_SIZE
        return Script(proc, said["id"], said["uids"], Path(said["instance"]))

    yield start
    for data_dir in data_dirs:
        if data_dir.is_dir():
            asyncio.run(_sweep(data_dir))


async def _sweep(data_dir: Path) -> None:
    async with SandboxManager(make_settings(data_dir, uid_base=UID_BASE)):
        pass


def _assert_all_released(data_dir: Path, script: Script) -> None:
    observer = leaks.Outside(make_settings(data_dir, uid_base=UID_BASE), script.instance_dir)
    # The script is gone, so its sandboxes must be too: every process of a sandbox uid in
    # our cgroups, every cgroup, mount, loop device and sandbox directory, and its instance.
    left = leaks.wait_for_baseline(observer, leaks.Snapshot(), orphans=leaks.no_orphans)
    assert not left, f"left behind after the script ended: {left}"
    assert not script.instance_dir.exists(), "the instance was not released"
    held = [uid for uid in script.uids if _locked(UID_LOCK_DIR / f"{uid}.lock")]
    assert not held, f"uid locks still held (by a process that outlived the script?): {held}"
    store = Store(data_dir / "sandlot.db")
    try:
        info = store.get(script.sandbox_id)
    finally:
        store.close()
    assert info is not None
    assert info.status == SandboxStatus.DESTROYED
    assert info.end_reason == "shutdown"


def _locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_normal_exit_releases_the_pool_and_forgotten_sandboxes(
    data_root: Path, run_script: Callable[[str, str, str], Script]
) -> None:
    _require_bubblewrap()
    script = run_script("exit-normal", FORGETFUL.format(pool_size=POOL_SIZE), "exit")
    _, err = script.proc.communicate(timeout=60)
    assert script.proc.returncode == 0, err[-3000:]
    _assert_all_released(data_root / "exit-normal", script)


def test_sigterm_releases_the_pool_and_forgotten_sandboxes(
    data_root: Path, run_script: Callable[[str, str, str], Script]
) -> None:
    _require_bubblewrap()
    script = run_script("exit-sigterm", FORGETFUL.format(pool_size=POOL_SIZE), "wait")
    script.proc.send_signal(signal.SIGTERM)
    _, err = script.proc.communicate(timeout=60)
    # It still dies of the signal, as it would have without sandlot.
    assert script.proc.returncode == -signal.SIGTERM, err[-3000:]
    _assert_all_released(data_root / "exit-sigterm", script)


def test_an_apps_own_sigterm_handler_is_kept(
    data_root: Path, run_script: Callable[[str, str, str], Script]
) -> None:
    _require_bubblewrap()
    # The app's handler turns SIGTERM into a clean exit with its own status: sandlot must
    # neither replace it nor skip its own release when the app exits through it.
    app = textwrap.dedent("""
        import signal, sys
        def graceful(signum, frame):
            print("app handler ran", file=sys.stderr, flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, graceful)
    """)
    script = run_script("exit-app-handler", app + FORGETFUL.format(pool_size=POOL_SIZE), "wait")
    script.proc.send_signal(signal.SIGTERM)
    _, err = script.proc.communicate(timeout=60)
    assert script.proc.returncode == 3, err[-3000:]
    assert "app handler ran" in err
    _assert_all_released(data_root / "exit-app-handler", script)


def test_an_ignored_sigterm_stays_ignored(
    data_root: Path, run_script: Callable[[str, str, str], Script]
) -> None:
    _require_bubblewrap()
    app = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    check = "\nassert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN\n"
    script = run_script("exit-ignored", app + FORGETFUL.format(pool_size=POOL_SIZE) + check, "exit")
    script.proc.send_signal(signal.SIGTERM)  # ignored, as the app asked
    _, err = script.proc.communicate(timeout=60)
    assert script.proc.returncode == 0, err[-3000:]
    _assert_all_released(data_root / "exit-ignored", script)


# ---------------------------------------------------------------------- reaping our children

CHURN_SANDBOXES = 50
CHURN_CONCURRENCY = 8
REAPING_WARNINGS = ("Unknown child process", "exit status already read")

# asyncio's child watcher collects a child's status either in a thread blocked in waitpid()
# (3.11's default) or on the loop once the child's pidfd is readable (3.12+): in the second
# case anything else that calls waitpid() between the exit and the loop's turn steals it. The
# script runs under the watcher it is given, and logs asyncio's warnings to stderr.
WATCHED = """
import asyncio, logging, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # set_child_watcher, on 3.12 and 3.13
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
kind, job = sys.argv[1], sys.argv[2:]

def use_watcher(loop):
    try:
        kinds = {"pidfd": asyncio.PidfdChildWatcher, "threaded": asyncio.ThreadedChildWatcher}
        watcher = kinds[kind]()
        asyncio.set_child_watcher(watcher)
        watcher.attach_loop(loop)
    except (AttributeError, NotImplementedError, OSError) as exc:
        print("unsupported", exc, flush=True)
        sys.exit(0)
"""

CHURN = (
    WATCHED
    + """
import time
from sandlot import SandboxManager
from sandlot.requests import SandboxSpec
from tests.conftest import make_settings

async def main():
    use_watcher(asyncio.get_running_loop())
    settings = make_settings(job[0], memory_mb=64, disk_mb=16, log_level="WARNING")
    gate = asyncio.Semaphore(int(job[2]))

    async def one():
        async with gate:
            info = await manager.create(SandboxSpec(backend="bubblewrap"))
            await manager.destroy(info.id)

    async def busy():
        # An app doing CPU work on its loop (an agent's local model, say) delays the loop's
        # turns, and with them asyncio's collection of exited children.
        while True:
            time.sleep(0.01)
            await asyncio.sleep(0)

    async with SandboxManager(settings) as manager:
        hog = asyncio.create_task(busy())
        await asyncio.gather(*(one() for _ in range(int(job[1]))))
        hog.cancel()
    print("done", flush=True)

asyncio.run(main())
"""
)

# One guest that has exited but is not yet collected when it is killed: the loop is kept
# from its turn (a blocking wait) until the kernel shows the child as a zombie.
ZOMBIE_KILL = (
    WATCHED
    + """
import os, time
from pathlib import Path
from sandlot.backends.base import GuestProcess

def zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False

async def main():
    use_watcher(asyncio.get_running_loop())
    fds_before = len(os.listdir("/proc/self/fd"))
    pipe = asyncio.subprocess.PIPE
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "pass", stdin=pipe, stdout=pipe, stderr=pipe
    )
    guest = GuestProcess(process)
    deadline = time.monotonic() + 10
    while not zombie(process.pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    guest.kill()
    guest.kill()
    code = await asyncio.wait_for(guest.wait(), 5)
    for _ in range(3):  # the transport lets go of its pipes a few turns later
        await asyncio.sleep(0)
    print("exit", code, "fds", len(os.listdir("/proc/self/fd")) - fds_before, flush=True)

asyncio.run(main())
"""
)


def _run_watched(script: str, kind: str, *job: str) -> tuple[str, list[str]]:
    """Run ``script`` under watcher ``kind``; its stdout and asyncio's reaping warnings."""
    proc = subprocess.run(
        [sys.executable, "-c", script, kind, *job],
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    if proc.stdout.startswith("unsupported"):
        pytest.skip(f"asyncio's {kind} child watcher is not available: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if any(w in line for w in REAPING_WARNINGS)]
    return proc.stdout, warned


@pytest.mark.parametrize("watcher", ["pidfd", "threaded"])
def test_killing_an_exited_guest_leaves_its_status_to_asyncio(watcher: str) -> None:
    out, warned = _run_watched(ZOMBIE_KILL, watcher)
    assert not warned, warned
    # Its real exit status, as asyncio collected it: not the 255 of a stolen one. And the
    # pidfd it was signalled through is closed once it is collected.
    assert out.split() == ["exit", "0", "fds", "0"], out


@pytest.mark.parametrize("watcher", ["pidfd", "threaded"])
def test_concurrent_create_and_destroy_leave_reaping_to_asyncio(
    data_root: Path, watcher: str
) -> None:
    _require_bubblewrap()
    data_dir = data_root / f"reaping-{watcher}"
    started = time.monotonic()
    out, warned = _run_watched(
        CHURN, watcher, str(data_dir), str(CHURN_SANDBOXES), str(CHURN_CONCURRENCY)
    )
    assert out.strip() == "done", out
    assert not warned, (
        f"{len(warned)} reaping warnings in {CHURN_SANDBOXES} creates and destroys "
        f"({time.monotonic() - started:.1f} s): {warned[:3]}"
    )
