"""Settings: one model, one documented order of precedence.

explicit argument > environment variable > ``.env`` file in the working directory > default.

Names follow the seeds where they give one (``SANDBOX_TIMEOUT_SECONDS``,
``SANDBOX_MEMORY_LIMIT_MB``); every other variable is listed in the README.
"""

from __future__ import annotations

import ipaddress
import os
import warnings
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sandlot.errors import ConfigError
from sandlot.models import ResolvedLimits, SandboxLimits

# Where a networked sandbox may not go by default: "this network", the private ranges, the
# carrier-grade NAT range (some clouds' internal services), link-local (every cloud's
# metadata service: the host's credentials), multicast and the reserved range above it.
DEFAULT_DENY_CIDRS = (
    "0.0.0.0/8,10.0.0.0/8,100.64.0.0/10,169.254.0.0/16,172.16.0.0/12,192.168.0.0/16,224.0.0.0/3"
)


def ipv4_networks(text: str) -> list[str]:
    """A comma-separated list of IPv4 networks (``"10.0.0.5, 169.254.0.0/16"``), each
    normalized (``10.0.0.5/32``); empty entries skipped.

    Raises:
        ValueError: an entry that is not an IPv4 address or network, named.
    """
    found = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        try:
            found.append(str(ipaddress.IPv4Network(entry, strict=False)))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IPv4 address or CIDR") from None
    return found


def ip_networks(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A comma-separated list of IPv4 or IPv6 networks (``"127.0.0.0/8, fd00::/8"``; an
    address is a network of one); empty entries skipped.

    Raises:
        ValueError: an entry that is not an IP address or network, named.
    """
    found: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        try:
            found.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or CIDR") from None
    return found


def _default_data_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/sandlot")
    return Path.home() / ".local" / "share" / "sandlot"


def _env(name: str, field: str) -> AliasChoices:
    return AliasChoices(field, name)


# The project was called agent-sandbox: its own variables were AGENT_SANDBOX_*. They are read
# for one more release (the new name wins when both are set), with a warning.
OLD_PREFIX, NEW_PREFIX = "AGENT_SANDBOX_", "SANDLOT_"


def _renamed(name: str, field: str) -> AliasChoices:
    return AliasChoices(field, name, OLD_PREFIX + name.removeprefix(NEW_PREFIX))


def warn_old_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn (FutureWarning) about AGENT_SANDBOX_* variables; return the names found."""
    old = sorted(
        k for k in (os.environ if environ is None else environ) if k.startswith(OLD_PREFIX)
    )
    if old:
        renames = ", ".join(f"{k} -> {NEW_PREFIX}{k.removeprefix(OLD_PREFIX)}" for k in old)
        warnings.warn(
            f"AGENT_SANDBOX_* variables are deprecated and will stop working in the next "
            f"release; rename them: {renames}",
            FutureWarning,
            stacklevel=2,
        )
    return old


class Settings(BaseSettings):
    """Everything configurable, with the environment variable that sets it."""

    model_config = SettingsConfigDict(
        env_file=".env", extra="ignore", populate_by_name=True, case_sensitive=False
    )

    backend: str = Field(
        default="bubblewrap",
        validation_alias=_env("SANDBOX_BACKEND", "backend"),
        description="Default backend for new sandboxes.",
    )
    environment: str = Field(
        default="python3",
        validation_alias=_env("SANDBOX_ENVIRONMENT", "environment"),
        description="Default environment (a name from the YAML registry) for new sandboxes.",
    )
    docker_runtime: str = Field(
        default="runc",
        validation_alias=_env("SANDBOX_DOCKER_RUNTIME", "docker_runtime"),
        description="Default OCI runtime of the docker backend: runc, or runsc for gVisor.",
    )
    registry_dir: Path | None = Field(
        default=None,
        validation_alias=_renamed("SANDLOT_REGISTRY_DIR", "registry_dir"),
        description="A directory whose environments/*.yaml add to the shipped registry.",
    )
    rootfs_dir: Path = Field(
        # Not <data dir>/rootfs: that name is a pre-instance layout's bubblewrap state, which
        # recovery removes from a data dir (core/instances.py LEGACY_STATE).
        default=Path("/var/lib/sandlot/rootfs-store"),
        validation_alias=_env("SANDBOX_ROOTFS_DIR", "rootfs_dir"),
        description=(
            "Built root file system trees, one per environment and spec (`sandlot image "
            "build`): machine-wide and kept across runs, never inside a data dir's state."
        ),
    )
    allow_unsafe: bool = Field(
        default=False,
        validation_alias=_env("SANDBOX_ALLOW_UNSAFE", "allow_unsafe"),
        description="Allow the unsafe-local backend (no isolation): tests and development only.",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        validation_alias=_env("SANDBOX_TIMEOUT_SECONDS", "timeout_s"),
        description="Default per-call timeout of code and commands.",
    )
    memory_mb: int = Field(
        default=256,
        ge=16,
        validation_alias=_env("SANDBOX_MEMORY_LIMIT_MB", "memory_mb"),
        description="Memory limit of a sandbox (swap is not allowed on top).",
    )
    cpu_cores: float = Field(
        default=0.5,
        gt=0,
        validation_alias=_env("SANDBOX_CPU_LIMIT", "cpu_cores"),
        description="CPU quota of a sandbox in cores (0.5 = half of one core).",
    )
    pids: int = Field(
        default=256,
        ge=16,
        validation_alias=_env("SANDBOX_PIDS_LIMIT", "pids"),
        description="Most processes and threads alive at once in a sandbox.",
    )
    disk_mb: int = Field(
        default=512,
        ge=8,
        validation_alias=_env("SANDBOX_DISK_LIMIT_MB", "disk_mb"),
        description="Size cap of the writable /workspace.",
    )
    output_limit_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=8 << 20,
        validation_alias=_env("SANDBOX_OUTPUT_LIMIT_BYTES", "output_limit_bytes"),
        description="Bytes of each stream kept in a result (head and tail).",
    )
    output_file_limit_mb: int = Field(
        default=100,
        ge=1,
        validation_alias=_env("SANDBOX_OUTPUT_FILE_LIMIT_MB", "output_file_limit_mb"),
        description="A call whose stream passes this size is killed (kill_reason output_limit).",
    )
    network: bool = Field(
        default=False,
        validation_alias=_env("SANDBOX_NETWORK", "network"),
        description="Give new sandboxes a network unless the caller says otherwise.",
    )
    network_max_connections: int = Field(
        default=1024,
        ge=16,
        validation_alias=_env("SANDBOX_NETWORK_MAX_CONNECTIONS", "network_max_connections"),
        description="bubblewrap as root: connections (TCP, UDP flows) one networked sandbox "
        "may have tracked by the host at once; past it new ones are refused. All networked "
        "sandboxes together get at most half of the host's table (nf_conntrack_max).",
    )
    network_deny_cidrs: str = Field(
        default=DEFAULT_DENY_CIDRS,
        validation_alias=_env("SANDBOX_NETWORK_DENY_CIDRS", "network_deny_cidrs"),
        description="Comma-separated IPv4 CIDRs a networked sandbox may not reach through "
        "the host (DNS to the host's resolvers excepted). By default link-local (cloud "
        "metadata services, 169.254.169.254) and the private ranges (the host's LAN); set "
        "it to 169.254.0.0/16 to let sandboxes reach the LAN. Root's bubblewrap and docker.",
    )
    ttl_s: float = Field(
        default=3600.0,
        gt=0,
        validation_alias=_env("SANDBOX_TTL_SECONDS", "ttl_s"),
        description="Absolute lifetime of a sandbox.",
    )
    idle_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        validation_alias=_env("SANDBOX_IDLE_TIMEOUT_SECONDS", "idle_timeout_s"),
        description="A sandbox with no call for this long is destroyed.",
    )
    artifact_retention_s: float = Field(
        default=7 * 86_400,
        gt=0,
        validation_alias=_env("SANDBOX_ARTIFACT_RETENTION_SECONDS", "artifact_retention_s"),
        description="Kept artifacts are deleted this long after they were kept.",
    )
    reaper_interval_s: float = Field(
        default=5.0,
        gt=0,
        validation_alias=_env("SANDBOX_REAPER_INTERVAL_SECONDS", "reaper_interval_s"),
        description="How often expired and idle sandboxes are looked for.",
    )
    max_memory_mb: int = Field(
        default=8192,
        ge=16,
        validation_alias=_env("SANDBOX_MAX_MEMORY_MB", "max_memory_mb"),
        description="Largest memory_mb a caller may ask for.",
    )
    max_cpu_cores: float = Field(
        default=float(os.cpu_count() or 1),
        gt=0,
        validation_alias=_env("SANDBOX_MAX_CPU_CORES", "max_cpu_cores"),
        description="Largest cpu_cores a caller may ask for (default: this host's cores).",
    )
    max_pids: int = Field(
        default=4096,
        ge=16,
        validation_alias=_env("SANDBOX_MAX_PIDS", "max_pids"),
        description="Largest pids a caller may ask for.",
    )
    max_disk_mb: int = Field(
        default=8192,
        ge=8,
        validation_alias=_env("SANDBOX_MAX_DISK_MB", "max_disk_mb"),
        description="Largest disk_mb a caller may ask for.",
    )
    max_volume_mb: int = Field(
        default=4096,
        ge=1,
        validation_alias=_env("SANDBOX_MAX_VOLUME_MB", "max_volume_mb"),
        description="Largest size_mb a named volume may have.",
    )
    max_output_file_limit_mb: int = Field(
        default=1024,
        ge=1,
        validation_alias=_env("SANDBOX_MAX_OUTPUT_FILE_LIMIT_MB", "max_output_file_limit_mb"),
        description="Largest output_file_limit_mb a caller may ask for.",
    )
    max_background_commands: int = Field(
        default=16,
        ge=1,
        le=1024,
        validation_alias=_env("SANDBOX_MAX_BACKGROUND_COMMANDS", "max_background_commands"),
        description="Background commands one sandbox may run at once.",
    )
    max_ptys: int = Field(
        default=32,
        ge=1,
        le=4096,
        validation_alias=_env("SANDBOX_MAX_PTYS", "max_ptys"),
        description="Pseudo-terminals one sandbox may hold open at once (its devpts "
        "instance's max; root's bubblewrap and docker on runc): all sandboxes draw on the "
        "host's kernel.pty.max.",
    )
    mcp_sessions_per_key: int = Field(
        default=32,
        ge=1,
        le=10_000,
        validation_alias=_env("SANDBOX_MCP_SESSIONS_PER_KEY", "mcp_sessions_per_key"),
        description="MCP sessions one API key may hold open at once on /mcp.",
    )
    pool_size: int = Field(
        default=0,
        ge=0,
        le=64,
        validation_alias=_env("SANDBOX_POOL_SIZE", "pool_size"),
        description="Sandboxes kept started with the default settings, so create is instant.",
    )
    pools: dict[str, int] = Field(
        default_factory=dict,
        validation_alias=_env("SANDBOX_POOLS", "pools"),
        description=(
            "Warm pools per backend, runtime and environment, as JSON: "
            '{"docker:python3": 2, "docker+runsc:node": 1}. Keys are backend[+runtime][:env].'
        ),
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        validation_alias=_renamed("SANDLOT_DATA_DIR", "data_dir"),
        description="SQLite store, workspaces and kept artifacts.",
    )
    uid_base: int = Field(
        default=200_000,
        ge=1000,
        validation_alias=_env("SANDBOX_UID_BASE", "uid_base"),
        description="First host uid given to sandboxes (each sandbox gets its own).",
    )
    uid_count: int = Field(
        default=10_000,
        ge=1,
        validation_alias=_env("SANDBOX_UID_COUNT", "uid_count"),
        description="How many host uids from uid_base sandboxes may use.",
    )
    cgroup_root: str = Field(
        default="sandlot",
        validation_alias=_env("SANDBOX_CGROUP_ROOT", "cgroup_root"),
        description="Cgroup (relative to each hierarchy's root) under which sandboxes live.",
    )
    require_limits: bool = Field(
        default=False,
        validation_alias=_env("SANDBOX_REQUIRE_LIMITS", "require_limits"),
        description="Refuse to start sandboxes without a cgroup (rootless with no delegated "
        "cgroup v2 subtree) instead of falling back to per-process rlimits.",
    )
    guest_template: bool = Field(
        default=True,
        validation_alias=_env("SANDBOX_GUEST_TEMPLATE", "guest_template"),
        description="bubblewrap as root: fork each new guest from a template interpreter per "
        "system, already imported, instead of starting one (~10 ms of CPU less a create); "
        "false starts every guest afresh (as rootless always does).",
    )
    raise_file_max: bool = Field(
        default=True,
        validation_alias=_env("SANDBOX_RAISE_FILE_MAX", "raise_file_max"),
        description="bubblewrap or docker, as root: lift the host's open-file cap "
        "(fs.file-max) to its maximum, as systemd does at boot, so that the files a sandbox "
        "opens are bounded by its memory alone and sandboxes together cannot fill the host's "
        "file table.",
    )
    guest_template_scope: Literal["tenant", "system"] = Field(
        default="tenant",
        validation_alias=_env("SANDBOX_GUEST_TEMPLATE_SCOPE", "guest_template_scope"),
        description="What a guest template's forks have in common (its memory layout and "
        "Python's hash secret): tenant, one template per system and owner, a pooled sandbox "
        "forked only for the tenant of the pool's last creates (for anyone it starts "
        "afresh); system, one per system for every owner, the pool included (one trust "
        "domain).",
    )
    max_guest_templates: int = Field(
        default=16,
        ge=1,
        le=4096,
        validation_alias=_env("SANDBOX_MAX_GUEST_TEMPLATES", "max_guest_templates"),
        description="Guest templates kept running at once by one manager (~4.5 MB of host "
        "memory each): past it, the least recently used one idle (no live guest) for 30 s is "
        "closed, and with none such a guest starts afresh.",
    )
    api_host: str = Field(
        default="127.0.0.1",
        validation_alias=_env("API_HOST", "api_host"),
        description="Address `sandlot serve` listens on.",
    )
    api_port: int = Field(
        default=8000,
        ge=0,
        le=65535,
        validation_alias=_env("API_PORT", "api_port"),
        description="Port `sandlot serve` listens on.",
    )
    api_workers: int = Field(
        default=1,
        ge=1,
        le=1,
        validation_alias=_env("API_WORKERS", "api_workers"),
        description="Server processes. Sandboxes live in the process that made them, so one "
        "process serves a data directory; scale out with more hosts.",
    )
    auth_enabled: bool = Field(
        default=True,
        validation_alias=_env("SANDBOX_AUTH_ENABLED", "auth_enabled"),
        description="Require API keys (`serve --no-auth` turns this off for local use).",
    )
    rate_limit_per_s: float = Field(
        default=50.0,
        gt=0,
        validation_alias=_env("API_RATE_LIMIT_PER_SECOND", "rate_limit_per_s"),
        description="Sustained requests per second allowed per API key.",
    )
    rate_limit_burst: int = Field(
        default=100,
        ge=1,
        validation_alias=_env("API_RATE_LIMIT_BURST", "rate_limit_burst"),
        description="Requests one API key may send at once above the sustained rate.",
    )
    auth_failures_per_s: float = Field(
        default=2.0,
        ge=0,
        validation_alias=_env("API_AUTH_FAILURES_PER_SECOND", "auth_failures_per_s"),
        description="Failed authentications (401) one client address may have a second past "
        "its burst; past them its connections are closed unread until it has credit again "
        "(0: no limit; none is kept with API_MAX_CONNECTIONS_PER_IP=0).",
    )
    auth_failures_burst: int = Field(
        default=30,
        ge=1,
        validation_alias=_env("API_AUTH_FAILURES_BURST", "auth_failures_burst"),
        description="Failed authentications one client address may have at once.",
    )
    tenant_max_sandboxes: int = Field(
        default=10,
        ge=0,
        validation_alias=_env("TENANT_MAX_SANDBOXES", "tenant_max_sandboxes"),
        description="Default quota: live sandboxes per tenant.",
    )
    tenant_max_memory_mb: int = Field(
        default=4096,
        ge=0,
        validation_alias=_env("TENANT_MAX_MEMORY_MB", "tenant_max_memory_mb"),
        description="Default quota: total memory_mb of a tenant's live sandboxes.",
    )
    tenant_max_pids: int = Field(
        default=4096,
        ge=0,
        validation_alias=_env("TENANT_MAX_PIDS", "tenant_max_pids"),
        description="Default quota: total pids limit of a tenant's live sandboxes.",
    )
    tenant_max_cpu_cores: float = Field(
        default_factory=lambda: 4.0 * (os.cpu_count() or 1),
        ge=0,
        validation_alias=_env("TENANT_MAX_CPU_CORES", "tenant_max_cpu_cores"),
        description="Default quota: total cpu_cores of a tenant's live sandboxes (default: "
        "4 times the host's cores; CPU is time-shared, so quotas may add up to more).",
    )
    tenant_max_disk_mb: int = Field(
        default=8192,
        ge=0,
        validation_alias=_env("TENANT_MAX_DISK_MB", "tenant_max_disk_mb"),
        description="Default quota: total disk_mb of a tenant's live sandboxes.",
    )
    tenant_max_artifact_mb: int = Field(
        default=1024,
        ge=0,
        validation_alias=_env("TENANT_MAX_ARTIFACT_MB", "tenant_max_artifact_mb"),
        description="Default quota: kept artifacts of all a tenant's sandboxes.",
    )
    tenant_max_volumes: int = Field(
        default=16,
        ge=0,
        validation_alias=_env("TENANT_MAX_VOLUMES", "tenant_max_volumes"),
        description="Default quota: named volumes a tenant may keep.",
    )
    tenant_max_volume_mb: int = Field(
        default=8192,
        ge=0,
        validation_alias=_env("TENANT_MAX_VOLUME_MB", "tenant_max_volume_mb"),
        description="Default quota: total size of a tenant's named volumes.",
    )
    host_memory_overcommit: float = Field(
        default=1.0,
        gt=0,
        validation_alias=_env("SANDBOX_HOST_MEMORY_OVERCOMMIT", "host_memory_overcommit"),
        description="Sandboxes' memory limits together may reach this many times the host's "
        "RAM (1.0: never more than there is; raise it for many mostly-idle sandboxes).",
    )
    host_memory_mb: float | None = Field(
        default=None,
        gt=0,
        validation_alias=_env("SANDBOX_HOST_MEMORY_MB", "host_memory_mb"),
        description="At most this much memory (MB) reserved by all sandboxes together "
        "(default: none beyond the host's memory, or its memory cgroup's limit where lower, "
        "times SANDBOX_HOST_MEMORY_OVERCOMMIT). A Ray node agent lowers it under the memory "
        "at which Ray's memory monitor kills the agent.",
    )
    host_cpu_overcommit: float = Field(
        default=16.0,
        gt=0,
        validation_alias=_env("SANDBOX_HOST_CPU_OVERCOMMIT", "host_cpu_overcommit"),
        description="Sandboxes' CPU quotas together may reach this many times the host's cores.",
    )
    host_pids_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        validation_alias=_env("SANDBOX_HOST_PIDS_FRACTION", "host_pids_fraction"),
        description="Sandboxes' pids limits together may reach this share of the kernel's "
        "process table (the rest stays for the host).",
    )
    host_ledger_dir: Path = Field(
        default=Path("/run/sandlot/reserved"),
        validation_alias=_env("SANDBOX_HOST_LEDGER_DIR", "host_ledger_dir"),
        description="Where each manager says what its sandboxes reserve, so that the "
        "managers of every data directory on the host share one capacity (root only: "
        "rootless managers count their own data directory's).",
    )
    host_disk_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        validation_alias=_env("SANDBOX_HOST_DISK_FRACTION", "host_disk_fraction"),
        description="Sandboxes' disk limits together may reach this share of the space free "
        "in the data directory when the manager started.",
    )
    max_metadata_bytes: int = Field(
        default=16384,
        ge=0,
        validation_alias=_env("SANDBOX_MAX_METADATA_BYTES", "max_metadata_bytes"),
        description="Largest metadata of one sandbox (keys and values together, as stored: JSON, "
        "where a control character takes 6 bytes and a quote or backslash 2).",
    )
    record_retention_s: float = Field(
        default=7 * 86_400.0,
        gt=0,
        validation_alias=_env("SANDBOX_RECORD_RETENTION_SECONDS", "record_retention_s"),
        description="How long the record of an ended sandbox is kept (one with kept "
        "artifacts stays as long as they do).",
    )
    max_ended_records: int = Field(
        default=10_000,
        ge=1,
        validation_alias=_env("SANDBOX_MAX_ENDED_RECORDS", "max_ended_records"),
        description="Ended sandboxes' records kept per tenant, newest first, those with kept "
        "artifacts too: older ones are forgotten before their retention ends, and their kept "
        "artifacts deleted with them.",
    )
    max_upload_mb: int = Field(
        default=100,
        ge=1,
        validation_alias=_env("API_MAX_UPLOAD_MB", "max_upload_mb"),
        description="Largest file upload the server accepts.",
    )
    max_body_mb: int = Field(
        default=8,
        ge=1,
        le=1024,
        validation_alias=_env("API_MAX_BODY_MB", "max_body_mb"),
        description="Largest request body other than an upload (read only after the API key "
        "was checked).",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        validation_alias=_env("API_HEADER_TIMEOUT_SECONDS", "header_timeout_s"),
        description="A request's line and headers must arrive within this long.",
    )
    body_idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        validation_alias=_env("API_BODY_IDLE_TIMEOUT_SECONDS", "body_idle_timeout_s"),
        description="A request body that sends nothing for this long is dropped.",
    )
    keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        validation_alias=_env("API_KEEPALIVE_TIMEOUT_SECONDS", "keepalive_timeout_s"),
        description="An idle keep-alive connection is closed after this long.",
    )
    api_event_loop: Literal["asyncio", "uvloop"] = Field(
        default="asyncio",
        validation_alias=_env("API_EVENT_LOOP", "api_event_loop"),
        description=(
            "The server's event loop. asyncio's own by default: it starts each sandbox's "
            "launcher with vfork, where uvloop forks the whole server process, so a sandbox's "
            "lifecycle through the server costs about a third less of the server's CPU, and "
            "uvloop measured no faster on calls either (BENCHMARKS.md)."
        ),
    )
    max_header_kb: int = Field(
        default=64,
        ge=4,
        validation_alias=_env("API_MAX_HEADER_KB", "max_header_kb"),
        description="Largest request line plus headers.",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        validation_alias=_env("API_MAX_CONNECTIONS", "max_connections"),
        description="Open HTTP connections the server holds at once; more are closed at once.",
    )
    max_connections_per_ip: int = Field(
        default=100,
        ge=0,
        validation_alias=_env("API_MAX_CONNECTIONS_PER_IP", "max_connections_per_ip"),
        description="Open HTTP connections one client address may hold (0: no cap, e.g. "
        "behind a reverse proxy).",
    )
    max_open_per_tenant: int = Field(
        default=100,
        ge=0,
        validation_alias=_env("API_MAX_OPEN_PER_TENANT", "max_open_per_tenant"),
        description="Requests and WebSockets one tenant's keys may have open at once "
        "(long-polls, streams, runs under way); past it, 429 too_many_open (0: no cap).",
    )
    webhook_allow_cidrs: str = Field(
        default="",
        validation_alias=_env("API_WEBHOOK_ALLOW_CIDRS", "webhook_allow_cidrs"),
        description="Comma-separated IPv4 or IPv6 networks a background command's webhook "
        "may reach although they are not public (loopback, private, link-local, CGNAT, ...: "
        "refused by default, so that no tenant can make the server call its own host, its "
        "LAN or a cloud metadata service). Empty: public addresses only.",
    )
    webhooks_pending_per_tenant: int = Field(
        default=100,
        ge=1,
        validation_alias=_env("API_WEBHOOKS_PENDING_PER_TENANT", "webhooks_pending_per_tenant"),
        description="Webhook deliveries one tenant may have waiting or under way at once; "
        "past it a new one is dropped (counted in sandlot_webhook_deliveries_total, "
        "outcome=dropped). Deliveries are kept in memory only: a restart loses them.",
    )
    allowed_origins: str = Field(
        default="",
        validation_alias=_env("API_ALLOWED_ORIGINS", "allowed_origins"),
        description="With API keys off (`serve --no-auth`), the web pages (origins, such as "
        "`http://localhost:3000`) besides the server's own that may call it, comma-separated; "
        "any other page's request is refused (403).",
    )
    allowed_hosts: str = Field(
        default="localhost,127.0.0.1,::1",
        validation_alias=_env("API_ALLOWED_HOSTS", "allowed_hosts"),
        description="With API keys off (`serve --no-auth`), the host names a request may be "
        "addressed to (its Host header), comma-separated, or `*` for any; a request from a web "
        "page (an Origin header) must come from one of them too. Guards a keyless server "
        "against other sites' pages: DNS rebinding and cross-site posts and WebSockets (an "
        "Origin must be the server's own page or one of API_ALLOWED_ORIGINS).",
    )
    metrics_public: bool = Field(
        default=False,
        validation_alias=_env("API_METRICS_PUBLIC", "metrics_public"),
        description="Serve /metrics without a key (it shows every tenant's activity: by "
        "default it takes an admin key); for a scraper on a private network.",
    )
    agent_tasks_per_tenant: int = Field(
        default=2,
        ge=0,
        validation_alias=_env("API_AGENT_TASKS_PER_TENANT", "agent_tasks_per_tenant"),
        description="Agent tasks (POST /execute with a task, WS /stream) one tenant may have "
        "running at once: each holds the server's one model for its calls, a core of the "
        "server's own CPU, charged to no sandbox; past it, 429 too_many_agent_tasks (0: no "
        "cap).",
    )
    agent_task_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        validation_alias=_env("API_AGENT_TASK_TIMEOUT_SECONDS", "agent_task_timeout_s"),
        description="An agent task still running after this long is ended (504 agent_timeout), "
        "its sandbox with it.",
    )
    stream_queue_mb_per_tenant: int = Field(
        default=64,
        ge=1,
        validation_alias=_env("API_STREAM_QUEUE_MB_PER_TENANT", "stream_queue_mb_per_tenant"),
        description="Output queued on all of one tenant's WebSockets for clients that have "
        "not read it yet; past it, streamed output is dropped (each stream also holds at "
        "most 8 MiB).",
    )
    stream_messages_per_s: float = Field(
        default=500.0,
        gt=0,
        validation_alias=_env("API_STREAM_MESSAGES_PER_SECOND", "stream_messages_per_s"),
        description="Messages (input, stdin, resizes) all of one tenant's WebSocket streams "
        "are read at, past a burst of twice as many, a message counting once more for each "
        "16 KiB of it; a client that sends faster waits.",
    )
    ws_max_message_kb: int = Field(
        default=4096,
        ge=64,
        validation_alias=_env("API_WS_MAX_MESSAGE_KB", "ws_max_message_kb"),
        description="Largest WebSocket message a client may send.",
    )
    ws_stdin_backlog_kb: int = Field(
        default=1024,
        ge=1,
        validation_alias=_env("API_WS_STDIN_BACKLOG_KB", "ws_stdin_backlog_kb"),
        description="Stdin sent over a WebSocket and not yet taken by the command; past it "
        "the run is refused more input.",
    )
    api_url: str | None = Field(
        default=None,
        validation_alias=_renamed("SANDLOT_URL", "api_url"),
        description="SDK: use this server instead of embedded mode.",
    )
    api_key: str | None = Field(
        default=None,
        validation_alias=_renamed("SANDLOT_API_KEY", "api_key"),
        description="SDK and CLI: the API key sent to the server.",
    )
    ray_address: str | None = Field(
        default=None,
        validation_alias=_renamed("SANDLOT_RAY_ADDRESS", "ray_address"),
        description="Serve a Ray cluster's node agents (e.g. 10.0.0.1:6379, or auto) instead "
        "of sandboxes in this process (`sandlot serve --ray`).",
    )
    ray_namespace: str = Field(
        default="sandlot",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        validation_alias=_renamed("SANDLOT_RAY_NAMESPACE", "ray_namespace"),
        description="The Ray namespace of sandlot's named actors (node agents, quota ledger).",
    )
    ray_node_max_sandboxes: int = Field(
        default=1000,
        ge=1,
        validation_alias=_renamed("SANDLOT_RAY_NODE_MAX_SANDBOXES", "ray_node_max_sandboxes"),
        description="Live sandboxes one Ray node agent may hold; placement skips a full node.",
    )
    ray_wall_node: bool = Field(
        default=True,
        validation_alias=_renamed("SANDLOT_RAY_WALL_NODE", "ray_wall_node"),
        description="A Ray node agent refuses new connections from networked sandboxes to the "
        "node itself (Ray's ports among them). Off only for tests that share a host.",
    )
    ray_wall_extra_cidrs: str = Field(
        default="",
        validation_alias=_renamed("SANDLOT_RAY_WALL_EXTRA_CIDRS", "ray_wall_extra_cidrs"),
        description="Comma-separated IPv4 CIDRs a networked sandbox on a Ray node may never "
        "reach, on top of every Ray node's address (Redis for GCS fault tolerance, the "
        "Kubernetes API, 169.254.169.254).",
    )
    ray_call_timeout_s: float = Field(
        default=30.0,
        gt=0,
        validation_alias=_renamed("SANDLOT_RAY_CALL_TIMEOUT_SECONDS", "ray_call_timeout_s"),
        description="How long a short call (not a run) to a node agent may take: past it the "
        "call fails alone (node_timeout, HTTP 504) while the agent still answers a 2 s probe; "
        "the node counts as lost (sandbox_lost) only when the agent answers neither. Also how "
        "long any call may be silent before that probe.",
    )
    log_level: str = Field(default="INFO", validation_alias=_env("LOG_LEVEL", "log_level"))
    log_format: Literal["console", "json"] = Field(
        default="console", validation_alias=_env("LOG_FORMAT", "log_format")
    )

    @field_validator("network_deny_cidrs")
    @classmethod
    def _ipv4_networks(cls, value: str) -> str:
        ipv4_networks(value)
        return value

    @field_validator("webhook_allow_cidrs")
    @classmethod
    def _ip_networks(cls, value: str) -> str:
        ip_networks(value)
        return value

    def network_deny_list(self) -> list[str]:
        """``network_deny_cidrs`` as normalized networks (``10.0.0.5`` -> ``10.0.0.5/32``)."""
        return ipv4_networks(self.network_deny_cidrs)

    def resolve_limits(self, limits: SandboxLimits | None) -> ResolvedLimits:
        """Fill every unset field of ``limits`` from these settings."""
        given = limits.model_dump(exclude_none=True) if limits else {}
        defaults = {
            "memory_mb": self.memory_mb,
            "cpu_cores": self.cpu_cores,
            "pids": self.pids,
            "timeout_s": self.timeout_s,
            "disk_mb": self.disk_mb,
            "output_limit_bytes": self.output_limit_bytes,
            "output_file_limit_mb": self.output_file_limit_mb,
        }
        resolved = ResolvedLimits(**(defaults | given))
        ceilings = {
            "memory_mb": ("max_memory_mb", "SANDBOX_MAX_MEMORY_MB"),
            "cpu_cores": ("max_cpu_cores", "SANDBOX_MAX_CPU_CORES"),
            "pids": ("max_pids", "SANDBOX_MAX_PIDS"),
            "disk_mb": ("max_disk_mb", "SANDBOX_MAX_DISK_MB"),
            "output_file_limit_mb": (
                "max_output_file_limit_mb",
                "SANDBOX_MAX_OUTPUT_FILE_LIMIT_MB",
            ),
        }
        for name, (ceiling, env) in ceilings.items():
            if getattr(resolved, name) > getattr(self, ceiling):
                raise ConfigError(
                    f"{name}={getattr(resolved, name)} is over this server's ceiling of "
                    f"{getattr(self, ceiling)}; ask for less, or raise {env}"
                )
        return resolved


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment and ``.env``.

    Raises:
        ConfigError: a variable's value is not one its setting takes (named, with the
            variable).
    """
    warn_old_names()
    try:
        return Settings()
    except ValidationError as exc:  # a variable's typo: name it, and what it takes
        raise ConfigError(explain_invalid(exc, "invalid setting")) from None


def explain_invalid(exc: ValidationError, what: str) -> str:
    """One clause per problem, each naming the argument and, where a setting gives its
    default, that setting's environment variable."""
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "?"
        field = Settings.model_fields.get(name)
        alias = field.validation_alias if field is not None else None
        env = f" (default from {alias.choices[-1]})" if isinstance(alias, AliasChoices) else ""
        given = repr(error.get("input"))
        if len(given) > MAX_ECHOED_CHARS:  # a 1 MiB command was echoed whole, in every log
            given = f"{given[:MAX_ECHOED_CHARS]}... ({len(given)} characters)"
        problems.append(f"{name}={given}: {error['msg']}{env}")
    return f"{what}: " + "; ".join(problems)


# How much of a refused value an error message repeats.
MAX_ECHOED_CHARS = 200
