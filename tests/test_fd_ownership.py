"""Every file descriptor of the manager's is closed once, by its owner, on either event loop.

The server runs on uvloop (uvicorn picks it); the SDK and the tests on asyncio's own loop. A
close(2) of a number already closed is harmless only until a thread is given that number in
between: its descriptor is then closed under it. That was the EBADF that failed a create in
two CI runs (2026-11-27/28): a templated guest's stdio pipes were handed to
``connect_read_pipe``/``connect_write_pipe`` as file objects, and under uvloop libuv closed
each fd and then the file object closed it again; its read pipes' transports also stayed open
past EOF, to be finalized by the garbage collector in whatever thread it ran (closing each fd
twice more, and calling libuv off its loop's thread).

Each case runs sandbox lifecycles in a child process under ``strace -f`` and counts the
``close()`` calls of that process's own threads that fail with EBADF: a close of a number
nobody held, so the second close of a double one (the first close of a race the trace cannot
catch every time, the second every time). With the garbage collector off, no pipe may stay
open once the sandboxes are destroyed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UID_BASE = 640_000  # its own uids: other runs on this host never hold them
LIFECYCLES = 6

# create, run_code, destroy; then a guest killed from inside and restarted by the next call
# (a restart ends a guest without a destroy); pipes counted with the collector off.
SCRIPT = """
import asyncio, gc, json, os, stat, sys
from sandlot import SandboxManager
from sandlot.requests import RunCode, SandboxSpec
from tests.conftest import make_settings

loop_kind, data_dir = sys.argv[1], sys.argv[2]
uid_base, lifecycles, templated = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "templated"
KILL_GUEST = "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"

def pipes():
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISFIFO(os.stat(f"/proc/self/fd/{name}").st_mode):
                count += 1
        except OSError:
            pass
    return count

async def main():
    settings = make_settings(
        data_dir, memory_mb=64, disk_mb=16, uid_base=uid_base, guest_template=templated
    )
    async with SandboxManager(settings) as manager:
        warm = await manager.create(SandboxSpec(backend="bubblewrap"))
        await manager.destroy(warm.id)
        gc.collect()
        gc.disable()
        before = pipes()
        for _ in range(lifecycles):
            info = await manager.create(SandboxSpec(backend="bubblewrap"))
            await manager.run_code(info.id, RunCode(code="1"))
            await manager.destroy(info.id)
        info = await manager.create(SandboxSpec(backend="bubblewrap"))
        await manager.run_code(info.id, RunCode(code=KILL_GUEST))
        await manager.run_code(info.id, RunCode(code="1"))
        await manager.destroy(info.id)
        await asyncio.sleep(0.2)  # a pipe's end is seen by the loop
        after = pipes()
        gc.enable()
        gc.collect()
    print(json.dumps({"pipes_before": before, "pipes_after": after}))

if loop_kind == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""

_CALL = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()(.*)$")


def own_threads(trace: list[str]) -> set[int]:
    """The traced process's own threads: its first pid and every thread it clones."""
    main = int(trace[0].split()[0])
    threads = {main}
    pending: dict[int, bool] = {}  # a clone cut by another line: whether it made a thread
    for line in trace:
        match = _CALL.match(line)
        if match is None:
            continue
        tid, resumed, call, rest = int(match[1]), match[2], match[3], match[4]
        if call in ("clone", "clone3"):
            is_thread = "CLONE_THREAD" in rest
            if "<unfinished" in rest:
                pending[tid] = is_thread
                continue
            child = re.search(r"= (\d+)$", rest)
            if is_thread and child and tid in threads:
                threads.add(int(child[1]))
        elif resumed in ("clone", "clone3"):
            child = re.search(r"= (\d+)$", rest)
            if pending.pop(tid, False) and child and tid in threads:
                threads.add(int(child[1]))
    return threads


def failed_closes(trace: list[str]) -> list[str]:
    """The process's own ``close()`` calls that found no open descriptor."""
    threads = own_threads(trace)
    found = []
    pending: set[int] = set()  # threads whose close() was cut by another line
    for line in trace:
        match = _CALL.match(line)
        if match is None:
            continue
        tid, resumed, call, rest = int(match[1]), match[2], match[3], match[4]
        if tid not in threads:
            continue
        if call == "close" and "<unfinished" in rest:
            pending.add(tid)
        elif call == "close" or (resumed == "close" and tid in pending):
            pending.discard(tid)
            if "EBADF" in rest:
                found.append(line)
    return found


def test_the_trace_reader_finds_a_double_close_in_a_thread() -> None:
    """The reader itself: a thread's failed close counts, a child process's does not."""
    trace = [
        "100  clone3({flags=CLONE_VM|CLONE_THREAD|CLONE_SIGHAND, exit_signal=0}, 88) = 101",
        "100  clone(child_stack=NULL, flags=SIGCHLD) = 102",
        "100  clone3({flags=CLONE_VM|CLONE_THREAD, exit_signal=0} <unfinished ...>",
        "101  close(7)                          = 0",
        "100  <... clone3 resumed> => {parent_tid=[103]}, 88) = 103",
        "101  close(7)                          = -1 EBADF (Bad file descriptor)",
        "102  close(9)                          = -1 EBADF (Bad file descriptor)",
        "103  close(8 <unfinished ...>",
        "100  close(5)                          = 0",
        "103  <... close resumed>)              = -1 EBADF (Bad file descriptor)",
    ]
    assert own_threads(trace) == {100, 101, 103}
    assert len(failed_closes(trace)) == 2


@pytest.mark.parametrize(
    ("loop_kind", "guests"),
    [("asyncio", "templated"), ("uvloop", "templated"), ("uvloop", "exec")],
)
def test_lifecycles_close_each_descriptor_once(
    root_bubblewrap: None, loop_kind: str, guests: str
) -> None:
    """A templated guest's pipes are the manager's own (the fault was there); a guest bwrap
    execs is an asyncio subprocess, whose pipes the loop makes."""
    if shutil.which("strace") is None:
        pytest.fail("strace is missing: `make test` installs it (TEST_PACKAGES)")
    root = Path(tempfile.mkdtemp(prefix="sandlot-fdown-", dir="/tmp"))
    root.chmod(0o711)
    log = root / "trace"
    try:
        trace = ["strace", "-f", "-qq", "-e", "trace=close,clone,clone3", "-o", str(log)]
        script = [sys.executable, "-c", SCRIPT, loop_kind, str(root / "data"), str(UID_BASE)]
        result = subprocess.run(
            [*trace, *script, str(LIFECYCLES), guests],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        failed = failed_closes(log.read_text().splitlines())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert failed == [], f"{len(failed)} closes of a closed descriptor: {failed[:10]}"
    # Nothing waits for the collector: a guest's pipes are closed when it ends.
    assert report["pipes_after"] <= report["pipes_before"], report
