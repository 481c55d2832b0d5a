"""A live sandbox as the core holds it: its record, its backend, and its guest link.

A :class:`Live` owns its guest's lifecycle (start, restart after a death, drop) so that the
execution and file rooms can ask for "a working connection" without knowing how one is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from sandlot.backends import Backend, GuestSpec
from sandlot.core.guest_link import GuestConnection
from sandlot.errors import (
    ConfigError,
    GuestError,
    SandboxError,
    SandboxFileError,
    SandboxNotRunning,
    SandboxStartError,
)
from sandlot.models import Quota, ResolvedLimits, ResourceUsage, SandboxInfo, SandboxStatus

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 15.0
# Restarts of one sandbox's guest in a row cost nothing extra until the burst is spent; then
# each waits until the window since the burst's first has passed. A restart costs the host a
# new guest nobody is charged for (on gVisor a container restart: ~1 s of the container
# runtime's CPU), and sandboxed code can force one per call by killing its own supervisor.
RESTART_BURST = 5
RESTART_WINDOW_S = 20.0

# A Ray node agent names its node in every id it makes ("sb-<node>-<hex>"), so that any API
# server routes a call by the id alone; one agent (one manager) runs per worker process.
NODE_NAME_PATTERN = r"^[A-Za-z0-9_]{1,24}$"
_id_prefix = "sb-"

# The owner of a sandbox started for a pool, until a create claims it.
POOL_OWNER = "__pool__"


def set_node_name(node: str | None) -> None:
    """Make this process's sandbox ids name ``node`` (None: plain "sb-<hex>" ids).

    Raises:
        ConfigError: ``node`` is not 1-24 letters, digits or underscores (a dash would make
            the id ambiguous).
    """
    global _id_prefix
    if node is not None and not re.fullmatch(NODE_NAME_PATTERN, node):
        raise ConfigError(f"node name {node!r} must match {NODE_NAME_PATTERN}")
    _id_prefix = "sb-" if node is None else f"sb-{node}-"


def node_of(sandbox_id: str) -> str | None:
    """The node an id names, or None for a plain id."""
    parts = sandbox_id.split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "sb" else None


@dataclass(frozen=True)
class PoolKey:
    """What a sandbox runs on: backend, OCI runtime and environment (a warm pool holds one)."""

    backend: str
    runtime: str | None
    environment: str

    def __str__(self) -> str:
        runtime = f"+{self.runtime}" if self.runtime else ""
        return f"{self.backend}{runtime}:{self.environment}"


@dataclass
class Live:
    info: SandboxInfo
    spec: GuestSpec
    backend: Backend
    conn: GuestConnection | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active_calls: int = 0
    # The backstop (timeout and BACKSTOP_S) of each foreground cell or command in flight, by
    # call id (terminals and background commands hold nothing a queued call waits for): a
    # call that waits its turn in the guest waits at most for theirs (execution.py).
    call_budgets: dict[int, float] = field(default_factory=dict)
    destroying: bool = False
    # Kill counters as last read; each call compares against these, so one cheap read per
    # call suffices. (A limit hit between calls is blamed on the next call, if that fails.)
    counters: ResourceUsage = field(default_factory=ResourceUsage)
    # The owner's quota when it was created (bounds the artifacts it may keep).
    quota: Quota | None = None
    # When the guest's last restarts began (monotonic), to pace them (RESTART_BURST).
    restarts: deque[float] = field(default_factory=lambda: deque(maxlen=RESTART_BURST))
    # Set with ``destroying`` (begin_destroy): wakes a paced restart.
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def new(
        cls,
        key: PoolKey,
        backend: Backend,
        limits: ResolvedLimits,
        network: bool,
        env: dict[str, str] | None,
        owner: str,
        *,
        ttl_s: float,
        idle_timeout_s: float,
    ) -> Live:
        """A sandbox not yet started: a fresh id, its record, and what to ask the backend."""
        now = time.time()
        info = SandboxInfo(
            id=_id_prefix + secrets.token_hex(8),
            backend=key.backend,
            runtime=key.runtime,
            environment=key.environment,
            status=SandboxStatus.STARTING,
            owner=owner,
            limits=limits,
            network=network,
            created_at=now,
            last_active_at=now,
            expires_at=now + ttl_s,
            idle_timeout_s=idle_timeout_s,
        )
        spec = GuestSpec(
            info.id,
            limits,
            network,
            dict(env or {}),
            environment=key.environment,
            runtime=key.runtime,
            tenant=None if owner == POOL_OWNER else owner,
        )
        return cls(info=info, spec=spec, backend=backend)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def disk_bytes(self) -> int:
        return self.info.limits.disk_mb * 1024 * 1024

    def touch(self) -> None:
        self.info.last_active_at = time.time()

    async def start_guest(self) -> GuestConnection:
        """Start a fresh guest (the backend ends any previous one; the workspace is kept).

        Raises:
            SandboxStartError: it did not say "ready" in time, or speaks another protocol.
        """
        guest = await self.backend.start(self.spec)
        conn = GuestConnection(guest.reader, guest.writer)
        try:
            await conn.wait_ready(READY_TIMEOUT_S)
        except (GuestError, TimeoutError) as exc:
            guest.kill()
            await guest.wait()
            detail = guest.stderr_tail() or str(exc)
            raise SandboxStartError(f"the sandbox's guest did not start: {detail}") from exc
        try:
            await self.backend.started(self.id)
        except SandboxStartError:
            guest.kill()
            await guest.wait()
            raise
        self.conn = conn
        self.counters = await self.backend.usage(self.id, full=False)
        return conn

    async def connection(self) -> tuple[GuestConnection, bool]:
        """The live guest connection, restarting a dead guest (workspace kept).

        Returns the connection and whether a guest death went unreported until now (the
        caller's result then says ``state_lost``).

        Raises:
            SandboxNotRunning: the sandbox is being destroyed.
        """
        if self.conn is not None and self.conn.alive:
            return self.conn, False
        wait_s = self.restart_wait_s()
        if wait_s > 0:
            # Outside the lock, and cut short by a destroy: one neither waits for it nor is
            # outlived by it.
            log.info("guest restart paced", sandbox=self.id, wait_s=round(wait_s, 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ended.wait(), wait_s)
        async with self.lock:
            if self.conn is not None and self.conn.alive:
                return self.conn, False
            if self.destroying:
                raise SandboxNotRunning(f"sandbox {self.id} was destroyed")
            # A dead connection still attached means the guest died between calls and no
            # result has told the caller yet; drop_guest detaches it once a result has.
            lost_unreported = self.conn is not None
            log.info("restarting guest", sandbox=self.id)
            self.restarts.append(time.monotonic())
            conn = await self.start_guest()
            return conn, lost_unreported

    def begin_destroy(self) -> None:
        self.destroying = True
        self.ended.set()

    def restart_wait_s(self) -> float:
        """How long the next restart must wait (0 while the burst lasts)."""
        if len(self.restarts) < RESTART_BURST:
            return 0.0
        return max(0.0, self.restarts[0] + RESTART_WINDOW_S - time.monotonic())

    async def drop_guest(self) -> None:
        """Forget the guest after a call already reported the loss of its state."""
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


def guest_broken(exc: SandboxError) -> bool:
    """Whether an error frame is the guest's own failure (``file_error``: EMFILE, ENFILE,
    ENOMEM or ENOBUFS, as after sandboxed code lowered the guest's file limit; or an error
    it could not name) rather than a problem with the file or the request (``io_error`` and
    the typed ones), which the caller must see as it is: sandboxed code can plant the file,
    and a restart costs the user the session's state."""
    return type(exc) in (SandboxError, SandboxFileError)
