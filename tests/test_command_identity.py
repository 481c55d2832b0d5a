"""Which command a background verb acts on: the host draws an id for each (``command_id``),
since a pid does not name one command (pids start again at 1 when the sandbox's guest
restarts, which its own code can force), and the input waiting for a sandbox's commands is
bounded per sandbox, not per command.

Failed before (red team, 2026-12-06): a handle kept A's pid; once the guest restarted, the
next command B got that pid, and A's ``wait()`` returned B's output and exit code, its
``kill()`` killed B and its ``send_stdin()`` typed into B. And each of a sandbox's 16
commands could park 4 MiB of stdin on the server (640 MiB for a tenant's 10 sandboxes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sandlot import Sandbox, SandboxManager
from sandlot._portal import get_portal
from sandlot.core import background
from sandlot.errors import CommandNotFound, InvalidRequest, StdinBacklogFull
from tests.conftest import LiveServer, placement

# Leaves a sleeping fork bomb holding every pid slot of the sandbox: the call comes back
# kill_reason "pids" and the guest is dropped, so the next call starts a new guest, whose pids
# start again at 1 (what sandboxed code can do at will: red team's e1_pid_reuse_restart.py).
FORCE_RESTART = """python3 -c '
import os, time
if os.fork() == 0:
    os.setsid()
    while True:
        try:
            if os.fork() == 0:
                time.sleep(3600); os._exit(0)
        except OSError:
            time.sleep(3600)
' & sleep 3; echo done"""
PIDS = 64  # the sandbox's process limit: the bomb fills it at once, on a busy machine too
ATTEMPTS = 4  # guest restarts tried for a command to take the earlier one's pid
DEADLINE_S = 60.0


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.1)


def _a_then_b(
    make_a: Callable[[], tuple[int, Any]],
    restart: Callable[[], Any],
    start: Callable[[], tuple[int, Any]],
    drop: Callable[[Any], None],
) -> tuple[Any, Any]:
    """A (``make_a``: the first command of a restarted guest, ended), then B, a command
    ``start`` made after another restart that took A's pid. Pids are handed out in order in a
    new guest, so B is the first command of some restart; which pid the first command gets
    varies by one with how the guest's own start raced it, so a new A is made where a few
    restarts never gave its pid."""
    for _ in range(ATTEMPTS):
        restart()
        a_pid, a = make_a()
        for _ in range(ATTEMPTS):
            restart()
            got, b = start()
            if got == a_pid:
                return a, b
            drop(b)
    pytest.fail(f"no command took an earlier one's pid in {ATTEMPTS * ATTEMPTS} guest restarts")


@pytest.fixture
def restartable(manager: SandboxManager, isolated_backend: str) -> Iterator[Sandbox]:
    """A sandbox with a pid namespace and a pids limit (whose guest its code can restart),
    for longer than ``jail``'s 10 s."""
    if isolated_backend == "docker":
        # On runc a guest restart keeps the container and its pid namespace: pids go on
        # rising, and no restart gives an old pid again (gVisor restarts the container).
        pytest.skip("pids do not start again with the guest on docker (runc)")
    sb = Sandbox.create(
        manager=manager, **placement(isolated_backend), pids=PIDS, memory_mb=256, timeout_s=300
    )
    yield sb
    sb.kill()


def test_a_handle_never_acts_on_a_later_command_that_took_its_pid(
    restartable: Sandbox, manager: SandboxManager
) -> None:
    sb = restartable

    def restart() -> None:
        forced = sb.commands.run(FORCE_RESTART, timeout_s=30)
        assert forced.state_lost, forced

    def make_a() -> tuple[int, Any]:
        a = sb.commands.run("echo A-REAL-RESULT; exit 7", background=True)
        assert a.info.command_id
        _until(lambda: a.pid not in {c.pid for c in sb.commands.list()}, "A ends")
        return a.pid, a

    def start() -> tuple[int, Any]:
        handle = sb.commands.run("cat", background=True)
        return handle.pid, handle

    def drop(handle: Any) -> None:
        handle.kill()

    a, b = _a_then_b(make_a, restart, start, drop)
    assert b.pid == a.pid

    # A's handle: A's own state (it has ended), never B's. Before: the input reached B's cat
    # and the kill killed B.
    with pytest.raises(InvalidRequest, match="has ended"):
        a.send_stdin("meant-for-A\n")
    assert a.kill() is False
    assert [c.command_id for c in sb.commands.list()] == [b.info.command_id]

    b.send_stdin("meant-for-B\n")
    b.close_stdin()
    rb = b.wait(timeout_s=30)
    assert (rb.stdout, rb.exit_code, rb.kill_reason) == ("meant-for-B\n", 0, None), rb
    ra = a.wait(timeout_s=10)
    # Before: ('meant-for-A\nmeant-for-B\n', 0) or B's kill, B's result in any case.
    assert (ra.stdout, ra.exit_code) == ("A-REAL-RESULT\n", 7), ra

    assert b.info.command_id != a.info.command_id
    # The pid alone names the newest command with it (E2B's clients send only the pid).
    assert sb.commands.connect(a.pid).info.command_id == b.info.command_id
    # An id no longer kept (or never drawn) is not found, naming what holds the pid now.
    with pytest.raises(CommandNotFound) as missing:
        get_portal().call(manager.command_info(sb.id, a.pid, command_id="0123456789abcdef"))
    assert b.info.command_id is not None and b.info.command_id in missing.value.message
    # An id with another command's pid is refused, not resolved by either.
    other = sb.commands.run("true", background=True)
    with pytest.raises(CommandNotFound, match="has pid"):
        get_portal().call(manager.wait_command(sb.id, other.pid, 5, command_id=a.info.command_id))


def test_a_terminal_handle_keeps_to_its_own_terminal(
    restartable: Sandbox,
) -> None:
    # Terminals share the table: a terminal's handle passes its id too.
    sb = restartable
    term = sb.pty.create(cmd="echo T-OUT; exit 3")
    assert term.info.command_id
    assert term.wait(timeout_s=30).exit_code == 3
    assert b"T-OUT" in term.read()
    with pytest.raises(InvalidRequest, match="has ended"):
        term.send_input("x")
    assert term.kill() is False


# ---------------------------------------------------------------------- REST


def test_rest_verbs_take_the_command_id(live_server: LiveServer) -> None:
    with httpx.Client(
        base_url=live_server.url, headers=live_server.headers("alice"), timeout=90
    ) as http:
        created = http.post("/v1/sandboxes", json={"pids": PIDS, "memory_mb": 256})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        commands = f"/v1/sandboxes/{sid}/commands"
        try:

            def restart() -> None:
                forced = http.post(commands, json={"command": FORCE_RESTART, "timeout_s": 30})
                assert forced.status_code == 200 and forced.json()["state_lost"], forced.text

            def make_a() -> tuple[int, Any]:
                started = http.post(
                    commands, json={"command": "echo A; exit 7", "background": True}
                )
                assert started.status_code == 202, started.text
                a = started.json()
                assert a["command_id"]

                def ended() -> bool:
                    params = {"command_id": a["command_id"]}
                    return (
                        http.get(f"{commands}/{a['pid']}", params=params).json()["running"] is False
                    )

                _until(ended, "A ends")
                return a["pid"], a

            def start() -> tuple[int, Any]:
                b = http.post(commands, json={"command": "cat", "background": True}).json()
                return b["pid"], b

            def drop(b: Any) -> None:
                http.delete(f"{commands}/{b['pid']}", params={"command_id": b["command_id"]})

            a, b = _a_then_b(make_a, restart, start, drop)
            a_pid, a_id = a["pid"], a["command_id"]
            b_id = b["command_id"]
            only_a = {"command_id": a_id}

            # With A's id: A's result, A's state; B is not touched.
            waited = http.get(f"{commands}/{a_pid}/wait", params=only_a)
            assert waited.status_code == 200, waited.text
            assert (waited.json()["stdout"], waited.json()["exit_code"]) == ("A\n", 7)
            typed = http.post(f"{commands}/{a_pid}/stdin", params=only_a, json={"data": "x"})
            assert typed.status_code == 422, typed.text
            assert typed.json()["error"]["code"] == "invalid_request"
            killed = http.delete(f"{commands}/{a_pid}", params=only_a)
            assert killed.json() == {"pid": a_pid, "killed": False}
            assert [c["command_id"] for c in http.get(commands).json()] == [b_id]

            # Without an id: today's behaviour, the newest command with that pid (B).
            running = http.get(f"{commands}/{a_pid}/wait", params={"timeout_s": 0.2})
            assert running.status_code == 202 and running.json()["command_id"] == b_id

            # An id not kept: 404, naming the command that holds the pid now.
            gone = http.get(f"{commands}/{a_pid}", params={"command_id": "0123456789abcdef"})
            assert gone.status_code == 404, gone.text
            assert gone.json()["error"]["code"] == "command_not_found"
            assert b_id in gone.json()["error"]["message"]
            # The pty routes take it as well: B is no terminal, A's id names no terminal.
            output = http.get(f"/v1/sandboxes/{sid}/pty/{a_pid}/output", params=only_a)
            assert output.status_code == 422, output.text
            assert "not a terminal" in output.json()["error"]["message"]
            # A malformed id is refused at the edge with a typed body.
            bad = http.get(f"{commands}/{a_pid}", params={"command_id": "../x"})
            assert bad.status_code in (400, 422) and "error" in bad.json(), bad.text

            sent = http.post(
                f"{commands}/{a_pid}/stdin",
                params={"command_id": b_id},
                json={"data": "to-B\n", "eof": True},
            )
            assert sent.status_code == 204, sent.text
            done = http.get(f"{commands}/{a_pid}/wait", params={"command_id": b_id})
            assert (done.json()["stdout"], done.json()["exit_code"]) == ("to-B\n", 0)
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


# ---------------------------------------------------------------------- stdin budget


def test_input_waiting_for_commands_is_bounded_per_sandbox(sandbox: Sandbox) -> None:
    # Before: 4 MiB per command (16 of them a sandbox); now 4 MiB for all of them together.
    chunk = b"x" * (background.STDIN_BACKLOG_BYTES * 3 // 4)
    first = sandbox.commands.run("sleep 1000", background=True)
    second = sandbox.commands.run("sleep 1000", background=True)
    first.send_stdin(chunk)  # written to a pipe nobody reads: held on the host until it ends
    with pytest.raises(StdinBacklogFull):
        second.send_stdin(chunk)
    with pytest.raises(StdinBacklogFull):
        first.send_stdin(chunk)
    second.send_stdin(b"small")  # what is left of the budget still takes input

    # Released once the command ends...
    assert first.kill() is True
    second.send_stdin(chunk)
    assert second.kill() is True

    # ...and as the guest writes it to a command that reads.
    reader = sandbox.commands.run("cat > /dev/null", background=True)
    sleeper = sandbox.commands.run("sleep 1000", background=True)
    reader.send_stdin(chunk)

    def taken() -> bool:
        try:
            sleeper.send_stdin(chunk)
        except StdinBacklogFull:
            return False
        return True

    _until(taken, "the reader's input is released once the guest wrote it")
    reader.close_stdin()
    assert reader.wait(timeout_s=30).exit_code == 0
    assert sleeper.kill() is True


def test_the_stdin_budget_counts_a_chunk_until_the_guest_has_written_it() -> None:
    # The feeder (execution._feed_stdin) takes a chunk, has the guest write it (which waits as
    # long as the command does not read), and only then asks for the next: the chunk it holds
    # meanwhile is on the host too, and counted until then.

    async def scenario() -> None:
        budget = background.StdinBudget(100)
        one, two = background.JobStdin(budget), background.JobStdin(budget)
        assert one.has_room(100) and not one.has_room(101)
        one.reserve(60)
        one.put_nowait(b"x" * 60)
        assert await one.get() == b"x" * 60  # taken, being written: still counted
        assert budget.held_bytes == 60 and not two.has_room(41)
        waiting = asyncio.ensure_future(one.get())  # written: the feeder asks for more
        await asyncio.sleep(0)
        assert budget.held_bytes == 0 and two.has_room(100)
        two.reserve(30)
        two.put_nowait(b"y" * 30)
        assert budget.held_bytes == 30
        two.release()  # its command ended: queued input is dropped and given back
        assert budget.held_bytes == 0 and two.empty()
        two.put_nowait(b"late")  # a put that was waiting for room when it ended
        assert two.empty() and budget.held_bytes == 0
        waiting.cancel()

    asyncio.run(scenario())


def test_a_websocket_attach_takes_the_command_id(live_server: LiveServer) -> None:
    """An attach that names a command_id streams that command only: one the pid does not
    hold (a later command's, after a guest restart) is refused with command_not_found."""
    import json

    from websockets.sync.client import connect

    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=90) as http:
        created = http.post("/v1/sandboxes", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            started = http.post(
                f"/v1/sandboxes/{sid}/commands",
                json={"command": "sleep 0.5; echo done", "background": True},
            )
            assert started.status_code == 202, started.text
            pid, command_id = started.json()["pid"], started.json()["command_id"]
            url = live_server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sid}/stream"
            with connect(url, additional_headers=headers) as ws:
                ws.send(json.dumps({"type": "attach", "pid": pid, "command_id": "0" * 16}))
                refused = json.loads(ws.recv(timeout=30))
                assert refused["type"] in ("started", "error"), refused
                while refused["type"] != "error":
                    refused = json.loads(ws.recv(timeout=30))
                assert refused["error"]["code"] == "command_not_found", refused
                ws.send(json.dumps({"type": "attach", "pid": pid, "command_id": command_id}))
                events = [json.loads(ws.recv(timeout=30))]
                while events[-1]["type"] not in ("result", "error"):
                    events.append(json.loads(ws.recv(timeout=30)))
            assert events[0]["info"]["command_id"] == command_id, events
            assert events[-1]["type"] == "result", events
            assert events[-1]["result"]["stdout"] == "done\n", events
        finally:
            http.delete(f"/v1/sandboxes/{sid}")
