"""``/mcp``: the MCP server (streamable HTTP) over the app's manager, as the API key's tenant.

The request guard authenticates ``/mcp`` like every ``/v1`` route, before the body is read,
and leaves the principal in the request's state; each tool call takes it from the HTTP
request that carried the call, so a call acts as that key: its owner filter, its quota, its
role (a viewer only reads), its audit log.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.routing import Route

from sandlot.errors import AuthenticationError, ConfigError, McpSessionLimit
from sandlot.models import (
    ArtifactInfo,
    ExecResult,
    FileInfo,
    Listing,
    ResourceUsage,
    SandboxInfo,
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
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, sandbox_error_response, while_open
from sandlot.server.metering import pay_answer
from sandlot.tools import ToolExecutor, ToolRegistry

log = structlog.get_logger(__name__)

MCP_PATH = "/mcp"
T = TypeVar("T")


class TenantService:
    """The app's manager seen by one caller (a :class:`~sandlot.service.SandboxService`)."""

    def __init__(self, state: ServerState, who: Principal, request: Request) -> None:
        self.state = state
        self.manager = state.manager
        self.who = who
        self.owner = who.owner_filter
        self.request = request

    async def _asked(self, work: Awaitable[T]) -> T:
        """A call that reaches a sandbox's guest ends with the HTTP request that carried it
        (counted in its tenant's open requests until then): the SDK runs a tool call on
        after its client hung up (deps.while_open)."""
        return await while_open(self.request, work)

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self.who.require_write()
        quota = self.state.quota_for(self.who)
        audit = self.state.audited(
            self.request, self.who, "sandbox.create", backend=spec.backend, via="mcp"
        )
        async with audit as a:
            info = await self.manager.create(spec, owner=self.who.tenant, quota=quota)
            a["sandbox_id"] = info.id
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.manager.get(sandbox_id, owner=self.owner)

    async def list(self, *, include_ended: bool = False) -> builtins.list[SandboxInfo]:
        return await self.manager.list(owner=self.owner, include_ended=include_ended)

    async def destroy(self, sandbox_id: str) -> SandboxInfo:
        self.who.require_write()
        async with self.state.audited(self.request, self.who, "sandbox.delete", sandbox_id):
            return await self.manager.destroy(sandbox_id, owner=self.owner)

    async def extend(self, sandbox_id: str, request: SetTimeout) -> SandboxInfo:
        self.who.require_write()
        return await self.manager.extend(sandbox_id, request, owner=self.owner)

    async def usage(self, sandbox_id: str) -> ResourceUsage:
        return await self.manager.usage(sandbox_id, owner=self.owner)

    async def run_code(self, sandbox_id: str, request: RunCode, **callbacks: Any) -> ExecResult:
        self.who.require_write()
        audit = self.state.audited(self.request, self.who, "sandbox.run_code", sandbox_id)
        async with audit as a:
            result = await self._asked(
                self.manager.run_code(sandbox_id, request, owner=self.owner, **callbacks)
            )
            a.update(exit_code=result.exit_code, kill_reason=result.kill_reason, via="mcp")
        return result

    async def run_command(
        self, sandbox_id: str, request: RunCommand, **callbacks: Any
    ) -> ExecResult:
        self.who.require_write()
        audit = self.state.audited(self.request, self.who, "sandbox.command", sandbox_id)
        async with audit as a:
            result = await self._asked(
                self.manager.run_command(sandbox_id, request, owner=self.owner, **callbacks)
            )
            a.update(exit_code=result.exit_code, kill_reason=result.kill_reason, via="mcp")
        return result

    async def run_tool(
        self,
        sandbox_id: str,
        registry: ToolRegistry,
        name: str,
        arguments: dict[str, Any] | None,
        timeout_s: float | None,
    ) -> ExecResult:
        """A registry tool, audited as one (``sandbox.tool``, refused calls too), as REST's."""
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "sandbox.tool", sandbox_id, tool=name, via="mcp"
        )
        async with audit as a:
            executor = ToolExecutor(
                registry,
                lambda command: self.manager.run_command(sandbox_id, command, owner=self.owner),
            )
            result = await self._asked(executor.run(name, arguments, timeout_s))
            a.update(exit_code=result.exit_code, kill_reason=result.kill_reason)
        return result

    async def write_file(self, sandbox_id: str, request: WriteFile, data: bytes) -> int:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.write", sandbox_id, path=request.path, via="mcp"
        )
        async with audit as a:
            size = await self._asked(
                self.manager.write_file(sandbox_id, request, data, owner=self.owner)
            )
            a["size_bytes"] = size
        return size

    async def read_file(self, sandbox_id: str, request: FilePath) -> bytes:
        from sandlot.mcp.tools import answer_bytes  # the SDK is loaded: a tool calls this

        data = await self._asked(self.manager.read_file(sandbox_id, request, owner=self.owner))
        # Paid before the answer is built: a key's burst of reads was all written before
        # the first was charged (red team, 2026-12-06).
        pay_answer(self.request.scope, answer_bytes(data))
        return data

    async def list_files(self, sandbox_id: str, request: ListFiles) -> Listing:
        checking = self.state.listings.checking(self.request.scope, self.who.tenant)
        return await self._asked(
            self.manager.list_files(sandbox_id, request, owner=self.owner, checking=checking)
        )

    async def stat_file(self, sandbox_id: str, request: FilePath) -> FileInfo:
        return await self._asked(self.manager.stat_file(sandbox_id, request, owner=self.owner))

    async def remove_file(self, sandbox_id: str, request: RemoveFile) -> None:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.delete", sandbox_id, path=request.path, via="mcp"
        )
        async with audit:
            await self._asked(self.manager.remove_file(sandbox_id, request, owner=self.owner))

    async def make_dir(self, sandbox_id: str, request: FilePath) -> None:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.mkdir", sandbox_id, path=request.path, via="mcp"
        )
        async with audit:
            await self._asked(self.manager.make_dir(sandbox_id, request, owner=self.owner))

    async def list_artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]:
        return await self.manager.list_artifacts(sandbox_id, owner=self.owner)

    async def read_artifact(self, sandbox_id: str, path: str) -> bytes:
        return await self.manager.read_artifact(sandbox_id, path, owner=self.owner)


class _AsTheKey:
    """Hands the SDK the API key that the guard authenticated, as its ``scope["user"]``, and
    caps the sessions one key may hold open.

    The SDK serves a session only to the credential that opened it, but it knows a
    credential only from ``scope["user"]``; without one, any key holding a leaked
    ``mcp-session-id`` could post into another tenant's session, or end it (and with it that
    tenant's default sandbox). The SDK caps sessions only in all (10,000 by default): without
    a cap per key, one key could open every slot and shut every other tenant out of /mcp."""

    def __init__(self, app: Any, sessions: Any, per_key: int) -> None:
        self.app = app
        self.sessions = sessions
        self.per_key = per_key
        # Opening requests in flight, per key: counted with the open sessions, so that
        # concurrent openings cannot all pass the check before any of them is registered.
        self._opening: dict[str, int] = {}

    def _open_sessions(self, key_id: str) -> int:
        # The SDK keeps each session's owner (the AuthorizationContext made from our
        # AccessToken) in this private map; tests/test_mcp.py fails if it goes away.
        owners = getattr(self.sessions, "_session_owners", None)
        if owners is None:
            raise RuntimeError("the MCP SDK no longer exposes its session owners")
        return sum(1 for owner in owners.values() if owner["client_id"] == key_id)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken

        principal = scope.get("state", {}).get("principal")
        if not isinstance(principal, Principal):
            await self.app(scope, receive, send)
            return
        token = AccessToken(token="", client_id=principal.key_id, scopes=[])
        scope["user"] = AuthenticatedUser(token)
        headers = dict(scope.get("headers") or ())
        opening = scope.get("method") == "POST" and b"mcp-session-id" not in headers
        if not opening:
            await self.app(scope, receive, send)
            return
        key_id = principal.key_id
        in_flight = self._opening.get(key_id, 0)
        if self._open_sessions(key_id) + in_flight >= self.per_key:
            exc = McpSessionLimit(
                f"this API key holds {self.per_key} open MCP sessions, its most "
                "(SANDBOX_MCP_SESSIONS_PER_KEY): end one (DELETE with its mcp-session-id) "
                "or wait for an idle one to time out"
            )
            request_id = scope.get("state", {}).get("request_id")
            await sandbox_error_response(exc, request_id)(scope, receive, send)
            return
        self._opening[key_id] = in_flight + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self._opening[key_id] - 1
            if left:
                self._opening[key_id] = left
            else:
                del self._opening[key_id]


def mount(app: FastAPI, state: ServerState) -> AbstractAsyncContextManager[None] | None:
    """Add ``/mcp`` to ``app``; returns an async context manager for the app's lifespan
    (the MCP session manager's task group, and the sessions' default sandboxes on the way
    out), or None where the MCP SDK is not installed (``/mcp`` is then absent)."""
    from sandlot.mcp import Binding, build_server
    from sandlot.tools import default_registry

    def resolve(request: Any) -> Binding:
        principal = getattr(request, "scope", {}).get("state", {}).get("principal")
        if not isinstance(principal, Principal):
            # The guard sets it on every non-public path; a call without one is a bug, and
            # must not fall through to acting as anyone.
            raise AuthenticationError("no authenticated caller on this MCP request")
        service = TenantService(state, principal, request)
        return Binding(service=service, caller=principal.key_id)

    try:
        server, defaults = build_server(resolve, default_registry(state.settings.registry_dir))
    except ConfigError as exc:
        log.info("/mcp is off", reason=exc.message)
        return None
    from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
    from mcp.server.transport_security import TransportSecuritySettings

    settings = state.settings
    # Rebinding protection (Host and Origin checks) matters where a browser's ambient
    # credentials would be enough: with auth off. The request wall checks /mcp as every other
    # route (origins.py, API_ALLOWED_HOSTS and API_ALLOWED_ORIGINS); the SDK's own check, on
    # a fixed list, refused the names an operator allowed (red team, 2026-12-07).
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=security,
        max_request_body_size=settings.max_body_mb * 1024 * 1024,
    )
    sessions = server.session_manager
    # A plain route, not a Mount: a Mount answers /mcp with a redirect to /mcp/.
    endpoint = _AsTheKey(StreamableHTTPASGIApp(sessions), sessions, settings.mcp_sessions_per_key)
    app.router.routes.append(Route(MCP_PATH, endpoint=endpoint))

    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        async with sessions.run():
            try:
                yield
            finally:
                await defaults.close()

    return running()
