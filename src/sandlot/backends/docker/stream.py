"""The guest's stdio in a docker sandbox: an exec whose hijacked HTTP stream we read ourselves.

Done by hand rather than with the SDK's ``socket=True`` because the SDK reads the HTTP
response through a buffer that may swallow the first bytes of the stream; and with no
``docker`` CLI process (25 MB RSS each) per sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING, Any

import structlog

from sandlot.backends.base import STDERR_TAIL_BYTES
from sandlot.backends.docker.dockerd import daemon_socket
from sandlot.errors import BackendUnavailable, SandboxStartError

if TYPE_CHECKING:
    import docker

log = structlog.get_logger(__name__)

STREAM_LIMIT_BYTES = 1 << 20
UPGRADE_TIMEOUT_S = 30.0


def socket_path() -> str:
    """The daemon's unix socket, from DOCKER_HOST.

    Raises:
        BackendUnavailable: DOCKER_HOST is not a unix socket.
    """
    path = daemon_socket()
    if path is None:
        raise BackendUnavailable(
            f"DOCKER_HOST={os.environ.get('DOCKER_HOST')}: the docker backend streams the "
            "guest's stdio over the daemon's unix socket; point DOCKER_HOST at a unix:// socket"
        )
    return path


class ExecGuest:
    """The guest's stdio over a hijacked ``POST /exec/{id}/start`` connection.

    Docker multiplexes stdout and stderr on it in frames (an 8-byte header: stream, 0, 0, 0,
    big-endian length); we demultiplex stdout into :attr:`reader` and keep stderr's tail.
    """

    def __init__(
        self,
        raw: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        exec_id: str,
        api: Any,
        watch: StopWatch | None = None,
    ) -> None:
        self.reader = asyncio.StreamReader(limit=STREAM_LIMIT_BYTES)
        self.writer = writer
        self.exec_id = exec_id
        self._api = api
        self._raw = raw
        self._stderr_tail = bytearray()
        self._demux_task = asyncio.create_task(self._demux())
        # The container's stop ends the stream: under gVisor an exec's stream outlived a
        # sandbox whose sentry the OOM killer took, and a call in flight waited out its
        # timeout and the backstop (15 s) before the restart.
        self._watch = watch
        self._watch_task: asyncio.Task[None] | None = None  # held: the loop keeps weak refs
        if watch is not None:
            self._watch_task = asyncio.create_task(watch.stopped())
            self._watch_task.add_done_callback(lambda _: self.kill())

    async def _demux(self) -> None:
        try:
            while True:
                header = await self._raw.readexactly(8)
                size = int.from_bytes(header[4:8], "big")
                payload = await self._raw.readexactly(size) if size else b""
                if header[0] == 2:
                    self._stderr_tail += payload
                    del self._stderr_tail[:-STDERR_TAIL_BYTES]
                else:
                    self.reader.feed_data(payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.reader.feed_eof()
            if self._watch is not None:
                self._watch.close()  # its wait ends with its connection
            if self._watch_task is not None:
                self._watch_task.cancel()

    @property
    def ended(self) -> bool:
        return self._demux_task.done()

    def stderr_tail(self) -> str:
        return self._stderr_tail.decode("utf-8", "replace").strip()

    def kill(self) -> None:
        # Closing the stream is all a client can do; the backend kills what runs inside.
        self.writer.transport.abort()

    async def wait(self) -> int:
        await self._demux_task
        try:
            info = await asyncio.to_thread(self._api.exec_inspect, self.exec_id)
        except Exception:  # the container may be gone already
            return -1
        code = info.get("ExitCode")
        return code if isinstance(code, int) else -1


async def start_exec(
    client: docker.DockerClient,
    container_id: str,
    argv: list[str],
    *,
    user: str,
    environment: dict[str, str],
    workdir: str,
) -> ExecGuest:
    """Run ``argv`` in the container with its stdin open, and hand back its stdio.

    Raises:
        SandboxStartError: docker would not create or start the exec.
    """
    try:
        created = await asyncio.to_thread(
            client.api.exec_create,
            container_id,
            argv,
            stdin=True,
            user=user,
            environment=environment,
            workdir=workdir,
        )
    except Exception as exc:
        raise SandboxStartError(f"docker could not start the guest: {exc}") from exc
    exec_id = created["Id"]
    api_version = client.api.api_version
    watch = await StopWatch.open(container_id, api_version)
    try:
        raw, writer = await _hijack(exec_id, api_version)
    except BaseException:
        watch.close()
        raise
    return ExecGuest(raw, writer, exec_id, client.api, watch)


class StopWatch:
    """The daemon's answer, on a connection of our own, to ``POST /containers/{id}/wait``:
    it comes when the container is no longer running (a thread blocked in the SDK's ``wait``
    per sandbox would hold the event loop's workers). The request is sent when this is
    made, so a stop that comes later is never missed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, container_id: str, api_version: str) -> StopWatch:
        """Raises:
        SandboxStartError: the daemon cannot be reached."""
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path())
        except OSError as exc:
            raise SandboxStartError(f"docker's socket: {exc}") from exc
        writer.write(
            (
                f"POST /v{api_version}/containers/{container_id}/wait?condition=not-running "
                "HTTP/1.1\r\nHost: docker\r\nContent-Length: 0\r\n\r\n"
            ).encode()
        )
        return cls(reader, writer)

    async def stopped(self) -> None:
        """Return once the container has stopped (or the daemon closed the connection); never,
        where the daemon refused the wait itself (the guest's stream then ends as before)."""
        try:
            # The daemon sends the headers at once and the body (the exit status) at the
            # stop; a connection it closes means the container is gone too.
            head = await self._reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if status not in (b"200", b"404"):  # 404: no such container, so it is not running
                log.warning("docker refused the wait on a container", status=status.decode())
                await asyncio.Future()  # cancelled with the guest's stream
            await self._reader.read(1)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass

    def close(self) -> None:
        self._writer.transport.abort()


async def _hijack(
    exec_id: str, api_version: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Start the exec on a connection of our own and keep it as the raw stdio stream."""
    reader, writer = await asyncio.open_unix_connection(socket_path(), limit=STREAM_LIMIT_BYTES)
    body = json.dumps({"Detach": False, "Tty": False}).encode()
    writer.write(
        (
            f"POST /v{api_version}/exec/{exec_id}/start HTTP/1.1\r\n"
            "Host: docker\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
        ).encode()
        + body
    )
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), UPGRADE_TIMEOUT_S)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        writer.close()
        raise SandboxStartError(f"docker did not start the guest: {exc!r}") from exc
    status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
    if status not in (b"101", b"200"):
        writer.close()
        raise SandboxStartError(
            f"docker refused to start the guest: {head.decode(errors='replace').strip()}"
        )
    return reader, writer
