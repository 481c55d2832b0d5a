"""What every route shares: the server's state, the caller, audit, and error bodies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import structlog
from fastapi import Path, Request, WebSocket
from fastapi.responses import JSONResponse

from sandlot.config import Settings
from sandlot.core import SandboxManager
from sandlot.errors import (
    AgentTimeout,
    AuthenticationError,
    BackendUnavailable,
    CapacityExhausted,
    ClientGone,
    ConfigError,
    Forbidden,
    GuestError,
    GuestTimeout,
    InvalidRequest,
    KeylessRefused,
    ModelOutputError,
    NodeTimeout,
    PathOutsideWorkspace,
    ProviderError,
    ProviderRateLimited,
    QuotaExceeded,
    RateLimited,
    RequestTooLarge,
    SandboxDiskFull,
    SandboxError,
    SandboxFileBusy,
    SandboxFileError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxLost,
    SandboxNotADirectory,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxPermissionError,
    SandboxStartError,
    ToolNotFound,
    TooManyAgentTasks,
    VolumeExists,
    VolumeInUse,
    VolumeNotFound,
)
from sandlot.models import Quota
from sandlot.requests import SANDBOX_ID_PATTERN
from sandlot.server import outbox as outbox_
from sandlot.server.auth import LOCAL_PRINCIPAL, AuthStore, Principal
from sandlot.server.limits import AuthFailures, OpenPerTenant, Pace, RateLimiter
from sandlot.server.metering import ListingTurns
from sandlot.server.metrics import Metrics
from sandlot.server.origins import check_local
from sandlot.server.webhooks import Webhooks

if TYPE_CHECKING:
    # Only for the annotation: a server without the [ray] extra never imports Ray.
    from sandlot.ray.cluster import ClusterManager

log = structlog.get_logger(__name__)

T = TypeVar("T")

# What a keyless request to a public route costs its address, in failed authentications: with
# the defaults (2 a second past a burst of 30) ~20 a second past a burst of 300.
KEYLESS_COST = 0.1

SandboxId = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="A sandbox's id.")]

HTTP_STATUS: dict[type[SandboxError], int] = {
    AuthenticationError: 401,
    Forbidden: 403,
    SandboxPermissionError: 403,
    SandboxNotFound: 404,
    ToolNotFound: 404,
    VolumeNotFound: 404,
    VolumeExists: 409,
    VolumeInUse: 409,
    SandboxFileNotFound: 404,
    PathOutsideWorkspace: 400,
    ConfigError: 422,
    InvalidRequest: 422,
    RequestTooLarge: 413,
    ClientGone: 499,  # nobody reads it
    QuotaExceeded: 429,
    CapacityExhausted: 503,
    RateLimited: 429,
    SandboxNotRunning: 409,
    # Gone for good with its node: a client must create a new sandbox, not retry this one.
    SandboxLost: 410,
    NodeTimeout: 504,  # the node is alive but this call outlived its bound
    AgentTimeout: 504,
    SandboxIsADirectory: 409,
    SandboxNotADirectory: 409,
    SandboxFileExists: 409,
    SandboxDiskFull: 507,
    SandboxFileBusy: 409,
    SandboxFileError: 400,  # any other file problem is about the path the client sent
    BackendUnavailable: 503,
    SandboxStartError: 503,
    GuestTimeout: 504,  # its guest, starved by the sandbox's own code, did not answer
    GuestError: 502,
    # The agent's model is upstream of us: its failures are a bad gateway, not a bad request.
    ProviderRateLimited: 503,
    ProviderError: 502,
    ModelOutputError: 502,
}


def status_of(error: SandboxError) -> int:
    for cls in type(error).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


def error_response(
    status: int, code: str, message: str, request_id: str | None, **headers: str
) -> JSONResponse:
    # The request-id header itself is added by the RequestContext middleware.
    body = {"error": {"code": code, "message": message, "request_id": request_id}}
    return JSONResponse(body, status_code=status, headers=headers)


def sandbox_error_response(exc: SandboxError, request_id: str | None) -> JSONResponse:
    """The typed error body of one of our errors, with ``Retry-After`` where it applies."""
    status = status_of(exc)
    headers = {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if status >= 500:
        log.warning("request failed", code=exc.code, error=exc.message)
    return error_response(status, exc.code, exc.message, request_id, **headers)


async def refuse_upgrade(websocket: WebSocket, exc: SandboxError) -> None:
    """Answer a WebSocket handshake with ``exc``'s typed HTTP error instead of upgrading it:
    nothing of it is held once the answer is out. A failed authentication counts against
    the client's address (:class:`AuthFailures`)."""
    request_id = getattr(websocket.state, "request_id", None)
    if isinstance(exc, AuthenticationError):
        websocket.app.state.sandbox.failed_auth(websocket.client)
    await websocket.send_denial_response(sandbox_error_response(exc, request_id))


@dataclass
class ServerState:
    settings: Settings
    # Sandboxes in this process, or (``serve --ray``) routed to a Ray cluster's node agents.
    manager: SandboxManager | ClusterManager
    auth: AuthStore | None = None
    metrics: Metrics | None = None
    limiter: RateLimiter = field(init=False)
    ready_cache: tuple[float, bool, str] = (0.0, False, "not checked yet")
    agent_runtime: Any = None  # the agent layer's AgentRuntime, made on the first task
    ready_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Shared with the connection wall (run.py); None: no limit on failed authentications.
    auth_failures: AuthFailures | None = None
    open_requests: OpenPerTenant = field(init=False)
    agent_tasks: OpenPerTenant = field(init=False)
    # Each tenant's queued stream output (outbox.py) and the pace of its streams' messages,
    # made on its first stream.
    stream_shares: dict[str, outbox_.Shared] = field(default_factory=dict)
    stream_paces: dict[str, Pace] = field(default_factory=dict)
    # Each tenant's listings, made a few at a time (metering.py).
    listings: ListingTurns = field(default_factory=ListingTurns)
    # Background commands' webhooks (webhooks.py): the manager's check and its listener.
    webhooks: Webhooks = field(init=False)

    def __post_init__(self) -> None:
        self.limiter = RateLimiter(self.settings.rate_limit_per_s, self.settings.rate_limit_burst)
        self.open_requests = OpenPerTenant(self.settings.max_open_per_tenant)
        self.agent_tasks = OpenPerTenant(
            self.settings.agent_tasks_per_tenant,
            TooManyAgentTasks,
            "agent tasks running",
            "API_AGENT_TASKS_PER_TENANT",
        )
        self.webhooks = Webhooks(self.settings, self._count_webhook)
        self.webhooks.attach(self.manager)

    def _count_webhook(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.webhook_deliveries.labels(outcome).inc()

    def stream_pace(self, principal: Principal) -> Pace:
        """The pace of ``principal``'s tenant's stream messages (``limits.Pace``)."""
        pace = self.stream_paces.get(principal.tenant)
        if pace is None:
            per_s = self.settings.stream_messages_per_s
            pace = self.stream_paces[principal.tenant] = Pace(per_s, int(2 * per_s) + 1)
        return pace

    def stream_budget(self, principal: Principal) -> outbox_.Budget:
        """A new stream's byte budget, counted in its tenant's share too."""
        shared = self.stream_shares.get(principal.tenant)
        if shared is None:
            cap_bytes = self.settings.stream_queue_mb_per_tenant * 1024 * 1024
            shared = self.stream_shares[principal.tenant] = outbox_.Shared(cap_bytes)
        return outbox_.Budget(shared)

    def failed_auth(self, client: Any, cost: float = 1.0) -> bool:
        """Count a failed authentication of ``client`` (a scope's ``(host, port)``), or
        ``cost`` of one; whether its address is refused now, so that the connection closes
        after the answer."""
        if self.auth_failures is None or not client:
            return False
        return self.auth_failures.failed(str(client[0]), cost)

    def keyless_request(self, client: Any) -> None:
        """Count a request without a key to a public route: a tenth of a failed
        authentication of ``client``'s address.

        Raises:
            KeylessRefused: the address is out of credit (this connection closes after its
                429, and its next ones are closed unread until it has credit again).
        """
        if self.failed_auth(client, cost=KEYLESS_COST):
            raise KeylessRefused(
                "too many requests without an API key from this address; send one, or wait"
            )

    def default_quota(self) -> Quota:
        settings = self.settings
        return Quota(
            max_sandboxes=settings.tenant_max_sandboxes,
            max_memory_mb=settings.tenant_max_memory_mb,
            max_pids=settings.tenant_max_pids,
            max_cpu_cores=settings.tenant_max_cpu_cores,
            max_disk_mb=settings.tenant_max_disk_mb,
            max_artifact_mb=settings.tenant_max_artifact_mb,
            max_volumes=settings.tenant_max_volumes,
            max_volume_mb=settings.tenant_max_volume_mb,
        )

    def quota_for(self, principal: Principal) -> Quota | None:
        if not self.settings.auth_enabled or self.auth is None:
            return None
        return self.auth.quota(principal.tenant, self.default_quota())

    def authenticate(self, headers: Any, query_key: str | None = None) -> Principal:
        if not self.settings.auth_enabled:
            check_local(headers, self.settings.allowed_hosts, self.settings.allowed_origins)
            principal = LOCAL_PRINCIPAL
        else:
            assert self.auth is not None
            principal = self.auth.authenticate(key_from(headers) or query_key)
        self.limiter.check(principal.key_id)
        return principal

    def recheck(self, headers: Any, query_key: str | None = None) -> None:
        """Raise if the key is no longer valid (revoked): for the messages of a long stream,
        which are not requests of their own and so are not rate-limited."""
        if self.settings.auth_enabled:
            assert self.auth is not None
            self.auth.authenticate(key_from(headers) or query_key)

    @asynccontextmanager
    async def audited(
        self,
        request: Request | WebSocket,
        principal: Principal,
        action: str,
        sandbox_id: str | None = None,
        **detail: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Record ``action`` in the audit log with its outcome, whatever happens inside."""
        extra: dict[str, Any] = {}
        outcome = "ok"
        try:
            yield extra
        except SandboxError as exc:
            outcome = exc.code
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            if self.auth is not None:
                self.auth.audit(
                    principal=principal,
                    action=action,
                    outcome=outcome,
                    request_id=getattr(request.state, "request_id", None),
                    sandbox_id=extra.get("sandbox_id", sandbox_id),
                    detail={**detail, **{k: v for k, v in extra.items() if k != "sandbox_id"}},
                )


async def client_gone(request: Request) -> None:
    """Return once the client has gone away (a request whose body is read: a long-poll, an
    agent task)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _race(work: Awaitable[T], stop: Awaitable[object]) -> asyncio.Future[T]:
    """``work`` run until it ends or ``stop`` comes first (then cancelled); its task,
    finished or cancelled."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandboxError):
                await task
    return task


async def unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone away first (``work`` cancelled):
    a run whose client hung up ran on for its whole timeout (up to a day), holding one of
    its tenant's open requests, which six such runs used up (red team, 2026-12-07)."""
    task = await _race(work, client_gone(request))
    return None if task.cancelled() else task.result()


async def while_open(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result while the HTTP request that asked for it is open (see
    ``RequestGuard``): an MCP tool call whose client hung up ran on in the SDK's task group
    once its POST had returned and given back its open request, so a key had 63 calls in
    flight under a cap of 6 (red team, 2026-12-07).

    Raises:
        ClientGone: the request ended first (``work`` cancelled).
    """
    ended: asyncio.Event | None = request.scope.get("state", {}).get("ended")
    if ended is None:
        return await work
    task = await _race(work, ended.wait())
    if task.cancelled():
        raise ClientGone("the request that asked for this call ended before it")
    return task.result()


def key_from(headers: Any) -> str | None:
    authorization = headers.get("authorization")
    if authorization and authorization.lower().startswith("bearer "):
        key: str = authorization[7:].strip()
        return key
    api_key: str | None = headers.get("x-api-key")
    return api_key


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.sandbox
    return state


async def caller(request: Request) -> Principal:
    """FastAPI dependency: the request's principal, authenticated and rate-limited once (by
    :class:`~sandlot.server.guard.RequestGuard`, before the body was read)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None:
        principal = state_of(request).authenticate(request.headers)
        request.state.principal = principal
    structlog.contextvars.bind_contextvars(tenant=principal.tenant, key_id=principal.key_id)
    return principal
