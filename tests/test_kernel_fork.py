"""The first kernel forked from the supervisor (issue 13): the same process a fresh
interpreter was, holding nothing of the supervisor's; a fresh interpreter wherever the
environment asks a start for more, and after a crash; and the guest's lean JSON codec, which
must answer as the ``json`` module does."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sandlot import Sandbox, SandboxManager
from sandlot.guest import wire  # stdlib only, no guest imports: loads as a package module

from .conftest import placement

PROBE = """
import os, sys
fds = {}
for name in os.listdir('/proc/self/fd'):
    try:
        fds[int(name)] = os.readlink('/proc/self/fd/' + name).split(':')[0]
    except FileNotFoundError:
        pass  # the descriptor listdir itself held
({'fds': fds, 'isolated': sys.flags.isolated, 'pid': os.getpid(), 'sid': os.getsid(0),
  'argv': sys.argv, 'stdin': sys.stdin.read(), 'path0': sys.path[0]})
"""


def _literal(sb: Sandbox, code: str) -> Any:
    result = sb.run_code(code)
    assert result.error is None and result.text is not None, result
    return ast.literal_eval(result.text)


@pytest.fixture
def make_jail(manager: SandboxManager, isolated_backend: str) -> Iterator[Any]:
    made: list[Sandbox] = []

    def make(**kwargs: Any) -> Sandbox:
        sb = Sandbox.create(manager=manager, **placement(isolated_backend), timeout_s=10, **kwargs)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.kill()


def test_the_forked_kernel_holds_none_of_the_supervisors_descriptors(make_jail: Any) -> None:
    sb = make_jail()
    seen = _literal(sb, PROBE)
    assert seen["isolated"] == 1, "the first kernel was not forked: this test shows nothing"
    # /dev/null in, the cell's two pipes out, its control socket: not the host's protocol
    # pipes, not the supervisor's ends of the kernel's pipes and socket.
    assert seen["fds"] == {0: "/dev/null", 1: "pipe", 2: "pipe", 3: "socket"}, seen
    assert seen["sid"] == seen["pid"] and seen["stdin"] == "" and seen["path0"] == ""
    assert seen["argv"] == ["-c", "--kernel", "3", "3"]
    supervisor_pid = sb.run_code("import os; os.getppid()").text
    # The supervisor stays non-dumpable: the kernel, same uid, cannot read its memory.
    denied = _literal(
        sb,
        f"try:\n    open('/proc/{supervisor_pid}/mem', 'rb').read(1)\n    r = 'read'\n"
        "except OSError as e:\n    r = type(e).__name__\nr",
    )
    assert denied == "PermissionError"


def test_pythonpath_and_locale_reach_the_forked_kernel(make_jail: Any) -> None:
    sb = make_jail(env={"PYTHONPATH": "/workspace/lib"})
    sb.files.write("lib/planted_mod.py", "VALUE = 'from PYTHONPATH'\n")
    seen = _literal(
        sb,
        "import sys, planted_mod, locale\n"
        "(sys.flags.isolated, planted_mod.VALUE, locale.getpreferredencoding(False),"
        " sys.stdout.encoding, 'exit' in dir(__builtins__) or hasattr(__builtins__, 'exit'))",
    )
    assert seen == (1, "from PYTHONPATH", "UTF-8", "utf-8", True)


def _restart_guest(manager: SandboxManager, sb: Sandbox) -> None:
    """Kill the guest from the host; the next call starts a new one (and says state_lost)."""
    manager._backend(sb.info.backend)._boxes[sb.id].guest.kill()
    conn = manager._live[sb.id].conn
    for _ in range(100):  # until the manager has read the connection's end
        if conn is None or not conn.alive:
            break
        time.sleep(0.05)
    assert sb.run_code("1").state_lost


def test_site_loads_as_a_fresh_interpreter_would_before_and_after_the_gate(
    make_jail: Any, manager: SandboxManager
) -> None:
    # The forked kernel loads the site directories before its gate when no PYTHONPATH is
    # set (issue 13), after it otherwise: either way what a `python3 -s -c` started in
    # /workspace would run, and nothing planted in the workspace runs before the gate.
    # A restarted guest forks its kernel again, with the workspace already full.
    plain = make_jail()
    plain.files.write("sitecustomize.py", "import builtins\nbuiltins.PLANTED = 'cwd'\n")
    with_path = make_jail(env={"PYTHONPATH": "/workspace/lib"})
    with_path.files.write("lib/sitecustomize.py", "import builtins\nbuiltins.PLANTED = 'path'\n")
    probe = (
        "import sys, builtins\n(sys.flags.isolated, getattr(builtins, 'PLANTED', None), "
        "'site' in sys.modules, any('-packages' in p for p in sys.path))"
    )
    for sb, planted in ((plain, None), (with_path, "path")):
        _restart_guest(manager, sb)
        assert _literal(sb, probe) == (1, planted, True, True)


def test_a_shown_result_does_not_load_json(make_jail: Any) -> None:
    # Its size is measured with the guest's lean codec: `import json` (with `re`) was ~8 ms
    # of every first shown result's wait.
    sb = make_jail()
    first = sb.run_code("41 + 1")
    assert first.text == "42" and first.results[0].text == "42"
    assert _literal(sb, "import sys; 'json' in sys.modules") is False


def test_an_env_a_start_reads_gets_a_fresh_interpreter(make_jail: Any) -> None:
    sb = make_jail(env={"PYTHONHASHSEED": "7"})
    isolated, hashed = _literal(sb, "import sys; (sys.flags.isolated, hash('sandlot'))")
    local = subprocess.run(
        ["/usr/bin/python3", "-c", "print(hash('sandlot'))"],
        env={"PYTHONHASHSEED": "7"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert isolated == 0 and hashed == int(local.stdout)


def test_a_crashed_forked_kernel_comes_back_as_a_fresh_interpreter(make_jail: Any) -> None:
    sb = make_jail()
    sb.run_code("kept = 1")
    crashed = sb.run_code("import os; os._exit(3)")
    assert crashed.state_lost and crashed.error is not None
    # An exit, not a kill (it said "killed (signal -3)" before; the red team's find).
    assert crashed.exit_code == 3 and crashed.kill_reason is None
    assert "exited (status 3)" in crashed.error.message, crashed.error
    after = _literal(sb, "import sys; (sys.flags.isolated, 'kept' in globals())")
    assert after == (0, False)


def test_cells_sources_reach_tracebacks_and_getsource_though_linecache_loads_late(
    make_jail: Any,
) -> None:
    # The kernel no longer imports linecache at start (issue 13): each cell's source is
    # kept aside and handed over when the first traceback or source lookup loads it.
    sb = make_jail()
    sb.run_code("def twice(x):\n    return x * 2  # the body\n")
    sb.run_code("def broken():\n    raise ValueError('from a cell')\n")
    failed = sb.run_code(
        "import sys; loaded = 'linecache' in sys.modules and sys.version_info < (3, 13)\nbroken()"
    )
    assert failed.error is not None
    assert "raise ValueError('from a cell')" in failed.error.traceback, failed.error.traceback
    # Python 3.13 imports linecache at its own start: there only the sources are checked.
    after = _literal(sb, "import inspect; (loaded, inspect.getsource(twice))")
    assert after == (False, "def twice(x):\n    return x * 2  # the body\n")
    sb.run_code("def later():\n    return 3\n")
    assert _literal(sb, "inspect.getsource(later)") == "def later():\n    return 3\n"


CASES: list[Any] = [
    {"id": 1, "op": "exec_code", "code": "print('é')\n", "stream": True},
    {"nested": [1, 2.5, -0.0, 1e300, None, True, False, {"": []}], "big": 10**40},
    "a\x00\x1f\u2028\ud800\U0001f600",
    [float("inf"), float("-inf")],
    [],
    {},
    0,
]


@pytest.mark.parametrize("value", CASES)
def test_the_lean_codec_writes_what_json_writes(value: Any) -> None:
    for ascii_only in (True, False):
        expected = json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only)
        assert wire.dumps(value, ensure_ascii=ascii_only) == expected
    text = json.dumps(value)
    assert repr(wire.loads(text)) == repr(json.loads(text))
    assert repr(wire.loads(text.encode())) == repr(json.loads(text))


def test_the_lean_codec_refuses_what_json_refuses() -> None:
    assert wire.loads.__qualname__.startswith("_lean_codec"), "the fallback is in use here"
    assert math.isnan(wire.loads("NaN"))
    for bad in ["", " ", "{", "[1]x", "nul", '{"a":}', '"\\x"', "[1,]", "\x00"]:
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            wire.loads(bad)
    circular: list[Any] = []
    circular.append(circular)
    with pytest.raises(ValueError):
        wire.dumps(circular)
    for unencodable in ([object()], {1j: 1}, {(1, 2): 1}):
        with pytest.raises(TypeError):
            wire.dumps(unencodable)


def test_the_supervisor_starts_without_the_heavy_stdlib_modules() -> None:
    """What the supervisor imports at start runs in every sandbox's start under its CPU
    quota: threading (functools, collections: ~2 ms of CPU measured), selectors, enum, json,
    subprocess are each loaded by the first call that needs them, or never."""
    from sandlot.guest import GUEST_SCRIPT

    probe = (
        f"import sys; sys.path.insert(0, {str(GUEST_SCRIPT.parent)!r}); import supervisor; "
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = set(
        subprocess.run(
            ["/usr/bin/python3", "-I", "-S", "-c", probe],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
    heavy = {"threading", "selectors", "collections", "functools", "enum", "json", "subprocess"}
    assert "supervisor" in loaded
    assert loaded & heavy == set()


def test_the_guests_event_wakes_every_waiter_once_set() -> None:
    """guest/threads.py's Event stands in for threading's: set wakes all waiters, a wait
    past its timeout says False, a second set is harmless."""
    import threading
    import time

    from sandlot.guest.threads import Event, start

    event = Event()
    assert not event.is_set()
    assert event.wait(0.05) is False
    woke: list[bool] = []
    done = threading.Semaphore(0)

    def waiter() -> None:
        woke.append(event.wait(10))
        done.release()

    for _ in range(3):
        start(waiter)
    time.sleep(0.05)
    event.set()
    event.set()
    for _ in range(3):
        assert done.acquire(timeout=10)
    assert woke == [True, True, True]
    assert event.is_set() and event.wait(0) is True


ORPHAN_ZOMBIES = """
import os, time
def orphan_zombies():
    n = 0
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                fields = open('/proc/%s/stat' % name).read().rsplit(')', 1)[1].split()
            except OSError:
                continue
            n += fields[0] == 'Z' and fields[1] == '1'
    return n
deadline = time.monotonic() + 5
while orphan_zombies() and time.monotonic() < deadline:
    time.sleep(0.05)
orphan_zombies()
"""


def test_an_orphan_that_ends_is_reaped_at_once(make_jail: Any) -> None:
    """A double-forked process ends as pid 1's child: the supervisor reaps it when its
    SIGCHLD comes (it polled every 0.5 s before, and an idle sandbox paid for every poll)."""
    sb = make_jail()
    assert sb.commands.run("(sh -c 'sleep 0.3' &); echo started").stdout == "started\n"
    time.sleep(0.5)  # it has ended by now, a zombie until reaped
    assert sb.run_code(ORPHAN_ZOMBIES).text == "0"


def test_a_sigchld_flood_at_pid_1_changes_no_result(make_jail: Any) -> None:
    """pid 1 now handles SIGCHLD (its orphan reaper wakes on it), so sandboxed code can send
    it any number: exit statuses and results stay right meanwhile (the red team's flood)."""
    sb = make_jail()
    flood = "while :; do kill -CHLD 1 2>/dev/null; done"
    started = sb.run_code(f"import subprocess\nflood = subprocess.Popen(['sh', '-c', {flood!r}])")
    assert started.error is None, started
    try:
        for status in (0, 3, 7):
            assert sb.commands.run(f"exit {status}").exit_code == status
        assert sb.run_code("6 * 7").text == "42"
    finally:
        assert sb.run_code("flood.kill(); flood.wait()").text == "-9"
