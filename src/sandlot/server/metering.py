"""What a keyed request's bytes cost its key's rate, beyond the one request it is.

A request is charged one request of ``API_RATE_LIMIT_PER_SECOND`` when it is admitted, but
what the server does for it grows with its bytes, on its one event loop: a JSON body is
parsed there (~130 ms for 8 MiB), a listing of 25,900 entries was built, checked and written
there (~170 ms, for one request: red team, 2026-12-06), and each MiB of a file streamed in or
out costs ~5 ms of the server's CPU. So:

- each 256 KiB of a JSON body or a JSON answer (or an MCP event stream's) costs one more
  request;
- each MiB of an upload or of a download (any other answer) costs one more;
- each 256 entries of a listing (files, kept artifacts) cost one more: each entry is a model
  made and written on the server (~6 us), so a listing costs ~4 times what its bytes say:
  charged by bytes alone, one key's listings at the default rate still took most of a core.

What a request declares (its ``Content-Length``) is checked before a byte of it is read (90
bodies of 8 MiB sent at once all passed on a key's burst before: red team, 2026-12-06); the
rest is charged once known, without refusing: the bucket goes below zero and the key's next
requests wait for it.
"""

from __future__ import annotations

from starlette.types import Message, Receive, Scope, Send

from sandlot.server.limits import RateLimiter

JSON_BYTES_PER_REQUEST = 256 * 1024
FILE_BYTES_PER_REQUEST = 1024 * 1024
ENTRIES_PER_REQUEST = 256
# Answers counted per JSON_BYTES_PER_REQUEST; any other kind per FILE_BYTES_PER_REQUEST.
_JSON_KINDS = (b"application/json", b"text/event-stream")


def declared_cost(declared: str | None, per_request_bytes: int) -> int:
    """What a body of the declared size costs, in requests beyond the first."""
    if declared is None or not declared.isdigit():
        return 0
    return int(declared) // per_request_bytes


class Meter:
    """One keyed request's bytes: an upload's as it is read, the answer's as it is sent."""

    def __init__(self, limiter: RateLimiter, key_id: str) -> None:
        self.limiter = limiter
        self.key_id = key_id
        self.paid = 0  # requests already taken for this request's bytes
        self.upload_bytes = 0
        self.json_bytes = 0
        self.file_bytes = 0
        self.entries = 0  # listed in the answer (charge_entries)
        self._answer_is_json = True

    def check_declared(self, declared: str | None, per_request_bytes: int) -> None:
        """Take what the declared size costs now, or refuse the request before its body.

        Raises:
            RateLimited: the key has not that much of its rate left.
        """
        cost = declared_cost(declared, per_request_bytes)
        if cost:
            self.limiter.check(self.key_id, cost)
            self.paid += cost

    def charge(self, more_json_bytes: int = 0) -> None:
        """Take what the bytes counted so far cost, less what was paid (called once, at the
        request's end; ``more_json_bytes``: a body read before the app saw it)."""
        cost = (
            (self.json_bytes + more_json_bytes) // JSON_BYTES_PER_REQUEST
            + (self.upload_bytes + self.file_bytes) // FILE_BYTES_PER_REQUEST
            + self.entries // ENTRIES_PER_REQUEST
        )
        self.limiter.charge(self.key_id, cost - self.paid)

    def receive(self, receive: Receive) -> Receive:
        """``receive``, counting an upload's bytes."""

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.upload_bytes += len(message.get("body", b""))
            return message

        return counted

    def send(self, send: Send) -> Send:
        """``send``, counting the answer's bytes by its kind."""

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", ())).get(b"content-type", b"")
                self._answer_is_json = kind.startswith(_JSON_KINDS)
            elif message["type"] == "http.response.body":
                if self._answer_is_json:
                    self.json_bytes += len(message.get("body", b""))
                else:
                    self.file_bytes += len(message.get("body", b""))
            await send(message)

        return counted


def charge_entries(scope: Scope, count: int) -> None:
    """Count ``count`` listed entries against the request's key (none for a request without
    one: the guard meters keyed requests only)."""
    meter = scope.get("state", {}).get("meter")
    if isinstance(meter, Meter):
        meter.entries += count
