"""The connection wall: what a client may hold before it has said who it is.

uvicorn bounds neither how long a request's headers or body may take to arrive nor how many
connections one address may hold, so 1,100 half-sent requests with no API key stopped the
server answering anyone. :func:`guarded_protocol` builds uvicorn's httptools protocol with:

- a cap on open HTTP connections, in all and per client address (an IPv6 address's /64;
  over it, the connection is answered 429 ``too_many_connections`` and closed, none of its
  request parsed, so a client may send it again; at the total cap, a new one takes
  the place of the connection that has waited longest for its request head, if any does;
  what a tenant's keys hold once served is capped by ``limits.OpenPerTenant``);
- a header deadline: the request line and headers must arrive within ``header_timeout_s`` of
  the connection (or of the previous response), and be at most ``max_header_bytes``;
- a body idle timeout: a request body that sends nothing for ``body_idle_timeout_s`` (while
  the server is reading) is dropped, so a stalled upload holds nothing for long.

Keep-alive idleness is uvicorn's own ``timeout_keep_alive``. A WebSocket stays in the count
until it closes (every WebSocket route checks the key before it reads a message, and closes
the socket without one); its frames are bounded by the WebSocket settings, and
:func:`_guard_websocket` adds two walls to it: a peer that pings and never reads is dropped,
and the app may drop a peer that does not read what it is sent (``outbox.cut``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sandlot.errors import TooManyConnections
from sandlot.server.connections import ConnectionCount, unread_bytes
from sandlot.server.outbox import ABORT_EXTENSION

log = structlog.get_logger(__name__)

# Pongs a WebSocket may owe a peer that does not read before it is dropped (~130 KiB): each is
# written at once, past the flow control that holds the app's own frames.
WS_PONGS_UNREAD_MAX = 1024
# A request answered before its body was all in (a 401 with no key, a 413, a 404 for an
# upload): the rest of the body is read and dropped for at most this long and this many bytes,
# so that the client can read the answer before the connection closes (closing with unread
# bytes sends a reset, and a client still sending loses the answer: a 2 MiB upload with no
# key got a reset instead of its 401 under load, with a cap of 256 KiB), and then the
# connection closes. Read on with no bound, a client with no key that trickled a chunked body
# after its 401 held its connection for good, and 200 of them held the whole cap (red team,
# 2026-12-06).
LINGER_S = 2.0
LINGER_BYTES = 64 << 20
# Requests one connection may have queued behind the one being served (HTTP/1.1 pipelining).
MAX_PIPELINED = 16
# How often a connection whose keyed answer is still being sent looks again (_waits_once_sent).
FLUSH_POLL_S = 0.05
# A connection over a cap is told why before it is closed (429 ``too_many_connections``,
# nothing of its request read), so that a client knows it may send that request again, even
# one that is not idempotent: closed unread, it could not tell "never read" from "lost after
# it ran", and the SDK lost 20 of 120 creates in a burst from one address (red team,
# 2026-12-06). The answer is written with the connection's end (FIN) once the client has sent
# something (answered before it had sent its request, a client could take it for a broken
# handshake: websockets' sync client raised an assertion of its own), and what it sends is
# dropped, until it has sent nothing for TURNED_AWAY_S, or for at most
# TURNED_AWAY_TOTAL_S and LINGER_BYTES in all, so that its unread bytes do not reset the
# connection before the answer is read (dropping only 64 KiB, a 600 KB run got a reset, not
# the 429: red team, 2026-12-06). At most TURNED_AWAY_MAX such connections are open at once;
# past that, one is closed unread as before (a flood of new connections must not hold the
# server's descriptors for long).
TURNED_AWAY_S = 1.0
TURNED_AWAY_TOTAL_S = 10.0
TURNED_AWAY_MAX = 256


def _release_when_lost(protocol: Any, release: Any) -> None:
    """Call ``release`` once, when ``protocol`` (a WebSocket's, after the upgrade) loses its
    connection."""
    lost = protocol.connection_lost
    released = False

    def connection_lost(exc: Exception | None) -> None:
        nonlocal released
        if not released:
            released = True
            release()
        lost(exc)

    protocol.connection_lost = connection_lost


def _guard_websocket(protocol: Any) -> None:
    """Walls on an upgraded WebSocket (uvicorn's websockets-sansio protocol):

    - the scope's :data:`ABORT_EXTENSION` (``{"abort": callable}``) drops the connection at
      once, for a client that reads nothing (a close frame would wait behind its buffer);
    - uvicorn answers every ping at once, written whatever the transport already holds: a
      client that sent pings and never read grew the server by 506 MiB in 15 s. Past
      :data:`WS_PONGS_UNREAD_MAX` pings answered while the transport holds back (its buffer
      over the high-water mark), the connection is dropped.
    """
    transport = getattr(protocol, "transport", None)
    if transport is None:
        return
    scope = getattr(protocol, "scope", None)
    if isinstance(scope, dict):
        scope.setdefault("extensions", {})[ABORT_EXTENSION] = {"abort": transport.abort}
    handle_ping = getattr(protocol, "handle_ping", None)
    writable = getattr(protocol, "writable", None)
    if handle_ping is None or not isinstance(writable, asyncio.Event):
        return
    unread = 0

    def guarded_ping() -> None:
        nonlocal unread
        unread = 0 if writable.is_set() else unread + 1
        if unread > WS_PONGS_UNREAD_MAX:
            if not transport.is_closing():
                log.warning("websocket dropped: its client pings and does not read")
                transport.abort()
            return
        handle_ping()

    protocol.handle_ping = guarded_ping


def guarded_protocol(count: ConnectionCount) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the walls above, sharing ``count``."""
    limits = count.limits

    class GuardedHttp(HttpToolsProtocol):
        _admitted_ip: str | None = None
        _refused = False  # closed unread: its address is out of credit (limits.py)
        _turned_away = False  # over a connection cap: told so, and read no further
        _turned_away_until = 0.0  # the loop's time by which it is dropped, whatever it sends
        _turned_away_over_address = False  # over its address's cap, not the total
        _deadline: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _in_headers = False
        _message_done = True  # the parser has the whole current request, body included
        _lingering = False  # answered; the rest of its body is being dropped
        _lingered_bytes = 0
        _write_deadline: asyncio.TimerHandle | None = None  # while the client reads nothing
        _flush_poll: asyncio.TimerHandle | None = None  # a keyed answer's tail not yet sent
        _tail_deadline: float | None = None  # the loop's time it is waited for until

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            failures = count.auth_failures
            if failures is not None:
                peer = transport.get_extra_info("peername")
                if failures.refused(str(peer[0]) if peer else "?"):
                    # Before uvicorn takes it in (nothing of it to undo), and not a line
                    # logged each: a flood would fill the log. Accepting it was most of
                    # the cost (BENCHMARKS.md): a limit in front of the server bounds that.
                    self._refused = True
                    transport.abort()
                    return
            super().connection_made(transport)
            ip = self.client[0] if self.client else "?"
            if not count.admit(ip):
                log.warning("connection refused: too many open", client=ip, total=count.total)
                self._turn_away(ip)
                return
            self._admitted_ip = ip
            self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return  # uvicorn never took it in
            if self._turned_away:
                self._turned_away = False
                count.turned_away -= 1
            self._disarm()
            self._cancel_write_deadline()
            self._leave_count()
            super().connection_lost(exc)

        def has_unread(self) -> bool:
            return unread_bytes(self.transport) > 0

        def evict(self) -> None:
            self._disarm()
            self._cancel_write_deadline()
            self._leave_count()
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._turned_away:
                if not self._lingered_bytes:
                    self._answer_turned_away()
                self._lingered_bytes += len(data)
                left_s = self._turned_away_until - self.loop.time()
                if self._lingered_bytes > LINGER_BYTES or left_s <= 0:
                    self.transport.abort()
                else:
                    self._arm(min(TURNED_AWAY_S, left_s), self.transport.abort)
                return  # never parsed: nothing of it reaches the app
            waiting = self._in_headers
            super().data_received(data)
            # Counted only while the headers are still incomplete after this chunk, so a
            # body that follows its headers in the same chunk is not counted as headers.
            if waiting and self._in_headers and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(431, "request headers too large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._message_done = False
            if not self._in_headers:
                self._expect_headers()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._cancel_flush_poll()
            self._tail_deadline = None
            count.served(self)
            self._arm(limits.body_idle_timeout_s, self._body_stalled)
            super().on_headers_complete()
            if len(self.pipeline) > MAX_PIPELINED:
                # Each queued request holds its parsed head until its turn: 20,000 pipelined
                # in one send took the server from 98 to 503 MiB (red team, 2026-12-06).
                log.warning("connection dropped: too many pipelined requests", client=self.client)
                self.transport.abort()

        def pause_writing(self) -> None:
            # The client does not read what it was sent yet: dropped if it reads nothing for
            # the body idle time, and meanwhile evictable, unless its request carried a key
            # (every large answer pauses: keyless newcomers at the cap cut a keyed client's
            # download that read at 1.3 MB/s, red team 2026-12-06).
            super().pause_writing()
            if not self._keyed():
                self._waits_on_client()
            self._cancel_write_deadline()
            self._write_deadline = self.loop.call_later(limits.body_idle_timeout_s, self._unread)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_write_deadline()
            if not self._in_headers and not self._lingering:
                count.served(self)

        def _keyed(self) -> bool:
            """The request being answered was authenticated (guard.py put its principal in
            the scope)."""
            state = self.cycle.scope.get("state") if self.cycle is not None else None
            return isinstance(state, dict) and "principal" in state

        def _waits_on_client(self) -> None:
            if self._admitted_ip is not None:
                count.waits_on_client(self, self._admitted_ip)

        def _cancel_write_deadline(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _unread(self) -> None:
            log.warning("connection dropped: its client reads nothing", client=self.client)
            self.transport.abort()

        def on_body(self, body: bytes) -> None:
            if self._lingering:
                self._lingered_bytes += len(body)
                if self._lingered_bytes > LINGER_BYTES:
                    self.transport.close()
                return  # nobody reads it: its request has been answered
            self._arm(limits.body_idle_timeout_s, self._body_stalled)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            self._message_done = True
            super().on_message_complete()
            # Answered before its body was all in (a refused upload): the rest has been read
            # now, and the connection waits for its next request, under the header deadline.
            if self.cycle is not None and self.cycle.response_complete:
                self._expect_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Busy: a pipelined request already parsed is being served now.
            if self.transport.is_closing() or self._busy():
                return
            if self._message_done:
                self._expect_headers()
            elif self._in_headers:
                self._waits_once_sent()  # a pipelined request's head, still arriving
            else:
                self._linger()  # this request's body, answered before it was all in

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            ip = self._admitted_ip
            super().handle_websocket_upgrade()
            upgraded = self.transport.get_protocol()
            if upgraded is not self:
                _guard_websocket(upgraded)
            if ip is not None and upgraded is not self:
                # The WebSocket stays counted until it closes: left out of the count, 1,150
                # sockets with no key held 1,150 of the server's file descriptors.
                self._admitted_ip = None
                _release_when_lost(upgraded, lambda: count.release(ip))

        # -- helpers

        def _turn_away(self, ip: str) -> None:
            """Over a cap: answer 429 ``too_many_connections`` to what the client sends, parsing
            none of it, and end the connection (TURNED_AWAY_S)."""
            if count.turned_away >= TURNED_AWAY_MAX or not self.transport.can_write_eof():
                self.transport.abort()
                return
            count.turned_away += 1
            self._turned_away = True
            self._turned_away_over_address = count.over_address_cap(ip)
            self._turned_away_until = self.loop.time() + TURNED_AWAY_TOTAL_S
            self._arm(TURNED_AWAY_S, self.transport.abort)

        def _answer_turned_away(self) -> None:
            try:
                self.transport.write(_too_many_connections(self._turned_away_over_address))
                if not self.transport.is_closing():
                    self.transport.write_eof()
            except OSError:
                # The client has gone already (it reset the connection): raised out of a
                # protocol callback, each was a traceback in the log, and a loop of them
                # stalled the server (red team, 2026-12-06).
                self.transport.abort()

        def _linger(self) -> None:
            """Its request is answered and its body still comes: drop the rest for a moment,
            then close; evictable meanwhile, as a connection waiting for a head is."""
            self._lingering = True
            self._lingered_bytes = 0
            self._arm(LINGER_S, self.transport.close)
            self._waits_once_sent()

        def _expect_headers(self) -> None:
            self._lingering = False
            self._in_headers = True
            if not self._busy():
                # Else a pipelined request's head: the connection is still being served
                # (evicted, it lost an answer under way), and waits once that is done.
                self._waits_once_sent()
            self._header_bytes = 0
            self._arm(limits.header_timeout_s, self._headers_late)

        def _waits_once_sent(self) -> None:
            """Evictable once a keyed answer's last bytes have left the transport's buffer
            (waiting for a next request's head, or dropping the rest of an answered body):
            an answer is complete for uvicorn when it is written there, and an eviction
            (an abort) drops what is left. A keyed download read at a modest pace lost its
            last 10 KB of 16 MiB so, to keyless newcomers at the cap (two test workers,
            2026-12-07). Polled: asyncio says when a buffer drains below its low-water
            mark, not when it is empty. A keyless answer's tail is not waited for: a client
            that reads nothing of small answers would hold its slot (it is cut by the
            header timeout meanwhile either way)."""
            self._cancel_flush_poll()
            if not (self._in_headers or self._lingering) or self._busy():
                self._tail_deadline = None
                return  # a request of it is being served again
            # Waited for no longer than a client that reads nothing is (the body idle time):
            # a tail under the high-water mark never pauses writing, so no write deadline
            # drops such a client, and a closing transport waits for its buffer forever.
            # Unbounded, 20 keyed downloads that left 3-64 KiB unread each held a server's
            # whole connection cap for good (red team, 2026-12-07). Past the bound, or once
            # the transport is closing, the connection is evictable as any other.
            now = self.loop.time()
            if self._tail_deadline is None:
                self._tail_deadline = now + limits.body_idle_timeout_s
            if (
                self._keyed()
                and self.transport.get_write_buffer_size() > 0
                and not self.transport.is_closing()
                and now < self._tail_deadline
            ):
                self._flush_poll = self.loop.call_later(FLUSH_POLL_S, self._waits_once_sent)
                return
            self._tail_deadline = None
            self._waits_on_client()

        def _cancel_flush_poll(self) -> None:
            if self._flush_poll is not None:
                self._flush_poll.cancel()
                self._flush_poll = None

        def _busy(self) -> bool:
            """A request of this connection is being served, or queued to be (uvicorn serves
            them in order: the newest parsed, ``cycle``, is answered last)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self, delay_s: float, handler: Any) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(delay_s, handler)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _leave_count(self) -> None:
            self._cancel_flush_poll()
            count.served(self)  # no longer waiting, whatever it waited for
            if self._admitted_ip is not None:
                count.release(self._admitted_ip)
                self._admitted_ip = None

        def _headers_late(self) -> None:
            if self._busy():
                # A pipelined head: its time runs from when the answers before it are out
                # (a 408 now would be written into an answer under way).
                self._arm(limits.header_timeout_s, self._headers_late)
                return
            # Between requests uvicorn's keep-alive timer closes an idle connection first.
            if self._in_headers and self._header_bytes:
                self._refuse(408, "request headers not received in time")
            elif self._in_headers:
                self.transport.close()

        def _body_stalled(self) -> None:
            if self.flow is not None and self.flow.read_paused:
                # We stopped reading (the app is busy with what came): not the client's fault.
                self._arm(limits.body_idle_timeout_s, self._body_stalled)
                return
            log.warning("request body stalled; connection closed", client=self._admitted_ip)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.close()

        def _refuse(self, status: int, reason: str) -> None:
            self._disarm()
            body = reason.encode()
            head = (
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.close()

    return GuardedHttp


def _too_many_connections(per_address: bool) -> bytes:
    """The whole answer to a connection over a cap, in the server's typed error body."""
    which = (
        "your address holds its most open connections (API_MAX_CONNECTIONS_PER_IP)"
        if per_address
        else "the server holds its most open connections (API_MAX_CONNECTIONS)"
    )
    error = {
        "code": TooManyConnections.code,
        "message": f"{which}; nothing of this request was read: send it again once one closes",
        "request_id": None,
    }
    body = json.dumps({"error": error}).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
