"""The conformance suite: what every backend must do, run on each backend this host has."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandlot.guest.ops
from sandlot import (
    ConfigError,
    InvalidRequest,
    PathOutsideWorkspace,
    Sandbox,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxManager,
    SandboxNotRunning,
)
from sandlot._portal import get_portal
from sandlot.requests import RunCommand
from tests.conftest import placement

GUEST_DIR = Path(sandlot.guest.ops.__file__).parent

# ---------------------------------------------------------------- stateful python


def test_state_persists_across_calls(sandbox: Sandbox) -> None:
    assert sandbox.run_code("x = 41").ok
    assert sandbox.run_code("import json\ndef inc(v):\n    return v + 1").ok
    result = sandbox.run_code("inc(x)")
    assert result.text == "42"
    assert sandbox.run_code("json.dumps({'a': inc(1)})").text == "'{\"a\": 2}'"


def test_last_expression_is_text_like_a_notebook(sandbox: Sandbox) -> None:
    assert sandbox.run_code("y = 5").text is None
    assert sandbox.run_code("None").text is None
    assert sandbox.run_code("print('hi')\n[1, 2]").text == "[1, 2]"
    assert sandbox.run_code("_").text == "[1, 2]"


def test_stdout_and_stderr_are_separate(sandbox: Sandbox) -> None:
    result = sandbox.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0


def test_exception_is_a_result_with_traceback(sandbox: Sandbox) -> None:
    result = sandbox.run_code("def f():\n    return 1 / 0\nf()")
    assert not result.ok
    assert result.exit_code == 1
    assert result.error is not None
    assert result.error.type == "ZeroDivisionError"
    assert result.error.message == "division by zero"
    assert "return 1 / 0" in result.error.traceback
    assert "supervisor.py" not in result.error.traceback
    assert "kernel.py" not in result.error.traceback
    assert sandbox.run_code("1 + 1").text == "2"


def test_the_users_modules_win_over_the_guests(sandbox: Sandbox) -> None:
    # The guest's modules share the kernel's interpreter; none may answer the user's imports.
    names = sorted(p.stem for p in GUEST_DIR.glob("*.py") if p.name != "__init__.py")
    assert "ops" in names
    for name in names:
        sandbox.files.write(f"{name}.py", f"X = 1\nMINE = {name!r}\n")
    assert sandbox.run_code("import ops\nops.X").text == "1"
    found = sandbox.run_code(
        f"import importlib\n[importlib.import_module(n).MINE for n in {names!r}]"
    )
    assert found.text == repr(names)


def test_syntax_error_is_reported(sandbox: Sandbox) -> None:
    result = sandbox.run_code("def broken(:\n  pass")
    assert result.error is not None and result.error.type == "SyntaxError"


def test_system_exit_sets_exit_code_and_keeps_state(sandbox: Sandbox) -> None:
    sandbox.run_code("kept = 'yes'")
    result = sandbox.run_code("import sys; sys.exit(7)")
    assert result.exit_code == 7
    assert not result.state_lost
    assert sandbox.run_code("kept").text == "'yes'"


def test_top_level_await(sandbox: Sandbox) -> None:
    result = sandbox.run_code("import asyncio\nawait asyncio.sleep(0)\n'done'")
    assert result.text == "'done'"


def test_timeout_interrupts_and_keeps_state(sandbox: Sandbox) -> None:
    sandbox.run_code("counter = 3")
    result = sandbox.run_code("print('started', flush=True)\nwhile True: pass", timeout_s=1)
    assert result.kill_reason == "timeout"
    assert result.stdout == "started\n"  # partial output is kept
    assert not result.state_lost
    assert sandbox.run_code("counter").text == "3"


def test_timeout_that_ignores_interrupts_restarts_interpreter(sandbox: Sandbox) -> None:
    sandbox.run_code("lost = 1")
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    result = sandbox.run_code(code, timeout_s=1)
    assert result.kill_reason == "timeout"
    assert result.state_lost
    after = sandbox.run_code("'lost' in globals()")
    assert after.text == "False"
    assert not after.state_lost


def test_interpreter_crash_is_a_result_and_recovers(sandbox: Sandbox) -> None:
    result = sandbox.run_code("import os; os._exit(3)")
    assert result.exit_code == 3
    assert result.state_lost
    assert sandbox.run_code("2 * 21").text == "42"


def test_streaming_callbacks_receive_output_in_order(sandbox: Sandbox) -> None:
    chunks: list[str] = []
    code = "import time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.02)"
    result = sandbox.run_code(code, on_stdout=chunks.append)
    assert "".join(chunks) == "0\n1\n2\n3\n4\n"
    assert result.stdout == "0\n1\n2\n3\n4\n"


# ---------------------------------------------------------------- shell


def test_shell_exit_code_and_output(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo hi && exit 3")
    assert result.exit_code == 3
    assert result.stdout == "hi\n"
    assert not result.ok


def test_shell_session_keeps_cwd_and_env(sandbox: Sandbox) -> None:
    home = sandbox.commands.run("pwd").stdout.rstrip("\n")
    sandbox.commands.run("mkdir -p sub/dir && cd sub/dir && export GREETING=hello")
    result = sandbox.commands.run("pwd; echo $GREETING")
    assert result.stdout == f"{home}/sub/dir\nhello\n"


def test_a_command_past_the_kernels_limit_is_refused_and_loses_nothing(
    manager: SandboxManager, backend_name: str
) -> None:
    """A command reaches the shell as one argument, and the kernel refuses one past 128 KiB
    (E2BIG): such a command is refused at the edge, naming the limit, without echoing it
    whole; and should one reach the guest anyway, it fails alone, as the caller's error.
    Failed before (red team): the guest took the E2BIG for its own failure and was
    restarted, its Python state and background commands lost, and the caller saw a 502."""
    sandbox = Sandbox.create(manager=manager, **placement(backend_name))
    assert sandbox.run_code("kept = 'yes'").ok
    with pytest.raises(ConfigError, match="at most 131071") as refused:
        sandbox.commands.run("echo " + "x" * (128 * 1024))
    assert len(str(refused.value)) < 1000  # the command is not echoed whole
    unchecked = RunCommand.model_construct(command="echo " + "x" * (128 * 1024), session="s")
    # gVisor's execve says ENAMETOOLONG where Linux says E2BIG: a 422 either way.
    with pytest.raises(InvalidRequest, match=r"E2BIG|File name too long"):
        get_portal().call(manager.run_command(sandbox.id, unchecked))
    after = sandbox.run_code("kept")
    assert after.text == "'yes'" and not after.state_lost, after
    assert sandbox.commands.run("echo fine", session="s").stdout == "fine\n"
    sandbox.kill()


def test_shell_sessions_are_independent(sandbox: Sandbox) -> None:
    home = sandbox.commands.run("pwd", session="b").stdout
    sandbox.commands.run("mkdir -p elsewhere && cd elsewhere && export ONLY_A=1", session="a")
    other = sandbox.commands.run("pwd; echo ${ONLY_A:-unset}", session="b")
    assert other.stdout == home + "unset\n"
    mine = sandbox.commands.run("pwd; echo $ONLY_A", session="a")
    assert mine.stdout == home.rstrip("\n") + "/elsewhere\n1\n"


def test_per_call_env_and_cwd_do_not_stick(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo $ONE_OFF", env={"ONE_OFF": "x"})
    assert result.stdout == "x\n"
    assert sandbox.commands.run("echo ${ONE_OFF:-gone}").stdout == "gone\n"


def test_shell_input_is_stdin(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("tr a-z A-Z", input="shout\n").stdout == "SHOUT\n"
    # Without input, stdin is empty rather than a hang.
    assert sandbox.commands.run("cat; echo end", timeout_s=5).stdout == "end\n"


def test_shell_timeout_keeps_partial_output(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo before; sleep 3600", timeout_s=1)
    assert result.kill_reason == "timeout"
    assert result.stdout == "before\n"
    assert result.exit_code == 137
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_background_process_does_not_block_the_call(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("sleep 30 & echo started", timeout_s=5)
    assert result.stdout == "started\n"
    assert result.kill_reason is None


# ---------------------------------------------------------------- output caps


def test_big_output_keeps_head_and_tail(sandbox: Sandbox) -> None:
    code = (
        "import sys\nsys.stdout.write('HEAD\\n')\n"
        "sys.stdout.write('x' * (3 * 1024 * 1024))\nsys.stdout.write('\\nTAIL\\n')"
    )
    result = sandbox.run_code(code)
    assert result.stdout_truncated
    assert result.stdout_bytes == 3 * 1024 * 1024 + len("HEAD\n") + len("\nTAIL\n")
    assert result.stdout.startswith("HEAD\n")
    assert result.stdout.endswith("\nTAIL\n")
    assert len(result.stdout.encode()) <= (1 << 20) + 200
    assert result.stdout_path is not None
    relative = result.stdout_path.removeprefix("/workspace/")
    assert sandbox.files.stat(relative).size_bytes == result.stdout_bytes


def test_small_output_is_not_truncated(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("seq 1 1000")
    assert not result.stdout_truncated
    assert result.stdout_path is None
    assert result.stdout.splitlines()[-1] == "1000"


# ---------------------------------------------------------------- files


def test_file_round_trip(sandbox: Sandbox) -> None:
    sandbox.files.write("data/a.txt", "hello")
    assert sandbox.files.read("data/a.txt") == "hello"
    assert sandbox.run_code("open('data/a.txt').read()").text == "'hello'"
    names = [f.name for f in sandbox.files.list("data")]
    assert names == ["a.txt"]
    info = sandbox.files.stat("data/a.txt")
    assert info.type == "file" and info.size_bytes == 5
    sandbox.files.remove("data/a.txt")
    assert not sandbox.files.exists("data/a.txt")


def test_binary_file_larger_than_one_chunk(sandbox: Sandbox) -> None:
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB, spans several protocol chunks
    assert sandbox.files.write("blob.bin", payload) == len(payload)
    assert sandbox.files.read_bytes("blob.bin") == payload


def test_files_written_by_code_are_listed(sandbox: Sandbox) -> None:
    sandbox.commands.run("mkdir -p out/deep && echo 1 > out/deep/x.txt")
    listed = {f.path for f in sandbox.files.list("out", depth=3)}
    assert listed == {"out/deep", "out/deep/x.txt"}


def test_missing_file_raises_file_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxFileNotFound):
        sandbox.files.read("nope.txt")
    with pytest.raises(FileNotFoundError):
        sandbox.files.stat("nope.txt")


def test_reading_a_directory_is_refused(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("adir")
    with pytest.raises(SandboxIsADirectory):
        sandbox.files.read("adir")


@pytest.mark.parametrize(
    "path", ["../outside.txt", "a/../../outside.txt", "/etc/passwd", "/tmp/x", "/workspace/../etc"]
)
def test_paths_outside_workspace_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(PathOutsideWorkspace):
        sandbox.files.read(path)
    with pytest.raises(PathOutsideWorkspace):
        sandbox.files.write(path, "x")


def test_symlink_leaving_workspace_is_refused(sandbox: Sandbox) -> None:
    sandbox.commands.run("ln -s /etc escape && ln -s /etc/hostname leak")
    with pytest.raises(PathOutsideWorkspace):
        sandbox.files.read("leak")
    with pytest.raises(PathOutsideWorkspace):
        sandbox.files.write("escape/evil", "x")
    with pytest.raises(PathOutsideWorkspace):
        sandbox.files.list("escape")
    # Removing the link itself is fine: it does not touch what it points to.
    sandbox.files.remove("leak")
    assert not sandbox.files.exists("leak")


def test_absolute_workspace_paths_are_accepted(sandbox: Sandbox) -> None:
    sandbox.files.write("/workspace/abs.txt", "ok")
    assert sandbox.files.read("abs.txt") == "ok"


# ---------------------------------------------------------------- lifecycle


def test_artifacts_outlive_the_sandbox(manager: SandboxManager, backend_name: str) -> None:
    sb = Sandbox.create(manager=manager, **placement(backend_name))
    sb.commands.run("mkdir -p artifacts/plots && echo chart > artifacts/plots/a.txt")
    sb.files.write("artifacts/report.md", "# done")
    sb.files.write("not-an-artifact.txt", "scratch")
    sb.kill()
    portal = get_portal()
    kept = portal.call(manager.list_artifacts(sb.id))
    assert sorted(a.path for a in kept) == ["plots/a.txt", "report.md"]
    report = portal.call(manager.artifact_path(sb.id, "report.md"))
    assert report.read_text() == "# done"
    assert portal.call(manager.delete_artifacts(sb.id)) == 2
    assert not report.exists()


def test_destroyed_sandbox_refuses_calls(manager: SandboxManager, backend_name: str) -> None:
    sb = Sandbox.create(manager=manager, **placement(backend_name))
    sb.kill()
    assert sb.info.status == "destroyed"
    with pytest.raises(SandboxNotRunning):
        sb.run_code("1")
    sb.kill()  # idempotent


def test_sandboxes_do_not_share_state(manager: SandboxManager, backend_name: str) -> None:
    with (
        Sandbox.create(manager=manager, **placement(backend_name)) as a,
        Sandbox.create(manager=manager, **placement(backend_name)) as b,
    ):
        a.run_code("secret = 'a'")
        a.files.write("mine.txt", "a")
        assert b.run_code("'secret' in globals()").text == "False"
        assert not b.files.exists("mine.txt")


def test_ttl_reaps_and_removes_everything(manager: SandboxManager, backend_name: str) -> None:
    import time

    sb = Sandbox.create(manager=manager, **placement(backend_name), ttl_s=0.5)
    sb.files.write("artifacts/kept.txt", "still here")
    deadline = time.monotonic() + 10
    while sb.refresh().status != "destroyed" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sb.info.end_reason == "ttl"
    get_portal().call(manager.settle())  # its files go just after it reads destroyed
    instance_dir = manager.instance_dir
    assert not (instance_dir / "sandboxes" / sb.id).exists()
    assert not (instance_dir / "local-sandboxes" / sb.id).exists()
    kept = get_portal().call(manager.list_artifacts(sb.id))
    assert [a.path for a in kept] == ["kept.txt"]
