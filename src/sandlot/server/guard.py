"""The request wall: who is asking is settled before a byte of the body is read.

FastAPI reads and parses a request's body before it runs the route's dependencies, so a
256 MiB JSON body with no API key grew the server by 765 MiB before the 401. This middleware
runs first:

1. every route but the public ones (health, readiness, metrics, the API docs) authenticates
   and rate-limits from the headers alone, and counts against its tenant's open requests
   until its response is sent (``API_MAX_OPEN_PER_TENANT``); the principal rides on to the
   route in ``scope["state"]`` (the route's ``caller`` dependency takes it from there);
2. a declared ``Content-Length`` over the cap is refused at once;
3. a JSON body is read here, up to ``API_MAX_BODY_MB``, and handed on; past the cap the
   request is refused with a typed 413 and the rest is never read. Uploads stream to their
   route, which counts them against ``API_MAX_UPLOAD_MB`` itself.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandlot.errors import AuthenticationError, RequestTooLarge, SandboxError
from sandlot.server.auth import Principal
from sandlot.server.deps import ServerState, sandbox_error_response

PUBLIC_PATHS = frozenset(
    {"/health", "/ready", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
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
        try:
            if scope["path"] not in PUBLIC_PATHS:
                principal = self.state.authenticate(headers)
                scope.setdefault("state", {})["principal"] = principal
                self.state.open_requests.acquire(principal.tenant)
                held = principal
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
            if not upload and scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
                receive = await _buffered(receive, cap, option)
        except SandboxError as exc:
            if held is not None:
                self.state.open_requests.release(held.tenant)
            request_id = scope.get("state", {}).get("request_id")
            response = sandbox_error_response(exc, request_id)
            if isinstance(exc, AuthenticationError) and self.state.failed_auth(scope.get("client")):
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


async def _buffered(receive: Receive, cap_bytes: int, option: str) -> Receive:
    """Read the whole body now (at most ``cap_bytes``) and replay it as one message.

    Raises:
        RequestTooLarge: the body went past the cap (the rest is left unread).
    """
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return _replay(message, receive)
        body += message.get("body", b"")
        if len(body) > cap_bytes:
            raise RequestTooLarge(
                f"the body is over this server's {cap_bytes} bytes; send less, or raise {option}"
            )
        if not message.get("more_body", False):
            break
    return _replay({"type": "http.request", "body": bytes(body), "more_body": False}, receive)


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
