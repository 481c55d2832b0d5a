"""SandboxManager: the lifecycle of sandboxes, whatever backend isolates them.

It owns what backends do not: ids, owners, limits bookkeeping, TTL and idle reaping, the
SQLite store, crash recovery, guest restarts, ``kill_reason`` from cgroup counters, and the
artifacts kept after a sandbox is gone.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import structlog
from pydantic import ValidationError

from sandlot.backends import KNOWN_BACKENDS, Backend, GuestSpec, create_backend
from sandlot.config import Settings, get_settings
from sandlot.environments import get_environment
from sandlot.errors import (
    ConfigError,
    GuestError,
    PidsExhausted,
    QuotaExceeded,
    RequestTooLarge,
    SandboxError,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxStartError,
)
from sandlot.log import configure_logging
from sandlot.models import (
    ArtifactInfo,
    ExecResult,
    Quota,
    ResolvedLimits,
    ResourceUsage,
    SandboxInfo,
    SandboxLimits,
    SandboxStatus,
)
from sandlot.protocol import GuestConnection, GuestDied, OutputCallback
from sandlot.store import Store

log = structlog.get_logger(__name__)

SATURATED = 0.9  # a limit this full after a call means something left behind holds it
BACKSTOP_S = 5.0  # the guest enforces timeouts; the host steps in only if the guest hangs
READY_TIMEOUT_S = 15.0
FILE_CHUNK_BYTES = 1 << 20
ARTIFACTS_DIR = "artifacts"
RESULT_FIELDS = frozenset(ExecResult.model_fields)
UNSAFE_BACKENDS = frozenset({"unsafe-local"})
HOST_ENVIRONMENT = "python3"  # what a backend without images (bubblewrap) offers
MAX_POOL_SIZE = 64
POOL_RETRY_S = 1.0
# Artifacts are read through the guest, which sandboxed code can slow down: bound the wait.
ARTIFACT_EXPORT_TIMEOUT_S = 60.0

# Observers of what happens to sandboxes (metrics, audit): called as listener(event, fields).
Listener = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class PoolKey:
    """What a warm pool holds: sandboxes of one backend, runtime and environment."""

    backend: str
    runtime: str | None
    environment: str

    def __str__(self) -> str:
        runtime = f"+{self.runtime}" if self.runtime else ""
        return f"{self.backend}{runtime}:{self.environment}"


@dataclass
class _Pool:
    """A warm pool: ``size`` started sandboxes of one key, refilled by ``task`` when woken."""

    size: int
    lives: list[_Live] = field(default_factory=list)
    wanted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class _Live:
    info: SandboxInfo
    spec: GuestSpec
    backend: Backend
    conn: GuestConnection | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active_calls: int = 0
    destroying: bool = False
    # Kill counters as last read; each call compares against these, so one cheap read per
    # call suffices. (A limit hit between calls is blamed on the next call, if that fails.)
    counters: ResourceUsage = field(default_factory=ResourceUsage)


class SandboxManager:
    """Creates, runs, reaps and destroys sandboxes; one per data directory.

    Use as an async context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self._backends: dict[str, Backend] = {}
        self._live: dict[str, _Live] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None
        self._store: Store = None  # type: ignore[assignment]  # set by start()
        self._started = False
        self._listeners: list[Listener] = []
        self._pools: dict[PoolKey, _Pool] = {}

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, fields)`` on "created", "destroyed", "exec", "backend_error"."""
        self._listeners.append(listener)

    def _emit(self, event: str, **fields: Any) -> None:
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:
                log.exception("listener failed", event=event)

    # ------------------------------------------------------------------ lifecycle of the manager

    async def __aenter__(self) -> SandboxManager:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Lock the data dir, clean up after a previous crash, start the reaper.

        Raises:
            ConfigError: another process uses this data directory.
        """
        if self._started:
            return
        if not structlog.is_configured():
            # A library must not print to stdout: send our logs to stderr unless the app
            # configured structlog itself.
            configure_logging(self.settings.log_level, self.settings.log_format)
        data_dir = self.settings.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(data_dir / "manager.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"data directory {data_dir} is in use by another sandlot process "
                f"(pid {holder}); set SANDLOT_DATA_DIR to another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._store = Store(data_dir / "sandlot.db")
        self._started = True
        try:
            targets = self._pool_targets()
        except ConfigError:
            await self.close()
            raise
        await self._recover(extra_backends={key.backend for key in targets})
        self._reaper = asyncio.create_task(self._reap_forever())
        for key, size in targets.items():
            pool = self._pools[key] = _Pool(size)
            pool.wanted.set()
            pool.task = asyncio.create_task(self._fill_pool(key, pool))

    async def _recover(self, extra_backends: set[str]) -> None:
        """Mark sandboxes of a crashed run as ended and remove all they left behind.

        Every backend this store ever used is swept (pooled sandboxes are never stored, and a
        backend may have been left running with none live), plus those pools will use.
        """
        orphans = self._store.list(live_only=True)
        names = (self._store.backends_used() | extra_backends | {self.settings.backend}) & set(
            KNOWN_BACKENDS
        )
        for name in sorted(names):
            try:
                backend = self._backend(name)
                removed = await backend.sweep(keep=())
            except SandboxError as exc:
                log.warning("recovery sweep skipped", backend=name, error=str(exc))
                continue
            if removed:
                log.warning("removed orphaned sandboxes", backend=name, ids=removed)
        now = time.time()
        for info in orphans:
            self._store.save(
                info.model_copy(
                    update={
                        "status": SandboxStatus.DESTROYED,
                        "ended_at": now,
                        "end_reason": "recovered",
                    }
                )
            )

    async def close(self) -> None:
        """Destroy every live sandbox and release the data directory."""
        if not self._started:
            return
        for task in (self._reaper, *(pool.task for pool in self._pools.values())):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pooled = [live for pool in self._pools.values() for live in pool.lives]
        self._pools = {}
        await asyncio.gather(*(self._discard_pooled(live) for live in pooled))
        await asyncio.gather(
            *(self.destroy(sid, reason="shutdown") for sid in list(self._live)),
            return_exceptions=True,
        )
        for backend in self._backends.values():
            await backend.close()
        self._store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._started = False

    def live_count(self) -> int:
        return len(self._live)

    def pooled_count(self) -> int:
        """Started sandboxes waiting in the warm pools."""
        return sum(len(pool.lives) for pool in self._pools.values())

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = create_backend(name, self.settings)
        return self._backends[name]

    # ------------------------------------------------------------------ sandboxes

    async def create(
        self,
        *,
        backend: str | None = None,
        runtime: str | None = None,
        environment: str | None = None,
        limits: SandboxLimits | None = None,
        network: bool | None = None,
        env: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        owner: str = "local",
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
        quota: Quota | None = None,
    ) -> SandboxInfo:
        """Start a sandbox and return once its guest answers.

        Raises:
            ConfigError: an unknown backend or an out-of-range setting.
            QuotaExceeded: ``owner`` already holds ``quota`` worth of live sandboxes.
            BackendUnavailable: the backend cannot run on this host.
            SandboxStartError: the backend failed to start the guest.
        """
        self._require_started()
        for name, value in (("ttl_s", ttl_s), ("idle_timeout_s", idle_timeout_s)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
        backend_name = backend or self.settings.backend
        for env_key, env_value in (env or {}).items():
            if not env_key or "=" in env_key or "\0" in env_key + env_value:
                raise ConfigError(f"env {env_key!r}: names need no '=' or NUL, values no NUL")
        key = self._pool_key(backend_name, runtime, environment)
        chosen = self._backend(backend_name)
        resolved = self.settings.resolve_limits(limits)
        network = self.settings.network if network is None else network
        if quota is not None:
            self._check_quota(owner, resolved.memory_mb, quota)
        live = self._take_pooled(key, resolved, network, env)
        if live is None:
            # Registered with its owner before the first await, so a concurrent create of
            # the same owner counts it against the quota.
            live = self._new_live(chosen, key, resolved, network, env, owner)
            self._live[live.info.id] = live
            self._store.save(live.info)
            await self._boot(live)
        # Ownership and clocks start now, also for a sandbox that waited in the pool.
        now = time.time()
        info = live.info
        info.owner = owner
        info.metadata = metadata or {}
        info.created_at = info.last_active_at = now
        info.expires_at = now + (ttl_s or self.settings.ttl_s)
        info.idle_timeout_s = idle_timeout_s or self.settings.idle_timeout_s
        info.status = SandboxStatus.RUNNING
        self._live[info.id] = live
        self._store.save(info)
        self._emit("created", info=info)
        log.info(
            "sandbox created",
            sandbox=info.id,
            backend=backend_name,
            runtime=key.runtime,
            environment=key.environment,
            memory_mb=resolved.memory_mb,
            network=network,
        )
        return info.model_copy()

    def _pool_key(self, backend: str, runtime: str | None, environment: str | None) -> PoolKey:
        """Check the backend, runtime and environment go together; name them canonically.

        Raises:
            ConfigError: an unknown name, a combination the backend cannot run, or an
                unsafe backend without SANDBOX_ALLOW_UNSAFE.
        """
        if backend in UNSAFE_BACKENDS and not self.settings.allow_unsafe:
            raise ConfigError(
                f"backend {backend!r} has no isolation and runs code as this process's "
                "user; it is refused unless SANDBOX_ALLOW_UNSAFE=true (tests, development)"
            )
        chosen = self._backend(backend)
        if runtime is not None and runtime not in chosen.runtimes:
            choice = ", ".join(sorted(chosen.runtimes)) or "none (only docker has runtimes)"
            raise ConfigError(
                f"backend {backend!r} has no runtime {runtime!r}; its runtimes: {choice}"
            )
        if runtime is None and chosen.runtimes:
            runtime = self.settings.docker_runtime
            if runtime not in chosen.runtimes:
                raise ConfigError(
                    f"SANDBOX_DOCKER_RUNTIME={runtime!r} is not one of "
                    f"{', '.join(sorted(chosen.runtimes))}"
                )
        env = get_environment(environment or self.settings.environment, self.settings.registry_dir)
        if not chosen.any_environment and env.name != HOST_ENVIRONMENT:
            raise ConfigError(
                f"environment {env.name!r} needs its own image, which backend {backend!r} "
                f"cannot use (it runs the host's {HOST_ENVIRONMENT}); use backend='docker'"
            )
        return PoolKey(backend, runtime, env.name)

    def _pool_targets(self) -> dict[PoolKey, int]:
        """Warm pool sizes: SANDBOX_POOL_SIZE for the defaults, SANDBOX_POOLS for the rest.

        Raises:
            ConfigError: a SANDBOX_POOLS key that names no backend, runtime or environment.
        """
        targets: dict[PoolKey, int] = {}
        if self.settings.pool_size > 0:
            targets[self._pool_key(self.settings.backend, None, None)] = self.settings.pool_size
        for text, size in self.settings.pools.items():
            head, _, environment = text.partition(":")
            backend, _, runtime = head.partition("+")
            if not 0 <= size <= MAX_POOL_SIZE:
                raise ConfigError(f"SANDBOX_POOLS[{text!r}]={size}: sizes go from 0 to 64")
            try:
                key = self._pool_key(backend, runtime or None, environment or None)
            except ConfigError as exc:
                raise ConfigError(f"SANDBOX_POOLS[{text!r}]: {exc.message}") from None
            if size:
                targets[key] = size
        return targets

    def _new_live(
        self,
        backend: Backend,
        key: PoolKey,
        limits: ResolvedLimits,
        network: bool,
        env: dict[str, str] | None,
        owner: str = "local",
    ) -> _Live:
        now = time.time()
        info = SandboxInfo(
            id="sb-" + secrets.token_hex(8),
            backend=key.backend,
            runtime=key.runtime,
            environment=key.environment,
            status=SandboxStatus.STARTING,
            owner=owner,
            limits=limits,
            network=network,
            created_at=now,
            last_active_at=now,
            expires_at=now + self.settings.ttl_s,
            idle_timeout_s=self.settings.idle_timeout_s,
        )
        spec = GuestSpec(
            info.id,
            limits,
            network,
            dict(env or {}),
            environment=key.environment,
            runtime=key.runtime,
        )
        return _Live(info=info, spec=spec, backend=backend)

    async def _boot(self, live: _Live) -> None:
        """Start the guest of a new sandbox; on failure remove every trace of it."""
        try:
            async with live.lock:
                await self._start_guest(live)
        except BaseException as exc:
            self._live.pop(live.info.id, None)
            with contextlib.suppress(Exception):
                await live.backend.stop(live.info.id)
            self._end(live.info, SandboxStatus.FAILED, "failed")
            self._emit(
                "backend_error", backend=live.info.backend, code=getattr(exc, "code", "error")
            )
            if isinstance(exc, SandboxError | asyncio.CancelledError):
                raise
            raise SandboxStartError(f"sandbox failed to start: {exc}") from exc

    # ------------------------------------------------------------------ warm pool

    def _take_pooled(
        self, key: PoolKey, limits: ResolvedLimits, network: bool, env: dict[str, str] | None
    ) -> _Live | None:
        """A pre-started sandbox, if the request is for exactly what a pool holds."""
        pool = self._pools.get(key)
        if pool is None or not pool.lives or env:
            return None
        if network != self.settings.network or limits != self.settings.resolve_limits(None):
            return None
        while pool.lives:
            live = pool.lives.pop(0)
            pool.wanted.set()
            if live.conn is not None and live.conn.alive:
                return live
            asyncio.create_task(self._discard_pooled(live))  # noqa: RUF006 - fire and forget
        return None

    async def _discard_pooled(self, live: _Live) -> None:
        if live.conn is not None:
            await live.conn.close()
        with contextlib.suppress(Exception):
            await live.backend.stop(live.info.id)

    async def _fill_pool(self, key: PoolKey, pool: _Pool) -> None:
        """Keep ``pool.size`` sandboxes of ``key`` started, never more (also after a crash: the
        start-up sweep removed the previous run's, so the count starts from zero)."""
        backend = self._backend(key.backend)
        limits = self.settings.resolve_limits(None)
        while True:
            await pool.wanted.wait()
            pool.wanted.clear()
            while len(pool.lives) < pool.size:
                live = self._new_live(backend, key, limits, self.settings.network, None, "__pool__")
                try:
                    await self._boot(live)
                except SandboxError as exc:
                    log.warning(
                        "warm pool refill failed; retrying", pool=str(key), error=exc.message
                    )
                    await asyncio.sleep(POOL_RETRY_S)
                    continue
                pool.lives.append(live)

    async def _start_guest(self, live: _Live) -> GuestConnection:
        guest = await live.backend.start(live.spec)
        conn = GuestConnection(guest.reader, guest.writer)
        try:
            await conn.wait_ready(READY_TIMEOUT_S)
        except (GuestError, TimeoutError) as exc:
            guest.kill()
            await guest.wait()
            detail = guest.stderr_tail() or str(exc)
            raise SandboxStartError(f"the sandbox's guest did not start: {detail}") from exc
        live.conn = conn
        live.counters = await live.backend.usage(live.info.id, full=False)
        return conn

    def _check_quota(self, owner: str, memory_mb: int, quota: Quota) -> None:
        # No await between this check and registering the sandbox: concurrent creates of one
        # owner cannot both slip under the quota.
        mine = [live.info for live in self._live.values() if live.info.owner == owner]
        if len(mine) >= quota.max_sandboxes:
            raise QuotaExceeded(
                f"{owner!r} has {len(mine)} live sandboxes, its quota is {quota.max_sandboxes}; "
                "destroy one, or raise TENANT_MAX_SANDBOXES"
            )
        used_mb = sum(info.limits.memory_mb for info in mine)
        if used_mb + memory_mb > quota.max_memory_mb:
            raise QuotaExceeded(
                f"{owner!r} uses {used_mb} MiB in live sandboxes; {memory_mb} MiB more is over "
                f"its quota of {quota.max_memory_mb} MiB; use a smaller memory_mb, destroy a "
                "sandbox, or raise TENANT_MAX_MEMORY_MB"
            )

    async def get(self, sandbox_id: str, *, owner: str | None = None) -> SandboxInfo:
        """A live or ended sandbox's record.

        Raises:
            SandboxNotFound: no such sandbox, or it belongs to another owner.
        """
        live = self._live.get(sandbox_id)
        info = live.info if live else self._store.get(sandbox_id)
        if info is None or (owner is not None and info.owner != owner):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return info.model_copy()

    async def list(
        self, *, owner: str | None = None, include_ended: bool = False
    ) -> builtins.list[SandboxInfo]:
        if include_ended:
            return self._store.list(owner=owner)
        return [
            live.info.model_copy()
            for live in self._live.values()
            if owner is None or live.info.owner == owner
        ]

    async def destroy(
        self, sandbox_id: str, *, owner: str | None = None, reason: str = "user"
    ) -> SandboxInfo:
        """Kill the sandbox, keep its artifacts, remove everything else (idempotent).

        Raises:
            SandboxNotFound: no such sandbox, or it belongs to another owner.
        """
        live = self._live.get(sandbox_id)
        if live is None:
            return await self.get(sandbox_id, owner=owner)
        if owner is not None and live.info.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if live.destroying:
            async with live.lock:  # another destroy is under way: wait for it to finish
                return live.info.model_copy()
        # Still in _live (so still counted against its owner's quota) until really gone.
        live.destroying = True
        try:
            async with live.lock:
                try:
                    await asyncio.wait_for(self._export_artifacts(live), ARTIFACT_EXPORT_TIMEOUT_S)
                except (SandboxError, OSError, TimeoutError) as exc:
                    log.warning("artifacts not kept", sandbox=sandbox_id, error=repr(exc))
                if live.conn is not None:
                    await live.conn.close()
                await live.backend.stop(sandbox_id)
        finally:
            self._live.pop(sandbox_id, None)
        self._end(live.info, SandboxStatus.DESTROYED, reason)
        self._emit("destroyed", info=live.info)
        log.info("sandbox destroyed", sandbox=sandbox_id, reason=reason)
        return live.info.model_copy()

    def _end(self, info: SandboxInfo, status: SandboxStatus, reason: str) -> None:
        info.status = status
        info.ended_at = time.time()
        info.end_reason = reason
        self._store.save(info)

    async def extend(
        self, sandbox_id: str, ttl_s: float, *, owner: str | None = None
    ) -> SandboxInfo:
        """Set the sandbox to expire ``ttl_s`` seconds from now."""
        if ttl_s <= 0:
            raise ConfigError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        live = self._get_live(sandbox_id, owner)
        live.info.expires_at = time.time() + ttl_s
        self._store.save(live.info)
        return live.info.model_copy()

    async def usage(self, sandbox_id: str, *, owner: str | None = None) -> ResourceUsage:
        live = self._get_live(sandbox_id, owner)
        return await live.backend.usage(sandbox_id)

    # ------------------------------------------------------------------ execution

    async def run_code(
        self,
        sandbox_id: str,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        """Run Python in the sandbox's persistent interpreter (state survives between calls)."""
        live = self._get_live(sandbox_id, owner)
        return await self._exec(live, "exec_code", {"code": code}, timeout_s, on_stdout, on_stderr)

    async def run_command(
        self,
        sandbox_id: str,
        command: str,
        *,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        stdin: asyncio.Queue[bytes | None] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        """Run a bash command; cwd and exported env persist within the named ``session``.

        ``input`` is written to the command's stdin up front; with ``stdin``, each item put on
        the queue is sent while it runs, and ``None`` closes its stdin.
        """
        live = self._get_live(sandbox_id, owner)
        payload: dict[str, Any] = {"command": command, "session": session, "env": env or {}}
        if cwd is not None:
            payload["cwd"] = cwd
        if input is not None:
            payload["input"] = input
        if stdin is not None:
            payload["stdin"] = True
        return await self._exec(
            live, "exec_shell", payload, timeout_s, on_stdout, on_stderr, stdin=stdin
        )

    async def _exec(
        self,
        live: _Live,
        op: str,
        payload: dict[str, Any],
        timeout_s: float | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        stdin: asyncio.Queue[bytes | None] | None = None,
    ) -> ExecResult:
        limits = live.info.limits
        timeout = limits.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout}")
        live.active_calls += 1
        self._touch(live)
        started = time.monotonic()
        try:
            conn, restarted = await self._connection(live)
            before = live.counters
            call_id = conn.new_id()
            request = {
                **payload,
                "timeout_s": timeout,
                "output_limit": limits.output_limit_bytes,
                "output_file_limit": limits.output_file_limit_mb * 1024 * 1024,
                # Full outputs are spilled to the sandbox's own disk: a quarter of it at most.
                "output_spill_limit": _disk_bytes(live) // 4,
            }
            feeder = (
                asyncio.create_task(_feed_stdin(conn, call_id, stdin))
                if stdin is not None
                else None
            )
            try:
                raw = await asyncio.wait_for(
                    conn.request(
                        op, request, on_stdout=on_stdout, on_stderr=on_stderr, call_id=call_id
                    ),
                    timeout + BACKSTOP_S,
                )
            except PidsExhausted:
                # Left-over processes hold every slot; only a fresh guest frees them.
                raw = {"exit_code": 137, "kill_reason": "pids", "state_lost": True}
                await self._drop_guest(live)
            except GuestDied:
                raw = {"exit_code": 137, "kill_reason": "killed", "state_lost": True}
                await self._drop_guest(live)
            except TimeoutError:
                log.warning("guest hung past its timeout; restarting it", sandbox=live.info.id)
                raw = {"exit_code": 137, "kill_reason": "timeout", "state_lost": True}
                await self._drop_guest(live)
            except asyncio.CancelledError:
                await conn.notify("cancel", {"target": call_id})
                raise
            finally:
                if feeder is not None:
                    feeder.cancel()
            after = live.counters = await live.backend.usage(live.info.id, full=False)
            try:
                result = ExecResult.model_validate(
                    {k: v for k, v in raw.items() if k in RESULT_FIELDS}
                )
            except ValidationError as exc:
                # The guest shares a uid with sandboxed code: a malformed reply is its failure
                # (502), never ours (500).
                await self._drop_guest(live)
                raise GuestError(f"the sandbox's guest sent an invalid result: {exc}") from exc
            if not result.duration_ms:
                result.duration_ms = (time.monotonic() - started) * 1000
            tasks = raw.get("tasks")
            await self._classify(
                live, result, before, after, tasks if isinstance(tasks, int) else 0
            )
            if restarted:
                result.state_lost = True
            self._emit("exec", info=live.info, op=op, result=result)
            return result
        finally:
            live.active_calls -= 1
            self._touch(live)

    async def _classify(
        self,
        live: _Live,
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
        limits = live.info.limits
        oom = after.oom_kills > before.oom_kills
        tasks_full = guest_tasks >= SATURATED * limits.pids
        pids_hit = after.pids_limit_hits > before.pids_limit_hits or tasks_full
        if not (oom or pids_hit):
            return
        usage = await live.backend.usage(live.info.id)
        # Still at the limit after the call: background processes (a fork bomb whose first
        # shell exited 0, files filling memory) hold it, and every next call would fail.
        saturated = (
            oom and (usage.memory_bytes or 0) >= SATURATED * limits.memory_mb * 1024 * 1024
        ) or (pids_hit and (tasks_full or (usage.pids or 0) >= SATURATED * limits.pids))
        if oom and (failed or saturated):
            result.kill_reason = "memory"
        elif pids_hit and (failed or saturated):
            result.kill_reason = "pids"
        if saturated:
            await self._drop_guest(live)
            result.state_lost = True

    async def _connection(self, live: _Live) -> tuple[GuestConnection, bool]:
        """The live guest connection, restarting a dead guest (workspace kept)."""
        if live.conn is not None and live.conn.alive:
            return live.conn, False
        async with live.lock:
            if live.conn is not None and live.conn.alive:
                return live.conn, False
            if live.info.id not in self._live or live.destroying:
                raise SandboxNotRunning(f"sandbox {live.info.id} was destroyed")
            # A dead connection still attached means the guest died between calls and no
            # result has told the caller yet; _drop_guest detaches it once a result has.
            lost_unreported = live.conn is not None
            log.info("restarting guest", sandbox=live.info.id)
            conn = await self._start_guest(live)
            return conn, lost_unreported

    async def _drop_guest(self, live: _Live) -> None:
        """Forget the guest after a call already reported the loss of its state."""
        if live.conn is not None:
            await live.conn.close()
            live.conn = None

    # ------------------------------------------------------------------ files

    async def _file_op(
        self, sandbox_id: str, owner: str | None, op: str, **payload: Any
    ) -> dict[str, Any]:
        live = self._get_live(sandbox_id, owner)
        self._touch(live)
        conn, _ = await self._connection(live)
        try:
            return await conn.request(op, payload)
        except PidsExhausted:
            # A fork bomb in the background: a fresh guest (its processes killed) can serve.
            await self._drop_guest(live)
            conn, _ = await self._connection(live)
            return await conn.request(op, payload)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        owner: str | None = None,
    ) -> int:
        """Write ``data`` to ``path`` (relative to /workspace); returns the size written."""
        chunks = [data[i : i + FILE_CHUNK_BYTES] for i in range(0, len(data), FILE_CHUNK_BYTES)]
        return await self.write_file_chunks(
            sandbox_id, path, _aiter(chunks or [b""]), mode=mode, owner=owner
        )

    async def write_file_chunks(
        self,
        sandbox_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        max_bytes: int | None = None,
        owner: str | None = None,
    ) -> int:
        """Stream chunks into a file; past ``max_bytes`` the partial file is removed.

        Raises:
            RequestTooLarge: more than ``max_bytes`` arrived.
        """
        written = 0
        size = 0
        first = True
        async for chunk in _rechunk(chunks, FILE_CHUNK_BYTES):
            written += len(chunk)
            if max_bytes is not None and written > max_bytes:
                with contextlib.suppress(SandboxError):
                    await self.remove_file(sandbox_id, path, owner=owner)
                raise RequestTooLarge(
                    f"upload is over {max_bytes} bytes; raise API_MAX_UPLOAD_MB to allow more"
                )
            reply = await self._file_op(
                sandbox_id,
                owner,
                "file_write",
                path=path,
                append=not first,
                mode=mode,
                data=_b64(chunk),
            )
            size = int(reply["size_bytes"])
            first = False
        return size

    async def read_file_chunks(
        self, sandbox_id: str, path: str, *, owner: str | None = None
    ) -> AsyncIterator[bytes]:
        """Stream a file out of the sandbox in chunks of at most 1 MiB."""
        live = self._get_live(sandbox_id, owner)
        self._touch(live)
        conn, _ = await self._connection(live)
        async for chunk in _read_chunks(conn, path, _disk_bytes(live)):
            yield chunk

    async def read_file(self, sandbox_id: str, path: str, *, owner: str | None = None) -> bytes:
        return b"".join([c async for c in self.read_file_chunks(sandbox_id, path, owner=owner)])

    async def list_files(
        self, sandbox_id: str, path: str = ".", *, depth: int = 1, owner: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        reply = await self._file_op(sandbox_id, owner, "file_list", path=path, depth=depth)
        entries: list[dict[str, Any]] = reply["entries"]
        return entries

    async def stat_file(
        self, sandbox_id: str, path: str, *, owner: str | None = None
    ) -> dict[str, Any]:
        return await self._file_op(sandbox_id, owner, "file_stat", path=path)

    async def remove_file(
        self, sandbox_id: str, path: str, *, recursive: bool = False, owner: str | None = None
    ) -> None:
        await self._file_op(sandbox_id, owner, "file_remove", path=path, recursive=recursive)

    async def make_dir(self, sandbox_id: str, path: str, *, owner: str | None = None) -> None:
        await self._file_op(sandbox_id, owner, "file_mkdir", path=path)

    # ------------------------------------------------------------------ artifacts

    def _artifact_root(self, sandbox_id: str) -> Path:
        return self.settings.data_dir / ARTIFACTS_DIR / sandbox_id

    async def _export_artifacts(self, live: _Live) -> None:
        """Copy /workspace/artifacts out through the guest, which only sees the sandbox's view.

        Paths come from inside the sandbox, so they are treated as hostile: each must be a plain
        relative path that stays below the artifact directory on the host.
        """
        if live.conn is None or not live.conn.alive:
            return
        try:
            entries = await live.conn.request("file_list", {"path": ARTIFACTS_DIR, "depth": 32})
        except (SandboxError, OSError):
            return  # no artifacts directory
        dest_root = self._artifact_root(live.info.id).resolve()
        budget = _disk_bytes(live)  # all artifacts together cannot exceed the sandbox's disk
        for entry in entries.get("entries", []):
            rel = PurePosixPath(str(entry.get("path", "")))
            if entry.get("type") != "file" or rel.is_absolute() or ".." in rel.parts:
                continue
            inner = PurePosixPath(*rel.parts[1:]) if rel.parts[:1] == (ARTIFACTS_DIR,) else rel
            target = (dest_root / inner).resolve()
            if not str(target).startswith(str(dest_root) + os.sep):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            size = 0
            with open(target, "wb") as out:
                async for data in _read_chunks(live.conn, str(rel), budget):
                    out.write(data)
                    digest.update(data)
                    size += len(data)
            budget -= size
            self._store.add_artifact(
                ArtifactInfo(
                    sandbox_id=live.info.id,
                    path=str(inner),
                    size_bytes=size,
                    sha256=digest.hexdigest(),
                    created_at=time.time(),
                )
            )

    async def list_artifacts(
        self, sandbox_id: str, *, owner: str | None = None
    ) -> builtins.list[ArtifactInfo]:
        await self.get(sandbox_id, owner=owner)
        return self._store.artifacts(sandbox_id)

    async def artifact_path(self, sandbox_id: str, path: str, *, owner: str | None = None) -> Path:
        """Host path of a kept artifact (for streaming it out).

        Raises:
            SandboxNotFound: no such sandbox.
            SandboxFileNotFound: it kept no such artifact.
        """
        known = {a.path for a in await self.list_artifacts(sandbox_id, owner=owner)}
        if path not in known:
            raise SandboxFileNotFound(f"sandbox {sandbox_id} kept no artifact {path!r}")
        return self._artifact_root(sandbox_id) / path

    async def delete_artifacts(self, sandbox_id: str, *, owner: str | None = None) -> int:
        await self.get(sandbox_id, owner=owner)
        count: int = self._store.delete_artifacts(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, self._artifact_root(sandbox_id), True)
        return count

    # ------------------------------------------------------------------ reaping

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")

    async def reap(self) -> builtins.list[str]:
        """Destroy sandboxes past their TTL or idle timeout; return their ids."""
        now = time.time()
        doomed: list[tuple[str, str]] = []
        for sandbox_id, live in list(self._live.items()):
            if live.destroying:
                continue
            if now >= live.info.expires_at:
                doomed.append((sandbox_id, "ttl"))
            elif (
                live.active_calls == 0
                and now - live.info.last_active_at >= live.info.idle_timeout_s
            ):
                doomed.append((sandbox_id, "idle"))
        for sandbox_id, reason in doomed:
            with contextlib.suppress(SandboxNotFound):
                await self.destroy(sandbox_id, reason=reason)
        for sandbox_id in self._store.sandboxes_with_artifacts_before(
            now - self.settings.artifact_retention_s
        ):
            await self.delete_artifacts(sandbox_id)
        return [sid for sid, _ in doomed]

    # ------------------------------------------------------------------ helpers

    def _require_started(self) -> None:
        if not self._started:
            raise SandboxNotRunning(
                "the SandboxManager is not started; use `async with` or start()"
            )

    def _get_live(self, sandbox_id: str, owner: str | None) -> _Live:
        self._require_started()
        live = self._live.get(sandbox_id)
        if live is None:
            info = self._store.get(sandbox_id)
            if info is None or (owner is not None and info.owner != owner):
                raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {info.status.value} ({info.end_reason}); create a new one"
            )
        if owner is not None and live.info.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if live.destroying:
            raise SandboxNotRunning(f"sandbox {sandbox_id} is being destroyed")
        return live

    @staticmethod
    def _touch(live: _Live) -> None:
        live.info.last_active_at = time.time()


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


def _disk_bytes(live: _Live) -> int:
    return live.info.limits.disk_mb * 1024 * 1024


async def _read_chunks(conn: GuestConnection, path: str, limit_bytes: int) -> AsyncIterator[bytes]:
    """Read a file through the guest, never trusting it to say when to stop.

    The guest shares a uid with sandboxed code, so a reply may lie: a "file" that never reaches
    eof would otherwise stream until the host's disk or memory is full.

    Raises:
        GuestError: the guest sent more bytes than the sandbox's disk can hold.
    """
    offset = 0
    while True:
        reply = await conn.request(
            "file_read", {"path": path, "offset": offset, "length": FILE_CHUNK_BYTES}
        )
        data = _unb64(reply["data"])
        offset += len(data)
        if offset > limit_bytes:
            raise GuestError(
                f"{path} grew past the sandbox's disk size ({limit_bytes} bytes) while read"
            )
        if data:
            yield data
        if reply["eof"] or not data:
            return


async def _aiter(items: builtins.list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def _rechunk(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Regroup a byte stream into pieces of at most ``size`` (at least one, maybe empty)."""
    buffer = bytearray()
    sent = False
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
            sent = True
    if buffer or not sent:
        yield bytes(buffer)


async def _feed_stdin(
    conn: GuestConnection, call_id: int, queue: asyncio.Queue[bytes | None]
) -> None:
    """Forward queued input to a running command; ``None`` closes its stdin."""
    while True:
        data = await queue.get()
        payload = {"target": call_id, "data": _b64(data or b""), "eof": data is None}
        try:
            await conn.request("stdin", payload)
        except SandboxError:
            return  # the command ended (or never took stdin): later input has nowhere to go
        if data is None:
            return
