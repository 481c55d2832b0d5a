"""Terminals: ``sandbox.pty`` embedded, over REST and the WebSocket, on every backend."""

from __future__ import annotations

import threading
import time

import pytest

from sandlot import Sandbox
from sandlot.errors import BackgroundLimitReached, CommandStillRunning, InvalidRequest


class Screen:
    """What a terminal wrote, as it arrives (on_data runs on the SDK's loop)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lock = threading.Lock()

    def __call__(self, chunk: bytes) -> None:
        assert isinstance(chunk, bytes)
        with self.lock:
            self.data += chunk

    def wait_for(self, needle: bytes, timeout_s: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if needle in self.data:
                    return bytes(self.data)
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} never came; the terminal wrote {bytes(self.data)!r}")


def test_shell_in_a_pty_is_interactive_and_sees_a_terminal(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(cols=100, rows=30, on_data=screen)
    assert term.pid > 0
    assert any(info.pid == term.pid and info.pty for info in sandbox.commands.list())
    term.send_input("tty; stty size\r")
    term.send_input("test -t 0 && echo IS-$((1+1))-TTY\r")
    text = screen.wait_for(b"IS-2-TTY\r\n")
    assert b"/dev/pts/" in text
    assert b"30 100" in text
    term.send_input("exit 7\r")
    result = term.wait(timeout_s=20)
    assert result.exit_code == 7
    assert result.stdout_bytes >= len(text)


def test_resize_reaches_the_program_as_sigwinch(sandbox: Sandbox) -> None:
    screen = Screen()
    script = (
        '/usr/bin/python3 -c "import signal, os, sys, time\n'
        "def on(*a):\n"
        "    print('WINCH', *os.get_terminal_size(0), flush=True)\n"
        "signal.signal(signal.SIGWINCH, on)\n"
        "print('READY', flush=True)\n"
        'time.sleep(30)"'
    )
    term = sandbox.pty.create(cols=80, rows=24, cmd=script, on_data=screen)
    screen.wait_for(b"READY")
    term.resize(cols=132, rows=43)
    screen.wait_for(b"WINCH 132 43")
    assert term.kill() is True
    assert term.wait(timeout_s=10).kill_reason == "killed"


def test_ctrl_c_interrupts_the_foreground_program_not_the_shell(sandbox: Sandbox) -> None:
    screen = Screen()
    term = sandbox.pty.create(cmd="/bin/bash --norc -i", on_data=screen)
    term.send_input("sleep 100\r")
    time.sleep(0.5)
    term.send_input(b"\x03")  # the terminal's driver sends SIGINT to the foreground group
    term.send_input("echo AFTER-$?\r")
    screen.wait_for(b"AFTER-130\r\n")  # sleep died of SIGINT; the shell read on
    term.kill()


def test_output_is_raw_bytes_and_read_polls_it(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(cmd="printf '\\377\\033[31mred\\033[0m\\n'; sleep 0.3")
    result = term.wait(timeout_s=20)
    assert result.exit_code == 0
    data = term.read()
    assert b"\xff\x1b[31mred\x1b[0m\r\n" in data  # no decoding: 0xff comes back as 0xff
    assert term.read() == b""  # read() goes on from where the last one stopped


def test_cwd_env_and_size_limits(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("sub")
    screen = Screen()
    term = sandbox.pty.create(
        cmd="pwd; echo $WHO $TERM", cwd="sub", env={"WHO": "me"}, on_data=screen
    )
    term.wait(timeout_s=20)
    text = screen.wait_for(b"me xterm")
    assert b"/workspace/sub\r\n" in text
    with pytest.raises(Exception):
        sandbox.pty.create(cols=0)


def test_terminals_count_against_the_background_cap(sandbox: Sandbox, manager) -> None:
    limit = manager.settings.max_background_commands
    terms = [sandbox.pty.create(cmd="sleep 60") for _ in range(limit)]
    with pytest.raises(BackgroundLimitReached):
        sandbox.pty.create(cmd="sleep 60")
    with pytest.raises(BackgroundLimitReached):
        sandbox.commands.run("sleep 60", background=True)
    assert terms[0].kill() is True
    terms[0].wait(timeout_s=10)
    again = sandbox.pty.create(cmd="sleep 60")
    for term in [*terms[1:], again]:
        term.kill()


def test_a_command_is_not_a_terminal(sandbox: Sandbox) -> None:
    cmd = sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(InvalidRequest):
        sandbox.pty.resize(cmd.pid, 10, 10)
    cmd.kill()
    with pytest.raises(CommandStillRunning):
        sandbox.pty.create(cmd="sleep 30").wait(timeout_s=0.2)
