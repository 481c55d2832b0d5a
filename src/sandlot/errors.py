"""The one exception tree of sandlot.

Every error this package raises derives from :class:`SandboxError`; each also inherits the
built-in exception a caller would naturally catch, so ``except FileNotFoundError`` works on a
file missing inside a sandbox.

::

    SandboxError
    ├── ConfigError (ValueError)                 bad setting or argument; names the option
    ├── InvalidRequest (ValueError)              a request the guest cannot act on (bad path)
    ├── BackendUnavailable (RuntimeError)        this host cannot run the chosen backend
    ├── SandboxNotFound (LookupError)            no such sandbox (or not yours)
    ├── SandboxNotRunning (RuntimeError)         destroyed, expired or failed
    │   └── SandboxHeldElsewhere                 another live process on the data dir runs it
    ├── SandboxLost (RuntimeError)               its Ray node died or cannot be reached
    ├── NodeTimeout (TimeoutError)               a live Ray node did not finish a call in time
    ├── VolumeNotFound (LookupError)             no such volume (or not yours)
    ├── VolumeExists (FileExistsError)           a volume of that name is already yours
    ├── VolumeInUse (RuntimeError)               attached to a live sandbox (one at a time)
    ├── SandboxStartError (RuntimeError)         the backend failed to start the guest
    ├── ImageBuildError (RuntimeError)           building an environment's image failed
    ├── GuestError (RuntimeError)                the guest broke the protocol or died mid-call
    │   ├── GuestDied                            the guest process exited with calls outstanding
    │   │   └── GuestChannelBroken               a frame on its channel failed the seal's check
    │   ├── GuestTimeout (TimeoutError)          it did not answer a file request in time
    │   ├── ProtocolMismatch                     the guest speaks another protocol version
    │   └── PidsExhausted                        the sandbox has no free process slot left
    ├── AuthenticationError (PermissionError)    no API key, or an unknown or revoked one
    ├── Forbidden (PermissionError)              the key's role may not do this
    ├── QuotaExceeded (RuntimeError)             the tenant's sandboxes, memory, pids, CPU, disk
    │                                            or kept artifacts are at quota
    ├── CapacityExhausted (RuntimeError)         the host has no room for one more sandbox
    │   └── FileDescriptorsExhausted             this process's open-file limit is reached
    ├── RateLimited (RuntimeError)               too many requests for this key; retry later
    ├── RequestTooLarge (ValueError)             an upload over the size cap
    ├── ClientGone (ConnectionError)             the call's client hung up; nobody reads it
    ├── ProviderError (RuntimeError)             an LLM provider failed (HTTP error, timeout)
    │   ├── ProviderAuthError (PermissionError)  the provider refused the API key
    │   ├── ProviderRateLimited                  the provider said 429 after our retries
    │   └── ProviderRequestRefused               the provider refused the request (other 4xx)
    ├── ModelOutputError (ValueError)            the model's reply did not fit the asked schema
    └── SandboxFileError (OSError)
        ├── SandboxFileNotFound (FileNotFoundError)
        ├── PathOutsideWorkspace (PermissionError)
        ├── SandboxPermissionError (PermissionError)
        ├── SandboxIsADirectory (IsADirectoryError)
        ├── SandboxNotADirectory (NotADirectoryError)
        ├── SandboxFileExists (FileExistsError)
        └── SandboxDiskFull (OSError)

A crash, timeout or resource kill of *sandboxed code* is not an exception: it is an
:class:`~sandlot.models.ExecResult` with ``exit_code``, ``error`` and ``kill_reason`` set.

Each class has a stable ``code``; over the wire errors travel as ``{"code", "message"}`` and
are mapped back with :func:`error_from_code`, an allow-list that never imports a class by name.
"""

from __future__ import annotations

from typing import ClassVar


class SandboxError(Exception):
    """Root of every sandlot error."""

    code: ClassVar[str] = "sandbox_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(SandboxError, ValueError):
    code = "invalid_config"


class InvalidRequest(SandboxError, ValueError):
    code = "invalid_request"


class ToolNotFound(InvalidRequest, LookupError):
    """No tool of the registry (:mod:`sandlot.tools`) has that name."""

    code = "tool_not_found"


class BackendUnavailable(SandboxError, RuntimeError):
    code = "backend_unavailable"


class SandboxNotFound(SandboxError, LookupError):
    code = "sandbox_not_found"


class SandboxNotRunning(SandboxError, RuntimeError):
    code = "sandbox_not_running"


class SandboxHeldElsewhere(SandboxNotRunning):
    """Another live process on the same data directory runs the sandbox: only it can."""

    code = "sandbox_held_elsewhere"

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class SandboxLost(SandboxError, RuntimeError):
    """The cluster node that ran the sandbox died or stopped answering: the sandbox and its
    state are gone (nothing retries it elsewhere); create a new one."""

    code = "sandbox_lost"

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class NodeTimeout(SandboxError, TimeoutError):
    """A call to a Ray node that still answers did not finish within its bound: that call
    failed; the node and its sandboxes are fine (retrying is the caller's choice)."""

    code = "node_timeout"


class VolumeNotFound(SandboxError, LookupError):
    """No volume of that name (or not yours)."""

    code = "volume_not_found"


class VolumeExists(SandboxError, FileExistsError):
    """A volume of that name is already yours."""

    code = "volume_exists"


class VolumeInUse(SandboxError, RuntimeError):
    """The volume is attached to a live sandbox: one at a time, and none while deleted."""

    code = "volume_in_use"


class SandboxStartError(SandboxError, RuntimeError):
    code = "sandbox_start_failed"


class ImageBuildError(SandboxError, RuntimeError):
    code = "image_build_failed"


class GuestError(SandboxError, RuntimeError):
    code = "guest_error"


class AuthenticationError(SandboxError, PermissionError):
    code = "unauthenticated"


class Forbidden(SandboxError, PermissionError):
    code = "forbidden"


class QuotaExceeded(SandboxError, RuntimeError):
    code = "quota_exceeded"


class BackgroundLimitReached(QuotaExceeded):
    """The sandbox already runs its most background commands
    (``SANDBOX_MAX_BACKGROUND_COMMANDS``); wait for or kill one first."""

    code = "background_limit"


class TooManyListeners(QuotaExceeded):
    """A terminal or background command already streams to its most clients at once
    (``MAX_LISTENERS_PER_JOB``); detach one first."""

    code = "too_many_listeners"


class McpSessionLimit(QuotaExceeded):
    """The API key already holds its most open MCP sessions (``SANDBOX_MCP_SESSIONS_PER_KEY``);
    end one (the client's DELETE) or wait for an idle one to time out."""

    code = "mcp_session_limit"


class TooManyOpen(QuotaExceeded):
    """The tenant already has its most requests and streams open at once
    (``API_MAX_OPEN_PER_TENANT``): long-polls, WebSockets, runs under way."""

    code = "too_many_open"


class TooManyAgentTasks(QuotaExceeded):
    """The tenant has its most agent tasks running already (``API_AGENT_TASKS_PER_TENANT``)."""

    code = "too_many_agent_tasks"


class AgentTimeout(SandboxError, TimeoutError):
    """An agent task ran past ``API_AGENT_TASK_TIMEOUT_SECONDS`` and was ended."""

    code = "agent_timeout"


class StdinBacklogFull(QuotaExceeded):
    """A command has not read this much of the input sent to it; more is refused until it
    does (the bytes waiting for a command are bounded)."""

    code = "stdin_backlog_full"


class CommandNotFound(SandboxNotFound):
    """No background command with that pid in the sandbox (never started, or forgotten)."""

    code = "command_not_found"


class CommandStillRunning(SandboxError, TimeoutError):
    """A background command's ``wait(timeout_s=)`` ran out before it ended (it runs on)."""

    code = "command_running"


class CapacityExhausted(SandboxError, RuntimeError):
    """The host's capacity (memory, CPU, pids, disk) is reserved by live sandboxes."""

    code = "capacity_exhausted"


class FileDescriptorsExhausted(CapacityExhausted):
    """The process has too few file descriptors left (``RLIMIT_NOFILE``) for one more sandbox."""

    code = "fds_exhausted"


class RateLimited(SandboxError, RuntimeError):
    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyConnections(RateLimited):
    """The server turned a connection away unread: its client's address (or the server)
    holds its most open connections (``API_MAX_CONNECTIONS_PER_IP``,
    ``API_MAX_CONNECTIONS``). Nothing of the request was read, so sending it again is safe;
    the SDK does, a few times."""

    code = "too_many_connections"


class KeylessRefused(RateLimited):
    """A client address past its credit for requests without a key (the public routes),
    as for failed authentications: its connections are closed unread for a while."""

    code = "too_many_keyless_requests"


class RequestTooLarge(SandboxError, ValueError):
    code = "too_large"


class ClientGone(SandboxError, ConnectionError):
    """The HTTP request that asked for a call ended (its client hung up) before the call
    did: the call is stopped, and this is what is left to answer (to nobody)."""

    code = "client_gone"


class PidsExhausted(GuestError):
    code = "pids_exhausted"


class GuestDied(GuestError):
    """The guest process exited (or was killed) while calls were outstanding."""

    code = "guest_died"


class GuestChannelBroken(GuestDied):
    """A frame between host and guest was not authentic: code in the sandbox wrote into the
    guest's channel, or read from it (possible on gVisor, see SECURITY.md). The guest is
    restarted, as after its death; nothing the channel carried after the break is believed."""

    code = "guest_channel_broken"


class GuestTimeout(GuestError, TimeoutError):
    """The guest did not answer a file request within the host's bound (``FILE_OP_TIMEOUT_S``):
    the sandbox's own code starves it. The guest is left as it is; a late answer is dropped."""

    code = "guest_timeout"


class ProtocolMismatch(GuestError):
    """The guest's "ready" frame names a protocol version this host does not speak."""

    code = "protocol_mismatch"


class ProviderError(SandboxError, RuntimeError):
    """An LLM provider did not answer: an HTTP error, a time-out, a broken stream."""

    code = "provider_error"


class ProviderAuthError(ProviderError, PermissionError):
    code = "provider_auth_failed"


class ProviderRateLimited(ProviderError):
    code = "provider_rate_limited"


class ProviderRequestRefused(ProviderError):
    """The provider refused the request itself (HTTP 4xx other than auth and rate limits):
    a parameter it does not take, a prompt too long."""

    code = "provider_request_refused"


class ModelOutputError(SandboxError, ValueError):
    """The model answered, but not with what was asked (no JSON, or JSON of the wrong shape)."""

    code = "invalid_model_output"


class SandboxFileError(SandboxError, OSError):
    code = "file_error"


class SandboxFileNotFound(SandboxFileError, FileNotFoundError):
    code = "file_not_found"


class PathOutsideWorkspace(SandboxFileError, PermissionError):
    code = "path_outside_workspace"


class SandboxPermissionError(SandboxFileError, PermissionError):
    code = "permission_denied"


class SandboxIsADirectory(SandboxFileError, IsADirectoryError):
    code = "is_a_directory"


class SandboxNotADirectory(SandboxFileError, NotADirectoryError):
    code = "not_a_directory"


class SandboxFileExists(SandboxFileError, FileExistsError):
    code = "file_exists"


class SandboxDiskFull(SandboxFileError):
    code = "disk_full"


class SandboxIOError(SandboxFileError):
    """The file operation failed for a reason of the file's or the request's (the errno is
    in the message): never a reason to restart the guest."""

    code = "io_error"


class SandboxFileBusy(SandboxFileError, BlockingIOError):
    """A process in the sandbox holds a lease on the file, or runs it: try again once it lets
    go."""

    code = "file_busy"


_BY_CODE: dict[str, type[SandboxError]] = {
    cls.code: cls
    for cls in (
        SandboxError,
        ConfigError,
        InvalidRequest,
        BackendUnavailable,
        SandboxNotFound,
        SandboxNotRunning,
        SandboxHeldElsewhere,
        SandboxLost,
        NodeTimeout,
        SandboxStartError,
        VolumeNotFound,
        VolumeExists,
        VolumeInUse,
        ImageBuildError,
        GuestError,
        PidsExhausted,
        GuestDied,
        GuestChannelBroken,
        GuestTimeout,
        ClientGone,
        ProtocolMismatch,
        AuthenticationError,
        Forbidden,
        QuotaExceeded,
        BackgroundLimitReached,
        TooManyListeners,
        StdinBacklogFull,
        McpSessionLimit,
        CommandNotFound,
        CommandStillRunning,
        CapacityExhausted,
        FileDescriptorsExhausted,
        RateLimited,
        RequestTooLarge,
        ProviderError,
        ProviderAuthError,
        ProviderRateLimited,
        ProviderRequestRefused,
        ModelOutputError,
        SandboxFileError,
        SandboxFileNotFound,
        PathOutsideWorkspace,
        SandboxPermissionError,
        SandboxIsADirectory,
        SandboxNotADirectory,
        SandboxFileExists,
        SandboxDiskFull,
        SandboxFileBusy,
        SandboxIOError,
        TooManyOpen,
        TooManyConnections,
        TooManyAgentTasks,
        AgentTimeout,
        KeylessRefused,
        ToolNotFound,
    )
}


def error_from_code(code: str, message: str) -> SandboxError:
    """Build our exception for a wire ``code``; unknown codes become a plain SandboxError."""
    cls = _BY_CODE.get(code, SandboxError)
    error = cls(message)
    return error
