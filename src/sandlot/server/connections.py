"""How many HTTP connections the server holds, in all and per client address, and which one
gives way to a new one at a cap (:class:`ConnectionCount`, one per server process; the
protocol that counts them is ``transport.guarded_protocol``)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import itertools
import termios
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from sandlot.server.limits import AuthFailures, client_group

# Eviction candidates looked at per new connection (_evictable).
EVICTION_SCAN = 8
# At its address's cap, a connection waiting on its client this long gives way to a new one
# from the same address (ConnectionCount.waiting).
ADDRESS_GRACE_S = 0.5


@dataclass
class ConnectionLimits:
    max_connections: int
    max_connections_per_ip: int  # 0: no per-address cap (e.g. behind a proxy)
    header_timeout_s: float
    body_idle_timeout_s: float
    max_header_bytes: int


class Evictable(Protocol):
    def evict(self) -> None:
        """Leave the count and drop the connection."""

    def has_unread(self) -> bool:
        """Bytes from the client wait in its socket, not read yet: a request on its way."""


@dataclass
class ConnectionCount:
    """Open HTTP connections, in all and by client address (one per server process)."""

    limits: ConnectionLimits
    total: int = 0
    by_ip: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    # Admitted connections the server is waiting on the client for, oldest first, with their
    # address's group: a whole request head (its first, or the next on a kept-alive
    # connection), the rest of a body after its answer, or reading what it was sent. At the
    # cap, a new connection takes the oldest one's place: clients with no key from 11
    # addresses, each at its per-address cap and reconnecting whenever dropped, held the
    # whole cap and no keyed request got through in 20 s; so did 40 that pipelined requests
    # for a public page and read nothing (red team, 2026-12-06). At an address's own cap, the
    # oldest of that address's: 24 SDK clients of one process, each keeping its connection
    # alive after its call, held a cap of 4 and turned the others away until uvicorn's
    # keep-alive timeout; only one that has waited ADDRESS_GRACE_S, so that in a burst a
    # newcomer does not take the place of a connection whose request is on its way. Nor (at
    # the address's cap alone) one whose client has sent bytes the server has not read yet
    # (a kept-alive connection's next request, arrived in the same turn of the loop as the
    # newcomer: another SDK client of the same address lost 12 of 80 runs that way, red
    # team 2026-12-06). A connection being
    # served (a request under way, a pipelined one queued, a WebSocket) is never evicted,
    # and the newest is evicted last, so a client that sends its request at once gets in.
    waiting: dict[Evictable, str] = field(default_factory=dict)
    # Per address group, the same connections, with when they began to wait (monotonic).
    waiting_by_ip: dict[str, dict[Evictable, float]] = field(default_factory=dict)
    evicted: int = 0
    # Addresses out of credit for failed authentications: their connections are closed
    # before a byte is read (limits.py).
    auth_failures: AuthFailures | None = None
    turned_away: int = 0  # connections over a cap being told so (TURNED_AWAY_MAX)

    def admit(self, ip: str) -> bool:
        """Count a new connection from ``ip`` (by its group: an IPv6 address's /64); False
        if it is over a cap and must be closed."""
        ip = client_group(ip)
        per_ip = self.limits.max_connections_per_ip
        victim: Evictable | None = None
        if per_ip and self.by_ip[ip] >= per_ip:
            settled = time.monotonic() - ADDRESS_GRACE_S
            of_ip = self.waiting_by_ip.get(ip, {}).items()  # oldest first
            victim = _evictable(c for c, _ in itertools.takewhile(lambda w: w[1] <= settled, of_ip))
        elif self.total >= self.limits.max_connections:
            # The oldest, unread bytes or not: clients with no key that trickle bytes would
            # otherwise keep themselves out of reach and hold the cap (a keyed request got
            # 429 under 250 trickling bodies from 5 addresses, found in review).
            victim = next(iter(self.waiting), None)
        else:
            self.total += 1
            self.by_ip[ip] += 1
            return True
        if victim is None:
            self.refused += 1
            return False
        self._evict(victim)
        self.total += 1
        self.by_ip[ip] += 1
        return True

    def over_address_cap(self, ip: str) -> bool:
        per_ip = self.limits.max_connections_per_ip
        return bool(per_ip) and self.by_ip[client_group(ip)] >= per_ip

    def waits_on_client(self, connection: Evictable, ip: str) -> None:
        """The server waits on ``connection``'s client (at ``ip``): the newest such,
        evicted last."""
        self.served(connection)
        group = client_group(ip)
        self.waiting[connection] = group
        self.waiting_by_ip.setdefault(group, {})[connection] = time.monotonic()

    def served(self, connection: Evictable) -> None:
        """``connection`` is being served (or gone): not evictable."""
        group = self.waiting.pop(connection, None)
        if group is not None:
            of_ip = self.waiting_by_ip[group]
            del of_ip[connection]
            if not of_ip:
                del self.waiting_by_ip[group]

    def release(self, ip: str) -> None:
        ip = client_group(ip)
        self.total -= 1
        self.by_ip[ip] -= 1
        if self.by_ip[ip] <= 0:
            del self.by_ip[ip]

    def _evict(self, connection: Evictable) -> None:
        self.served(connection)
        connection.evict()  # leaves the count now, before its transport is gone
        self.evicted += 1


def _evictable(candidates: Iterator[Evictable]) -> Evictable | None:
    """The first of (at most EVICTION_SCAN of) ``candidates`` with nothing unread."""
    for candidate in itertools.islice(candidates, EVICTION_SCAN):
        if not candidate.has_unread():
            return candidate
    return None


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except (OSError, ValueError):
        return 0
    return count[0]
