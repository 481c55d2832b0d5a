"""Calls to a node agent, and what their silence means.

Only Ray saying the actor is gone (``GONE``: dead, its worker killed or crashed, or
unreachable) means a node is lost. A call that merely takes long proves nothing: a tenant can
make its own call wait (a command that never reads its stdin, a wait with no timeout). So a
call that has not answered after a while asks the agent for its ``load`` with a short bound:
an agent that answers is alive and the call goes on waiting (or, past its own bound, fails
alone with :class:`~sandlot.errors.NodeTimeout`); an agent that does not answer either is
hung, and the caller declares the sandbox lost. A hung node is so found within
``every_s + PROBE_S``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from ray.exceptions import (
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    WorkerCrashedError,
)

from sandlot.errors import NodeTimeout, error_from_code

T = TypeVar("T")

# Ray's word that the agent's process is gone with its node's sandboxes (its successor's
# start-up sweep ends them): its worker killed (by Ray's memory monitor, whatever process
# filled the node: a sandbox's own allowance can), crashed, or its node or the call's result
# lost. Until 2026-12-07 these reached the caller raw, as a 500 (red team).
DEAD = (RayActorError, OutOfMemoryError, WorkerCrashedError, NodeDiedError, ObjectLostError)
# ... and the actor unreachable for now (``ActorUnavailableError``, a ``RayActorError``).
GONE = (*DEAD, ActorUnavailableError)
# A live agent answers ``load`` in milliseconds; this much silence on top of a slow call
# means its event loop (or its machine) is stuck.
PROBE_S = 2.0
# ``bound_s`` of a short call: the settings' ``ray_call_timeout_s``.
SHORT_CALL = 0.0


class NodeSilent(Exception):
    """The node agent answered neither the call nor a probe."""


async def awaited(ref: Awaitable[Any]) -> Any:
    """An ObjectRef as a coroutine (what asyncio.wait_for and tasks want)."""
    return await ref


def unwrap(envelope: tuple[Any, ...]) -> Any:
    if envelope[0] == "ok":
        return envelope[1]
    raise error_from_code(envelope[1], envelope[2])


async def answers(agent: Any, probe_s: float = PROBE_S) -> bool:
    """Whether the agent answers a ``load`` within ``probe_s``."""
    try:
        await asyncio.wait_for(awaited(agent.load.remote()), probe_s)
    except (TimeoutError, *GONE):
        return False
    return True


async def settle(
    work: Awaitable[T],
    agent: Any,
    *,
    bound_s: float | None,
    every_s: float,
    probe_s: float = PROBE_S,
) -> T:
    """Await ``work`` (a call to ``agent``), probing the agent every ``every_s`` it is silent.

    Raises:
        NodeSilent: the agent answered no probe (the caller declares its sandbox lost).
        NodeTimeout: ``bound_s`` passed (None: no bound) with the agent alive.
        and whatever ``work`` raises (Ray's GONE errors among them).
    """
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = None if bound_s is None else loop.time() + bound_s
    try:
        while True:
            step_s = every_s if deadline is None else min(every_s, deadline - loop.time())
            await asyncio.wait({task}, timeout=max(step_s, 0.0))
            if task.done():
                return task.result()
            alive = await answers(agent, min(probe_s, every_s))
            if task.done():
                return task.result()
            if not alive:
                raise NodeSilent
            if deadline is not None and loop.time() >= deadline:
                raise NodeTimeout(
                    f"the node did not finish the call within {bound_s:g} s (it still "
                    "answers: the call failed, not the node)"
                )
    finally:
        # Not awaited: a cancel of the caller must not wait on (or be swallowed by) this one.
        task.cancel()
