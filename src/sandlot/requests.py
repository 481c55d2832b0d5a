"""One typed request per verb: what the SDK builds, the REST API receives and the core runs.

Each verb (create, run code, run a command, the file verbs, set a timeout) is one pydantic
model, validated once at whichever edge it enters: the SDK's keyword arguments, a REST body or
query, a WebSocket message. The manager, the remote client and the server routes pass the same
object on, so a new option is one field here plus the code that uses it.

The sandbox id is not part of a request: it names the resource (the URL path in REST), not what
to do with it.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from sandlot._strict import Strict, at_most
from sandlot.config import explain_invalid
from sandlot.errors import ConfigError, InvalidRequest
from sandlot.models import (
    MAX_VOLUMES_PER_SANDBOX,
    MIN_VOLUME_MB,
    VOLUME_NAME_PATTERN,
    SandboxLimits,
    VolumeMount,
    check_volume_mounts,
)

MAX_SOURCE_CHARS = 1 << 20
MAX_PATH_CHARS = 4096
MAX_ENV_VARS = 256
# A sandbox's env reaches its guest as one JSON value in the guest's environment
# (launch.guest_env), and the kernel refuses an execve with any one string over 128 KiB
# (MAX_ARG_STRLEN, E2BIG): past this a create failed at the guest's start, not at the edge.
MAX_ENV_JSON_CHARS = 128 * 1024 - 1024
# The kernel's limit on one argument or environment string (MAX_ARG_STRLEN), less its NUL.
MAX_COMMAND_BYTES = 128 * 1024 - 1
MAX_METADATA_KEYS = 64
MAX_TTL_S = 30 * 86_400
SESSION_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
# What a sandbox id may look like at the edge (ours are "sb-" + 16 hex digits): anything else
# is refused before it can reach a log, the audit trail or a terminal.
SANDBOX_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"

R = TypeVar("R", bound=BaseModel)


# The most one ranged read returns (ReadRange): what a Ray call moves at once.
RANGE_MAX_BYTES = 4 << 20


class Request(Strict):
    pass


def _utf8(value: str) -> bool:
    """Whether ``value`` is text UTF-8 can carry: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which failed later, inside the server or the guest, as a 500 or a 502
    instead of this 422 (red team, 2026-11-25)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not contain a NUL byte")
    if not _utf8(value):
        raise ValueError("must be valid Unicode (no lone surrogate)")
    return value


NoNul = Annotated[str, AfterValidator(_no_nul)]


def _one_argument(value: str) -> str:
    """A command reaches the sandbox's shell as one argument: past the kernel's limit on one
    (E2BIG) the guest could not start it, which a caller learned as a 502 and a guest
    restarted with its state lost (red team, 2026-11-27)."""
    if (size := len(value.encode("utf-8"))) > MAX_COMMAND_BYTES:
        raise ValueError(
            f"command is {size} bytes; at most {MAX_COMMAND_BYTES} (the kernel's limit on one "
            "argument): write it to a file in the workspace and run that"
        )
    return value


Command = Annotated[str, AfterValidator(_no_nul), AfterValidator(_one_argument)]


def _env_ok(env: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError("env names must be non-empty, without '=' or NUL; values no NUL")
        if not (_utf8(key) and _utf8(value)):
            raise ValueError("env names and values must be valid Unicode (no lone surrogate)")
    # Measured as it travels: json.dumps's default escapes (a control character is 6 chars).
    if env and (size := len(json.dumps(env))) > MAX_ENV_JSON_CHARS:
        raise ValueError(
            f"env is {size} characters as JSON; at most {MAX_ENV_JSON_CHARS} (the kernel's "
            "limit on one environment string, less the guest's own)"
        )
    return env


Env = Annotated[
    dict[str, str] | None, BeforeValidator(at_most(MAX_ENV_VARS, "env")), AfterValidator(_env_ok)
]


def _labels_ok(labels: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (labels or {}).items():
        if not (_utf8(key) and _utf8(value)):
            raise ValueError("labels must be valid Unicode (no lone surrogate)")
    return labels


Labels = Annotated[
    dict[str, str] | None,
    BeforeValidator(at_most(MAX_METADATA_KEYS, "metadata")),
    AfterValidator(_labels_ok),
]


class SandboxSpec(SandboxLimits):
    """A new sandbox: placement, limits, environment, metadata and lifetimes.

    Every field is optional; unset ones take the settings (``SANDBOX_*`` variables).
    """

    backend: str | None = Field(
        default=None, max_length=64, description="bubblewrap | docker | unsafe-local"
    )
    runtime: str | None = Field(
        default=None, max_length=64, description="docker only: runc | runsc (gVisor)"
    )
    environment: str | None = Field(
        default=None, max_length=64, description="A YAML registry name: python3, node, ..."
    )
    network: bool | None = Field(default=None, description="Give the sandbox a network.")
    env: Env = Field(
        default=None, max_length=MAX_ENV_VARS, description="Environment of its processes."
    )
    metadata: Labels = Field(
        default=None, max_length=MAX_METADATA_KEYS, description="Free-form labels."
    )
    ttl_s: float | None = Field(
        default=None, gt=0, le=MAX_TTL_S, description="Absolute lifetime from now."
    )
    idle_timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_TTL_S, description="Destroyed after this long unused."
    )
    volumes: Annotated[list[VolumeMount] | None, AfterValidator(check_volume_mounts)] = Field(
        default=None,
        max_length=MAX_VOLUMES_PER_SANDBOX,
        description="Named volumes to attach (one sandbox at a time each), under /workspace.",
    )

    def limits(self) -> SandboxLimits:
        """The resource limits alone (unset ones stay None)."""
        return SandboxLimits.model_validate(
            self.model_dump(include=set(SandboxLimits.model_fields))
        )


class CreateVolume(Request):
    """A new named volume of the caller's, empty, capped at ``size_mb``."""

    name: str = Field(pattern=VOLUME_NAME_PATTERN)
    # The setting SANDBOX_MAX_VOLUME_MB is the real ceiling (checked where it is known).
    size_mb: int = Field(default=256, ge=MIN_VOLUME_MB, le=1_048_576)


class RunCode(Request):
    """Run Python in the sandbox's persistent interpreter."""

    code: str = Field(max_length=MAX_SOURCE_CHARS)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class RunCommand(Request):
    """Run a bash command; ``cd`` and ``export`` persist within ``session``."""

    command: Command = Field(max_length=MAX_SOURCE_CHARS)
    session: str = Field(default="default", pattern=SESSION_PATTERN)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    env: Env = Field(default=None, max_length=MAX_ENV_VARS)
    cwd: NoNul | None = Field(default=None, max_length=MAX_PATH_CHARS)
    input: str | None = Field(
        default=None, max_length=MAX_SOURCE_CHARS, description="Written to stdin up front."
    )
    fresh: bool = Field(
        default=False,
        description="Kill every process earlier calls left (the Python kernel is paused, "
        "not lost) and run in a clean environment and HOME, outside any session: for checks "
        "that earlier code must not be able to influence except through files.",
    )
    background: bool = Field(
        default=False,
        description="Start it and return its pid at once (REST: 202); it runs until it ends, "
        "is killed or the sandbox is destroyed, outside its session's lock.",
    )
    webhook_url: str | None = Field(
        default=None,
        max_length=2048,
        description="Background only, over the REST server: an http(s) URL the server POSTs "
        "a JSON `command.completed` event to when the command ends (exit, kill, timeout or "
        "the sandbox's destroy). It must resolve to public addresses only (see "
        "API_WEBHOOK_ALLOW_CIDRS); it stays on the host, never sent into the sandbox.",
    )
    webhook_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        repr=False,
        description="With webhook_url: each delivery is signed, `X-Sandlot-Signature: "
        "t=<unix>,v1=<hex HMAC-SHA256(secret, f'{t}.{body}')>`.",
    )

    @field_validator("webhook_url", "webhook_secret")
    @classmethod
    def _webhook_in_background(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A webhook tells of a background command's end: a foreground run's caller has
        its result already. Only http(s): no other scheme reaches the sender."""
        if value is None:
            return value
        if not info.data.get("background"):
            raise ValueError("is only allowed with background=True")
        if info.field_name == "webhook_url":
            if not value.lower().startswith(("http://", "https://")):
                raise ValueError("must be an http:// or https:// URL")
        elif info.data.get("webhook_url") is None:
            raise ValueError("needs webhook_url")
        return value


class CommandInput(Request):
    """Bytes for a background command's stdin (UTF-8 text here), or its end."""

    data: str = Field(default="", max_length=MAX_SOURCE_CHARS)
    eof: bool = Field(default=False, description="Close its stdin after ``data``.")


MAX_PTY_SIZE = 1000  # columns or rows


class OpenPty(Request):
    """Open a terminal: ``command`` (default an interactive bash, sh where bash is absent)
    under a pseudo-terminal of ``cols`` x ``rows``."""

    cols: int = Field(default=80, ge=1, le=MAX_PTY_SIZE)
    rows: int = Field(default=24, ge=1, le=MAX_PTY_SIZE)
    command: Command | None = Field(default=None, max_length=MAX_SOURCE_CHARS)
    env: Env = Field(default=None, max_length=MAX_ENV_VARS)
    cwd: NoNul | None = Field(default=None, max_length=MAX_PATH_CHARS)
    timeout_s: float | None = Field(
        default=None, gt=0, le=86_400, description="Killed after this; default: never."
    )


class PtySize(Request):
    """A terminal's new size; its programs get SIGWINCH."""

    cols: int = Field(ge=1, le=MAX_PTY_SIZE)
    rows: int = Field(ge=1, le=MAX_PTY_SIZE)


class PtyInput(Request):
    """Keystrokes for a terminal: raw bytes, base64."""

    data_b64: str = Field(max_length=MAX_SOURCE_CHARS)

    def data(self) -> bytes:
        try:
            return base64.b64decode(self.data_b64, validate=True)
        except ValueError as exc:
            raise InvalidRequest(f"data_b64 is not base64: {exc}") from exc


PathField = Annotated[
    NoNul,
    Field(min_length=1, max_length=MAX_PATH_CHARS, description="Relative to /workspace."),
]


class FilePath(Request):
    """A path in /workspace: read a file, stat it, make a directory."""

    path: PathField


class ReadFile(FilePath):
    """A file read whole: ``max_bytes`` bounds the bytes actually read, not a size looked up
    first (the sandbox's code can grow the file between the two: red team, 2026-12-06)."""

    max_bytes: int | None = Field(default=None, ge=0)


class ReadRange(FilePath):
    """Part of a file: at most ``length`` bytes from ``offset`` (fewer at its end, none past
    it). How a file crosses a Ray cluster in pieces, where one call moves its object whole."""

    offset: int = Field(default=0, ge=0)
    length: int = Field(default=RANGE_MAX_BYTES, ge=1, le=RANGE_MAX_BYTES)


class WriteFile(Request):
    """Create or replace a file (its parents are made); the bytes travel beside the request."""

    path: PathField
    mode: int = Field(default=0o644, ge=0, le=0o7777)


class ListFiles(Request):
    path: PathField = "."
    depth: int = Field(default=1, ge=1, le=32)


class RemoveFile(Request):
    path: PathField
    recursive: bool = False


class SetTimeout(Request):
    ttl_s: float = Field(gt=0, le=MAX_TTL_S, description="Seconds from now until expiry.")


def build(model: type[R], **values: Any) -> R:
    """Build ``model`` from keyword arguments, dropping the ones left as None (so they take
    their defaults); a bad value becomes a :class:`ConfigError` that names the argument.

    Raises:
        ConfigError: a value is out of range or of the wrong type.
    """
    given = {name: value for name, value in values.items() if value is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise ConfigError(explain_invalid(exc, f"invalid {model.__name__}")) from None


class RunTool(Request):
    """Run a tool (:mod:`sandlot.tools`) in the sandbox: its arguments, checked against the
    tool's parameters when it runs, and a timeout."""

    arguments: dict[str, Any] = Field(default_factory=dict, max_length=64)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
