"""Per-key rate limiting, failed authentications per client address, each tenant's open
requests and streams, and the pace of a stream's messages: in memory (one server process)."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from collections import Counter, OrderedDict

import structlog

from sandlot.errors import QuotaExceeded, RateLimited, TooManyOpen

log = structlog.get_logger(__name__)


def _refilled(bucket: tuple[float, float] | None, now: float, per_s: float, burst: int) -> float:
    """A token bucket's tokens at ``now``: ``bucket`` is (tokens, when last counted), None
    for a full one."""
    if bucket is None:
        return float(burst)
    tokens, last = bucket
    return min(float(burst), tokens + (now - last) * per_s)


def client_group(address: str) -> str:
    """Whose share a client address spends, of failed authentications (:class:`AuthFailures`)
    and of connections (``transport.py``): its own (IPv4), or its /64's (IPv6: a client
    holds a whole /64, and took a fresh share from each address in it: 1,000 connections of
    one /64 under a cap of 100 a client, red team, 2026-12-06); an IPv4-mapped address is
    its IPv4's."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


class OpenPerTenant:
    """Requests and WebSockets each tenant has open at once, at most ``max_open`` (0: no
    cap). A connection being served is never evicted (``transport.py``), so one key's 1,000
    long-polls of an hour, from ten addresses, held every connection the server takes and
    locked every other tenant out (red team, 2026-12-06): past its cap a tenant's next
    request is refused at once (429 ``too_many_open``)."""

    def __init__(
        self,
        max_open: int,
        error: type[QuotaExceeded] = TooManyOpen,
        what: str = "requests and streams open (long-polls, WebSockets, runs under way)",
        setting: str = "API_MAX_OPEN_PER_TENANT",
    ) -> None:
        self.max_open = max_open
        self.open: Counter[str] = Counter()
        self._error, self._what, self._setting = error, what, setting

    def acquire(self, tenant: str) -> None:
        """Count one more open request or stream (or whatever this counts) of ``tenant``.

        Raises:
            QuotaExceeded: it has its most open already (``TooManyOpen`` by default).
        """
        if self.max_open and self.open[tenant] >= self.max_open:
            raise self._error(
                f"this tenant already has {self.open[tenant]} {self._what}; end some or raise "
                f"{self._setting}"
            )
        self.open[tenant] += 1

    def release(self, tenant: str) -> None:
        self.open[tenant] -= 1
        if self.open[tenant] <= 0:
            del self.open[tenant]


class Pace:
    """The messages of one tenant's WebSocket streams, ``per_s`` a second past a ``burst``
    (a leaky bucket, reserved before it waits, so streams waiting at once each get their
    own turn): a client sending faster is read more slowly (:meth:`wait` holds its next
    message back), so no input is lost and the flood costs it time, not the server's CPU.
    A stream's messages are not requests (no rate limit of their own), and one socket sent
    14,500 resizes a second, each a round trip to the guest: a core of the server's (red
    team, 2026-12-06)."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.interval_s = 1.0 / per_s
        self.tolerance_s = (burst - 1) * self.interval_s
        self._next_s = 0.0  # when the bucket is empty again (monotonic)

    async def wait(self, units: int = 1) -> None:
        """Take ``units`` messages' turns (a large message counts as several), waiting for
        them past the burst."""
        now = time.monotonic()
        due = max(self._next_s, now)
        self._next_s = due + units * self.interval_s
        delay_s = due - now - self.tolerance_s
        if delay_s > 0:
            await asyncio.sleep(delay_s)


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self._lock = threading.Lock()

    def check(self, key: str, cost: float = 1.0, counted_by: str = "its body's size") -> None:
        """Take ``cost`` tokens for ``key`` (a cost past the burst needs the bucket full but
        for the request's own token, and leaves it below zero).

        Raises:
            RateLimited: not enough tokens; ``retry_after_s`` says when there will be.
        """
        now = time.monotonic()
        needed = min(cost, float(max(self.burst - 1, 1)))
        with self._lock:
            tokens = _refilled(self._buckets.get(key), now, self.rate_per_s, self.burst)
            if tokens < needed:
                self._buckets[key] = (tokens, now)
                retry_after_s = (needed - tokens) / self.rate_per_s
                counted = f" (this one counts as {cost:g}: {counted_by})" if cost > 1 else ""
                raise RateLimited(
                    f"over {self.rate_per_s:g} requests/s for this API key{counted}; retry in "
                    f"{retry_after_s:.2f} s or raise API_RATE_LIMIT_PER_SECOND",
                    retry_after_s=retry_after_s,
                )
            self._buckets[key] = (tokens - cost, now)

    def charge(self, key: str, tokens: float) -> None:
        """Take ``tokens`` more for ``key`` without refusing: a request already admitted
        whose cost showed later (its body's size). The bucket may go below zero, so the
        key's next requests wait for it."""
        if tokens <= 0:
            return
        now = time.monotonic()
        with self._lock:
            left = _refilled(self._buckets.get(key), now, self.rate_per_s, self.burst)
            self._buckets[key] = (left - tokens, now)


# Addresses whose failed authentications are tracked, the most recent first: an address
# forgotten starts again with its whole burst.
MAX_TRACKED_ADDRESSES = 10_000
SAY_EVERY_S = 10.0


class AuthFailures:
    """Failed authentications by client address. Each may fail ``burst`` times at once and
    ``per_s`` times a second after that; past it the address is *refused*: its new
    connections are closed before a byte of them is read (``transport.py``), and the
    connection its last 401 went out on closes after it, until it has credit for one more
    failure. A keyless client from one address had the server answer 13,000 401s a second
    (red team, 2026-12-06), each a line of the access log: refused, it gets ~2 a second. Its
    connections still cost the server their accept (~45 us each, BENCHMARKS.md), so its CPU
    does not fall: a per-source limit in front of the server bounds that. Every client
    behind one address (a NAT, a proxy) shares its credit: with
    ``API_MAX_CONNECTIONS_PER_IP=0`` (behind a reverse proxy, where every client has the
    proxy's address) the server makes none of these."""

    def __init__(
        self, per_s: float, burst: int, max_addresses: int = MAX_TRACKED_ADDRESSES
    ) -> None:
        self.per_s = per_s
        self.burst = burst
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.refusals = 0  # connections closed unread, for the log and the tests
        self._said_at = -SAY_EVERY_S

    def _credit(self, address: str, now: float) -> float:
        return _refilled(self._buckets.get(address), now, self.per_s, self.burst)

    def failed(self, address: str, cost: float = 1.0) -> bool:
        """Count one failed authentication from ``address`` (or ``cost`` of one: a keyless
        request to a public route); whether it is refused now."""
        address = client_group(address)
        now = time.monotonic()
        tokens = self._credit(address, now) - cost
        self._buckets[address] = (tokens, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        if tokens < 1.0 and now - self._said_at >= SAY_EVERY_S:
            # At most a line every SAY_EVERY_S: a flood must not fill the log instead.
            self._said_at = now
            log.warning(
                "client address refused: too many failed authentications or keyless requests",
                client=address,
                refusals_so_far=self.refusals,
                per_s=self.per_s,
                burst=self.burst,
            )
        return tokens < 1.0

    def refused(self, address: str) -> bool:
        """Whether ``address`` has no credit for one more failure (counted as a refusal)."""
        address = client_group(address)
        if address not in self._buckets:
            return False
        if self._credit(address, time.monotonic()) >= 1.0:
            return False
        self.refusals += 1
        return True
