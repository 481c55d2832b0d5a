"""Request and response bodies of the HTTP API (the OpenAPI document is built from these)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sandlot.models import SandboxLimits

MAX_SOURCE_CHARS = 1 << 20
SESSION_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not contain a NUL byte")
    return value


NoNul = Annotated[str, AfterValidator(_no_nul)]


def _env_ok(env: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError("env names must be non-empty, without '=' or NUL; values no NUL")
    return env


Env = Annotated[dict[str, str] | None, AfterValidator(_env_ok)]


class CreateSandboxRequest(SandboxLimits):
    """A new sandbox. Every field is optional; unset limits take the server's settings."""

    backend: str | None = Field(
        default=None, max_length=64, description="bubblewrap | docker | unsafe-local"
    )
    runtime: str | None = Field(
        default=None, max_length=64, description="docker only: runc | runsc (gVisor)"
    )
    environment: str | None = Field(
        default=None, max_length=64, description="A YAML registry name: python3, node, ..."
    )
    network: bool | None = None
    env: Env = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, max_length=64)
    ttl_s: float | None = Field(default=None, gt=0, le=30 * 86_400)
    idle_timeout_s: float | None = Field(default=None, gt=0, le=30 * 86_400)

    def limits(self) -> SandboxLimits:
        return SandboxLimits.model_validate(
            self.model_dump(include=set(SandboxLimits.model_fields))
        )


class RunCodeRequest(_Body):
    code: str = Field(max_length=MAX_SOURCE_CHARS)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class RunCommandRequest(_Body):
    command: NoNul = Field(max_length=MAX_SOURCE_CHARS)
    session: str = Field(default="default", pattern=SESSION_PATTERN)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    env: Env = Field(default=None, max_length=256)
    cwd: NoNul | None = Field(default=None, max_length=4096)
    input: str | None = Field(default=None, max_length=MAX_SOURCE_CHARS)


class TimeoutRequest(_Body):
    ttl_s: float = Field(gt=0, le=30 * 86_400, description="Seconds from now until expiry.")


class ErrorDetail(_Body):
    code: str = Field(description="Stable machine-readable code, e.g. 'sandbox_not_found'.")
    message: str = Field(description="What went wrong and which option to change.")
    request_id: str | None = None


class ErrorBody(_Body):
    error: ErrorDetail


class WrittenFile(_Body):
    path: str
    size_bytes: int


class Health(_Body):
    status: str
    version: str
    sandboxes_live: int | None = None
    detail: str | None = None


# -- seed 004 (Flask sandbox server) ----------------------------------------------------


class SessionRef(_Body):
    session_id: str = Field(max_length=64)


class CreateSessionResponse(_Body):
    session_id: str


class LegacyExecuteRequest(_Body):
    session_id: str = Field(max_length=64)
    command: NoNul = Field(max_length=MAX_SOURCE_CHARS)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class LegacyExecuteResponse(_Body):
    exit_code: int | None
    output: str = Field(description="stdout then stderr, as the seed's server returned it.")
    stdout: str
    stderr: str
    kill_reason: str | None


# -- seed 001 (stateful sandbox system) ------------------------------------------------------


class SessionCreateRequest(_Body):
    provider: str | None = Field(default=None, max_length=64)
    environment: str | None = Field(default=None, max_length=128)


class SessionCreateResponse(_Body):
    session_id: str
    sandbox_id: str
    provider: str
    url: str


class SessionCodeRequest(_Body):
    session_id: str = Field(max_length=64)
    code: str = Field(max_length=MAX_SOURCE_CHARS)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class SessionCodeResponse(_Body):
    stdout: str
    stderr: str
    results: list[str]
    error: str | None
    artifacts: list[str]


class SessionFileWrite(_Body):
    session_id: str = Field(max_length=64)
    path: NoNul = Field(min_length=1, max_length=4096)
    content: str = Field(max_length=MAX_SOURCE_CHARS)
