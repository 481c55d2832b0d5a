"""SandboxManager: the lifecycle of sandboxes, whatever backend isolates them.

It owns what backends do not: ids, owners and quotas, TTL and idle reaping, the SQLite store
and crash recovery. Each verb takes one typed request (:mod:`sandlot.requests`) and hands the
work to the room that does it: :mod:`~sandlot.core.execution` (one run),
:mod:`~sandlot.core.pools`, and through the verbs' mixins (:mod:`~sandlot.core.creates`,
:mod:`~sandlot.core.job_verbs`, :mod:`~sandlot.core.file_verbs`,
:mod:`~sandlot.core.volume_verbs`, which find a sandbox with :mod:`~sandlot.core.lookup`)
:mod:`~sandlot.core.admission`, :mod:`~sandlot.core.background`, :mod:`~sandlot.core.files`,
:mod:`~sandlot.core.artifacts` and :mod:`~sandlot.core.volumes`; a
:class:`~sandlot.core.live.Live` owns its guest link.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from sandlot.backends import Backend, create_backend
from sandlot.config import Settings, get_settings
from sandlot.core import admission, execution, instances, placement, recovery
from sandlot.core.admission import HostCapacity
from sandlot.core.artifacts import EXPORT_TIMEOUT_S, Artifacts
from sandlot.core.background import BackgroundCommands
from sandlot.core.creates import CreateVerbs
from sandlot.core.file_verbs import FileVerbs
from sandlot.core.host_ledger import HostLedger
from sandlot.core.job_verbs import JobVerbs
from sandlot.core.live import Live
from sandlot.core.pools import Pools
from sandlot.core.store import LIVE, Store
from sandlot.core.teardown import Teardowns
from sandlot.errors import (
    BackendUnavailable,
    ConfigError,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
)
from sandlot.log import configure_logging
from sandlot.models import (
    ExecResult,
    OutputCallback,
    ResourceUsage,
    ResultCallback,
    SandboxInfo,
    SandboxStatus,
)
from sandlot.requests import (
    RunCode,
    RunCommand,
    SetTimeout,
)

log = structlog.get_logger(__name__)

# Destroys the reaper runs at once (reap()): each sandbox past its TTL or idle time is
# destroyed on its own, so one whose teardown is slow holds no other.
REAP_CONCURRENCY = 16

# Observers of what happens to sandboxes (metrics, audit): called as listener(event, fields).
Listener = Callable[[str, dict[str, Any]], None]


class SandboxManager(JobVerbs, FileVerbs, CreateVerbs):
    """Creates, runs, reaps and destroys sandboxes.

    Several managers (in one process or many) may share a data directory: each is its own
    instance there (:mod:`sandlot.core.instances`) and runs only the sandboxes it made; the
    store, artifacts, quotas and the host's capacity are the data directory's.
    Use as an async context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self._backends: dict[str, Backend] = {}
        self._live: dict[str, Live] = {}
        # "released": a destroyed sandbox's disk, cgroup and network are gone.
        self._teardowns = Teardowns(self._released)
        self._closing = False
        # Destroyed sandboxes whose record the store could not save (a full disk): saved
        # again when their teardown ends.
        self._unsaved: set[str] = set()
        self._exporting_mb = 0.0  # room on the disk held for artifacts being kept now
        self._recovery_capacity: HostCapacity | None = None  # the start's, before its own
        self._reaper: asyncio.Task[None] | None = None
        # The reaper's destroys under way, REAP_CONCURRENCY at once (reap()).
        self._reaping: dict[str, asyncio.Task[None]] = {}
        self._reap_slots = asyncio.Semaphore(REAP_CONCURRENCY)
        self._instance: instances.Instance | None = None
        self._store: Store = None  # type: ignore[assignment]  # set by start()
        self._artifacts: Artifacts = None  # type: ignore[assignment]  # set by start()
        self._pools: Pools | None = None
        self._dead_peers: recovery.DeadPeers | None = None
        self._ledger: HostLedger | None = None
        self._capacity: HostCapacity = None  # type: ignore[assignment]  # set by start()
        self._started = False
        self._listeners: list[Listener] = []
        self._background: dict[str, BackgroundCommands] = {}
        self._init_volumes()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, fields)`` on "created", "destroyed", "released" (its
        teardown ended: core/teardown.py), "exec", "backend_error", "command_ended" (a
        background command or terminal ended: core/job_verbs.py)."""
        self._listeners.append(listener)

    def _emit(self, event: str, **fields: Any) -> None:
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:
                log.exception("listener failed", event=event)

    # ------------------------------------------------------------------ the manager itself

    async def __aenter__(self) -> SandboxManager:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Claim an instance of the data dir, recover the instances of processes that died,
        start the reaper and pools.

        Raises:
            ConfigError: a sandlot from before instances uses this data directory, or a pool
                setting is bad.
        """
        if self._started:
            return
        if not structlog.is_configured():
            # A library must not print to stdout: send our logs to stderr unless the app
            # configured structlog itself.
            configure_logging(self.settings.log_level, self.settings.log_format)
        data_dir = self.settings.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self._instance = instances.claim(data_dir)
        try:
            self._store = Store(data_dir / "sandlot.db", self._instance.id)
        except BaseException:
            self._instance.release(remove=True)
            raise
        self._artifacts = Artifacts(data_dir, self._store)
        # Where root's /run/sandlot cannot be kept (rootless), one in the data directory
        # still has its managers count each other's pools.
        self._ledger = HostLedger.open(
            self.settings.host_ledger_dir, data_dir, self._instance.id
        ) or HostLedger.open(data_dir / "host-ledger", data_dir, self._instance.id)
        self._started = True
        self._closing = False
        try:
            targets = placement.pool_targets(self.settings, self._backend)
            pools = Pools(
                self.settings.resolve_limits(None),
                self.settings.network,
                self._new_pooled,
                self._boot,
            )
        except ConfigError:
            await self.close()
            raise
        try:
            await self._recover(extra_backends={key.backend for key in targets})
        except BaseException:
            # The instance claimed and the store opened are given back: each failed start
            # left one more dead instance behind (red team, 2026-12-06).
            await self.close()
            raise
        # Before measuring: the soft limit (often 1024) would cap us at ~200 sandboxes.
        admission.raise_nofile_limit()
        # Measured after the sweep: nothing of ours holds the host's memory or disk now.
        self._capacity = HostCapacity.measure(self.settings, self._volumes.written_mb())
        self._dead_peers = recovery.DeadPeers(
            functools.partial(self._recover, set()), data_dir, self._instance.id
        )
        self._reaper = asyncio.create_task(self._reap_forever())
        self._pools = pools
        pools.start(targets)

    async def _recover(self, extra_backends: set[str]) -> None:
        assert self._instance is not None
        orphans = await recovery.recover(
            self._store,
            self._artifacts,
            self.settings,
            self._instance.id,
            extra_backends | {self.settings.backend},
            self._disk_for_artifacts,
        )
        for info in orphans:
            self._end(info, SandboxStatus.DESTROYED, "recovered")

    async def close(self) -> None:
        """Destroy every live sandbox, remove this instance from the data directory."""
        if not self._started:
            return
        self._closing = True  # a create waiting for room gives up instead
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*self._reaping.values(), return_exceptions=True)
        if self._dead_peers is not None:
            await self._dead_peers.settle()
        if self._pools is not None:
            await self._pools.close()
            self._pools = None
        await asyncio.gather(
            *(self.destroy(sid, reason="shutdown") for sid in list(self._live)),
            return_exceptions=True,
        )
        await self._teardowns.settle()
        # Whatever a failed destroy left is swept now; if some of it stays, so does the
        # instance's directory, and the next start recovers it. A backend this host cannot
        # run made nothing to sweep.
        swept = True
        for backend in self._backends.values():
            try:
                with contextlib.suppress(BackendUnavailable):
                    await backend.sweep(keep=())
                await backend.close()
            except Exception as exc:
                log.warning("instance not swept at close", backend=backend.name, error=repr(exc))
                swept = False
        self._store.close()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        if self._instance is not None:
            self._instance.release(remove=swept)
        self._started = False

    def _live_infos(
        self, elsewhere: builtins.list[SandboxInfo] | None = None
    ) -> builtins.list[SandboxInfo]:
        # Other processes' live sandboxes count too: quotas and capacity are the data dir's.
        # Ours being torn down still hold their limits (core/teardown.py).
        mine = [live.info for live in self._live.values()] + self._teardowns.infos()
        if elsewhere is None:
            elsewhere = instances.live_elsewhere(self._store, self.settings.data_dir)
        return mine + elsewhere

    @property
    def instance_dir(self) -> Path:
        """This manager's directory in the data directory: its backends' state."""
        if self._instance is None:
            raise SandboxNotRunning("the SandboxManager is not started")
        return self._instance.dir

    def live_count(self) -> int:
        return len(self._live)

    async def settle(self, sandbox_id: str | None = None) -> None:
        """Wait until the sandbox (by default: every sandbox destroyed so far) has released
        what it held: its disk, cgroup and network go after its destroy returns
        (:mod:`sandlot.core.teardown`)."""
        if sandbox_id is None:
            await self._teardowns.settle()
        else:
            await self._teardowns.wait(sandbox_id)

    def tearing_down(self) -> builtins.list[SandboxInfo]:
        """Sandboxes destroyed whose disk, cgroup and network are still being released: they
        hold their limits until then (what a node reports as its load counts them)."""
        return self._teardowns.infos()

    def pooled_count(self) -> int:
        """Started sandboxes waiting in the warm pools."""
        return self._pools.count() if self._pools is not None else 0

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            assert self._instance is not None
            # Noted before it makes anything: what a recovery of this instance sweeps.
            self._instance.note_backend(name, self.settings)
            self._backends[name] = create_backend(name, self._instance.settings(self.settings))
        return self._backends[name]

    # ------------------------------------------------------------------ records and ending

    async def list(
        self,
        *,
        owner: str | None = None,
        include_ended: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> builtins.list[SandboxInfo]:
        """Sandboxes, oldest first: the live ones, or every kept record; ``limit`` of them
        from the ``offset``-th (None: all)."""
        if include_ended:
            # Off the event loop: a tenant may keep many ended records (each up to its
            # metadata cap), and reading them held the loop (red team, 2026-12-06).
            return await asyncio.to_thread(
                self._store.list, owner=owner, limit=limit, offset=offset
            )
        found = [
            live.info.model_copy()
            for live in self._live.values()
            if owner is None or live.info.owner == owner
        ]
        return found[offset : None if limit is None else offset + limit]

    async def destroy(
        self, sandbox_id: str, *, owner: str | None = None, reason: str = "user"
    ) -> SandboxInfo:
        """Kill the sandbox, keep its artifacts, remove everything else (idempotent).

        Raises:
            SandboxNotFound: no such sandbox, or it belongs to another owner.
        """
        live = self._live.get(sandbox_id)
        if live is None:
            info = await self.get(sandbox_id, owner=owner)
            if info.status.value in LIVE:
                raise instances.not_here(self._store, self.settings.data_dir, sandbox_id)
            return info
        if owner is not None and live.info.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if live.destroying:
            async with live.lock:  # another destroy is under way: wait for it to finish
                return live.info.model_copy()
        # Still counted against its owner's quota until really gone: in _live until halted,
        # then among the teardowns.
        live.begin_destroy()
        try:
            background = self._background.pop(sandbox_id, None)
            if background is not None:
                await background.close()
            async with live.lock:
                try:
                    async with asyncio.timeout(EXPORT_TIMEOUT_S):
                        await self._artifacts.export(live, self._disk_for_artifacts)
                except (SandboxError, OSError, TimeoutError) as exc:
                    log.warning("artifacts not kept", sandbox=sandbox_id, error=repr(exc))
                if live.conn is not None:
                    await live.conn.close()
                await live.backend.halt(sandbox_id)
            # Nothing of it runs: its volumes may be taken again at once (an attach waits
            # for the kernel to drop the last mount: backends/volumes.py).
            self._release_lease(sandbox_id)
        finally:
            self._live.pop(sandbox_id, None)
            # Its disk, cgroup and network go after we return (a destroy cut short by a
            # cancellation too: the stop kills whatever still runs), and its record says so
            # either way: left "running", other processes counted it for good.
            self._teardowns.start(live)
            try:
                self._end(live.info, SandboxStatus.DESTROYED, reason, held=True)
            except sqlite3.Error as exc:
                # A full disk (a red team filled it, 2026-12-07) must not turn the destroy
                # that frees it into an error: the sandbox is halted and its teardown, which
                # removes its disk, is under way; the record is saved when that ends.
                log.warning("destroy not recorded yet", sandbox=sandbox_id, error=repr(exc))
                self._unsaved.add(sandbox_id)
        self._emit("destroyed", info=live.info)
        log.info("sandbox destroyed", sandbox=sandbox_id, reason=reason)
        return live.info.model_copy()

    def _end(
        self, info: SandboxInfo, status: SandboxStatus, reason: str, *, held: bool = False
    ) -> None:
        info.status = status
        info.ended_at = time.time()
        info.end_reason = reason
        self._store.save(info, held=held)

    def _released(self, info: SandboxInfo) -> None:
        """Its teardown has ended (done or failed: a failed one's leftovers are the sweep's)."""
        self._release_lease(info.id)
        try:
            if info.id in self._unsaved:
                self._store.save(info)  # its destroy's record, once its disk is free
                self._unsaved.discard(info.id)
            self._store.release(info.id)
        except sqlite3.Error as exc:  # the others count it until this instance is gone
            log.warning("teardown's release not recorded", sandbox=info.id, error=repr(exc))
        if self._ledger is not None:
            with self._ledger.turn():  # its room is the host's again, for every data dir
                self._publish()
        self._emit("released", info=info)

    async def extend(
        self, sandbox_id: str, request: SetTimeout, *, owner: str | None = None
    ) -> SandboxInfo:
        """Set the sandbox to expire ``request.ttl_s`` seconds from now."""
        live = self._get_live(sandbox_id, owner)
        live.info.expires_at = time.time() + request.ttl_s
        self._store.save(live.info)
        return live.info.model_copy()

    async def usage(self, sandbox_id: str, *, owner: str | None = None) -> ResourceUsage:
        live = self._get_live(sandbox_id, owner)
        return await live.backend.usage(sandbox_id)

    # ------------------------------------------------------------------ running

    async def run_code(
        self,
        sandbox_id: str,
        request: RunCode,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        """Run Python in the sandbox's persistent interpreter (state survives between calls);
        ``on_result`` receives each rich output (a display, a figure) as it is shown."""
        live = self._get_live(sandbox_id, owner)
        op, payload = execution.code_payload(request)
        result = await execution.execute(
            live, op, payload, request.timeout_s, on_stdout, on_stderr, on_result=on_result
        )
        self._emit("exec", info=live.info, op=op.value, result=result)
        return result

    async def run_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        stdin: asyncio.Queue[bytes | None] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        owner: str | None = None,
    ) -> ExecResult:
        """Run a bash command; cwd and exported env persist within the request's ``session``.

        ``request.input`` is written to the command's stdin up front; with ``stdin``, each
        item put on the queue is sent while it runs, and ``None`` closes its stdin.

        Raises:
            ConfigError: ``request.background`` is set: that is :meth:`start_command`'s (a
                surface that has no background mode must not run it in the foreground).
        """
        if request.background:
            raise ConfigError(
                "background=True starts a command with start_command (REST: POST "
                ".../commands; SDK: commands.run(background=True)); this call runs it in "
                "the foreground: leave background out"
            )
        live = self._get_live(sandbox_id, owner)
        op, payload = execution.command_payload(request, streams_stdin=stdin is not None)
        result = await execution.execute(
            live, op, payload, request.timeout_s, on_stdout, on_stderr, stdin=stdin
        )
        self._emit("exec", info=live.info, op=op.value, result=result)
        return result

    # ------------------------------------------------------------------ reaping

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")

    async def reap(self) -> builtins.list[str]:
        """Start destroying the sandboxes past their TTL or idle timeout; return their ids.
        Their destroys go on in tasks of their own (``_reaping``)."""
        now = time.time()
        doomed: list[tuple[str, str]] = []
        for sandbox_id, live in list(self._live.items()):
            if live.destroying:
                continue
            if sandbox_id in self._reaping:
                continue  # its destroy is on its way
            if now >= live.info.expires_at:
                doomed.append((sandbox_id, "ttl"))
            elif (
                live.active_calls == 0
                and now - live.info.last_active_at >= live.info.idle_timeout_s
            ):
                doomed.append((sandbox_id, "idle"))
        for sandbox_id, reason in doomed:
            # Each on its own, not one after another: a sandbox whose artifacts take their
            # export's whole timeout held every other tenant's expiry for it (61 s past a
            # 2 s TTL: red team, 2026-12-06), and a pass that waited for them held the next.
            task = asyncio.create_task(self._reap_one(sandbox_id, reason))
            self._reaping[sandbox_id] = task
            task.add_done_callback(functools.partial(self._reaped, sandbox_id))
        if self._dead_peers is not None:
            self._dead_peers.look()
        if self._ledger is not None:
            # What ended without a teardown since (a failed start, a pooled sandbox
            # discarded): its room is the host's again.
            with self._ledger.turn():
                self._publish()
        await self._artifacts.delete_older_than(now - self.settings.artifact_retention_s)
        # The records cap counts those that keep artifacts: theirs go first, then the records.
        await self._artifacts.delete_beyond(self.settings.max_ended_records)
        # Off the event loop (each reads an index, and deletes what it finds).
        await asyncio.to_thread(
            self._store.forget_ended_before, now - self.settings.record_retention_s
        )
        await asyncio.to_thread(self._store.forget_beyond, self.settings.max_ended_records)
        return [sid for sid, _ in doomed]

    def _reaped(self, sandbox_id: str, _task: asyncio.Task[None]) -> None:
        self._reaping.pop(sandbox_id, None)

    async def _reap_one(self, sandbox_id: str, reason: str) -> None:
        async with self._reap_slots:
            try:
                await self.destroy(sandbox_id, reason=reason)
            except (SandboxNotFound, SandboxNotRunning):
                pass  # destroyed meanwhile
            except Exception:
                log.exception("reaper could not destroy a sandbox", sandbox=sandbox_id)
