"""One run of code or of a command in a live sandbox, from request to :class:`ExecResult`.

The guest enforces the call's timeout and output caps; this room adds the host's backstop
(a guest that hangs past its timeout is restarted), turns a guest death into a result, and
names the real cause of a kill from the cgroup's counters, which exit codes lose.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from typing import Any

import structlog
from pydantic import ValidationError

from sandlot.core.guest_link import GuestConnection, TurnCallback
from sandlot.core.live import Live, guest_broken
from sandlot.errors import ConfigError, GuestDied, GuestError, PidsExhausted, SandboxError
from sandlot.guest.ops import Op
from sandlot.guest.wire import Results
from sandlot.models import ExecResult, OutputCallback, ResourceUsage, Result, ResultCallback
from sandlot.requests import RunCode, RunCommand

log = structlog.get_logger(__name__)

SATURATED = 0.9  # a limit this full after a call means something left behind holds it
KILLED_EXIT_CODE = 128 + 9  # a call whose process SIGKILL ended (the guest reports 128 + signal)
BACKSTOP_S = 5.0  # the guest enforces timeouts; the host steps in only if the guest hangs
RESULT_FIELDS = frozenset(ExecResult.model_fields)
# Told the connection and call id an exec call was sent with (a background command's handle
# cancels and feeds that call).
CallObserver = Callable[[GuestConnection, int], None]


def code_payload(request: RunCode) -> tuple[Op, dict[str, Any]]:
    return Op.EXEC_CODE, {"code": request.code}


def command_payload(request: RunCommand, *, streams_stdin: bool) -> tuple[Op, dict[str, Any]]:
    payload: dict[str, Any] = {
        "command": request.command,
        "session": request.session,
        "env": request.env or {},
    }
    if request.cwd is not None:
        payload["cwd"] = request.cwd
    if request.input is not None:
        payload["input"] = request.input
    if streams_stdin:
        payload["stdin"] = True
    if request.fresh:
        payload["fresh"] = True
    return Op.EXEC_SHELL, payload


async def execute(
    live: Live,
    op: Op,
    payload: dict[str, Any],
    timeout_s: float | None,
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
    stdin: asyncio.Queue[bytes | None] | None = None,
    on_result: ResultCallback | None = None,
    on_call: CallObserver | None = None,
) -> ExecResult:
    """Run one exec call; a crash, timeout or kill of the sandboxed program is a result.

    A guest that answers with an error of its own (it cannot open a pipe: sandboxed code
    lowered its file limit, say) is broken for every later call too: it is restarted and the
    call is tried once more on the fresh guest (``state_lost``). An exec request's error frame
    means the guest failed before running the code, so the retry runs it once, not twice.

    Raises:
        ConfigError: ``timeout_s`` is not positive.
        GuestError: the guest sent a result that is not one, or failed again once restarted.
        SandboxNotRunning: the sandbox is being destroyed.
    """
    try:
        return await _attempt(
            live, op, payload, timeout_s, on_stdout, on_stderr, stdin, on_result, on_call
        )
    except SandboxError as exc:
        if not guest_broken(exc):
            raise
        log.warning("the guest fails calls; restarting it", sandbox=live.id, error=exc.message)
        await live.drop_guest()
    try:
        result = await _attempt(
            live, op, payload, timeout_s, on_stdout, on_stderr, stdin, on_result, on_call
        )
    except SandboxError as exc:
        if not guest_broken(exc):
            raise
        await live.drop_guest()
        raise GuestError(f"the sandbox's guest fails even when restarted: {exc.message}") from exc
    result.state_lost = True
    return result


async def _attempt(
    live: Live,
    op: Op,
    payload: dict[str, Any],
    timeout_s: float | None,
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
    stdin: asyncio.Queue[bytes | None] | None = None,
    on_result: ResultCallback | None = None,
    on_call: CallObserver | None = None,
) -> ExecResult:
    limits = live.info.limits
    timeout = limits.timeout_s if timeout_s is None else timeout_s
    if timeout <= 0:
        raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout}")
    live.active_calls += 1
    live.touch()
    started = time.monotonic()
    try:
        conn, restarted = await live.connection()
        before = live.counters
        call_id = _new_call(conn, on_call)
        if op in (Op.EXEC_CODE, Op.EXEC_SHELL) and not payload.get("background"):
            # Only these hold what a queued call waits for (the kernel, a session, the
            # fresh gate): a terminal's or a background command's budget (up to the
            # sandbox's lifetime) would leave a queued call no deadline again.
            live.call_budgets[call_id] = timeout + BACKSTOP_S
        request = _call_request(live, payload, timeout)
        feeder = (
            asyncio.create_task(_feed_stdin(conn, call_id, stdin)) if stdin is not None else None
        )
        try:
            async with asyncio.timeout(timeout + BACKSTOP_S) as backstop:
                raw = await conn.request(
                    op,
                    request,
                    on_stdout=on_stdout,
                    on_stderr=on_stderr,
                    on_result=on_result,
                    call_id=call_id,
                    on_turn=_backstop_from_turn(backstop, timeout, live, call_id),
                )
        except PidsExhausted:
            # Left-over processes hold every slot; only a fresh guest frees them.
            raw = {"exit_code": 137, "kill_reason": "pids", "state_lost": True}
            await live.drop_guest()
        except GuestDied:
            raw = {"exit_code": 137, "kill_reason": "killed", "state_lost": True}
            await live.drop_guest()
        except TimeoutError:
            log.warning("guest hung past its timeout; restarting it", sandbox=live.id)
            raw = {"exit_code": 137, "kill_reason": "timeout", "state_lost": True}
            await live.drop_guest()
        except asyncio.CancelledError:
            await conn.notify(Op.CANCEL, {"target": call_id})
            raise
        finally:
            live.call_budgets.pop(call_id, None)
            if feeder is not None:
                feeder.cancel()
        result = await _result(live, raw, before, started)
        if restarted:
            result.state_lost = True
        return result
    finally:
        live.active_calls -= 1
        live.touch()


async def _result(
    live: Live, raw: dict[str, Any], before: ResourceUsage, started: float
) -> ExecResult:
    """The call's result from the guest's ``raw`` answer, its kill reason from the cgroup's
    counters read now against ``before``."""
    after = live.counters = await live.backend.usage(live.id, full=False)
    try:
        result = ExecResult.model_validate(
            {k: v for k, v in raw.items() if k in RESULT_FIELDS}
            | _results(raw, live.info.limits.output_limit_bytes)
        )
    except ValidationError as exc:
        # The guest shares a uid with sandboxed code: a malformed reply is its failure
        # (502), never ours (500).
        await live.drop_guest()
        raise GuestError(f"the sandbox's guest sent an invalid result: {exc}") from exc
    if not result.duration_ms:
        result.duration_ms = (time.monotonic() - started) * 1000
    tasks = raw.get("tasks")
    await _classify(live, result, before, after, tasks if isinstance(tasks, int) else 0)
    return result


def _new_call(conn: GuestConnection, on_call: CallObserver | None) -> int:
    call_id = conn.new_id()
    if on_call is not None:
        on_call(conn, call_id)
    return call_id


def _backstop_from_turn(
    backstop: asyncio.Timeout, timeout_s: float, live: Live, call_id: int
) -> TurnCallback:
    """The backstop of a call that waits its turn in the guest (a cell behind a cell, a
    command behind its session's or a fresh command): while it waits, the backstops of the
    other foreground calls in flight and its own (the calls ahead of it are among them),
    then its timeout and BACKSTOP_S from when it can run, as the guest counts its timeout.
    Counted from its sending, a call queued behind another ran out of it and the host
    restarted a healthy guest, its state lost; with no deadline while it waited, a call
    queued behind one its caller had cancelled (and the guest had not ended: its thread
    stuck sending a cell to a kernel that no longer read) waited for good (red team,
    2026-12-06)."""
    loop = asyncio.get_running_loop()

    def turn(started: bool) -> None:
        if backstop.expired():
            return  # too late: the call is being ended (a reschedule now would raise)
        if started:
            backstop.reschedule(loop.time() + timeout_s + BACKSTOP_S)
            return
        ahead_s = sum(b for other, b in live.call_budgets.items() if other != call_id)
        backstop.reschedule(loop.time() + ahead_s + timeout_s + BACKSTOP_S)

    return turn


def _call_request(live: Live, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    limits = live.info.limits
    return {
        "output_limit": limits.output_limit_bytes,
        "output_file_limit": limits.output_file_limit_mb * 1024 * 1024,
        # Full outputs are spilled to the sandbox's own disk: a quarter of it at most
        # (a payload may ask for less: background commands share that quarter).
        "output_spill_limit": live.disk_bytes // 4,
        **payload,
        "timeout_s": timeout_s,
    }


def _results(raw: dict[str, Any], limit_bytes: int) -> dict[str, Any]:
    """The call's rich outputs as :class:`Result` models, kept by the guest's own rule
    (``wire.Results``: its count, and its cost against the output limit) before any model is
    built: the guest shares a uid with sandboxed code, and a reply it forged could otherwise
    make the manager hold many times the cap."""
    bundles = raw.get("results")
    if not isinstance(bundles, list):
        return {}
    fitting = Results(limit_bytes)
    for bundle in bundles:
        if fitting.full():
            fitting.dropped += 1
            break  # the rest would be dropped too: walking them is work for nothing
        if not isinstance(bundle, dict):
            continue
        fitting.add(bundle)
    results = [
        Result.from_bundle(b.get("data"), b.get("is_main_result"))
        for b in fitting.kept
        if isinstance(b, dict)
    ]
    return {"results": results} | ({"results_truncated": True} if fitting.dropped else {})


async def _classify(
    live: Live,
    result: ExecResult,
    before: ResourceUsage,
    after: ResourceUsage,
    guest_tasks: int,
) -> None:
    """Name the real cause of a kill from the cgroup's counters (exit codes lose it), and
    restart a guest that a limit left wedged.

    ``guest_tasks`` is the process count the guest saw after the call. Under gVisor it
    is the only witness of a fork bomb held at the limit: the host's pids cgroup holds
    the sentry, not the sandbox's processes, and counts none of their failed forks.
    """
    failed = result.kill_reason is not None or result.exit_code not in (0, None)
    # The OOM killer's signal, as the call's own process met it. A failed call that was not
    # killed ("sleep 1; exit 3") did not fail for memory, even if a process an earlier call
    # left in the background was OOM-killed meanwhile (red team: it was reported "memory").
    killed = result.kill_reason is not None or result.exit_code == KILLED_EXIT_CODE
    limits = live.info.limits
    oom = after.oom_kills > before.oom_kills
    tasks_full = guest_tasks >= SATURATED * limits.pids
    pids_hit = after.pids_limit_hits > before.pids_limit_hits or tasks_full
    if not (oom or pids_hit):
        return
    usage = await live.backend.usage(live.id)
    # Still at the limit after the call: background processes (a fork bomb whose first
    # shell exited 0, files filling memory) hold it, and every next call would fail.
    saturated = (
        oom and (usage.memory_bytes or 0) >= SATURATED * limits.memory_mb * 1024 * 1024
    ) or (pids_hit and (tasks_full or (usage.pids or 0) >= SATURATED * limits.pids))
    if oom and (killed or saturated):
        result.kill_reason = "memory"
    elif pids_hit and (failed or saturated):
        result.kill_reason = "pids"
    if saturated:
        await live.drop_guest()
        result.state_lost = True


async def _feed_stdin(
    conn: GuestConnection, call_id: int, queue: asyncio.Queue[bytes | None]
) -> None:
    """Forward queued input to a running command; ``None`` closes its stdin."""
    while True:
        data = await queue.get()
        payload = {
            "target": call_id,
            "data": base64.b64encode(data or b"").decode("ascii"),
            "eof": data is None,
        }
        try:
            await conn.request(Op.STDIN, payload)
        except SandboxError:
            return  # the command ended (or never took stdin): later input has nowhere to go
        if data is None:
            return
