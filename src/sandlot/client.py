"""The SDK's view of a remote server: the same verbs as the embedded manager, over HTTP.

Each verb sends its typed request (:mod:`sandlot.requests`) through one helper, ``_send``:
the model's fields are the JSON body (or, for the file verbs, the query), so a new option
is a new field and nothing here changes.

Errors come back as ``{"error": {"code", "message"}}`` and are raised as this package's own
classes, chosen from an allow-list by ``code`` (:func:`sandlot.errors.error_from_code`).
Idempotent calls are retried on transport failures; a non-idempotent call (create, run) only
when nothing of it reached the server: the connection was refused, or the server turned it
away unread at its connection cap (429 ``too_many_connections``).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from sandlot._remote_jobs import (
    MAX_MESSAGE_BYTES,
    TURNED_AWAY_RETRIES,
    JobStreams,
    open_stream,
    turned_away_wait_s,
    typed_error,
)
from sandlot._version import __version__
from sandlot.errors import (
    CommandStillRunning,
    ConfigError,
    RateLimited,
    SandboxError,
    TooManyConnections,
    error_from_code,
)
from sandlot.models import (
    LISTING_TRUNCATED,
    TRUNCATED_HEADER,
    VOLUME_NAME_PATTERN,
    ArtifactInfo,
    CommandInfo,
    DataCallback,
    ExecResult,
    FileInfo,
    Listing,
    OutputCallback,
    PtyOutput,
    ResourceUsage,
    Result,
    ResultCallback,
    SandboxInfo,
    VolumeInfo,
)
from sandlot.requests import (
    CommandInput,
    CreateVolume,
    FilePath,
    ListFiles,
    OpenPty,
    PtyInput,
    PtySize,
    RemoveFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
    WriteFile,
)

DEFAULT_TIMEOUT_S = 30.0
EXEC_MARGIN_S = 30.0  # on top of the run's own timeout: the server answers after it
RETRY_ATTEMPTS = 3
# A call refused by its key's rate did nothing on the server, so it is sent again once the
# server says it may be (Retry-After), up to this many times and this long a wait: a large
# listing or transfer costs its key more of its rate after it is answered, and the next
# call would otherwise fail (server/metering.py).
RATE_RETRIES = 3
RATE_WAIT_MAX_S = 10.0
WAIT_SLICE_S = 60.0  # a wait with no timeout asks the server again after each slice
STREAM_CHUNK_BYTES = 1 << 20
LIST_PAGE = 1000  # the most the server returns a list call (routes.MAX_LISTED)
# An idle connection is dropped by the client before the server's default keep-alive (5 s,
# API_KEEPALIVE_TIMEOUT_SECONDS) closes it: at equal times a create could be sent just as the
# server closed its connection, and fail with nothing run, not to be sent again (not
# idempotent).
KEEPALIVE_EXPIRY_S = 2.0


class RemoteService:
    """Talks to ``sandlot serve`` at ``base_url``."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"api_url {base_url!r} must start with http:// or https:// (SANDLOT_URL)"
            )
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"User-Agent": f"sandlot/{__version__}"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._client = self._new_client()
        self._jobs = JobStreams(self.base_url, headers)

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._headers,
            timeout=DEFAULT_TIMEOUT_S,
            limits=httpx.Limits(  # httpx's own defaults, but for the expiry
                max_connections=100,
                max_keepalive_connections=20,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )

    @property
    def _http(self) -> httpx.AsyncClient:
        # A sandbox object closes its client when the sandbox is killed, yet may still be
        # asked for what outlives it (its artifacts): a closed client is opened again.
        if self._client.is_closed:
            self._client = self._new_client()
        return self._client

    async def aclose(self) -> None:
        await self._jobs.aclose()
        await self._client.aclose()

    async def _call(
        self, method: str, url: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, httpx.ConnectError):
                return True  # nothing reached the server
            return idempotent and isinstance(exc, httpx.TransportError)

        rate_waits = 0
        for turn in range(TURNED_AWAY_RETRIES + 1):
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(retryable),
                stop=stop_after_attempt(RETRY_ATTEMPTS),
                wait=wait_exponential(multiplier=0.1, max=2.0),
                reraise=True,
            ):
                with attempt:
                    response = await self._http.request(method, url, **kwargs)
            if _turned_away(response) and turn < TURNED_AWAY_RETRIES:
                # Turned away unread at the server's connection cap: sent again, whatever the
                # verb (nothing of it ran), after a wait that spreads a burst's clients out.
                await asyncio.sleep(turned_away_wait_s(turn))
                continue
            wait_s = _rate_wait_s(response, kwargs)
            if wait_s is None or rate_waits == RATE_RETRIES:
                break
            rate_waits += 1
            await asyncio.sleep(wait_s)
        if response.status_code >= 400:
            raise response_error(response)
        return response

    async def _json(self, method: str, url: str, *, idempotent: bool, **kwargs: Any) -> Any:
        return (await self._call(method, url, idempotent=idempotent, **kwargs)).json()

    async def _send(
        self,
        method: str,
        url: str,
        request: BaseModel | None = None,
        *,
        idempotent: bool,
        in_query: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one verb's typed request: as the JSON body, or (file verbs, whose body is
        bytes) as query parameters. Unset fields are left out, so the server's defaults apply."""
        if request is not None:
            fields = request.model_dump(mode="json", exclude_none=True)
            if in_query:
                kwargs["params"] = {k: _query_value(v) for k, v in fields.items()}
            else:
                kwargs["json"] = fields
        return await self._call(method, url, idempotent=idempotent, **kwargs)

    # -- lifecycle

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        response = await self._send("POST", "/v1/sandboxes", spec, idempotent=False)
        return SandboxInfo.model_validate(response.json())

    async def get(self, sandbox_id: str) -> SandboxInfo:
        data = await self._json("GET", f"/v1/sandboxes/{sandbox_id}", idempotent=True)
        return SandboxInfo.model_validate(data)

    async def list(self, include_ended: bool = False) -> builtins.list[SandboxInfo]:
        """Every one, page by page (the server returns at most a page a call)."""
        found: builtins.list[SandboxInfo] = []
        while True:
            params = {
                "include_ended": str(include_ended).lower(),
                "limit": str(LIST_PAGE),
                "offset": str(len(found)),
            }
            data = await self._json("GET", "/v1/sandboxes", idempotent=True, params=params)
            found += [SandboxInfo.model_validate(item) for item in data]
            if len(data) < LIST_PAGE:
                return found

    # -- named volumes

    async def create_volume(self, request: CreateVolume) -> VolumeInfo:
        response = await self._send("POST", "/v1/volumes", request, idempotent=False)
        return VolumeInfo.model_validate(response.json())

    async def list_volumes(self) -> builtins.list[VolumeInfo]:
        data = await self._json("GET", "/v1/volumes", idempotent=True)
        return [VolumeInfo.model_validate(item) for item in data]

    async def get_volume(self, name: str) -> VolumeInfo:
        data = await self._json("GET", f"/v1/volumes/{_volume_name(name)}", idempotent=True)
        return VolumeInfo.model_validate(data)

    async def delete_volume(self, name: str) -> None:
        await self._call("DELETE", f"/v1/volumes/{_volume_name(name)}", idempotent=True)

    async def destroy(self, sandbox_id: str) -> SandboxInfo:
        data = await self._json("DELETE", f"/v1/sandboxes/{sandbox_id}", idempotent=True)
        return SandboxInfo.model_validate(data)

    async def extend(self, sandbox_id: str, request: SetTimeout) -> SandboxInfo:
        url = f"/v1/sandboxes/{sandbox_id}/timeout"
        response = await self._send("POST", url, request, idempotent=True)
        return SandboxInfo.model_validate(response.json())

    async def usage(self, sandbox_id: str) -> ResourceUsage:
        data = await self._json("GET", f"/v1/sandboxes/{sandbox_id}/usage", idempotent=True)
        return ResourceUsage.model_validate(data)

    # -- execution

    async def run_code(
        self,
        sandbox_id: str,
        request: RunCode,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> ExecResult:
        if on_stdout is not None or on_stderr is not None or on_result is not None:
            return await self._stream(
                sandbox_id, "run_code", request, on_stdout, on_stderr, on_result
            )
        return await self._exec(f"/v1/sandboxes/{sandbox_id}/code", request)

    async def run_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        if on_stdout is not None or on_stderr is not None:
            return await self._stream(sandbox_id, "command", request, on_stdout, on_stderr)
        return await self._exec(f"/v1/sandboxes/{sandbox_id}/commands", request)

    async def _exec(self, url: str, request: RunCode | RunCommand) -> ExecResult:
        timeout = (request.timeout_s or DEFAULT_TIMEOUT_S) + EXEC_MARGIN_S
        response = await self._send("POST", url, request, idempotent=False, timeout=timeout)
        return ExecResult.model_validate(response.json())

    async def _stream(
        self,
        sandbox_id: str,
        kind: str,
        request: RunCode | RunCommand,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_result: ResultCallback | None = None,
    ) -> ExecResult:
        url = self.base_url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/stream"
        headers = {k: v for k, v in self._headers.items() if k == "Authorization"}
        message = {"type": kind, **request.model_dump(mode="json", exclude_none=True)}
        ws = await open_stream(url, headers, MAX_MESSAGE_BYTES)
        async with ws:
            await ws.send(json.dumps(message))
            async for raw in ws:
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "stdout" and on_stdout is not None:
                    on_stdout(event["data"])
                elif kind == "stderr" and on_stderr is not None:
                    on_stderr(event["data"])
                elif kind == "display" and on_result is not None:
                    on_result(Result.model_validate(event["result"]))
                elif kind == "result":
                    return ExecResult.model_validate(event["result"])
                elif kind == "error":
                    raise error_from_code(event["error"]["code"], event["error"]["message"])
        raise SandboxError("the server closed the stream before sending a result")

    # -- background commands

    def _commands_url(self, sandbox_id: str, pid: int | None = None) -> str:
        tail = "" if pid is None else f"/{pid}"
        return f"/v1/sandboxes/{sandbox_id}/commands{tail}"

    @staticmethod
    def _which(command_id: str | None) -> dict[str, str]:
        """The query that holds a verb to one command (its pid may be a later one's)."""
        return {} if command_id is None else {"command_id": command_id}

    async def start_command(
        self,
        sandbox_id: str,
        request: RunCommand,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandInfo:
        if on_stdout is not None or on_stderr is not None:
            # Streamed: started over the WebSocket, which holds the callbacks from the start.
            message = {
                "type": "command",
                **request.model_dump(mode="json", exclude_none=True),
                "background": True,
            }
            return await self._jobs.start(
                sandbox_id, message, on_stdout=on_stdout, on_stderr=on_stderr
            )
        background = request.model_copy(update={"background": True})
        response = await self._send(
            "POST", self._commands_url(sandbox_id), background, idempotent=False
        )
        return CommandInfo.model_validate(response.json())

    async def list_commands(self, sandbox_id: str) -> builtins.list[CommandInfo]:
        data = await self._json("GET", self._commands_url(sandbox_id), idempotent=True)
        return [CommandInfo.model_validate(item) for item in data]

    async def connect_command(
        self,
        sandbox_id: str,
        pid: int,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        command_id: str | None = None,
    ) -> CommandInfo:
        which = self._which(command_id)
        if on_stdout is not None or on_stderr is not None:
            message = {"type": "attach", "pid": pid, **which}
            return await self._jobs.start(
                sandbox_id, message, on_stdout=on_stdout, on_stderr=on_stderr
            )
        url = self._commands_url(sandbox_id, pid)
        data = await self._json("GET", url, idempotent=True, params=which)
        return CommandInfo.model_validate(data)

    async def wait_command(
        self,
        sandbox_id: str,
        pid: int,
        timeout_s: float | None = None,
        *,
        command_id: str | None = None,
    ) -> ExecResult:
        url = self._commands_url(sandbox_id, pid) + "/wait"
        left_s = timeout_s
        while True:
            slice_s = WAIT_SLICE_S if left_s is None else min(left_s, WAIT_SLICE_S)
            response = await self._call(
                "GET",
                url,
                idempotent=True,
                params={"timeout_s": slice_s, **self._which(command_id)},
                timeout=slice_s + EXEC_MARGIN_S,
            )
            if response.status_code == 200:
                return ExecResult.model_validate(response.json())
            if left_s is not None:
                left_s -= slice_s
                if left_s <= 0:
                    raise CommandStillRunning(
                        f"background command {pid} still runs after {timeout_s} s"
                    )

    async def send_command_stdin(
        self,
        sandbox_id: str,
        pid: int,
        data: bytes,
        *,
        eof: bool = False,
        command_id: str | None = None,
    ) -> None:
        # Not idempotent: input sent twice would reach the command twice.
        try:
            body = CommandInput(data=data.decode(), eof=eof)
        except UnicodeDecodeError as exc:
            raise ConfigError("a remote command's stdin takes UTF-8 text") from exc
        url = self._commands_url(sandbox_id, pid) + "/stdin"
        await self._send("POST", url, body, idempotent=False, params=self._which(command_id))

    async def kill_command(
        self, sandbox_id: str, pid: int, *, command_id: str | None = None
    ) -> bool:
        url = self._commands_url(sandbox_id, pid)
        data = await self._json("DELETE", url, idempotent=True, params=self._which(command_id))
        return bool(data["killed"])

    # -- terminals

    async def start_pty(
        self, sandbox_id: str, request: OpenPty, *, on_data: DataCallback | None = None
    ) -> CommandInfo:
        if on_data is not None:
            message = {"type": "pty", **request.model_dump(mode="json", exclude_none=True)}
            return await self._jobs.start(sandbox_id, message, on_data=on_data)
        response = await self._send(
            "POST", f"/v1/sandboxes/{sandbox_id}/pty", request, idempotent=False
        )
        return CommandInfo.model_validate(response.json())

    async def resize_pty(
        self, sandbox_id: str, pid: int, size: PtySize, *, command_id: str | None = None
    ) -> None:
        url = f"/v1/sandboxes/{sandbox_id}/pty/{pid}/resize"
        await self._send("POST", url, size, idempotent=True, params=self._which(command_id))

    async def pty_output(
        self, sandbox_id: str, pid: int, offset: int = 0, *, command_id: str | None = None
    ) -> PtyOutput:
        url = f"/v1/sandboxes/{sandbox_id}/pty/{pid}/output"
        params = {"offset": offset, **self._which(command_id)}
        data = await self._json("GET", url, idempotent=True, params=params)
        return PtyOutput.model_validate(data)

    async def send_pty_input(
        self, sandbox_id: str, pid: int, data: bytes, *, command_id: str | None = None
    ) -> None:
        body = PtyInput(data_b64=base64.b64encode(data).decode("ascii"))
        url = f"/v1/sandboxes/{sandbox_id}/pty/{pid}/input"
        # Not idempotent: keystrokes sent twice would be typed twice.
        await self._send("POST", url, body, idempotent=False, params=self._which(command_id))

    # -- files

    def _files_url(self, sandbox_id: str, tail: str = "") -> str:
        return f"/v1/sandboxes/{sandbox_id}/files{tail}"

    async def write_file(self, sandbox_id: str, request: WriteFile, data: bytes) -> int:
        url = self._files_url(sandbox_id, "/content")
        response = await self._send(
            "PUT", url, request, idempotent=True, in_query=True, content=data
        )
        return int(response.json()["size_bytes"])

    async def upload(
        self,
        sandbox_id: str,
        path: str,
        source: Path,
        on_progress: Callable[[int], None] | None = None,
    ) -> int:
        """Stream a local file to ``path`` without reading it whole into memory."""

        async def chunks() -> AsyncIterator[bytes]:
            with source.open("rb") as f:
                while chunk := f.read(STREAM_CHUNK_BYTES):
                    if on_progress is not None:
                        on_progress(len(chunk))
                    yield chunk

        response = await self._send(
            "PUT",
            self._files_url(sandbox_id, "/content"),
            WriteFile(path=path),
            idempotent=False,
            in_query=True,
            content=chunks(),
            timeout=None,
        )
        return int(response.json()["size_bytes"])

    async def download(
        self,
        sandbox_id: str,
        path: str,
        dest: Path,
        on_progress: Callable[[int], None] | None = None,
    ) -> int:
        """Stream ``path`` out of the sandbox into the local file ``dest``."""
        size = 0
        url = self._files_url(sandbox_id, "/content")
        async with self._http.stream("GET", url, params={"path": path}, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise response_error(response)
            with dest.open("wb") as out:
                async for chunk in response.aiter_bytes(STREAM_CHUNK_BYTES):
                    out.write(chunk)
                    size += len(chunk)
                    if on_progress is not None:
                        on_progress(len(chunk))
        return size

    async def list_artifacts(self, sandbox_id: str) -> builtins.list[ArtifactInfo]:
        data = await self._json("GET", f"/v1/sandboxes/{sandbox_id}/artifacts", idempotent=True)
        return [ArtifactInfo.model_validate(item) for item in data]

    async def read_artifact(self, sandbox_id: str, path: str) -> bytes:
        url = f"/v1/sandboxes/{sandbox_id}/artifacts/{quote(path)}"
        return (await self._call("GET", url, idempotent=True)).content

    async def read_file(self, sandbox_id: str, request: FilePath) -> bytes:
        url = self._files_url(sandbox_id, "/content")
        response = await self._send("GET", url, request, idempotent=True, in_query=True)
        return response.content

    async def list_files(self, sandbox_id: str, request: ListFiles) -> Listing:
        url = self._files_url(sandbox_id)
        response = await self._send("GET", url, request, idempotent=True, in_query=True)
        entries = (FileInfo.model_validate(entry) for entry in response.json())
        truncated = LISTING_TRUNCATED if response.headers.get(TRUNCATED_HEADER) else None
        return Listing(entries, truncated)

    async def stat_file(self, sandbox_id: str, request: FilePath) -> FileInfo:
        url = self._files_url(sandbox_id, "/stat")
        response = await self._send("GET", url, request, idempotent=True, in_query=True)
        return FileInfo.model_validate(response.json())

    async def remove_file(self, sandbox_id: str, request: RemoveFile) -> None:
        url = self._files_url(sandbox_id)
        await self._send("DELETE", url, request, idempotent=True, in_query=True)

    async def make_dir(self, sandbox_id: str, request: FilePath) -> None:
        url = f"/v1/sandboxes/{sandbox_id}/directories"
        await self._send("POST", url, request, idempotent=True, in_query=True)


def _query_value(value: Any) -> Any:
    """Query strings carry booleans as true/false, the way the server's parser reads them."""
    return str(value).lower() if isinstance(value, bool) else value


def _turned_away(response: httpx.Response) -> bool:
    """The server answered the connection, not the request: over its connection cap, it read
    nothing (``server/transport.py``)."""
    return response.status_code == 429 and isinstance(
        typed_error(response.status_code, response.content), TooManyConnections
    )


def _rate_wait_s(response: httpx.Response, sent: dict[str, Any]) -> float | None:
    """How long to wait before sending a call its key's rate refused (nothing of it ran);
    None for any other answer, a wait past RATE_WAIT_MAX_S, or a streamed body, which
    cannot be sent twice."""
    if response.status_code != 429 or not isinstance(sent.get("content", b""), bytes | str):
        return None
    error = response_error(response)
    if not isinstance(error, RateLimited) or isinstance(error, TooManyConnections):
        return None
    return error.retry_after_s if 0 <= error.retry_after_s <= RATE_WAIT_MAX_S else None


def response_error(response: httpx.Response) -> SandboxError:
    """Our exception for a server's error response (its typed body), or a plain one; a rate's
    refusal says when to try again (its ``Retry-After``)."""
    error = typed_error(response.status_code, response.content)
    if isinstance(error, RateLimited):
        with contextlib.suppress(ValueError):
            error.retry_after_s = float(response.headers.get("retry-after", "1"))
    return error


def _volume_name(name: str) -> str:
    """A volume's name as it goes in a URL: only a valid one (no path of the server's)."""
    if not re.fullmatch(VOLUME_NAME_PATTERN, name):
        raise ConfigError(f"volume name {name!r} must match {VOLUME_NAME_PATTERN}")
    return name
