"""Response bodies of the HTTP API, and the request bodies of the seeds' compatibility routes.

The requests of our own verbs are :mod:`sandlot.requests`, shared with the SDK and the core.
"""

from __future__ import annotations

from pydantic import Field

from sandlot._strict import Strict
from sandlot.requests import MAX_SOURCE_CHARS, SANDBOX_ID_PATTERN, NoNul


class _Body(Strict):
    pass


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
    session_id: str = Field(pattern=SANDBOX_ID_PATTERN)


class CreateSessionResponse(_Body):
    session_id: str


class LegacyExecuteRequest(_Body):
    session_id: str = Field(pattern=SANDBOX_ID_PATTERN)
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
    session_id: str = Field(pattern=SANDBOX_ID_PATTERN)
    code: str = Field(max_length=MAX_SOURCE_CHARS)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class SessionFileWrite(_Body):
    session_id: str = Field(pattern=SANDBOX_ID_PATTERN)
    path: NoNul = Field(min_length=1, max_length=4096)
    content: str = Field(max_length=MAX_SOURCE_CHARS)
