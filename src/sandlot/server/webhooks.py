"""Webhooks: the server POSTs a background command's end to the URL it was started with.

A ``RunCommand`` with ``webhook_url`` (and optionally ``webhook_secret``) is checked before
the command starts (:meth:`Webhooks.check_url`, the manager's ``webhook_check``); when the
command ends (exit, kill, timeout, its sandbox's destroy) the manager's "command_ended"
event queues one delivery, sent on the server's event loop::

    POST <webhook_url>
    Content-Type: application/json
    X-Sandlot-Event: command.completed
    X-Sandlot-Delivery: <32 hex digits, the same on each try>
    X-Sandlot-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, f"{t}.{body}")>

    {"event": "command.completed", "sandbox_id", "command_id", "pid", "exit_code",
     "kill_reason", "duration_ms", "stdout_tail", "stderr_tail", "sent_at"}

The URL is the tenant's, and the server sends from inside the operator's network, so the
walls are against the tenant (server-side request forgery):

- **Where it may go.** The host is resolved once per try, and every address it resolves to
  must be public (:func:`address_refusal`: no loopback, private, CGNAT, link-local where cloud
  metadata answers, multicast, unspecified, reserved, nor an IPv6 form of one: IPv4-mapped,
  NAT64, 6to4, unique-local, link-local) unless ``API_WEBHOOK_ALLOW_CIDRS`` holds it. The
  connection goes to the address checked, not to the name again (a name rebound between the
  check and the connect cannot move it), with the URL's Host header and, for https, its name
  as SNI and for the certificate check; the port is the URL's. Checked when the command
  starts (422) and again at each try (a name may resolve elsewhere by then).
- **What it may learn.** Nothing comes back to the tenant: no redirect is followed, the
  answer's body is never read, its status only counted. A refused host name gets one message
  whether it did not resolve or resolved to a refused address (the server's resolver is no
  oracle for internal names); logs name the URL's scheme, host and port only (a URL's path
  often holds a token).
- **What it may cost.** Each try is bounded to :data:`ATTEMPT_TIMEOUT_S` in all (a receiver
  trickling its answer a byte at a time too), at most :data:`MAX_TRIES` tries (only after a
  connection error or a 5xx: a timeout may have been received, so it is not sent again), at
  most :data:`IN_FLIGHT` tries at once server-wide, taken by tenants in turn; a tenant has at
  most ``API_WEBHOOKS_PENDING_PER_TENANT`` deliveries queued or under way (past it a new one is
  dropped, counted, and logged once a minute for that tenant); a body holds at most
  :data:`TAIL_BYTES` of each stream; names are resolved on :data:`DNS_THREADS` threads of
  their own, never the event loop's shared pool, at most :data:`DNS_PER_TENANT` of a
  tenant's at once.

Deliveries live in this process's memory only: they are at most :data:`MAX_TRIES` tries,
usually one, and a server's restart loses those not yet sent (the command's result stays
with ``wait``). A failure is logged and counted (``sandlot_webhook_deliveries_total``), never
raised into the command, its sandbox or a request. The server's shutdown cancels what is
pending within :data:`CLOSE_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from sandlot._turns import FairTurns
from sandlot._version import __version__
from sandlot.config import Settings, ip_networks
from sandlot.core.background import Webhook
from sandlot.core.job_verbs import JobVerbs
from sandlot.errors import InvalidRequest
from sandlot.models import CommandInfo, ExecResult, SandboxInfo
from sandlot.server.webhook_targets import (
    IPAddress,
    IPNetwork,
    Target,
    address_refusal,
    parse_target,
)
from sandlot.server.webhook_transport import bounded_transport

log = structlog.get_logger(__name__)
# httpx logs each request's whole URL at INFO, and a webhook's path and query often hold its
# receiver's token: three lines a delivery reached the server's log (red team, 2026-12-07).
# Set where webhooks are sent, whatever configured the process's logging.
for _library in ("httpx", "httpcore"):
    logging.getLogger(_library).setLevel(logging.WARNING)

EVENT = "command.completed"
ATTEMPT_TIMEOUT_S = 5.0  # one try, all of it: resolving, connecting, TLS, sending, the status
CONNECT_TIMEOUT_S = 4.0  # under the try's: a connect that never answers is retried
BACKOFF_S = (1.0, 4.0)  # before the second and the third try
MAX_TRIES = len(BACKOFF_S) + 1
IN_FLIGHT = 8  # tries under way at once, server-wide
TAIL_BYTES = 4096  # of each of stdout and stderr, in UTF-8
# A lookup cannot be interrupted, and a name whose servers never answer holds its thread for
# the resolver's whole timeout: a tenant holds one thread at most, so that it takes 32
# tenants' hung names, not 4 tenants' (red team, 2026-12-07: with 8 threads and 2 a tenant,
# four tenants held them all and a fifth's webhook was refused, its delivery lost).
DNS_THREADS = 32
DNS_PER_TENANT = 1  # lookups of one tenant on those threads at once
MAX_ADDRESSES = 32  # a name's addresses checked (all of them must pass)
CLOSE_WAIT_S = 1.0
MAX_REASON_CHARS = 300  # of a failure's reason in its log line
DROP_LOG_EVERY_S = 60.0  # a tenant's dropped deliveries: logged once a minute
FAILURE_LOG_EVERY_S = 10.0  # a tenant's failed (or refused) ones
SETTING = "API_WEBHOOK_ALLOW_CIDRS"
# A try that failed with one of these is made again (after BACKOFF_S).
RETRIED = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def _tls_refused(exc: BaseException) -> str | None:
    """The TLS error (a certificate not trusted, or not for the host) under ``exc``."""
    seen: BaseException | None = exc
    for _ in range(8):  # httpx wraps httpcore's, which wraps ssl's
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError):
            return type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    return None


class Refused(Exception):
    """A webhook's host may not be reached (its message is the one its client may read)."""


def tail(text: str, limit_bytes: int = TAIL_BYTES) -> str:
    """The last ``limit_bytes`` of ``text`` in UTF-8, cut on a character's boundary."""
    data = text[-limit_bytes:].encode("utf-8", "replace")[-limit_bytes:]
    return data.decode("utf-8", "ignore")


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Sandlot-Signature`` value of ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


class _Throttle:
    """Log a (tenant, kind) at most once every ``every_s``, saying how many were not."""

    MAX_KEYS = 10_000

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def due(self, tenant: str, kind: str, every_s: float) -> int | None:
        """The number left unlogged since the last line if one is due now, else None."""
        now = time.monotonic()
        key = (tenant, kind)
        last, unlogged = self._last.get(key, (-every_s, 0))
        if now - last < every_s:
            self._last[key] = (last, unlogged + 1)
            return None
        if len(self._last) >= self.MAX_KEYS:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < DROP_LOG_EVERY_S}
        self._last[key] = (now, 0)
        return unlogged


@dataclass
class Delivery:
    tenant: str
    target: Target
    secret: str | None = field(repr=False)
    fields: dict[str, Any]  # the body, less sent_at
    delivery_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def request(self, now: float) -> tuple[bytes, dict[str, str]]:
        """The body and headers of one try, sent at ``now``."""
        body = json.dumps(
            {**self.fields, "sent_at": round(now, 3)}, ensure_ascii=False, separators=(",", ":")
        ).encode("utf-8")
        headers = {
            "Host": self.target.host_header,
            "Content-Type": "application/json",
            "User-Agent": f"sandlot-webhook/{__version__}",
            "X-Sandlot-Event": EVENT,
            "X-Sandlot-Delivery": self.delivery_id,
        }
        if self.secret is not None:
            headers["X-Sandlot-Signature"] = sign(self.secret, int(now), body)
        return body, headers


def event_fields(
    sandbox: SandboxInfo, command: CommandInfo, result: ExecResult | None, kill_reason: str | None
) -> dict[str, Any]:
    """A delivery's body, less its ``sent_at``."""
    if result is not None:
        duration_ms = result.duration_ms
    else:
        duration_ms = max(0.0, (time.time() - command.started_at) * 1000)
    return {
        "event": EVENT,
        "sandbox_id": sandbox.id,
        "command_id": command.command_id,
        "pid": command.pid,
        "exit_code": None if result is None else result.exit_code,
        "kill_reason": kill_reason,
        "duration_ms": round(duration_ms, 3),
        "stdout_tail": tail(result.stdout) if result is not None else "",
        "stderr_tail": tail(result.stderr) if result is not None else "",
    }


class Webhooks:
    """The server's webhook sender: checks URLs for the manager, queues a delivery on each
    "command_ended" event that has a webhook, and sends them (module docstring)."""

    def __init__(self, settings: Settings, count: Callable[[str], None] | None = None) -> None:
        self.allowed: tuple[IPNetwork, ...] = tuple(ip_networks(settings.webhook_allow_cidrs))
        self.pending_per_tenant = settings.webhooks_pending_per_tenant
        self._count = count or (lambda outcome: None)
        self.pending: dict[str, int] = {}  # tenant -> deliveries queued or under way
        self.turns = FairTurns(IN_FLIGHT)  # round robin by tenant
        self._tasks: set[asyncio.Task[None]] = set()
        self._dns: ThreadPoolExecutor | None = None
        self._dns_turns: dict[str, asyncio.Semaphore] = {}  # tenant -> its lookups' turns
        self._ssl: ssl.SSLContext | None = None
        self._throttle = _Throttle()
        self._closed = False
        self._manager: JobVerbs | None = None

    def attach(self, manager: object) -> None:
        """Take ``manager``'s webhook checks and its "command_ended" events. A manager that
        runs no commands here (a Ray cluster's router) is left alone: its nodes' managers
        have no check, and so refuse a webhook_url rather than drop it."""
        if isinstance(manager, JobVerbs):
            self._manager = manager
            manager.webhook_check = self.check_url
            manager.add_listener(self.on_event)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ where it may go

    async def check_url(self, tenant: str, url: str) -> None:
        """Refuse ``url`` before its command starts.

        Raises:
            InvalidRequest: malformed, or its host is not one webhooks may reach now.
        """
        target = parse_target(url)
        try:
            async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
                await self.resolve(target, tenant)
        except TimeoutError:
            raise InvalidRequest(
                f"webhook_url's host {target.host!r} did not resolve within {ATTEMPT_TIMEOUT_S:g} s"
            ) from None
        except Refused as exc:
            raise InvalidRequest(str(exc)) from None

    async def resolve(self, target: Target, tenant: str) -> IPAddress:
        """The address to connect to: the first the host resolves to, once all of them
        have passed :func:`address_refusal` (``tenant``'s lookup, in its turn).

        Raises:
            Refused: the host did not resolve, or to an address webhooks may not reach.
        """
        if target.literal is not None:
            what = address_refusal(target.literal, self.allowed)
            if what is not None:
                raise Refused(
                    f"webhook_url's host {target.literal} is not public ({what}): webhooks go "
                    f"to public addresses only, unless the server's {SETTING} allows its network"
                )
            return target.literal
        addresses = await self._addresses(tenant, target.host, target.port)
        if not addresses or any(address_refusal(ip, self.allowed) for ip in addresses):
            # One message either way: which of the two it was would tell the tenant what
            # the server's resolver knows of internal names.
            raise Refused(
                f"webhook_url's host {target.host!r} did not resolve, or resolved to an "
                "address webhooks may not reach (loopback, private, CGNAT, link-local, "
                "multicast, reserved or unspecified): they go to public addresses only, "
                f"unless the server's {SETTING} allows the network"
            )
        return addresses[0]

    async def _addresses(self, tenant: str, host: str, port: int) -> list[IPAddress]:
        """``host``'s addresses (none if it does not resolve), looked up on a thread of
        the webhooks' own, at most :data:`DNS_PER_TENANT` of ``tenant``'s at once. A lookup
        cannot be interrupted: its thread and its tenant's turn stay taken until the
        resolver gives up, however long after its caller did (a name whose servers never
        answer holds them for the resolver's whole timeout), so one tenant's slow names
        hold its own turns, not the other tenants' threads."""
        turns = self._dns_turns.setdefault(tenant, asyncio.Semaphore(DNS_PER_TENANT))
        await turns.acquire()
        loop = asyncio.get_running_loop()
        try:
            if self._dns is None:
                self._dns = ThreadPoolExecutor(DNS_THREADS, thread_name_prefix="webhook-dns")
            lookup = self._dns.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        except BaseException:
            turns.release()
            raise

        def looked_up(_future: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(turns.release)

        lookup.add_done_callback(looked_up)
        try:
            infos = await asyncio.wrap_future(lookup)
        except (OSError, UnicodeError):
            return []
        found: list[IPAddress] = []
        for _family, _type, _proto, _name, sockaddr in infos[:MAX_ADDRESSES]:
            try:
                found.append(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
            except ValueError:
                return []  # not an address we can judge: refused with the rest
        return found

    # ------------------------------------------------------------------ queueing

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        """The manager's listener: a delivery for each ended command with a webhook."""
        if event != "command_ended":
            return
        if self._manager is not None and self._manager.webhook_check != self.check_url:
            return  # a later app's sender took this manager over: it sends them
        webhook: Webhook | None = fields.get("webhook")
        if webhook is None:
            return
        try:
            self._queue(webhook, fields)
        except Exception:
            log.exception("webhook not queued")
            self._count("failed")

    def _queue(self, webhook: Webhook, fields: dict[str, Any]) -> None:
        sandbox: SandboxInfo = fields["info"]
        tenant = sandbox.owner
        if self._closed:
            self._count("cancelled")
            return
        if self.pending.get(tenant, 0) >= self.pending_per_tenant:
            self._count("dropped")
            unlogged = self._throttle.due(tenant, "dropped", DROP_LOG_EVERY_S)
            if unlogged is not None:
                log.warning(
                    "webhook dropped: the tenant has too many pending; raise "
                    "API_WEBHOOKS_PENDING_PER_TENANT or make its receivers answer faster",
                    tenant=tenant,
                    pending=self.pending_per_tenant,
                    dropped_unlogged=unlogged,
                )
            return
        delivery = Delivery(
            tenant=tenant,
            target=parse_target(webhook.url),
            secret=webhook.secret,
            fields=event_fields(
                sandbox, fields["command"], fields.get("result"), fields.get("kill_reason")
            ),
        )
        self.pending[tenant] = self.pending.get(tenant, 0) + 1
        task = asyncio.get_running_loop().create_task(self._deliver(delivery))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ sending

    async def _deliver(self, delivery: Delivery) -> None:
        outcome, reason, tries = "failed", "no try made", 0
        try:
            for tries, backoff_s in enumerate((0.0, *BACKOFF_S), start=1):
                if backoff_s:
                    await asyncio.sleep(backoff_s)
                outcome, reason, retry = await self._one_try(delivery)
                if not retry or tries == MAX_TRIES:
                    break
        except asyncio.CancelledError:
            outcome, reason = "cancelled", "the server stopped"
            raise
        except Exception as exc:  # never into anything else
            log.exception("webhook delivery failed unexpectedly", tenant=delivery.tenant)
            outcome, reason = "failed", repr(exc)
        finally:
            left = self.pending.get(delivery.tenant, 1) - 1
            if left > 0:
                self.pending[delivery.tenant] = left
            else:
                self.pending.pop(delivery.tenant, None)
            self._count(outcome)
            if outcome in ("failed", "refused"):
                self._log_failure(delivery, outcome, reason, tries)

    async def _one_try(self, delivery: Delivery) -> tuple[str, str, bool]:
        """One try, in one of the server's places: its outcome, why, and whether to try
        again (after a connection error or a 5xx only)."""
        try:
            async with self.turns.turn(delivery.tenant):
                status = await self._try(delivery)
        except Refused as exc:
            return "refused", str(exc), False
        except RETRIED as exc:  # not connected, or cut before an answer
            tls = _tls_refused(exc)  # a refused certificate is the same next time
            return "failed", f"{'TLS' if tls else 'connection'} failed: {tls or exc!r}", not tls
        except (TimeoutError, httpx.TimeoutException):
            # It may have been received: sent again, it could be taken twice.
            return "failed", f"no answer within {ATTEMPT_TIMEOUT_S:g} s", False
        except httpx.HTTPError as exc:
            return "failed", f"{type(exc).__name__}: {exc}", False
        if 200 <= status < 300:
            return "delivered", f"answered {status}", False
        return "failed", f"answered {status}", status >= 500

    async def _try(self, delivery: Delivery) -> int:
        """One try: resolve and check the host again, POST to the address checked, and
        return the answer's status without reading its body.

        Raises:
            Refused: the host resolves to an address webhooks may not reach now.
            TimeoutError: the try took :data:`ATTEMPT_TIMEOUT_S`.
            httpx.HTTPError: the connection failed.
        """
        target = delivery.target
        async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
            ip = await self.resolve(target, delivery.tenant)
            body, headers = delivery.request(time.time())
            extensions: dict[str, Any] = {}
            if target.scheme == "https" and target.literal is None:
                extensions["sni_hostname"] = target.host  # and the certificate's name
            timeout = httpx.Timeout(ATTEMPT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
            async with (
                httpx.AsyncClient(
                    # No proxy (the connection goes to the address checked), and what the try
                    # reads is bounded (webhook_transport.py).
                    transport=bounded_transport(self._ssl_context()),
                    trust_env=False,
                    follow_redirects=False,
                    timeout=timeout,
                ) as client,
                client.stream(
                    "POST",
                    target.url_for(ip),
                    content=body,
                    headers=headers,
                    extensions=extensions,
                ) as response,
            ):
                return response.status_code

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:  # once: loading the CA bundle takes ~10 ms of the loop
            self._ssl = httpx.create_ssl_context(trust_env=False)
        return self._ssl

    def _log_failure(self, delivery: Delivery, outcome: str, reason: str, tries: int) -> None:
        # By outcome, not reason: a refusal's reason names the host, and a tenant's many
        # hosts would each have a line.
        unlogged = self._throttle.due(delivery.tenant, outcome, FAILURE_LOG_EVERY_S)
        if unlogged is None:
            return
        log.warning(
            "webhook not delivered",
            outcome=outcome,
            reason=reason[:MAX_REASON_CHARS],  # a receiver's garbage status line: 90 KB
            tries=tries,
            tenant=delivery.tenant,
            sandbox=delivery.fields["sandbox_id"],
            command_id=delivery.fields["command_id"],
            delivery_id=delivery.delivery_id,
            url=delivery.target.where(),
            unlogged=unlogged,
        )

    # ------------------------------------------------------------------ stopping

    async def aclose(self) -> None:
        """Cancel every pending delivery (waiting at most :data:`CLOSE_WAIT_S` for them to
        unwind); events after this are counted ``cancelled`` and not sent."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            log.warning(
                "webhooks not sent: the server is stopping (deliveries live in its memory only)",
                cancelled=len(tasks),
            )
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if self._dns is not None:
            # A resolver thread cannot be interrupted: left to end by itself.
            self._dns.shutdown(wait=False, cancel_futures=True)
            self._dns = None
