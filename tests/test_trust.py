"""Trust (issue 11, the guest's side): code run in a sandbox may change files, and through them
what later code does, but never the guest, never the framing of a result; and a check run as
a fresh process (or with ``fresh=True``) sees no state planted by earlier code.

Each attack program here broke a result before the fix it names.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import errno
import os
import re
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot import ExecResult, Sandbox, SandboxError, SandboxManager
from sandlot._portal import get_portal
from sandlot.backends import mountns
from sandlot.backends.bubblewrap import backend as bubblewrap_backend
from sandlot.backends.bubblewrap import forks as bubblewrap_forks
from sandlot.backends.bubblewrap.forks import TemplateGuest
from sandlot.errors import SandboxStartError
from sandlot.requests import ListFiles, RunCommand, SandboxSpec
from tests import leaks
from tests.conftest import placement, skip_reason

MiB = 1 << 20


def describe(result: ExecResult) -> str:
    return (
        f"exit={result.exit_code} kill={result.kill_reason} lost={result.state_lost} "
        f"out={result.stdout[-300:]!r} err={result.stderr[-300:]!r} text={result.text!r}"
    )


def run_fresh(manager: SandboxManager, sb: Sandbox, command: str, **fields: object) -> ExecResult:
    request = RunCommand(command=command, fresh=True, **fields)  # type: ignore[arg-type]
    return get_portal().call(manager.run_command(sb.id, request))


def kernel_kept_through_fresh(sb: Sandbox) -> bool:
    """Whether a fresh command keeps the Python kernel (stopped) or ends it first: gVisor's
    /proc shows no counter that would tell whether a stopped kernel ran (its context
    switches, its CPU time), so there the kernel is ended before the command (README)."""
    return sb.info.runtime != "runsc"


def assert_kernel_after_fresh(sb: Sandbox, fresh: ExecResult) -> None:
    """The kernel's ``keep`` survived the fresh command, or (gVisor) the command said it
    did not."""
    kept = sb.run_code("keep")
    if kernel_kept_through_fresh(sb):
        assert not fresh.state_lost, describe(fresh)
        assert kept.text == "'state'" and not kept.state_lost, describe(kept)
    else:
        assert fresh.state_lost, describe(fresh)
        assert kept.error is not None and kept.error.type == "NameError", describe(kept)


# ------------------------------------------- 1. planted interpreter and shell start-up files

USER_SITE = "$(python3 -s -c 'import site; print(site.getusersitepackages())')"
PLANTS = {
    # Each one makes every later interpreter exit 0 whatever its script does.
    "usercustomize.py": "import os, atexit\natexit.register(lambda: os._exit(0))\n",
    "sitecustomize.py": "import os, atexit\natexit.register(lambda: os._exit(0))\n",
    "planted.pth": "import os, atexit; atexit.register(lambda: os._exit(0))\n",
}


@pytest.mark.hostile
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_start_up_file_does_not_run_in_a_later_python(
    sandbox: Sandbox, name: str
) -> None:
    # Failed before: HOME=/workspace and the user site was on, so all three made the check
    # exit 0 (usercustomize.py, sitecustomize.py and .pth files there run at start-up).
    sandbox.files.write("plant.txt", PLANTS[name])
    planted = sandbox.commands.run(f'd={USER_SITE}; mkdir -p "$d" && cp plant.txt "$d/{name}"')
    assert planted.exit_code == 0, describe(planted)
    sandbox.files.write("check.py", "raise SystemExit(3)\n")
    check = sandbox.commands.run("python3 check.py")
    assert check.exit_code == 3, describe(check)


PLANTED_STDLIB = """
import builtins, importlib.util, os, sys, sysconfig
builtins.PLANTED = True
spec = importlib.util.spec_from_file_location(
    "base64", os.path.join(sysconfig.get_paths()["stdlib"], "base64.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules["base64"] = module
"""


@pytest.mark.hostile
def test_a_fresh_interpreter_runs_nothing_planted(sandbox: Sandbox) -> None:
    # Failed before: the restarted kernel imported /workspace/base64.py (the working
    # directory led its path during the guest's own imports) and the user site's
    # usercustomize.py, so "a fresh interpreter" ran code planted by the one it replaced.
    sandbox.files.write("base64.py", PLANTED_STDLIB)
    sandbox.files.write("plant.txt", "import builtins\nbuiltins.PLANTED_SITE = True\n")
    planted = sandbox.commands.run(
        f'd={USER_SITE}; mkdir -p "$d" && cp plant.txt "$d/usercustomize.py"'
    )
    assert planted.exit_code == 0, describe(planted)
    died = sandbox.run_code("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert died.state_lost, describe(died)
    fresh = sandbox.run_code(
        "import builtins\n(getattr(builtins, 'PLANTED', False), "
        "getattr(builtins, 'PLANTED_SITE', False))"
    )
    assert fresh.text == "(False, False)", describe(fresh)
    # The user's own modules in the working directory stay importable by name.
    sandbox.files.write("mine.py", "VALUE = 42\n")
    assert sandbox.run_code("import mine\nmine.VALUE").text == "42"


@pytest.mark.hostile
def test_nothing_on_path_is_writable(jail: Sandbox) -> None:
    # A guard, not a regression: no directory on the default PATH can take a planted python3.
    found = jail.commands.run(
        'IFS=:; for d in $PATH; do [ -w "$d" ] && echo "$d"; '
        'case "$d" in /*) ;; *) echo "relative: $d";; esac; done; true'
    )
    assert found.stdout == "", describe(found)


@pytest.mark.hostile
def test_a_fresh_command_ignores_planted_session_state_and_dotfiles(
    manager: SandboxManager, sandbox: Sandbox
) -> None:
    # Failed before (the guest ignored ``fresh``): BASH_ENV exported into the session made
    # the check exit 0, and the session's other exports reached it.
    sandbox.files.write("hook.sh", "exit 0\n")
    sandbox.files.write(".gitconfig", "[user]\n\tname = planted\n")
    sandbox.commands.run("export BASH_ENV=/workspace/hook.sh FOO=planted; cd /tmp")
    if sandbox.info.backend == "bubblewrap":
        assert sandbox.commands.run("exit 3").exit_code == 0  # the session's hook, by design
    check = run_fresh(manager, sandbox, 'echo "${FOO:-clean} $PWD $HOME"; exit 3')
    assert check.exit_code == 3, describe(check)
    words = check.stdout.split()
    home_was = sandbox.commands.run("echo $HOME", session="other").stdout.strip()
    assert words[0] == "clean" and words[1] == home_was != words[2], describe(check)


# ------------------------------------------- 2. a child of an earlier cell answers for later ones

STOP_AND_ANSWER = """
import json, os, signal, struct, sys, time
# The kernel's argv names its control socket, forked or not (a forked kernel's
# /proc/self/cmdline is the supervisor's).
ctl_in, ctl_out = int(sys.argv[-2]), int(sys.argv[-1])
kernel = os.getpid()
if os.fork() == 0:
    os.setsid()
    time.sleep(0.5)  # after this cell's own reply
    os.kill(kernel, signal.SIGSTOP)
    for _ in range(3):
        try:
            size = struct.unpack(">I", os.read(ctl_in, 4))[0]
            body = b""
            while len(body) < size:
                body += os.read(ctl_in, size - len(body))
            nonce = json.loads(body)["nonce"]
            reply = json.dumps({"exit_code": 0, "text": "'forged'", "error": None,
                                "nonce": nonce}).encode()
            os.write(ctl_out, struct.pack(">I", len(reply)) + reply)
        except OSError:
            break
    os._exit(0)
'planted'
"""


@pytest.mark.hostile
def test_a_child_that_stops_the_kernel_cannot_answer_for_it(sandbox: Sandbox) -> None:
    # Failed before: the child stopped the kernel, read the next request (nonce included)
    # from the control pipe it inherited, and its reply was taken as the cell's.
    assert sandbox.run_code(STOP_AND_ANSWER).text == "'planted'"
    time.sleep(1.0)
    result = sandbox.run_code("'real'", timeout_s=5)
    assert result.text == "'real'" and result.state_lost, describe(result)
    assert sandbox.run_code("6 * 7").text == "42"


ANSWER_BESIDE_THE_KERNEL = """
import json, os, struct, sys, time
ctl_out = int(sys.argv[-1])  # the kernel's argv names its control socket (forked or not)
if os.fork() == 0:
    os.setsid()
    end = time.time() + 4
    while time.time() < end:  # a flood of well-formed replies, each to any nonce it may be
        reply = json.dumps({"exit_code": 0, "text": "'forged'", "error": None}).encode()
        try:
            os.write(ctl_out, struct.pack(">I", len(reply)) + reply)
        except OSError:
            break
        time.sleep(0.01)
    os._exit(0)
'planted'
"""


@pytest.mark.hostile
def test_bytes_from_a_child_never_mix_into_the_kernels_reply(sandbox: Sandbox) -> None:
    assert sandbox.run_code(ANSWER_BESIDE_THE_KERNEL).text == "'planted'"
    for _ in range(5):
        result = sandbox.run_code("'real'", timeout_s=5)
        assert result.text == "'real'" and not result.state_lost, describe(result)


# ------------------------------------------- 3. a leftover daemon against a later command

DAEMON = r"""
import os, time
me = os.getpid()
end = time.time() + 20
while time.time() < end:
    for name in os.listdir('/proc'):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open('/proc/%s/cmdline' % name, 'rb') as f:
                if b'THE_CHECK' not in f.read():
                    continue
            with open('/proc/%s/mem' % name, 'r+b'):
                pass  # write access to its memory: it is ours to rewrite
            with open('/workspace/touched', 'a') as f:
                f.write(name + '\n')
            with open('/proc/%s/fd/1' % name, 'w') as out:
                out.write('forged\n')
        except OSError:
            continue
    time.sleep(0.002)
"""


@pytest.mark.hostile
def test_a_fresh_command_is_out_of_reach_of_leftover_processes(
    manager: SandboxManager, sandbox: Sandbox
) -> None:
    # Failed before (the guest ignored ``fresh``): the daemon opened the check's memory for
    # writing and wrote into its stdout.
    sandbox.run_code("keep = 'state'")
    sandbox.files.write("daemon.py", DAEMON)
    started = sandbox.commands.run("(setsid python3 daemon.py >/dev/null 2>&1 &)")
    assert started.exit_code == 0, describe(started)
    # The daemon is alive and armed: an ordinary command is within its reach (by design).
    time.sleep(0.5)
    exposed = sandbox.commands.run("bash -c 'sleep 0.5; echo THE_CHECK'")
    if sandbox.info.backend == "bubblewrap":
        assert "forged" in exposed.stdout, describe(exposed)
    before = sandbox.commands.run("cat touched 2>/dev/null").stdout
    check = run_fresh(manager, sandbox, "bash -c 'sleep 1; echo THE_CHECK ok'")
    assert check.stdout == "THE_CHECK ok\n" and check.exit_code == 0, describe(check)
    assert sandbox.commands.run("cat touched 2>/dev/null").stdout == before
    alive = sandbox.commands.run(
        "for p in /proc/[0-9]*; do grep -qa 'daemon[.]py' $p/cmdline 2>/dev/null && echo $p; done"
    )
    assert alive.stdout == "", describe(alive)
    # The kernel was paused, not lost (gVisor: ended first, and said so).
    assert_kernel_after_fresh(sandbox, check)


# The kernel itself, kept stopped during a fresh command, woken by a timer it armed before:
# SIGCONT undoes SIGSTOP even when the OS kernel sends it to a stopped process. A thread of
# the cell then rewrites the check's script in its memory (red team, 2026-11-28).
# A POSIX timer that sends SIGCONT to its own process every ``every`` (SIGEV_SIGNAL): the OS
# kernel delivers it even while the process is stopped, and it undoes the stop.
SIGCONT_TIMER = r"""
import ctypes, os, signal, threading, time
libc = ctypes.CDLL(None, use_errno=True)
class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_long), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]
class TS(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
class ITS(ctypes.Structure):
    _fields_ = [("interval", TS), ("value", TS)]
event, timer = SigEvent(0, signal.SIGCONT, 0), ctypes.c_void_p()
def arm(every_ns):
    assert libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0
    every = ITS(TS(0, every_ns), TS(0, every_ns))
    assert libc.timer_settime(timer, 0, ctypes.byref(every), None) == 0
"""
WAKING_KERNEL = (
    SIGCONT_TIMER
    + r"""
arm(10_000_000)

def rewrite():
    done = set()
    while True:
        for p in os.listdir('/proc'):
            if not p.isdigit() or p in done:
                continue
            try:
                if b'THE_CHECK' not in open('/proc/%s/cmdline' % p, 'rb').read():
                    continue
                done.add(p)
                mem = os.open('/proc/%s/mem' % p, os.O_RDWR)
                for line in open('/proc/%s/maps' % p):
                    if 'rw-p' not in line:
                        continue
                    a, b = (int(x, 16) for x in line.split()[0].split('-'))
                    try:
                        data = os.pread(mem, b - a, a)
                    except OSError:
                        continue
                    for old, new in ((b'exit 1', b'exit 0'), (b'=FAIL', b'=PASS')):
                        i = data.find(old)
                        while i >= 0:
                            os.pwrite(mem, new, a + i)
                            i = data.find(old, i + 1)
                os.close(mem)
            except OSError:
                continue
        time.sleep(0.002)

threading.Thread(target=rewrite, daemon=True).start()
"""
)
CHECK = "sleep 1.5\necho THE_CHECK result=FAIL\nexit 1"


@pytest.mark.hostile
def test_a_kernel_woken_during_a_fresh_command_cannot_forge_it(
    manager: SandboxManager, jail: Sandbox
) -> None:
    # Failed before (bubblewrap): the fresh check came back exit 0, "result=PASS", state kept.
    honest = run_fresh(manager, jail, CHECK)
    assert (honest.exit_code, honest.stdout) == (1, "THE_CHECK result=FAIL\n"), describe(honest)
    armed = jail.run_code(WAKING_KERNEL)
    assert armed.exit_code == 0, describe(armed)
    try:
        forged = run_fresh(manager, jail, CHECK)
    except SandboxError as exc:
        assert kernel_kept_through_fresh(jail), exc
        assert exc.code == "guest_error" and "ran meanwhile" in exc.message, exc
        # The kernel that ran was ended: its loss is told by the next cell.
        after = jail.run_code("1 + 1")
        assert after.text == "2" and after.state_lost, describe(after)
    else:
        # The kernel was ended before the command, which ran alone: always on gVisor, and
        # on any backend when the kernel did not stop in time (a CI run on a machine whose
        # both cores were busy took this path once). Then the result says the state was
        # lost, and it is the honest one.
        assert forged.state_lost, (
            f"a result came back from a check the kernel could rewrite: {describe(forged)}"
        )
        assert (forged.exit_code, forged.stdout) == (1, "THE_CHECK result=FAIL\n")
    again = run_fresh(manager, jail, CHECK)
    assert (again.exit_code, again.stdout) == (1, "THE_CHECK result=FAIL\n"), describe(again)


KILL_THE_STOPPED = (
    "for p in /proc/[0-9]*; do grep -q '^State:.*(stopped)' $p/status 2>/dev/null"
    " && kill -9 ${p#/proc/}; done; echo done"
)


@pytest.mark.hostile
def test_a_kernel_killed_during_a_fresh_command_withholds_its_result(
    manager: SandboxManager, jail: Sandbox
) -> None:
    # Killed (by the command here; the OOM killer alike), the kernel leaves no way to tell
    # whether it ran first: the result is withheld, and the message says it was killed.
    jail.run_code("keep = 'state'")
    if not kernel_kept_through_fresh(jail):
        pytest.skip("gVisor: the kernel is ended before a fresh command")
    with pytest.raises(SandboxError, match="ended during this fresh command"):
        run_fresh(manager, jail, KILL_THE_STOPPED)
    after = jail.run_code("1 + 1")
    assert after.text == "2" and after.state_lost, describe(after)


# A sibling of the woken kernel: a chain of processes that each arm a SIGCONT timer (every
# 50 us) and fork the next before going, so that a stop never holds and a walk of /proc has a
# new pid to chase. The guest's walk stops all at once (kill(-1) in the sandbox's own pid
# namespace), then kills until a look finds nothing new. Held before this test was written
# (2026-11-28): kept so that it stays so.
SELF_WAKING_CHAIN = (
    SIGCONT_TIMER
    + r"""
arm(50_000)
while True:
    if libc.fork() == 0:
        arm(50_000)
        try:  # no O_TRUNC: a reader between a truncation and its write saw it empty (CI)
            os.write(os.open("/workspace/chain.alive", os.O_WRONLY | os.O_CREAT), b"1")
        except OSError:
            pass
        continue
    libc._exit(0)
"""
)


@pytest.mark.hostile
def test_a_self_waking_fork_chain_does_not_outlive_a_fresh_commands_walk(
    manager: SandboxManager, jail: Sandbox
) -> None:
    jail.run_code("keep = 'state'")
    jail.files.write("chain.py", SELF_WAKING_CHAIN)
    started = jail.commands.run(
        "(setsid python3 chain.py >/dev/null 2>&1 &); "
        "for _ in $(seq 100); do [ -s chain.alive ] && break; sleep 0.05; done; cat chain.alive"
    )
    assert started.stdout == "1", f"the chain never ran: {describe(started)}"
    check = run_fresh(manager, jail, "rm -f chain.alive; sleep 0.5; cat chain.alive 2>&1; true")
    assert "No such file" in check.stdout, describe(check)
    assert_kernel_after_fresh(jail, check)


# Files the guest writes and reads back at names a command can predict (call ids count up):
# its spill of a long output, and a command's saved cwd and environment (red team,
# 2026-11-28). A FIFO there blocked the guest's open for good; a link to /dev/zero, a read
# without end.
PLANT_AHEAD = r"""
id=${__agsb_state##*-}
mkdir -p /workspace/.sandlot/outputs
for i in 1 2 3 4 5 6 7; do
  n=$((id+i))
  mkfifo /workspace/.sandlot/outputs/$n.stdout
  touch -h -d 2100-01-01 /workspace/.sandlot/outputs/$n.stdout
  for session in default fresh; do
    mkfifo /tmp/.sandlot_shells/$session-$n.cwd
    ln -s /dev/zero /tmp/.sandlot_shells/$session-$n.env
  done
done
echo planted
"""
LONG_OUTPUT = "head -c 3000000 /dev/zero | tr '\\0' x; echo; cd /tmp; echo done"


@pytest.mark.hostile
def test_files_planted_at_a_later_calls_names_neither_hang_nor_flood_the_guest(
    manager: SandboxManager, jail: Sandbox
) -> None:
    # Failed before: the fresh command came back kill_reason=timeout, state_lost, after its
    # backstop (the guest stuck opening the spill FIFO), the kernel's variables gone.
    jail.run_code("keep = 'state'")
    planted = jail.commands.run(PLANT_AHEAD)
    assert planted.stdout.strip() == "planted", describe(planted)
    fresh = run_fresh(manager, jail, LONG_OUTPUT, timeout_s=10)
    assert fresh.exit_code == 0 and fresh.kill_reason is None, describe(fresh)
    assert fresh.stdout_truncated and fresh.stdout.endswith("done\n"), describe(fresh)
    # An ordinary command's saved state is read back as well: still a session that works.
    ordinary = jail.commands.run("cd /tmp && echo here", timeout_s=10)
    assert ordinary.exit_code == 0 and ordinary.stdout == "here\n", describe(ordinary)
    where = jail.commands.run("pwd", timeout_s=10)
    assert where.exit_code == 0 and where.stdout == "/tmp\n", describe(where)
    assert_kernel_after_fresh(jail, fresh)


@pytest.mark.hostile
def test_a_fresh_commands_state_files_are_out_of_reach_of_planted_ones(
    manager: SandboxManager, jail: Sandbox
) -> None:
    # FIFOs at the next fresh commands' state names, in a directory then made unwritable so
    # that the guest's unlink fails (review, 2026-11-28): the trap's write would wait there
    # until the timeout. A fresh command's state now goes to a new directory of its own.
    plant = (
        "id=${__agsb_state##*-}; for i in 1 2 3 4 5; do "
        "mkfifo /tmp/.sandlot_shells/fresh-$((id+i)).cwd; done; chmod 555 /tmp/.sandlot_shells"
    )
    assert jail.commands.run(plant).exit_code == 0
    try:
        check = run_fresh(manager, jail, "pwd; exit 4", timeout_s=10)
        assert (check.exit_code, check.kill_reason) == (4, None), describe(check)
        assert check.stdout == "/workspace\n" and check.duration_ms < 5000, describe(check)
    finally:
        jail.commands.run("chmod 755 /tmp/.sandlot_shells")


# ------------------------------------------- 4. control bytes must not blow up a frame


@pytest.fixture
def roomy(manager: SandboxManager, backend_name: str) -> Iterator[Sandbox]:
    spec = SandboxSpec(**placement(backend_name), output_limit_bytes=8 * MiB)
    info = get_portal().call(manager.create(spec))
    sb = Sandbox.connect(info.id, manager=manager)
    yield sb
    sb.kill()


@pytest.mark.hostile
def test_control_bytes_in_every_part_of_a_result_still_fit_a_frame(roomy: Sandbox) -> None:
    # Failed before: 8 MiB of control bytes on stdout and stderr became a ~96 MiB frame; an
    # exception message of them a kernel reply over the limit. Both lost the interpreter.
    roomy.run_code("keep = 'state'")
    flood = roomy.run_code(
        "import sys\nsys.stdout.write('\\x01' * (8 << 20))\nsys.stderr.write('\\x02' * (8 << 20))"
    )
    assert flood.exit_code == 0 and not flood.state_lost, describe(flood)
    assert flood.stdout_truncated and flood.stdout_bytes == 8 * MiB
    assert len(flood.stdout) <= 8 * MiB
    raised = roomy.run_code("raise ValueError('\\x03' * (8 << 20))")
    assert raised.error is not None and raised.error.type == "ValueError", describe(raised)
    assert not raised.state_lost, describe(raised)
    shell = roomy.commands.run("head -c 9000000 /dev/zero; head -c 9000000 /dev/zero >&2")
    assert shell.exit_code == 0 and shell.stdout_truncated, describe(shell)
    kept = roomy.run_code("keep")
    assert kept.text == "'state'" and not kept.state_lost, describe(kept)


# ------------------------------------------- 5. a directory swapped for a symlink mid-call

SWAPPER = """
import os, sys, time
os.chdir('/workspace/swap%s' % sys.argv[1])
end = time.time() + 8
while time.time() < end:
    os.rename('real', 'd')
    time.sleep(0.0005)
    os.rename('d', 'real')
    os.symlink('/etc', 'd')
    time.sleep(0.0005)
    os.unlink('d')
"""
SWAPPERS = 4


@pytest.mark.hostile
def test_a_symlink_swapped_in_mid_call_never_leads_out(sandbox: Sandbox) -> None:
    # Failed before: a read resolved swapN/d while it was a directory, then opened
    # swapN/d/hosts after it had become a link to /etc (O_NOFOLLOW guards only the last
    # component). Bounded in time: the swappers stop after 8 s, the readers after 6.
    import threading

    for n in range(SWAPPERS):
        sandbox.files.write(f"swap{n}/real/hosts", "inside\n")
    sandbox.files.write("swapper.py", SWAPPER)
    sandbox.commands.run(
        " ".join(f"(setsid python3 swapper.py {n} >/dev/null 2>&1 &);" for n in range(SWAPPERS))
    )
    seen: set[str] = set()
    end = time.monotonic() + 6

    def attack(n: int) -> None:
        calls = (
            lambda: sandbox.files.read(f"swap{n}/d/hosts"),
            lambda: str([e.name for e in sandbox.files.list(f"swap{n}/d")]),
            lambda: sandbox.files.write(f"swap{n}/d/hosts", "inside\n") and "written",
            lambda: str(sandbox.files.stat(f"swap{n}/d/hosts").size_bytes),
        )
        while time.monotonic() < end:
            for call in calls:
                try:
                    seen.add(call())
                except SandboxError:
                    seen.add("refused")

    threads = [threading.Thread(target=attack, args=(n,)) for n in range(SWAPPERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen <= {"inside\n", "['hosts']", "written", "7", "refused"}, seen


# ------------------------------------------- 6. listing survives odd entries


@pytest.mark.hostile
def test_one_odd_entry_does_not_hide_the_others(manager: SandboxManager, sandbox: Sandbox) -> None:
    # Failed before: a file name that is not UTF-8 (or a directory we may not read) made the
    # whole listing fail, so every artifact was lost with it.
    made = sandbox.commands.run(
        "mkdir -p artifacts/locked && echo a > artifacts/a.txt && echo z > artifacts/z.txt "
        "&& echo x > artifacts/locked/x && echo b > artifacts/$'bad\\xff' "
        "&& chmod 000 artifacts/locked"
    )
    assert made.exit_code == 0, describe(made)
    entries = get_portal().call(
        manager.list_files(sandbox.id, ListFiles(path="artifacts", depth=32))
    )
    names = {e.name for e in entries}
    assert {"a.txt", "z.txt", "locked"} <= names, names
    sandbox.commands.run("chmod 755 artifacts/locked")


# ------------------------------------------- 7. the caller's env never becomes the guest's own

HOSTILE_ENV = {
    "LD_LIBRARY_PATH": "/workspace/lib",
    "LD_PRELOAD": "/workspace/lib/evil.so",
    "PYTHONPATH": "/workspace/evil",
}


def _supervisor_environ(
    manager: SandboxManager, sb: Sandbox, asked: list[dict[str, str]]
) -> dict[str, str]:
    """The guest supervisor's own environment: read from the host's /proc (as root); for a
    template's guest (bubblewrap as root), whose /proc shows the template's exec-time block,
    the whole environment the template was asked to give it (``asked``, recorded)."""
    box = getattr(manager._backend(sb.info.backend), "_boxes", {}).get(sb.id)
    if box is not None and isinstance(box.guest, TemplateGuest):
        assert asked, "a template's guest whose request was not recorded"
        return asked[-1]
    from pathlib import Path

    from tests.leaks import docker_container, pids_cgroup_dir, procs_of_container

    if sb.info.backend == "docker":
        pids = [p.pid for p in procs_of_container(docker_container(manager, sb.id)[0])]
    else:
        procs = pids_cgroup_dir(manager, sb.id) / "cgroup.procs"
        pids = [int(pid) for pid in procs.read_text().split()]
    found: list[tuple[bytes, bytes]] = []
    for pid in pids:
        try:
            proc = Path(f"/proc/{pid}")
            found.append(((proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()))
        except OSError:
            continue
    for cmdline, raw in found:
        argv = cmdline.split(b"\0")
        # The python process itself, not bwrap (whose arguments carry the same launcher).
        is_python = b"python" in argv[0].rsplit(b"/", 1)[-1]
        # A template's guest (bubblewrap as root) shows the template's command line.
        launched = b"supervisor.main" in cmdline or b"import template" in cmdline
        if is_python and launched and b"--kernel" not in cmdline:
            pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
            return {k.decode(): v.decode(errors="replace") for k, v in pairs}
    raise AssertionError(f"no guest supervisor among {[c[:80] for c, _ in found]}")


@pytest.mark.hostile
def test_the_callers_env_reaches_commands_but_never_the_supervisor(
    manager: SandboxManager, isolated_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed before: the caller's env was the supervisor's own, so LD_LIBRARY_PATH pointed the
    # next guest start at libraries sandboxed code could plant in /workspace/lib.
    if isolated_backend == "docker+runsc":
        pytest.skip(
            "gVisor's processes live inside its sentry, not on the host: no /proc to read the "
            "supervisor's environment from (the env takes the same path, backends/launch.py)"
        )
    # A template's guest gets its whole environment from the config the manager seals for
    # it (the child installs it and nothing else): recorded there.
    asked: list[dict[str, str]] = []
    seal = bubblewrap_forks.sealed_config

    def recorded(config: dict[str, Any]) -> int:
        asked.append(dict(config["env"]))
        return seal(config)

    monkeypatch.setattr(bubblewrap_forks, "sealed_config", recorded)
    with Sandbox.create(manager=manager, **placement(isolated_backend), env=HOSTILE_ENV) as sb:
        seen = sb.commands.run("echo $LD_LIBRARY_PATH $PYTHONPATH")
        assert seen.stdout == "/workspace/lib /workspace/evil\n", describe(seen)
        assert sb.run_code("import os; os.environ['LD_LIBRARY_PATH']").text == "'/workspace/lib'"
        own = _supervisor_environ(manager, sb, asked)
        # The caller's env travels as one JSON value the guest applies to what it starts.
        assert isolated_backend != "bubblewrap" or "SANDLOT_USER_ENV" in own, own
        assert not set(HOSTILE_ENV) & set(own), own


# ------------------------------------------- 8. the backends' walls: host files, sockets, /proc

STRANGER = ("/usr/bin/setpriv", "--reuid=65000", "--regid=65000", "--clear-groups")


def _as_stranger(*argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run as a host uid that is neither root nor any sandbox's."""
    return subprocess.run(
        [*STRANGER, *argv], capture_output=True, text=True, timeout=10, check=False
    )


def _literal(result: ExecResult) -> Any:
    assert result.text is not None, describe(result)
    return ast.literal_eval(result.text)


@pytest.mark.hostile
def test_no_other_host_uid_reads_a_sandboxs_files(manager: SandboxManager, jail: Sandbox) -> None:
    # Failed before: disk.img was 0644 (every byte of the workspace, to any host uid), and the
    # sandbox's directories were 0711, so a sandbox that opened its own /workspace (chmod 755)
    # showed its files to every host uid.
    jail.files.write("secret.txt", "the tenant's secret\n")
    opened = jail.commands.run(
        "echo tmp-secret > /tmp/secret.txt && chmod 755 /workspace /tmp"
        " && chmod 644 secret.txt /tmp/secret.txt"
    )
    assert opened.exit_code == 0, describe(opened)
    kind = "docker-sandboxes" if jail.info.backend == "docker" else "sandboxes"
    root = manager.instance_dir / kind / jail.id
    volume = root / "volume"
    targets = [volume / "workspace" / "secret.txt", volume / "tmp" / "secret.txt"]
    targets += [p for p in (root / "disk.img",) if p.exists()]  # capped disks only
    assert root.exists() and all(p.exists() for p in targets)
    for path in targets:
        read = _as_stranger("/bin/cat", str(path))
        assert read.returncode != 0 and "secret" not in read.stdout, (path, read)
    for directory in (root, volume):
        listed = _as_stranger("/bin/ls", str(directory))
        assert listed.returncode != 0, (directory, listed)


SOCKET_FAMILIES_PROBE = """
import errno, socket
def make(call, family):
    made = getattr(socket, call)(family, socket.SOCK_STREAM)
    for s in made if isinstance(made, tuple) else (made,):
        s.close()
seen = {}
for family in [*range(1, 64), 64, 100, 1000]:
    for call in ("socket", "socketpair"):
        try:
            make(call, family)
            seen[(call, family)] = "made"
        except OSError as exc:
            seen[(call, family)] = exc.errno
seen
"""


@pytest.mark.hostile
@pytest.mark.parametrize("network", [False, True], ids=["offline", "online"])
def test_every_call_that_makes_a_socket_refuses_the_blocked_families(
    manager: SandboxManager, isolated_backend: str, network: bool
) -> None:
    # Failed before: socketpair() had no family rule, so AF_INET, AF_NETLINK, AF_TIPC... reached
    # the families' own code (and loaded their modules) in an offline sandbox.
    if isolated_backend.startswith("docker"):
        pytest.skip(
            "docker's wall is its network namespace; its seccomp profile has no family rule"
        )
    allowed = {socket.AF_UNIX, socket.AF_INET, socket.AF_INET6}  # offline: loopback only
    if network:
        allowed |= {socket.AF_NETLINK}
    with Sandbox.create(manager=manager, **placement(isolated_backend), network=network) as sb:
        seen = _literal(sb.run_code(SOCKET_FAMILIES_PROBE))
    wrong = {
        key: outcome
        for key, outcome in seen.items()
        if key[1] not in allowed and outcome != errno.EAFNOSUPPORT
    }
    assert not wrong, wrong
    assert seen[("socketpair", socket.AF_UNIX)] == "made"


PROC_PROBE = """
import os
seen = {}
for name in ("sys/kernel/random/boot_id", "cmdline", "uptime", "stat", "loadavg", "meminfo",
             "kallsyms", "config.gz", "interrupts", "locks", "sys/fs/file-nr", "cpuinfo",
             "sys/fs/aio-nr"):
    try:
        with open("/proc/" + name, "rb") as f:
            seen[name] = f.read(1 << 20)
    except OSError as exc:
        seen[name] = exc.errno
seen["nprocs"] = os.cpu_count()
seen["listed"] = {d: os.listdir("/proc/" + d) for d in ("bus", "irq") if os.path.isdir("/proc/"+d)}
seen
"""


@pytest.mark.hostile
def test_proc_names_neither_the_host_nor_its_other_tenants(jail: Sandbox) -> None:
    # Failed before: /proc showed the host's boot id, kernel command line and symbols, and
    # its host-wide counters (uptime, CPU times and forks, load, memory, file locks).
    seen = _literal(jail.run_code(PROC_PROBE))
    host = {name: Path("/proc", name).read_bytes() for name in ("sys/kernel/random/boot_id",)}
    boot_id = host["sys/kernel/random/boot_id"].strip()
    assert all(boot_id not in v for v in seen.values() if isinstance(v, bytes)), seen
    if jail.info.runtime == "runsc":
        # gVisor's own kernel makes up its /proc: nothing in it is the host's.
        return
    host_cmdline = Path("/proc/cmdline").read_bytes()
    assert seen["cmdline"] in (b"", errno.EACCES) and seen["cmdline"] != host_cmdline
    for hidden in (
        "kallsyms",
        "config.gz",
        "interrupts",
        "locks",
        "sys/fs/file-nr",
        "sys/fs/aio-nr",
    ):
        assert seen[hidden] in (b"", errno.ENOENT), (hidden, seen[hidden][:200])
    assert all(listing == [] for listing in seen["listed"].values()), seen["listed"]
    meminfo = dict(line.split(":", 1) for line in seen["meminfo"].decode().splitlines())
    assert int(meminfo["MemTotal"].split()[0]) * 1024 == jail.info.limits.memory_mb * MiB
    host_btime = [ln for ln in Path("/proc/stat").read_text().splitlines() if "btime" in ln]
    assert host_btime[0].encode() not in seen["stat"]
    assert seen["uptime"] == b"0.00 0.00\n"
    assert seen["cpuinfo"] and seen["nprocs"] == Path("/proc/cpuinfo").read_text().count(
        "processor\t:"
    )


PROC_UNMASK = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
outcome, after = {}, {}
for name in ("cmdline", "kallsyms", "meminfo", "acpi", "sys/kernel/random/boot_id"):
    path = ("/proc/" + name).encode()
    tries = []
    for flags in (0, 2, 8):  # umount2 plain, MNT_DETACH, UMOUNT_NOFOLLOW
        tries.append(ctypes.get_errno() if libc.umount2(path, flags) else "unmounted")
    remount = libc.mount(b"none", path, None, 0x20 | 0x1000, None)  # MS_REMOUNT | MS_BIND
    tries.append(ctypes.get_errno() if remount else "remounted")
    outcome[name] = tries
    try:
        with open(path, "wb") as f:
            f.write(b"planted")
    except OSError:
        pass
    try:
        after[name] = open(path, "rb").read(1 << 16)
    except OSError as exc:
        after[name] = exc.errno
with open("/proc/self/mountinfo") as f:
    masks = [ln.split() for ln in f if " /proc/" in ln]
writable = [m[4] for m in masks if "ro" not in m[5].split(",")]
(outcome, after, writable)
"""


@pytest.mark.hostile
def test_the_proc_masks_cannot_be_lifted_or_written(jail: Sandbox) -> None:
    # On bubblewrap the manager puts the masks over /proc's host-wide entries in itself
    # (mountns.py, as root; bwrap's binds where the kernel has no mount API): the sandbox's
    # uid can neither unmount nor remount any of them, nor write through one (runc's masks
    # are /dev/null, where a write goes nowhere); on bubblewrap every one is read-only.
    outcome, after, writable = _literal(jail.run_code(PROC_UNMASK))
    assert not any(t in ("unmounted", "remounted") for v in outcome.values() for t in v), outcome
    assert not any(isinstance(v, bytes) and b"planted" in v for v in after.values()), after
    if jail.info.runtime != "runsc":
        assert after["cmdline"] == after["kallsyms"] == b"", after
        assert b"MemTotal" in after["meminfo"], after
    if jail.info.backend == "bubblewrap":
        assert writable == [], writable


@pytest.mark.hostile
def test_where_the_kernel_has_no_mount_api_bwrap_masks_proc(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(mountns, "supported", lambda: False)
    sb = Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10)
    try:
        seen = _literal(sb.run_code(PROC_PROBE))
        assert seen["cmdline"] == seen["kallsyms"] == b"", seen
        outcome, after, writable = _literal(sb.run_code(PROC_UNMASK))
        assert not any(t in ("unmounted", "remounted") for v in outcome.values() for t in v)
        assert after["cmdline"] == b"" and writable == [], (after, writable)
        # The terminal cap is the manager's whichever makes the masks (a review found it
        # skipped along with them once).
        pts = _literal(
            sb.run_code("[ln for ln in open('/proc/self/mountinfo') if ' /dev/pts ' in ln]")
        )
        assert pts and all(f"max={manager.settings.max_ptys}" in ln for ln in pts), pts
    finally:
        sb.kill()


MEMINFO_MB = "int(open('/proc/meminfo').read().split()[1]) // 1024"


def _skip_unless_roots_bubblewrap() -> None:
    reason = skip_reason("bubblewrap")
    if reason or os.geteuid() != 0:
        pytest.skip(reason or "root's backend only")


@pytest.mark.hostile
def test_sandboxes_of_one_memory_limit_share_one_read_only_set_of_proc_files(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The synthesized /proc files say only the memory limit: root's bubblewrap writes one set
    # per limit and tenant (six files fewer made and deleted a lifecycle), root's own and
    # read-only in every sandbox. Never two tenants': inotify and flock act on the inode, so
    # sharers can see each other open it (a red team's find). Past MAX_PROC_SETS sets a
    # sandbox gets its own, so asking for many sizes cannot fill the data directory.
    _skip_unless_roots_bubblewrap()
    backend = manager._backend("bubblewrap")
    boxes = [
        Sandbox.create(manager=manager, backend="bubblewrap", memory_mb=mb, timeout_s=10)
        for mb in (128, 128, 96)
    ]
    try:
        a, b, c = (backend._boxes[sb.id] for sb in boxes)
        assert a.proc_files == b.proc_files != c.proc_files
        stranger = get_portal().call(manager.create(SandboxSpec(memory_mb=128), owner="stranger"))
        boxes.append(Sandbox.connect(stranger.id, manager=manager))
        assert backend._boxes[stranger.id].proc_files not in (a.proc_files, c.proc_files)
        assert "stranger" not in backend._boxes[stranger.id].proc_files  # it shows in mountinfo
        for box in (a, c):
            assert not (box.root / "proc").exists()
            directory = Path(box.proc_files)
            assert directory.stat().st_uid == 0 and directory.stat().st_mode & 0o022 == 0
            assert (directory / "meminfo").stat().st_mode & 0o777 == 0o644
        assert [_literal(sb.run_code(MEMINFO_MB)) for sb in boxes] == [128, 128, 96, 128]
        _, after, writable = _literal(boxes[0].run_code(PROC_UNMASK))
        assert writable == [] and b"planted" not in after["meminfo"], (after, writable)
        assert b"planted" not in (Path(a.proc_files) / "meminfo").read_bytes()
        monkeypatch.setattr(bubblewrap_backend, "MAX_PROC_SETS", len(backend._proc_sets))
        own = Sandbox.create(manager=manager, backend="bubblewrap", memory_mb=80, timeout_s=10)
        boxes.append(own)
        assert backend._boxes[own.id].proc_files == f"{backend._boxes[own.id].root}/proc/"
        assert _literal(own.run_code(MEMINFO_MB)) == 80
    finally:
        for sb in boxes:
            sb.kill()


@pytest.mark.hostile
def test_a_proc_set_that_cannot_be_written_fails_the_create_and_holds_nothing(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written before the sandbox's uid and cgroup are taken: a full disk fails the create
    # with a typed error and leaks no uid lock (a red team's find: it leaked one a try).
    _skip_unless_roots_bubblewrap()
    backend = manager._backend("bubblewrap")
    monkeypatch.setattr(bubblewrap_backend, "MAX_PROC_SETS", len(backend._proc_sets) + 1)
    real = bubblewrap_backend.write_proc_files

    def full(directory: Path, memory_bytes: int) -> Any:
        directory.mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bubblewrap_backend, "write_proc_files", full)
    get_portal().call(manager.settle())
    held = _uid_locks()
    for _ in range(3):
        with pytest.raises(SandboxStartError, match="could not write the /proc files"):
            get_portal().call(manager.create(SandboxSpec(memory_mb=72)))
    assert _uid_locks() == held
    assert not [p for p in (backend.data_dir / "proc-files").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(bubblewrap_backend, "write_proc_files", real)
    sb = Sandbox.create(manager=manager, backend="bubblewrap", memory_mb=72, timeout_s=10)
    try:
        assert _literal(sb.run_code(MEMINFO_MB)) == 72
    finally:
        sb.kill()


def _uid_locks() -> list[str]:
    """The uid locks this process holds (bubblewrap's uids.py: one open file a sandbox)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "/uids/" in target:
                found.append(target)
    return sorted(found)


ABSTRACT_CONNECT = """
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(3)
try:
    s.connect({name!r})
    outcome = s.recv(16)
except OSError as exc:
    outcome = exc.errno
outcome
"""
ABSTRACT_SERVE = """
import socket, threading
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind({name!r})
server.listen()
def serve():
    while True:
        conn, _ = server.accept()
        conn.sendall(b"peer")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
"""


@pytest.mark.hostile
def test_a_networked_sandbox_reaches_no_abstract_socket_but_its_own(
    manager: SandboxManager, isolated_backend: str
) -> None:
    # Failed before (bubblewrap): network=True shared the host's network namespace, which is
    # what scopes abstract unix sockets, so the sandbox connected to the host's and to every
    # other networked sandbox's (no seccomp rule can see the address behind the pointer).
    if isolated_backend == "docker+runsc":
        pytest.skip("runsc is registered with --network=none: network=True is refused")
    host_name = f"\0sandlot-trust-{os.getpid()}-{time.monotonic_ns()}"
    peer_name = "\0sandlot-trust-peer"
    where = placement(isolated_backend)
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server,
        Sandbox.create(manager=manager, **where, network=True) as attacker,
        Sandbox.create(manager=manager, **where, network=True) as peer,
    ):
        server.bind(host_name)
        server.listen(4)
        served = peer.run_code(ABSTRACT_SERVE.format(name=peer_name))
        assert served.error is None, describe(served)
        # The peer's socket works, from inside the peer.
        assert _literal(peer.run_code(ABSTRACT_CONNECT.format(name=peer_name))) == b"peer"
        for name in (host_name, peer_name):
            seen = _literal(attacker.run_code(ABSTRACT_CONNECT.format(name=name)))
            assert seen == errno.ECONNREFUSED, (name, seen)
        ready, _, _ = select.select([server], [], [], 0.2)
        assert not ready, "a sandbox reached the host's abstract socket"


@pytest.fixture
def bwrap_module() -> Any:
    """The bubblewrap backend's module, for tests that patch its steps; skips without it."""
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    import sandlot.backends.bubblewrap.backend as module

    return module


@pytest.mark.hostile
def test_every_process_of_a_sandbox_is_in_its_cgroup_in_every_hierarchy(
    manager: SandboxManager,
) -> None:
    # The launcher moves itself in by writing "0" to each hierarchy's entry file (v1: its
    # thread's `tasks`, which skips the kernel's grace-period wait): the whole process, and
    # so everything bwrap and the guest fork after it, must land in every hierarchy.
    if skip_reason("bubblewrap"):
        pytest.skip(skip_reason("bubblewrap") or "")
    sb = Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10)
    try:
        sb.commands.run("sleep 30 >/dev/null 2>&1 &", timeout_s=10)
        cgroup = manager._backend("bubblewrap")._boxes[sb.id].cgroup
        if not cgroup.enter_files:
            pytest.skip("no cgroup here (rootless without a delegated subtree)")
        listed = [set(procs.read_text().split()) for procs in cgroup.procs_files]
        uid = leaks.host_uid(manager, sb.id)
        pids = {str(p.pid) for p in leaks.procs_of_uid(uid)}
        assert len(pids) >= 3, pids  # the guest, its kernel, the sleep
        for members in listed:
            assert pids <= members, (pids - members, cgroup.procs_files)
    finally:
        sb.kill()


@pytest.mark.hostile
def test_a_create_that_fails_while_its_disk_is_made_leaves_nothing(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, bwrap_module: Any
) -> None:
    # The launcher enters the sandbox's cgroup, then bwrap starts while the manager makes the
    # disk (as root with the mount API; elsewhere the launcher waits for "go" until the disk
    # is made: bubblewrap/backend.py): a disk that cannot be made must end the chain, with
    # its cgroup and directory, and no guest may run on without its volume.
    def waiting_launchers() -> list[int]:
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, AttributeError):
                if b"read -r go" not in (proc / "cmdline").read_bytes():
                    continue
                status = (proc / "status").read_text()
                ppid = re.search(r"^PPid:\s+(\d+)", status, re.M)
                if int(ppid.group(1)) == os.getpid():  # ours: the manager runs in this process
                    found.append(int(proc.name))
        return found

    seen: dict[str, Any] = {}

    async def no_disk(root: Path, *args: object, **kwargs: object) -> None:
        await asyncio.sleep(0.2)  # the chain is in its cgroup by now
        seen["sandbox_id"] = root.name
        seen["chain"] = {
            int(pid)
            for d in leaks.sandbox_cgroup_dirs(manager, root.name)
            for pid in (d / "cgroup.procs").read_text().split()
        }
        raise SandboxStartError("no disk today")

    Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10).kill()  # set-up
    get_portal().call(manager.settle())  # its files go after the kill returns
    backend = manager._backend("bubblewrap")
    before = set(backend.sandboxes_dir.iterdir())
    monkeypatch.setattr(bwrap_module, "make_sandbox_disk", no_disk)
    with pytest.raises(SandboxError, match="no disk today"):
        Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10)
    assert seen["chain"], seen
    assert waiting_launchers() == []
    assert not [pid for pid in seen["chain"] if leaks.running(pid)], seen
    assert not any(d.exists() for d in leaks.sandbox_cgroup_dirs(manager, seen["sandbox_id"]))
    assert set(backend.sandboxes_dir.iterdir()) == before
    monkeypatch.undo()
    sb = Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10)
    try:
        assert sb.run_code("1 + 1").text == "2"
    finally:
        sb.kill()


def _cpu_quota_us(manager: SandboxManager, sandbox_id: str) -> int | None:
    box = manager._backend("bubblewrap")._boxes[sandbox_id]
    return box.cgroup.cpu_quota_us()


@pytest.mark.hostile
def test_a_small_cpu_quota_is_in_force_before_the_first_call(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, bwrap_module: Any
) -> None:
    # The guest starts under START_CPU_CORES (a 0.05-core sandbox took ~550 ms to start
    # under its own), and gets its own quota once it says ready, before create returns.
    backend = manager._backend("bubblewrap")
    real_started = backend.started
    while_starting: list[int | None] = []

    async def started(sandbox_id: str) -> None:
        while_starting.append(_cpu_quota_us(manager, sandbox_id))
        await real_started(sandbox_id)

    monkeypatch.setattr(backend, "started", started)
    with Sandbox.create(
        manager=manager, **placement("bubblewrap"), cpu_cores=0.05, timeout_s=10
    ) as sb:
        start_us = int(bwrap_module.START_CPU_CORES * 100_000)
        assert while_starting == [start_us]
        assert _cpu_quota_us(manager, sb.id) == 5_000
        before = sb.usage().cpu_s or 0.0
        sb.run_code("import time\nend = time.monotonic() + 1\nwhile time.monotonic() < end: pass")
        # A twentieth of a core for ~1 s (a free spin would burn the whole second).
        assert (sb.usage().cpu_s or 0.0) - before < 0.25


@pytest.mark.hostile
def test_a_cpu_quota_that_cannot_be_set_fails_the_create_and_leaves_nothing(
    manager: SandboxManager, monkeypatch: pytest.MonkeyPatch, bwrap_module: Any
) -> None:
    # A sandbox never runs a call under the start's quota: the create fails instead.
    from sandlot.backends.cgroups import Cgroup

    real_set_cpu = Cgroup.set_cpu
    made: list[str] = []

    def refused(self: Cgroup, cpu_cores: float) -> None:
        if cpu_cores < bwrap_module.START_CPU_CORES:
            made.append(self.dirs[next(iter(self.dirs))].name)
            raise PermissionError(13, "Permission denied", "cpu.max")
        real_set_cpu(self, cpu_cores)

    Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10).kill()  # set-up
    get_portal().call(manager.settle())  # its files go after the kill returns
    backend = manager._backend("bubblewrap")
    before = set(backend.sandboxes_dir.iterdir())
    monkeypatch.setattr(Cgroup, "set_cpu", refused)
    with pytest.raises(SandboxError, match="could not set the sandbox's CPU quota"):
        Sandbox.create(manager=manager, **placement("bubblewrap"), cpu_cores=0.05, timeout_s=10)
    assert len(made) == 1
    assert not any(d.exists() for d in leaks.sandbox_cgroup_dirs(manager, made[0]))
    assert set(backend.sandboxes_dir.iterdir()) == before


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("enter_file", "said"),
    [
        # The manager cannot open it to hand it over: the error names it.
        ("/nonexistent/procs", "nonexistent"),
        # It opens, and the launcher's write fails: the launcher's own words.
        ("/dev/full", "No space left on device"),
    ],
)
def test_a_launcher_that_cannot_enter_its_cgroup_says_why(
    manager: SandboxManager,
    monkeypatch: pytest.MonkeyPatch,
    bwrap_module: Any,
    enter_file: str,
    said: str,
) -> None:
    # It exits before bwrap runs: the create fails with the launcher's own words, not
    # "Connection lost" (a review's find), and nothing runs outside a cgroup.
    from sandlot.backends.cgroups import Cgroup

    real_make_volume = bwrap_module.make_sandbox_disk

    async def slow_disk(*args: Any, **kwargs: Any) -> None:
        await real_make_volume(*args, **kwargs)
        await asyncio.sleep(0.2)  # the launcher has failed and exited by now

    monkeypatch.setattr(bwrap_module, "make_sandbox_disk", slow_disk)
    monkeypatch.setattr(Cgroup, "enter_files", property(lambda self: [Path(enter_file)]))
    with pytest.raises(SandboxError, match=rf"launcher failed.*{said}") as failed:
        Sandbox.create(manager=manager, **placement("bubblewrap"), timeout_s=10)
    assert "Connection lost" not in str(failed.value)
