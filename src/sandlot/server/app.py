"""The FastAPI application: ``create_app()`` builds it, ``sandlot serve`` runs it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot._strict import problems
from sandlot._version import __version__
from sandlot.config import Settings, get_settings
from sandlot.core import SandboxManager
from sandlot.errors import SandboxError
from sandlot.requests import RunCode, SandboxSpec
from sandlot.server import agent, compat, mcp, routes, stream, tools, volumes
from sandlot.server.auth import AuthStore
from sandlot.server.deps import ServerState, error_response, sandbox_error_response, state_of
from sandlot.server.guard import PUBLIC_PATHS, RequestGuard
from sandlot.server.limits import AuthFailures
from sandlot.server.metrics import Metrics
from sandlot.server.schemas import Health
from sandlot.tools import default_registry

# The owner of the readiness probe's sandboxes (a tenant may not take a name starting "__").
READINESS_OWNER = "__readiness__"

if TYPE_CHECKING:
    from sandlot.ray.cluster import ClusterManager

log = structlog.get_logger(__name__)

READY_CACHE_S = 30.0
BEARER_SCHEME = "bearer"
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "patch", "options", "head", "trace"})


def create_app(
    settings: Settings | None = None,
    manager: SandboxManager | ClusterManager | None = None,
    auth_failures: AuthFailures | None = None,
) -> FastAPI:
    """The API, serving ``manager`` (by default a new one for ``settings``: a routing manager
    over a Ray cluster when ``settings.ray_address`` is set); failed authentications counted
    in ``auth_failures`` (by default a new count, :func:`auth_failures_for`), which the
    connection wall shares when it is given here (run.py)."""
    settings = settings or get_settings()
    default_registry(settings.registry_dir)  # a tool file that is not a tool stops the start
    state = ServerState(
        settings=settings,
        manager=manager or _default_manager(settings),
        auth_failures=auth_failures or auth_failures_for(settings),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.manager.start()
        state.auth = AuthStore(settings.data_dir / "sandlot.db")
        # Metrics reads live_count() and add_listener(), which a Ray routing manager has too.
        state.metrics = Metrics(state.manager)  # type: ignore[arg-type]
        if not settings.auth_enabled:
            log.warning(
                "AUTH IS OFF: every request acts as the local admin; never expose this server",
                host=settings.api_host,
                port=settings.api_port,
            )
        try:
            if mcp_running is None:
                yield
            else:
                async with mcp_running:
                    yield
        finally:
            await state.webhooks.aclose()  # pending deliveries live in memory only: cancelled
            if state.agent_runtime is not None:
                await state.agent_runtime.aclose()
            await state.manager.close()
            state.auth.close()

    app = FastAPI(
        title="sandlot",
        version=__version__,
        summary="Isolated, stateful sandboxes for code that AI agents write.",
        lifespan=lifespan,
    )
    app.state.sandbox = state
    # Added last, so outermost: rejections by the guard get a request id and are counted.
    app.add_middleware(RequestGuard, state=state)
    app.add_middleware(RequestContext, state=state)
    app.add_exception_handler(SandboxError, _sandbox_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.include_router(routes.router)
    app.include_router(tools.router)
    app.include_router(volumes.router)
    app.include_router(stream.router)
    app.include_router(compat.router)
    app.include_router(agent.router)
    mcp_running = mcp.mount(app, state)
    _add_operational_routes(app)
    _document_auth(app)
    _write_the_document_once(app)
    return app


def _write_the_document_once(app: FastAPI) -> None:
    """``/openapi.json`` written once, then sent as bytes. FastAPI wrote the 96 KB document
    again for every request (~2.5 ms of the event loop): keyless clients pipelining it from
    five addresses had the server answer ~4,000 of them before a keyed request, which waited
    7 s (`test_trust_server.py::test_deep_pipelining_is_refused`, on a slow VM, 2026-12-07)."""
    path = app.openapi_url
    if path is None:
        return
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    written: list[bytes] = []

    async def openapi_json(_request: Request) -> Response:
        if not written:  # as JSONResponse writes it
            written.append(
                json.dumps(
                    app.openapi(), ensure_ascii=False, allow_nan=False, separators=(",", ":")
                ).encode()
            )
        return Response(written[0], media_type="application/json")

    app.add_route(path, openapi_json, include_in_schema=False)


def auth_failures_for(settings: Settings) -> AuthFailures | None:
    """The count of failed authentications by address ``settings`` ask for: none behind a
    reverse proxy (``API_MAX_CONNECTIONS_PER_IP=0``: every client has its address) or with
    ``API_AUTH_FAILURES_PER_SECOND=0``."""
    if not settings.max_connections_per_ip or not settings.auth_failures_per_s:
        return None
    return AuthFailures(settings.auth_failures_per_s, settings.auth_failures_burst)


def _default_manager(settings: Settings) -> SandboxManager | ClusterManager:
    if settings.ray_address is None:
        return SandboxManager(settings)
    from sandlot.ray.cluster import ClusterManager as RayManager  # needs the [ray] extra

    return RayManager(settings)


def _document_auth(app: FastAPI) -> None:
    """Declare in the OpenAPI document the key that the guard asks for, so that ``/docs``'
    "Authorize" button and generated clients send it. Documentation only: the guard
    authenticates (before the body is read, which a FastAPI security dependency could not do),
    and its ``PUBLIC_PATHS`` are the operations left without the requirement."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # also cached on the app: the edits below are made once
        schema.setdefault("components", {})["securitySchemes"] = {
            BEARER_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "An API key from `sandlot keys create` (the server also "
                "reads it from an `X-API-Key` header).",
            }
        }
        for path, operations in schema.get("paths", {}).items():
            if path in PUBLIC_PATHS:
                continue
            for method, operation in operations.items():
                if method in HTTP_METHODS:
                    operation["security"] = [{BEARER_SCHEME: []}]
        return schema

    # FastAPI's documented way to extend the document: replace the method on the instance.
    app.openapi = openapi  # type: ignore[method-assign]


def _add_operational_routes(app: FastAPI) -> None:
    @app.get("/health", response_model=Health, tags=["operations"])
    async def health(request: Request) -> Health:
        """Liveness: the process answers."""
        return Health(
            status="ok", version=__version__, sandboxes_live=state_of(request).manager.live_count()
        )

    @app.get(
        "/ready", response_model=Health, tags=["operations"], responses={503: {"model": Health}}
    )
    async def ready(request: Request) -> Response:
        """Readiness: a real sandbox of the default backend started and ran code (cached 30 s)."""
        state = state_of(request)
        # One probe at a time, whoever asks: it starts a real sandbox, and /ready needs no key.
        async with state.ready_lock:
            checked_at, ok, detail = state.ready_cache
            if time.monotonic() - checked_at > READY_CACHE_S:
                ok, detail = await _probe(state)
                state.ready_cache = (time.monotonic(), ok, detail)
        body = Health(status="ready" if ok else "unavailable", version=__version__, detail=detail)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics."""
        registry = state_of(request).metrics
        data = generate_latest(registry.registry) if registry else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)


async def _probe(state: ServerState) -> tuple[bool, str]:
    try:
        # An env keeps it out of the warm pools (they hold sandboxes without one), on a cluster
        # too: it proves a sandbox starts, and it would count as a tenant's create there.
        probe = SandboxSpec(ttl_s=60, env={"SANDLOT_READINESS_PROBE": "1"})
        info = await state.manager.create(probe, owner=READINESS_OWNER)
        try:
            result = await state.manager.run_code(info.id, RunCode(code="1 + 1"))
        finally:
            await state.manager.destroy(info.id, reason="readiness")
    except SandboxError as exc:
        return False, f"{exc.code}: {exc.message}"
    if result.text != "2":
        return False, f"probe sandbox answered {result.text!r}"
    return True, f"{info.backend} started a sandbox and ran code"


class RequestContext:
    """Request id and per-route counts, as plain ASGI: Starlette's BaseHTTPMiddleware (what
    ``@app.middleware("http")`` builds) costs about a millisecond a request in task hops."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (
            next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
            or uuid.uuid4().hex
        )
        scope.setdefault("state", {})["request_id"] = request_id
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.state.metrics is not None:
                route = getattr(scope.get("route"), "path", "unmatched")
                self.state.metrics.http_requests.labels(scope["method"], route, str(status)).inc()


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
    return sandbox_error_response(exc, _request_id(request))


def _body_not_json(request: Request, exc: RequestValidationError) -> bool:
    """A body the route reads as JSON, sent as something else (curl's ``-d`` sends a form)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # None is not JSON either: FastAPI's strict content type reads no body it is not told is.
    is_json = kind == "application/json" or kind.endswith("+json")
    return not is_json and any(e["loc"][:1] == ("body",) for e in exc.errors())


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    if _body_not_json(request, exc):
        # Read as JSON it might well parse, but a web page on another site may post a form
        # or a text body to a server without asking first (no CORS preflight), which JSON
        # needs: one more wall behind origins.py for a keyless server.
        return error_response(
            415,
            "unsupported_media_type",
            "send the body as JSON, with the header 'Content-Type: application/json' "
            "(curl: -H 'Content-Type: application/json'); a form or text body is refused, so "
            "that no web page can post one to this server from another site",
            _request_id(request),
        )
    # At most ten, each without its location's first part ("body", "query").
    said = problems([{**e, "loc": e["loc"][1:]} for e in exc.errors()])
    return error_response(422, "invalid_request", said or "invalid request", _request_id(request))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), _request_id(request))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", path=request.url.path)
    request_id = _request_id(request)
    # Starlette answers an unexpected error from its outermost layer, outside the one that
    # adds the request id to every response: it is added here, so that the id the body
    # names is in the headers too.
    headers = {"x-request-id": request_id} if request_id else {}
    return error_response(
        500,
        "internal_error",
        "internal error; the request id is in the server log",
        request_id,
        **headers,
    )
