"""sandlot: isolated, stateful, resource-limited sandboxes for code AI agents write.

>>> from sandlot import Sandbox
>>> with Sandbox.create(memory_mb=256, timeout_s=5) as sb:   # doctest: +SKIP
...     sb.run_code("x = 41")
...     sb.run_code("x + 1").text
'42'
"""

from sandlot._version import __version__
from sandlot.config import Settings, get_settings
from sandlot.core import SandboxManager
from sandlot.errors import (
    AuthenticationError,
    BackendUnavailable,
    ConfigError,
    Forbidden,
    GuestError,
    InvalidRequest,
    PathOutsideWorkspace,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    SandboxDiskFull,
    SandboxError,
    SandboxFileError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxHeldElsewhere,
    SandboxIsADirectory,
    SandboxLost,
    SandboxNotADirectory,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxPermissionError,
    SandboxStartError,
    VolumeExists,
    VolumeInUse,
    VolumeNotFound,
)
from sandlot.models import (
    ArtifactInfo,
    CommandInfo,
    ExecError,
    ExecResult,
    FileInfo,
    KillReason,
    Listing,
    ResolvedLimits,
    ResourceUsage,
    Result,
    SandboxInfo,
    SandboxLimits,
    SandboxStatus,
    VolumeInfo,
    VolumeMount,
)
from sandlot.requests import (
    FilePath,
    ListFiles,
    RemoveFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
    WriteFile,
)
from sandlot.sandbox import AsyncSandbox, Sandbox
from sandlot.volume import AsyncVolume, Volume

__all__ = [
    "AgentRuntime",
    "ArtifactInfo",
    "AsyncSandbox",
    "AsyncVolume",
    "AuthenticationError",
    "BackendUnavailable",
    "CommandInfo",
    "ConfigError",
    "ExecError",
    "ExecResult",
    "FileInfo",
    "FilePath",
    "Forbidden",
    "GuestError",
    "InvalidRequest",
    "KillReason",
    "ListFiles",
    "Listing",
    "PathOutsideWorkspace",
    "QuotaExceeded",
    "RateLimited",
    "RemoveFile",
    "RequestTooLarge",
    "ResolvedLimits",
    "ResourceUsage",
    "Result",
    "RunCode",
    "RunCommand",
    "Sandbox",
    "SandboxDiskFull",
    "SandboxError",
    "SandboxFileError",
    "SandboxFileExists",
    "SandboxFileNotFound",
    "SandboxHeldElsewhere",
    "SandboxInfo",
    "SandboxIsADirectory",
    "SandboxLimits",
    "SandboxLost",
    "SandboxManager",
    "SandboxNotADirectory",
    "SandboxNotFound",
    "SandboxNotRunning",
    "SandboxPermissionError",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxStatus",
    "SetTimeout",
    "Settings",
    "Volume",
    "VolumeExists",
    "VolumeInUse",
    "VolumeInfo",
    "VolumeMount",
    "VolumeNotFound",
    "WriteFile",
    "__version__",
    "get_settings",
]


def __getattr__(name: str) -> object:
    # The agent layer is optional (LangGraph): import it only when it is asked for.
    if name == "AgentRuntime":
        from sandlot.agent.runtime import AgentRuntime

        return AgentRuntime
    raise AttributeError(f"module 'sandlot' has no attribute {name!r}")
