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

A listing's entries are known only once it is made, so a key's burst could start 100 large
listings at once (``API_MAX_OPEN_PER_TENANT``) before the first was charged. A tenant's
listings therefore take turns (:class:`ListingTurns`) once their guests have answered: at
most ``LISTINGS_PER_TENANT`` have their entries checked at once, each charged as soon as its
entries are known, and one whose turn comes while its key is in debt is refused then, before
the host does anything more for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from starlette.types import Message, Receive, Scope, Send

from sandlot.server.limits import RateLimiter

JSON_BYTES_PER_REQUEST = 256 * 1024
FILE_BYTES_PER_REQUEST = 1024 * 1024
ENTRIES_PER_REQUEST = 256
# A tenant's listings whose entries the server checks at once (the guests list beforehand,
# outside the turns): 2 keep a tenant's listings from being one another's queue while
# bounding the server's CPU its burst can ask for at once.
LISTINGS_PER_TENANT = 2
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
        self.take(declared_cost(declared, per_request_bytes))

    def take(self, cost: int, counted_by: str = "its body's size") -> None:
        """Take ``cost`` requests now, toward what the request's bytes will cost at its end,
        or refuse it (the error says the cost is ``counted_by``).

        Raises:
            RateLimited: the key has not that much of its rate left.
        """
        if cost > 0:
            self.limiter.check(self.key_id, cost, counted_by)
            self.paid += cost

    def charge(self, more_json_bytes: int = 0) -> None:
        """Take what the bytes and entries counted so far cost, less what was paid (at the
        request's end, and once a listing's entries are known; ``more_json_bytes``: a body
        read before the app saw it)."""
        cost = (
            (self.json_bytes + more_json_bytes) // JSON_BYTES_PER_REQUEST
            + (self.upload_bytes + self.file_bytes) // FILE_BYTES_PER_REQUEST
            + self.entries // ENTRIES_PER_REQUEST
        )
        self.limiter.charge(self.key_id, cost - self.paid)
        self.paid = max(self.paid, cost)

    def check_debt(self) -> None:
        """Refuse the request if its key owes: an earlier request's charge left its bucket
        below zero (it takes nothing otherwise).

        Raises:
            RateLimited: the key is in debt; ``retry_after_s`` says until when.
        """
        self.limiter.check(self.key_id, 0)

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


def meter_of(scope: Scope) -> Meter | None:
    """The request's meter (none for a request without a key: the guard meters keyed
    requests only)."""
    meter = scope.get("state", {}).get("meter")
    return meter if isinstance(meter, Meter) else None


def charge_entries(scope: Scope, count: int) -> None:
    """Charge ``count`` listed entries to the request's key now, before they are written,
    so that the key's next listing waiting for its turn sees the debt."""
    meter = meter_of(scope)
    if meter is not None:
        meter.entries += count
        meter.charge()


def pay_answer(scope: Scope, json_bytes: int) -> None:
    """Take what a JSON answer of ``json_bytes`` will cost before it is built (MCP's
    ``read_file``: its text is written twice on the event loop, as JSON and as an event).

    Raises:
        RateLimited: the request's key has not that much of its rate left.
    """
    meter = meter_of(scope)
    if meter is not None:
        meter.take(json_bytes // JSON_BYTES_PER_REQUEST, "its answer's size")


class ListingTurns:
    """Each tenant's listings, at most ``per_tenant`` made at once (module docstring)."""

    def __init__(self, per_tenant: int = LISTINGS_PER_TENANT) -> None:
        self.per_tenant = per_tenant
        # tenant -> (its turns, listings holding or waiting for one); gone when none are
        self._tenants: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @asynccontextmanager
    async def turn(self, scope: Scope, tenant: str, *, refuse: bool = True) -> AsyncIterator[None]:
        """Wait for one of ``tenant``'s turns, then make the listing in it.

        ``refuse=False`` for a listing that comes with work already done (seed 001's execute
        lists its artifacts after the code ran: its output must not be lost for a debt).

        Raises:
            RateLimited: the request's key is in debt when its turn comes.
        """
        turns, waiting = self._tenants.get(tenant, (None, 0))
        if turns is None:
            turns = asyncio.Semaphore(self.per_tenant)
        self._tenants[tenant] = (turns, waiting + 1)
        try:
            async with turns:
                meter = meter_of(scope)
                if meter is not None and refuse:
                    meter.check_debt()
                yield
        finally:
            turns, waiting = self._tenants[tenant]
            if waiting <= 1:
                del self._tenants[tenant]
            else:
                self._tenants[tenant] = (turns, waiting - 1)

    def checking(
        self, scope: Scope, tenant: str, *, refuse: bool = True
    ) -> Callable[[int], AbstractAsyncContextManager[None]]:
        """What the manager enters, with a listing's entry count, around the host's check of
        its entries once the guest has answered (``core.files.list_dir``): one of
        ``tenant``'s turns, the entries charged first. The turn is not held while the guest
        lists: one sandbox whose guest never answered held its tenant's turns, and every
        other listing of the tenant waited for it (red team, 2026-12-06)."""

        @asynccontextmanager
        async def checked(count: int) -> AsyncIterator[None]:
            async with self.turn(scope, tenant, refuse=refuse):
                charge_entries(scope, count)
                yield

        return checked

    def waiting(self, tenant: str) -> int:
        """``tenant``'s listings being made or waiting for a turn (tests)."""
        return self._tenants.get(tenant, (None, 0))[1]
