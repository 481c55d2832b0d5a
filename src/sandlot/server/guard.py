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
   request is refused with a typed 413 and the rest is never read. A public route's body
   is never read: they take none. Uploads stream to their
   route, which counts them against ``API_MAX_UPLOAD_MB`` itself.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.errors import AuthenticationError, KeylessRefused, RequestTooLarge, SandboxError
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, key_from, sandbox_error_response

PUBLIC_PATHS = frozenset(
    {"/health", "/ready", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
# Every tenant's activity (live sandboxes, creates, run times to the microsecond): an admin
# key's, unless API_METRICS_PUBLIC (a scraper on a private network).
ADMIN_PATHS = frozenset({"/metrics"})
# Uploads: the raw PUT and the multipart POST stream their bodies to the route.
UPLOAD_ROUTE = re.compile(r"^/v1/sandboxes/[^/]+/files(/content)?$")
MULTIPART_SLACK_BYTES = 64 * 1024  # boundaries and part headers around an upload
# A body (not an upload) costs its key one request of its rate for each this many bytes.
BODY_BYTES_PER_REQUEST = 256 * 1024


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
        try:
            held = self._admit(scope, headers)
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
            body_method = scope["method"] in ("POST", "PUT", "PATCH", "DELETE")
            if held is not None and not upload and body_method:
                receive = await self._read_body(receive, held, declared, cap, option)
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
        try:
            await self.app(scope, receive, send)
        finally:
            if held is not None:
                self.state.open_requests.release(held.tenant)

    async def _read_body(
        self, receive: Receive, held: Principal, declared: str | None, cap: int, option: str
    ) -> Receive:
        """The body read now (see :func:`_buffered`), charged to its key's rate.

        Parsing is paid on the server's one event loop: an 8 MiB JSON array takes it ~130
        ms, so 50 such requests a second from one key held it for good (red team's sibling,
        2026-12-06). Each 256 KiB of a body costs its key one more request of its rate: the
        size it declares before it is read (90 bodies of 8 MiB, read at once on the key's
        burst, took 690 MB: red team, 2026-12-06), what more it sends once read.
        """
        paid = 0
        if declared is not None and declared.isdigit():
            paid = int(declared) // BODY_BYTES_PER_REQUEST
            if paid:
                self.state.limiter.check(held.key_id, paid)
        receive, size = await _buffered(receive, cap, option)
        self.state.limiter.charge(held.key_id, size // BODY_BYTES_PER_REQUEST - paid)
        return receive

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
