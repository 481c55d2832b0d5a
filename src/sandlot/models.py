"""Typed models shared by the manager, the backends, the SDK and (later) the API.

:class:`ExecResult` is the one result schema for Python code and shell commands alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandlot._strict import Strict
from sandlot.guest.wire import EXIT_CODE_MAX, EXIT_CODE_MIN, nests_within

# "cpu" is no longer produced: no CPU-time limit (RLIMIT_CPU) is set, so a death by SIGXCPU
# is a signal some process sent ("killed"). Kept in the schema for results made before.
KillReason = Literal["timeout", "memory", "pids", "output_limit", "cpu", "killed"]

# Receives each piece of a run's stdout or stderr as it is produced (decoded UTF-8).
OutputCallback = Callable[[str], None]
# A terminal's output: raw bytes, as the program wrote them (escape sequences included).
DataCallback = Callable[[bytes], None]


class _Model(Strict):
    pass


class _Entry(BaseModel):
    """An item of a long list the host builds from a sandbox's reply or its own store (a
    listing's 100,000 entries, a sandbox's 10,000 kept artifacts), never from a client's
    request: unknown fields are refused by pydantic alone. ``Strict``'s check, a Python call
    an item, was a third of a 25,900-entry listing's ~100 ms on the event loop (2026-12-06);
    an item that comes with unknown fields fails by itself, a few errors at most."""

    model_config = ConfigDict(extra="forbid")


class ExecError(_Model):
    """An exception raised by sandboxed Python code (never by sandlot itself)."""

    type: str = Field(description="Exception class name, e.g. 'ZeroDivisionError'.")
    message: str = Field(description="str() of the exception.")
    traceback: str = Field(description="Formatted traceback, cell source lines included.")


# The formats a :class:`Result` has a field for: MIME type -> field name (E2B's names).
RESULT_FORMATS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


class Result(_Model):
    """One rich output of a Python cell: an object shown by ``display(obj)``, a matplotlib
    figure (``plt.show()`` or left open at the end of the cell), or the value of the cell's
    last expression (``is_main_result``). Each format is one field; images are base64.
    Matches E2B's ``Result`` (``chart`` and ``data`` are not produced)."""

    is_main_result: bool = Field(
        default=False, description="The value of the cell's last expression, not a display."
    )
    text: str | None = Field(default=None, description="text/plain: the object's repr().")
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = Field(default=None, description="image/png, base64.")
    jpeg: str | None = Field(default=None, description="image/jpeg, base64.")
    pdf: str | None = Field(default=None, description="application/pdf, base64.")
    latex: str | None = None
    json_data: Any = Field(
        default=None,
        alias="json",
        serialization_alias="json",
        description="application/json: any JSON value.",
    )
    javascript: str | None = None
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Other MIME types the object offered."
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    def formats(self) -> list[str]:
        """The formats present, by field name (as E2B's ``Result.formats()``)."""
        present = [f for f in RESULT_FORMATS.values() if f != "text" and self[f] is not None]
        return present + sorted(self.extra)

    def __getitem__(self, name: str) -> Any:
        return self.json_data if name == "json" else getattr(self, name)

    @classmethod
    def from_bundle(cls, data: object, is_main_result: object = False) -> Result:
        """The result of a ``{mime: value}`` bundle from the guest. The guest shares a uid
        with sandboxed code, which can write any bundle: a value of the wrong type, or nested
        past ``wire.MAX_JSON_DEPTH`` (the guest leaves those out too), is left out, never
        raised."""
        fields: dict[str, Any] = {"is_main_result": is_main_result is True, "extra": {}}
        for mime, value in (data if isinstance(data, dict) else {}).items():
            name = RESULT_FORMATS.get(str(mime))
            if not nests_within(value):
                continue
            if name == "json":
                fields["json"] = value
            elif name is not None:
                if isinstance(value, str):
                    fields[name] = value
            elif isinstance(mime, str):
                fields["extra"][mime] = value
        return cls.model_validate(fields)


# Receives each rich output of a running cell as it is shown.
ResultCallback = Callable[[Result], None]


class ExecResult(_Model):
    """What one run of code or of a shell command produced.

    A crash, a timeout or a resource kill of the sandboxed program is reported here, not
    raised: check :attr:`ok`, ``exit_code``, ``error`` and ``kill_reason``.
    """

    exit_code: int | None = Field(
        ge=EXIT_CODE_MIN,
        le=EXIT_CODE_MAX,
        description="0 on success. Python: 1 on an uncaught exception, the SystemExit code "
        "otherwise (1 for one outside a C int's range). Shell: the command's status; 128+N "
        "when killed by signal N.",
    )
    stdout: str = ""
    stderr: str = ""
    text: str | None = Field(
        default=None,
        description="repr() of the value of the last expression (Python only), like a "
        "notebook cell; None when the cell ends in a statement or the value is None.",
    )
    error: ExecError | None = None
    kill_reason: KillReason | None = Field(
        default=None, description="Why the run was stopped, if it was stopped."
    )
    duration_ms: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = Field(default=0, description="Full size of stdout, kept or not.")
    stderr_bytes: int = Field(default=0, description="Full size of stderr, kept or not.")
    stdout_path: str | None = Field(
        default=None, description="Where the full stdout was written inside the sandbox."
    )
    stderr_path: str | None = Field(
        default=None, description="Where the full stderr was written inside the sandbox."
    )
    state_lost: bool = Field(
        default=False,
        description="The interpreter had to be restarted: variables and imports are gone.",
    )
    results: list[Result] = Field(
        default_factory=list,
        description="Rich outputs in the order shown (Python only): display() calls, "
        "figures, and the last expression's value (is_main_result).",
    )
    results_truncated: bool = Field(
        default=False,
        description="Some rich outputs were left out: together they passed the output cap.",
    )

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None and self.kill_reason is None


class CommandInfo(_Model):
    """A background command: what ``commands.list()`` and a start return."""

    pid: int = Field(description="Its bash's process id inside the sandbox.")
    command: str
    started_at: float = Field(description="Unix time it was started.")
    running: bool = True
    exit_code: int | None = None
    pty: bool = Field(default=False, description="A terminal (``pty.create``), not a command.")
    # The pid alone does not name one command: pids start again at 1 when the sandbox's guest
    # restarts (which its code can force) and wrap within one guest, so a handle kept by pid
    # once got a later command's result (red team, 2026-12-06). Optional on the wire: a server
    # from before it sends none, and its client then acts by pid as before.
    command_id: str | None = Field(
        default=None,
        description="Drawn by the host at random, unique in its sandbox: pass it with the pid "
        "(``?command_id=``) to act on this command only, not a later one given its pid.",
    )


class PtyOutput(_Model):
    """A window of a terminal's recent output (REST polls it by offset)."""

    data_b64: str = Field(description="Raw bytes, base64.")
    offset: int = Field(description="Position of the first byte in the terminal's output.")
    next_offset: int = Field(description="Pass it back to read on from here.")
    dropped_bytes: int = Field(
        default=0, description="Output between the asked offset and ``offset`` no longer kept."
    )


class SandboxStatus(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DESTROYED = "destroyed"
    FAILED = "failed"


class SandboxLimits(_Model):
    """Resource limits of one sandbox. ``None`` fields take the server's settings."""

    memory_mb: int | None = Field(default=None, ge=16, le=1_048_576)
    cpu_cores: float | None = Field(default=None, gt=0, le=1024)
    pids: int | None = Field(default=None, ge=16, le=1_000_000)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    disk_mb: int | None = Field(default=None, ge=8, le=1_048_576)
    # Kept head + tail travel in one protocol frame (64 MiB, JSON-escaped): 8 MiB at most.
    output_limit_bytes: int | None = Field(default=None, ge=1024, le=8 << 20)
    output_file_limit_mb: int | None = Field(default=None, ge=1, le=1_048_576)


class ResolvedLimits(_Model):
    """Limits with every field set (after settings were applied)."""

    memory_mb: int
    cpu_cores: float
    pids: int
    timeout_s: float
    disk_mb: int
    output_limit_bytes: int
    output_file_limit_mb: int


class Quota(_Model):
    """What one owner (tenant) may hold at once: every resource a sandbox reserves.

    ``None`` leaves that resource unbounded for the tenant (the host's capacity still is).
    """

    max_sandboxes: int = Field(ge=0)
    max_memory_mb: int = Field(ge=0)
    max_pids: int | None = Field(default=None, ge=0)
    max_cpu_cores: float | None = Field(default=None, ge=0)
    max_disk_mb: int | None = Field(default=None, ge=0)
    max_artifact_mb: int | None = Field(
        default=None, ge=0, description="Kept artifacts of all the tenant's sandboxes."
    )
    max_volumes: int | None = Field(default=None, ge=0, description="Named volumes kept.")
    max_volume_mb: int | None = Field(
        default=None, ge=0, description="Total size of the tenant's named volumes."
    )


VOLUME_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
# mkfs.ext4 gives a volume under 2 MB no journal; the smallest volume has one.
MIN_VOLUME_MB = 8
# Where volumes may go: inside the workspace, which each backend mounts writable and whose
# mount points the host can make (the system's tree above it is read-only).
VOLUME_ROOT = "/workspace"
MAX_VOLUMES_PER_SANDBOX = 8
_MAX_VOLUME_PATH_DEPTH = 8


class VolumeMount(_Model):
    """A named volume attached to a sandbox at ``mount_path``."""

    name: str = Field(pattern=VOLUME_NAME_PATTERN, description="The volume's name.")
    mount_path: str = Field(
        max_length=512,
        description="A directory under /workspace (made if missing), e.g. /workspace/data; "
        "a relative path is taken from /workspace.",
    )
    read_only: bool = False

    @field_validator("mount_path")
    @classmethod
    def _inside_workspace(cls, path: str) -> str:
        inside = path.removeprefix(VOLUME_ROOT + "/") if path.startswith("/") else path
        names = [n for n in inside.split("/") if n]
        if (
            (path.startswith("/") and not path.startswith(VOLUME_ROOT + "/"))
            or not names
            or len(names) > _MAX_VOLUME_PATH_DEPTH
            or any(n in (".", "..") or "\0" in n or len(n.encode()) > 255 for n in names)
        ):
            raise ValueError(
                f"mount_path {path[:80]!r} must be a directory under {VOLUME_ROOT} (at most "
                f"{_MAX_VOLUME_PATH_DEPTH} names, none '.' or '..'), e.g. {VOLUME_ROOT}/data"
            )
        return f"{VOLUME_ROOT}/" + "/".join(names)


def check_volume_mounts(mounts: list[VolumeMount] | None) -> list[VolumeMount] | None:
    """No volume twice, no mount path at or inside another's, and none where the artifacts
    are kept from (a create's check: a record from before it still reads)."""
    for mount in mounts or []:
        if nests_path(f"{VOLUME_ROOT}/artifacts", mount.mount_path):
            # A sandbox's artifacts are copied from its own disk when it ends, within that
            # disk's use: a volume there kept most of its files from being kept (red team,
            # 2026-12-07).
            raise ValueError(
                f"mount_path {mount.mount_path[:80]!r}: a volume cannot be mounted at or under "
                f"{VOLUME_ROOT}/artifacts (a sandbox's artifacts come from its own disk); "
                f"mount it elsewhere, e.g. {VOLUME_ROOT}/data"
            )
    for i, a in enumerate(mounts or []):
        for b in (mounts or [])[i + 1 :]:
            if a.name == b.name:
                raise ValueError(f"volume {a.name!r} is named twice")
            if nests_path(a.mount_path, b.mount_path) or nests_path(b.mount_path, a.mount_path):
                raise ValueError(f"mount paths {a.mount_path} and {b.mount_path} overlap")
    return mounts


def nests_path(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer + "/")


# What ``Sandbox.create(volumes=...)`` takes: mounts, or ``{name: mount_path}``.
Volumes = list[VolumeMount | dict[str, object]] | dict[str, str]


def volume_mounts(volumes: Volumes | None) -> list[VolumeMount | dict[str, object]] | None:
    """``volumes`` as the create's mounts (``{"data": "/workspace/data"}`` is one mount of
    the volume "data", writable; ``"/workspace/data:ro"`` read-only and ``":rw"`` writable,
    as docker's ``-v``), validated with the rest of the create."""
    if isinstance(volumes, dict):
        return [
            {
                "name": name,
                "mount_path": path.removesuffix(":ro").removesuffix(":rw"),
                "read_only": path.endswith(":ro"),
            }
            for name, path in volumes.items()
        ]
    return volumes


class VolumeInfo(_Model):
    """A named volume: files of a tenant that outlive its sandboxes."""

    name: str
    size_mb: int = Field(description="Its cap: writes past it fail with ENOSPC.")
    created_at: float = Field(description="Unix time, seconds.")
    used_bytes: int = Field(default=0, description="Bytes of the host's disk it takes now.")
    attached: bool = Field(default=False, description="Whether a live sandbox has it.")


class SandboxInfo(_Model):
    id: str
    backend: str
    runtime: str | None = Field(
        default=None, description="The OCI runtime (runc, runsc) of a docker sandbox."
    )
    environment: str = Field(default="python3", description="A name from the YAML registry.")
    status: SandboxStatus
    owner: str
    limits: ResolvedLimits
    network: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    volumes: list[VolumeMount] = Field(default_factory=list, description="Its named volumes.")
    created_at: float = Field(description="Unix time, seconds.")
    last_active_at: float
    expires_at: float = Field(description="Absolute TTL deadline, Unix time.")
    idle_timeout_s: float
    ended_at: float | None = None
    end_reason: str | None = Field(
        default=None, description="user | ttl | idle | shutdown | recovered | failed"
    )


class FileInfo(_Entry):
    name: str
    path: str = Field(description="Path relative to /workspace.")
    type: Literal["file", "dir", "symlink", "other"]
    size_bytes: int
    mtime: float
    mode: int


class Listing(list[FileInfo]):
    """A directory listing: its entries, and ``truncated`` (why it stopped short) where the
    listing reached its bound (100,000 entries or 4 MiB of names and paths). Before
    2026-12-06 a listing cut there said nothing: a client took a part for the whole (red
    team). Over REST the ``X-Listing-Truncated`` header carries it."""

    truncated: str | None = None

    def __init__(self, entries: Iterable[FileInfo] = (), truncated: str | None = None) -> None:
        super().__init__(entries)
        self.truncated = truncated


class SessionCodeResponse(_Model):
    """Seed 001's answer to running code in a session (``POST /api/e2b/execute``, and
    :meth:`sandlot.lifecycle.UnifiedSandboxManager.execute_code`)."""

    stdout: str
    stderr: str
    results: list[str]
    error: str | None
    artifacts: list[str]
    artifacts_truncated: bool = Field(
        default=False,
        description="The artifacts directory held more than a listing returns (100,000 "
        "entries or 4 MiB of names): ``artifacts`` is not all of it.",
    )

    @classmethod
    def of(cls, result: ExecResult, artifacts: Listing) -> SessionCodeResponse:
        """``result``'s answer, with the files listed under ``artifacts/``."""
        error = result.error
        return cls(
            stdout=result.stdout,
            stderr=result.stderr,
            results=[result.text] if result.text is not None else [],
            error=(error.traceback or f"{error.type}: {error.message}") if error else None,
            artifacts=[f.path for f in artifacts if f.type == "file"],
            artifacts_truncated=artifacts.truncated is not None,
        )


TRUNCATED_HEADER = "X-Listing-Truncated"
LISTING_TRUNCATED = (
    "the listing stopped at its bound (100,000 entries or 4 MiB of names and paths): list a "
    "narrower path or fewer levels"
)


class ArtifactInfo(_Entry):
    sandbox_id: str
    path: str = Field(description="Path relative to /workspace/artifacts.")
    size_bytes: int
    sha256: str
    created_at: float


class ResourceUsage(_Model):
    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    pids: int | None = None
    cpu_s: float | None = None
    oom_kills: int = 0
    pids_limit_hits: int = 0
    disk_used_bytes: int | None = None
