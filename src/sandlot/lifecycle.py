"""Seed 001's integration point for agent developers (its ``orchestrator.lifecycle``)::

    from sandlot.lifecycle import Lifecycle

    lifecycle = Lifecycle(storage_path="./storage", runtime_path="./sandbox_runtime")
    session = lifecycle.start(
        agent_config={"type": "code_executor"}, environment="Python3", provider="e2b"
    )
    result = lifecycle.sandbox_mgr.execute_code(
        session_id=session["session_id"], code="print('Hello World')"
    )
    lifecycle.stop(session["session_id"], session["sandbox_id"])

A session is one sandbox plus its record. The records are the seed's "state persistence (JSON
files)", under ``storage_path``:

- ``sessions/<session id>.json``: what was asked (agent, environment, provider), where it ran
  (the backend), its status (``running``, ``stopped``, ``lost``) and its artifacts;
- ``logs/<session id>.jsonl``: one line per execution (code, stdout, stderr, error);
- ``artifacts/<session id>/``: what the session's code left in ``/workspace/artifacts``,
  copied there when the session stops (it is also kept by the runtime, as for any sandbox).

``runtime_path`` is the embedded runtime's data directory (sandboxes, disks, its SQLite
store); without one, the process's default runtime (``SANDLOT_DATA_DIR``), or a server's with
``api_url``. sandlot runs no E2B: a session asked of ``"e2b"`` runs on the default backend
(``"docker"``, ``"bubblewrap"`` and ``"unsafe-local"`` run where they say), and its record
says which backend that was; ``e2b_api_key`` is accepted for the seed's signature and unused.
An ``agent_config`` whose ``type`` names a registry agent (``sandlot`` ships
``code_executor``) gives the session that agent's sandbox (environment, memory, timeout);
agents themselves run outside, as the seed has it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from sandlot._portal import get_portal
from sandlot.agent.agents import get_agent
from sandlot.backends import KNOWN_BACKENDS
from sandlot.config import get_settings
from sandlot.core import SandboxManager
from sandlot.errors import (
    ConfigError,
    InvalidRequest,
    SandboxError,
    SandboxFileError,
    SandboxNotFound,
    SandboxNotRunning,
)
from sandlot.models import FileInfo, Listing, SessionCodeResponse
from sandlot.sandbox import Sandbox

log = structlog.get_logger(__name__)

SESSION_ID_PREFIX = "ses-"
# What an execution's log line keeps of each text: the log is a record, not the output store
# (a run's whole stdout is in its result, and a large one in the sandbox's file).
LOG_FIELD_MAX_CHARS = 65_536
# The providers seed 001 names that sandlot does not run: served by the default backend.
FOREIGN_PROVIDERS = ("e2b",)

SessionStatus = Literal["running", "stopped", "lost"]


class SessionRecord(BaseModel):
    """One session's JSON state (``sessions/<session id>.json``)."""

    model_config = ConfigDict(extra="ignore")

    session_id: str
    sandbox_id: str
    provider: str = Field(description="What was asked: 'e2b', 'docker', ...")
    backend: str = Field(description="Where it ran.")
    environment: str | None = None
    agent_config: dict[str, Any] = Field(default_factory=dict)
    status: SessionStatus = "running"
    created_at: datetime
    stopped_at: datetime | None = None
    executions: int = 0
    artifacts: list[str] = Field(
        default_factory=list, description="Paths below storage's artifacts/<session id>/."
    )


def _valid_session_id(session_id: str) -> str:
    hex_part = session_id.removeprefix(SESSION_ID_PREFIX)
    if (
        not session_id.startswith(SESSION_ID_PREFIX)
        or len(hex_part) != 32
        or any(c not in "0123456789abcdef" for c in hex_part)
    ):
        # Also what keeps a session id from naming a file outside sessions/ ("../x").
        raise InvalidRequest(f"{session_id!r} is not a session id (ses- and 32 hex digits)")
    return session_id


class StateManager:
    """The sessions' JSON records under one directory: each written whole (a new file
    renamed over the old), so a reader never sees half of one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _path(self, session_id: str) -> Path:
        return self.directory / f"{_valid_session_id(session_id)}.json"

    def save(self, record: SessionRecord) -> None:
        path = self._path(record.session_id)
        staged = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        staged.write_text(record.model_dump_json(indent=2))
        staged.replace(path)

    def load(self, session_id: str) -> SessionRecord:
        """Raises SandboxNotFound: no session has that id here."""
        try:
            text = self._path(session_id).read_text()
        except FileNotFoundError:
            raise SandboxNotFound(f"session {session_id} not found") from None
        return SessionRecord.model_validate_json(text)

    def list(self) -> list[SessionRecord]:
        """Every recorded session, oldest first."""
        records = []
        for path in self.directory.glob(f"{SESSION_ID_PREFIX}*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                records.append(SessionRecord.model_validate_json(path.read_text()))
        return sorted(records, key=lambda r: r.created_at)


class UnifiedSandboxManager:
    """Seed 001's sandbox manager: a session's sandbox, started, used and stopped by the
    session's id. Reached as ``Lifecycle.sandbox_mgr``."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    def start_sandbox(
        self, session_id: str, environment: str | None = None, provider: str = "e2b"
    ) -> str:
        """Start a session of this id (one not started before): its sandbox's id."""
        record = self._lifecycle._begin(session_id, environment, provider, {})
        return record.sandbox_id

    def stop_sandbox(self, sandbox_id: str) -> None:
        """Stop the session whose sandbox this is (see :meth:`Lifecycle.stop`)."""
        self._lifecycle.stop(self._lifecycle._session_of(sandbox_id))

    def execute_code(
        self, session_id: str, code: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Run Python in the session (state persists between calls): ``stdout``, ``stderr``,
        ``results``, ``error`` and ``artifacts`` (the files in ``/workspace/artifacts``), as
        seed 001's ``POST /api/e2b/execute`` answers. Code that fails is a result."""
        sandbox = self._lifecycle._sandbox(session_id)
        result = sandbox.run_code(code, timeout_s=timeout_s)
        artifacts = Listing()
        # The code may have made no artifacts directory, or a file at its name: its output
        # is still the answer.
        with contextlib.suppress(SandboxFileError):
            artifacts = sandbox.files.list("artifacts", depth=8)
        answer = SessionCodeResponse.of(result, artifacts)
        self._lifecycle._logged(session_id, code, answer)
        return answer.model_dump()

    def list_files(self, session_id: str, path: str = ".") -> list[dict[str, Any]]:
        """The entries at ``path`` in the session's ``/workspace``."""
        found: list[FileInfo] = self._lifecycle._sandbox(session_id).files.list(path)
        return [entry.model_dump() for entry in found]

    def write_file(self, session_id: str, path: str, content: str | bytes) -> int:
        """Write ``content`` at ``path`` in the session's ``/workspace``: bytes written."""
        written: int = self._lifecycle._sandbox(session_id).files.write(path, content)
        return written

    def read_file(self, session_id: str, path: str) -> str:
        """The text of ``path`` in the session's ``/workspace``."""
        text: str = self._lifecycle._sandbox(session_id).files.read(path)
        return text


class Lifecycle:
    """Sessions, each a sandbox with a JSON record: :meth:`start`, ``sandbox_mgr`` to use
    them, :meth:`stop`. Use as a context manager to stop what is left at the end.

    Raises (at construction):
        ConfigError: ``runtime_path`` and ``api_url`` together, or with ``manager``.
    """

    def __init__(
        self,
        storage_path: str | os.PathLike[str] = "./storage",
        runtime_path: str | os.PathLike[str] | None = None,
        e2b_api_key: str | None = None,
        *,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if runtime_path is not None and (manager is not None or api_url):
            raise ConfigError("runtime_path is the embedded runtime's: not with manager or api_url")
        del e2b_api_key  # seed 001's signature; sandlot runs no E2B (the module's docstring)
        storage = Path(storage_path)
        self.state_mgr = StateManager(storage / "sessions")
        self._logs = storage / "logs"
        self._artifacts = storage / "artifacts"
        for directory in (self._logs, self._artifacts):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._own_manager: SandboxManager | None = None
        if runtime_path is not None:
            settings = get_settings().model_copy(update={"data_dir": Path(runtime_path)})
            manager = SandboxManager(settings)
            get_portal().call(manager.start())
            self._own_manager = manager
        self._manager = manager
        self._api_url = api_url
        self._api_key = api_key
        self._open: dict[str, Sandbox] = {}  # session id -> its sandbox, held here
        self._started: set[str] = set()  # the sessions started here (close() stops them)
        self._lock = threading.RLock()
        self.sandbox_mgr = UnifiedSandboxManager(self)

    # -- sessions ---------------------------------------------------------------------------

    def start(
        self,
        agent_config: dict[str, Any] | None = None,
        environment: str | None = None,
        provider: str = "e2b",
    ) -> dict[str, Any]:
        """Start a session: ``session_id``, ``sandbox_id``, ``provider`` (asked), ``backend``
        (where it runs), ``status`` and the rest of its record.

        Raises:
            InvalidRequest: an unknown provider or agent type (the message names the known).
            SandboxStartError, QuotaExceeded, BackendUnavailable: as ``Sandbox.create``.
        """
        session_id = SESSION_ID_PREFIX + uuid.uuid4().hex
        return self._begin(session_id, environment, provider, agent_config or {}).model_dump(
            mode="json"
        )

    def stop(self, session_id: str, sandbox_id: str | None = None) -> dict[str, Any]:
        """Stop a session: its sandbox destroyed, its artifacts copied to storage, its record
        ``stopped``. Stopping a stopped session does nothing more.

        Raises:
            SandboxNotFound: no session of that id here.
            InvalidRequest: ``sandbox_id`` is not the session's sandbox.
        """
        with self._lock:
            record = self.state_mgr.load(session_id)
            if sandbox_id is not None and sandbox_id != record.sandbox_id:
                raise InvalidRequest(
                    f"sandbox {sandbox_id} is not session {session_id}'s ({record.sandbox_id})"
                )
            held = self._open.get(session_id)
            # A sandbox held here is stopped whatever the record says (another Lifecycle may
            # have marked it lost: one whose key cannot see it).
            if held is None and record.status != "running":
                return record.model_dump(mode="json")
            sandbox = held or self._connect(record)
            if sandbox is not None:
                sandbox.kill()  # raises: still held here, for the next stop or close()
                record.artifacts = self._save_artifacts(session_id, sandbox) or record.artifacts
                record.status = "stopped"
            self._open.pop(session_id, None)
            self._started.discard(session_id)
            record.stopped_at = datetime.now(UTC)
            self.state_mgr.save(record)
            return record.model_dump(mode="json")

    def get(self, session_id: str) -> dict[str, Any]:
        """A session's record (``SandboxNotFound`` if there is none)."""
        return self.state_mgr.load(session_id).model_dump(mode="json")

    def sessions(self) -> list[dict[str, Any]]:
        """Every session recorded in this storage, oldest first."""
        return [record.model_dump(mode="json") for record in self.state_mgr.list()]

    def close(self) -> None:
        """Stop the sessions started here that are still running, let go of those carried on
        from elsewhere (they run on), and close the runtime this made (``runtime_path``)."""
        try:
            for session_id in list(self._open):
                try:
                    if session_id in self._started:
                        self.stop(session_id)
                    else:
                        self._open.pop(session_id).detach()
                except Exception as exc:
                    log.warning("session_stop_failed", session_id=session_id, error=repr(exc))
        finally:
            if self._own_manager is not None:
                manager, self._own_manager = self._own_manager, None
                get_portal().call(manager.close())

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- for the sandbox manager ------------------------------------------------------------

    def _begin(
        self,
        session_id: str,
        environment: str | None,
        provider: str,
        agent_config: dict[str, Any],
    ) -> SessionRecord:
        _valid_session_id(session_id)
        backend = _backend_for(provider)
        limits: dict[str, Any] = {}
        agent_type = agent_config.get("type")
        if agent_type is not None:
            preset = get_agent(str(agent_type)).sandbox
            limits = {"memory_mb": preset.memory_mb, "timeout_s": preset.timeout_s}
            if preset.network:
                limits["network"] = True
            environment = environment or preset.environment
        with self._lock:
            if session_id in self._open or self._recorded(session_id):
                raise InvalidRequest(f"session {session_id} was started already")
            sandbox = Sandbox.create(
                backend=backend,
                environment=environment,
                metadata={"session_id": session_id},
                manager=self._manager,
                api_url=self._api_url,
                api_key=self._api_key,
                **limits,
            )
            record = SessionRecord(
                session_id=session_id,
                sandbox_id=sandbox.id,
                provider=provider,
                backend=sandbox.info.backend,
                environment=environment,
                agent_config=agent_config,
                created_at=datetime.now(UTC),
            )
            try:
                self.state_mgr.save(record)
            except BaseException:
                sandbox.kill()  # no record, no session: nothing left running unrecorded
                raise
            self._open[session_id] = sandbox
            self._started.add(session_id)
        return record

    def _recorded(self, session_id: str) -> bool:
        try:
            self.state_mgr.load(session_id)
        except SandboxNotFound:
            return False
        return True

    def _sandbox(self, session_id: str) -> Sandbox:
        with self._lock:
            if session_id in self._open:
                return self._open[session_id]
            record = self.state_mgr.load(session_id)
            if record.status != "running":
                raise SandboxNotRunning(f"session {session_id} is {record.status}")
            sandbox = self._connect(record)
            if sandbox is None:
                raise SandboxNotRunning(f"session {session_id} is lost: its sandbox is gone")
            self._open[session_id] = sandbox
            return sandbox

    def _connect(self, record: SessionRecord) -> Sandbox | None:
        """The running sandbox of a session started elsewhere (another Lifecycle on the same
        runtime or server); None, and the record ``lost``, where it is gone."""
        try:
            sandbox = Sandbox.connect(
                record.sandbox_id,
                manager=self._manager,
                api_url=self._api_url,
                api_key=self._api_key,
            )
        except SandboxNotFound:
            sandbox = None
        if sandbox is not None:
            if sandbox.info.status == "running":
                return sandbox
            sandbox.detach()
        record.status = "lost"
        record.stopped_at = datetime.now(UTC)
        self.state_mgr.save(record)
        return None

    def _session_of(self, sandbox_id: str) -> str:
        for record in self.state_mgr.list():
            if record.sandbox_id == sandbox_id:
                return record.session_id
        raise SandboxNotFound(f"no session's sandbox is {sandbox_id}")

    def _logged(self, session_id: str, code: str, answer: SessionCodeResponse) -> None:
        entry = {
            "at": datetime.now(UTC).isoformat(),
            "code": code[:LOG_FIELD_MAX_CHARS],
            "stdout": answer.stdout[:LOG_FIELD_MAX_CHARS],
            "stderr": answer.stderr[:LOG_FIELD_MAX_CHARS],
            "error": (answer.error or "")[:LOG_FIELD_MAX_CHARS] or None,
        }
        with self._lock:
            with (self._logs / f"{_valid_session_id(session_id)}.jsonl").open("a") as out:
                out.write(json.dumps(entry) + "\n")
            record = self.state_mgr.load(session_id)
            record.executions += 1
            self.state_mgr.save(record)

    def _save_artifacts(self, session_id: str, sandbox: Sandbox) -> list[str]:
        """Copy the artifacts the runtime kept for a destroyed sandbox into storage. Their
        paths came from inside the sandbox: each is checked again before it names a file."""
        root = self._artifacts / session_id
        saved: list[str] = []
        try:
            kept = sandbox.artifacts()
        except SandboxError as exc:
            log.warning("artifacts_unlisted", session_id=session_id, error=str(exc))
            return saved
        for artifact in kept:
            target = _inside(root, artifact.path)
            if target is None:
                log.warning("artifact_skipped", session_id=session_id, path=artifact.path)
                continue
            try:
                data = sandbox.read_artifact(artifact.path)
            except SandboxError as exc:
                log.warning("artifact_unread", session_id=session_id, error=str(exc))
                continue
            try:
                _write_new(root, target, data)
            except OSError as exc:  # a name taken (a file where a directory goes): skipped
                log.warning("artifact_unsaved", session_id=session_id, error=str(exc))
                continue
            saved.append(artifact.path)
        return saved


def _backend_for(provider: str) -> str | None:
    if provider in FOREIGN_PROVIDERS:
        return None
    if provider in KNOWN_BACKENDS:
        return provider
    known = ", ".join([*FOREIGN_PROVIDERS, *KNOWN_BACKENDS])
    raise InvalidRequest(f"unknown provider {provider!r}; the providers here: {known}")


def _inside(root: Path, path: str) -> Path | None:
    """``root``/``path`` where ``path`` is a plain relative path (no ``..``, no root, no
    empty or NUL part); else None."""
    parts = PurePosixPath(path).parts
    if (
        not parts
        or path.startswith("/")
        or "\0" in path
        or any(part in ("", ".", "..") for part in parts)
    ):
        return None
    return root.joinpath(*parts)


def _write_new(root: Path, target: Path, data: bytes) -> None:
    """Write a new file at ``target`` below ``root``: directories made private, and neither
    they nor the file followed if something put a link there."""
    for directory in _parents_below(root, target):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        if directory.is_symlink() or not directory.is_dir():
            raise NotADirectoryError(f"{directory} is not a plain directory")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _parents_below(root: Path, target: Path) -> Iterator[Path]:
    yield root
    for part in target.relative_to(root).parts[:-1]:
        root = root / part
        yield root
