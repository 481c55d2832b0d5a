"""The one connection a webhook's try makes, with what it may read bounded.

A try reads the receiver's answer up to its final status line, never its body. httpcore skips
interim (1xx) answers while it waits for that line, parsing each on the server's one event
loop, with no bound on how many: a receiver that sent ``100 Continue`` forever held a whole
core for the try's 5 s, and a tenant's eight at once took another tenant's GET from 2 ms to
118 ms median (red team, 2026-12-07). Here every byte a try reads is counted, and past
:data:`MAX_READ_BYTES` the connection fails like any other broken one.
"""

# httpcore's stream and backend interface names its parameters ``timeout``.
# ruff: noqa: ASYNC109

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

# An answer's head, 1xx ones before it included: far more than any real receiver sends.
MAX_READ_BYTES = 64 * 1024


class _CountedStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream, budget: list[int]) -> None:
        self._stream = stream
        self._budget = budget  # shared with the TLS stream that wraps this one

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._stream.read(max_bytes, timeout)
        self._budget[0] -= len(data)
        if self._budget[0] < 0:
            raise httpcore.ReadError(f"the receiver sent more than {MAX_READ_BYTES} bytes")
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        tls = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        return _CountedStream(tls, self._budget)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _CountedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _CountedStream(stream, [MAX_READ_BYTES])

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a webhook goes over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def bounded_transport(ssl_context: ssl.SSLContext) -> httpx.AsyncHTTPTransport:
    """httpx's transport, its pool one whose connections count what they read (httpx takes
    no network backend of its own: the pool is replaced as its constructor makes it)."""
    transport = httpx.AsyncHTTPTransport(verify=ssl_context, trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl_context, max_connections=1, network_backend=_CountedBackend()
    )
    return transport
