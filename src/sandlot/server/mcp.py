"""``/mcp``: the MCP server (streamable HTTP) over the app's manager, as the API key's tenant.

The request guard authenticates ``/mcp`` like every ``/v1`` route, before the body is read,
and leaves the principal in the request's state; each tool call takes it from the HTTP
request that carried the call, so a call acts as that key: its owner filter, its quota, its
role (a viewer only reads), its audit log.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.routing import Route

from sandlot.errors import AuthenticationError, ConfigError
from sandlot.models import ArtifactInfo, ExecResult, FileInfo, ResourceUsage, SandboxInfo
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
from sandlot.server.deps import ServerState

log = structlog.get_logger(__name__)

MCP_PATH = "/mcp"


class TenantService:
    """The app's manager seen by one caller (a :class:`~sandlot.service.SandboxService`)."""

    def __init__(self, state: ServerState, who: Principal, request: Request) -> None:
        self.state = state
        self.manager = state.manager
        self.who = who
        self.owner = who.owner_filter
        self.request = request

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
            result = await self.manager.run_code(sandbox_id, request, owner=self.owner, **callbacks)
            a.update(exit_code=result.exit_code, kill_reason=result.kill_reason, via="mcp")
        return result

    async def run_command(
        self, sandbox_id: str, request: RunCommand, **callbacks: Any
    ) -> ExecResult:
        self.who.require_write()
        audit = self.state.audited(self.request, self.who, "sandbox.command", sandbox_id)
        async with audit as a:
            result = await self.manager.run_command(
                sandbox_id, request, owner=self.owner, **callbacks
            )
            a.update(exit_code=result.exit_code, kill_reason=result.kill_reason, via="mcp")
        return result

    async def write_file(self, sandbox_id: str, request: WriteFile, data: bytes) -> int:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.write", sandbox_id, path=request.path, via="mcp"
        )
        async with audit as a:
            size = await self.manager.write_file(sandbox_id, request, data, owner=self.owner)
            a["size_bytes"] = size
        return size

    async def read_file(self, sandbox_id: str, request: FilePath) -> bytes:
        return await self.manager.read_file(sandbox_id, request, owner=self.owner)

    async def list_files(self, sandbox_id: str, request: ListFiles) -> builtins.list[FileInfo]:
        return await self.manager.list_files(sandbox_id, request, owner=self.owner)

    async def stat_file(self, sandbox_id: str, request: FilePath) -> FileInfo:
        return await self.manager.stat_file(sandbox_id, request, owner=self.owner)

    async def remove_file(self, sandbox_id: str, request: RemoveFile) -> None:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.delete", sandbox_id, path=request.path, via="mcp"
        )
        async with audit:
            await self.manager.remove_file(sandbox_id, request, owner=self.owner)

    async def make_dir(self, sandbox_id: str, request: FilePath) -> None:
        self.who.require_write()
        audit = self.state.audited(
            self.request, self.who, "file.mkdir", sandbox_id, path=request.path, via="mcp"
        )
        async with audit:
            await self.manager.make_dir(sandbox_id, request, owner=self.owner)

    async def list_artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]:
        return await self.manager.list_artifacts(sandbox_id, owner=self.owner)

    async def read_artifact(self, sandbox_id: str, path: str) -> bytes:
        return await self.manager.read_artifact(sandbox_id, path, owner=self.owner)


class _AsTheKey:
    """Hands the SDK the API key that the guard authenticated, as its ``scope["user"]``.

    The SDK serves a session only to the credential that opened it, but it knows a
    credential only from ``scope["user"]``; without one, any key holding a leaked
    ``mcp-session-id`` could post into another tenant's session, or end it (and with it that
    tenant's default sandbox)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken

        principal = scope.get("state", {}).get("principal")
        if isinstance(principal, Principal):
            token = AccessToken(token="", client_id=principal.key_id, scopes=[])
            scope["user"] = AuthenticatedUser(token)
        await self.app(scope, receive, send)


def mount(app: FastAPI, state: ServerState) -> AbstractAsyncContextManager[None] | None:
    """Add ``/mcp`` to ``app``; returns an async context manager for the app's lifespan
    (the MCP session manager's task group, and the sessions' default sandboxes on the way
    out), or None where the MCP SDK is not installed (``/mcp`` is then absent)."""
    from sandlot.mcp import Binding, build_server

    def resolve(request: Any) -> Binding:
        principal = getattr(request, "scope", {}).get("state", {}).get("principal")
        if not isinstance(principal, Principal):
            # The guard sets it on every non-public path; a call without one is a bug, and
            # must not fall through to acting as anyone.
            raise AuthenticationError("no authenticated caller on this MCP request")
        service = TenantService(state, principal, request)
        return Binding(service=service, caller=principal.key_id)

    try:
        server, defaults = build_server(resolve)
    except ConfigError as exc:
        log.info("/mcp is off", reason=exc.message)
        return None
    from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
    from mcp.server.transport_security import TransportSecuritySettings

    settings = state.settings
    # Rebinding protection (Host and Origin checks) matters where a browser's ambient
    # credentials would be enough: with auth off. With auth on, the call needs a bearer key
    # that a page on another origin cannot make the browser send.
    if settings.auth_enabled:
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    else:
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=security,
        max_request_body_size=settings.max_body_mb * 1024 * 1024,
    )
    sessions = server.session_manager
    # A plain route, not a Mount: a Mount answers /mcp with a redirect to /mcp/.
    app.router.routes.append(Route(MCP_PATH, endpoint=_AsTheKey(StreamableHTTPASGIApp(sessions))))

    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        async with sessions.run():
            try:
                yield
            finally:
                await defaults.close()

    return running()
