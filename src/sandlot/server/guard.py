"""The request wall: who is asking is settled before a byte of the body is read.

FastAPI reads and parses a request's body before it runs the route's dependencies, so a
256 MiB JSON body with no API key grew the server by 765 MiB before the 401. This middleware
runs first:

1. every route but the public ones (health, readiness, the API docs) authenticates
   and rate-limits from the headers alone, and counts against its tenant's open requests
   until its response is sent (``API_MAX_OPEN_PER_TENANT``); the principal rides on to the
   route in ``scope["state"]`` (the route's ``caller`` dependency takes it from there);
   ``/metrics`` takes an admin key unless ``API_METRICS_PUBLIC``. A public route asked
   without a key costs its address a tenth of a failed authentication: a keyless client
   looping on ``/health`` had ~2,700 answers a second, three quarters of a core and 386
   KiB/s of access log (red team, 2026-12-06); now ~20 a second, then its connections are
   closed unread, as for failed authentications;
2. a declared ``Content-Length`` over the cap is refused at once;
3. a JSON body is read here, up to ``API_MAX_BODY_MB``, and handed on; past the cap the
   request is refused with a typed 413 and the rest is never read. Uploads stream to their
   route, which counts them against ``API_MAX_UPLOAD_MB`` itself. A public route's body is
   never read: they take none;
4. a keyed request's bytes cost its key more of its rate: its body's or upload's, and its
   answer's, by size (``metering.py``).
"""

from __future__ import annotations

import asyncio
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.errors import AuthenticationError, KeylessRefused, RequestTooLarge, SandboxError
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, key_from, sandbox_error_response
from sandlot.server.metering import FILE_BYTES_PER_REQUEST, JSON_BYTES_PER_REQUEST, Meter
from sandlot.server.origins import check_local

PUBLIC_PATHS = frozenset(
    {"/health", "/ready", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
# Every tenant's activity (live sandboxes, creates, run times to the microsecond): an admin
# key's, unless API_METRICS_PUBLIC (a scraper on a private network).
ADMIN_PATHS = frozenset({"/metrics"})
# Uploads: the raw PUT and the multipart POST stream their bodies to the route.
UPLOAD_ROUTE = re.compile(r"^/v1/sandboxes/[^/]+/files(/content)?$")
MULTIPART_SLACK_BYTES = 64 * 1024  # boundaries and part headers around an upload


class RequestGuard:
    """Authenticate, then bound the body, before the application sees the request."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        held: Principal | None = None
        meter: Meter | None = None
        body_bytes = 0
        try:
            held = self._admit(scope, headers)
            if held is not None:
                meter = Meter(self.state.limiter, held.key_id)
                scope["state"]["meter"] = meter  # a route counts a listing's entries on it
            receive, body_bytes = await self._bound_body(scope, headers, receive, meter)
        except SandboxError as exc:
            if held is not None:
                self.state.open_requests.release(held.tenant)
            request_id = scope.get("state", {}).get("request_id")
            response = sandbox_error_response(exc, request_id)
            if isinstance(exc, KeylessRefused) or (
                isinstance(exc, AuthenticationError) and self.state.failed_auth(scope.get("client"))
            ):
                # Out of credit: this connection closes after its 401, and the address's next
                # ones are closed unread (transport.py) until it has credit again.
                response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if meter is not None:
            send = meter.send(send)
        # Set once the request is answered or its client gone: work it started that may
        # outlive it (an MCP tool call, which the SDK runs on in the session's task group)
        # ends with it, as the open request it counted as does (deps.while_open).
        ended = scope.setdefault("state", {})["ended"] = asyncio.Event()
        try:
            await self.app(scope, receive, send)
        finally:
            ended.set()
            if held is not None:
                self.state.open_requests.release(held.tenant)
            if meter is not None:
                meter.charge(body_bytes)  # its body's, upload's and answer's bytes (metering.py)

    async def _bound_body(
        self, scope: Scope, headers: Headers, receive: Receive, meter: Meter | None
    ) -> tuple[Receive, int]:
        """``receive`` for the app, and the size of a body read here: one over its cap is
        refused on its declared size, a JSON body read now (:func:`_buffered`), an upload
        counted as it streams; a keyed one costs its key by its size (``meter``).

        Raises:
            RequestTooLarge: the body is over its cap.
            RateLimited: its declared size is more than its key has left.
        """
        upload = scope["method"] in ("PUT", "POST") and UPLOAD_ROUTE.match(scope["path"])
        settings = self.state.settings
        if upload:
            cap = settings.max_upload_mb * 1024 * 1024 + MULTIPART_SLACK_BYTES
            option = "API_MAX_UPLOAD_MB"
        else:
            cap = settings.max_body_mb * 1024 * 1024
            option = "API_MAX_BODY_MB"
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise RequestTooLarge(
                f"a body of {declared} bytes is over this server's {cap} bytes; "
                f"send less, or raise {option}"
            )
        # A public route takes no body: its 405 comes unread (read, an 8 MiB body to
        # /health was buffered for a keyless client, and charged nothing to a key).
        if meter is None:
            return receive, 0
        if upload:
            meter.check_declared(declared, FILE_BYTES_PER_REQUEST)
            return meter.receive(receive), 0
        if scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            meter.check_declared(declared, JSON_BYTES_PER_REQUEST)
            return await _buffered(receive, cap, option)
        return receive, 0

    def _admit(self, scope: Scope, headers: Headers) -> Principal | None:
        """Who asks, for a route that takes a key (its tenant's open requests counted until
        the answer: the caller releases it); None for a public route."""
        if not self._public(scope["path"]):
            principal = self.state.authenticate(headers)
            if scope["path"] in ADMIN_PATHS:
                principal.require_admin()
            scope.setdefault("state", {})["principal"] = principal
            self.state.open_requests.acquire(principal.tenant)
            return principal
        settings = self.state.settings
        if scope["path"] in ADMIN_PATHS and not settings.auth_enabled:
            # No page reads it by a rebound name.
            check_local(headers, settings.allowed_hosts, settings.allowed_origins)
        if key_from(headers) is not None:
            self.state.authenticate(headers)  # a key given is checked, and its rate kept
        else:
            self.state.keyless_request(scope.get("client"))
        return None

    def _public(self, path: str) -> bool:
        """Whether ``path`` is served without a key (``/metrics`` only with
        ``API_METRICS_PUBLIC``, or with no auth at all: it shows every tenant's activity)."""
        if path in ADMIN_PATHS:
            return self.state.settings.metrics_public or not self.state.settings.auth_enabled
        return path in PUBLIC_PATHS


async def _buffered(receive: Receive, cap_bytes: int, option: str) -> tuple[Receive, int]:
    """Read the whole body now (at most ``cap_bytes``) and replay it as one message; its
    size too.

    Raises:
        RequestTooLarge: the body went past the cap (the rest is left unread).
    """
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return _replay(message, receive), len(body)
        body += message.get("body", b"")
        if len(body) > cap_bytes:
            raise RequestTooLarge(
                f"the body is over this server's {cap_bytes} bytes; send less, or raise {option}"
            )
        if not message.get("more_body", False):
            break
    replay = _replay({"type": "http.request", "body": bytes(body), "more_body": False}, receive)
    return replay, len(body)


def _replay(first: Message, receive: Receive) -> Receive:
    """``first``, then the connection's own messages (a later receive waits for the client
    to go away, as Starlette expects)."""
    sent = False

    async def receive_again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return receive_again
