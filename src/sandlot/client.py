"""The SDK's view of a remote server: the same verbs as the embedded manager, over HTTP.

Errors come back as ``{"error": {"code", "message"}}`` and are raised as this package's own
classes, chosen from an allow-list by ``code`` (:func:`sandlot.errors.error_from_code`).
Idempotent calls are retried on transport failures; a non-idempotent call (create, run) only
when the connection was refused, i.e. before anything reached the server.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from sandlot._version import __version__
from sandlot.errors import ConfigError, SandboxError, error_from_code
from sandlot.models import ExecResult, ResourceUsage, SandboxInfo, SandboxLimits
from sandlot.protocol import OutputCallback

DEFAULT_TIMEOUT_S = 30.0
EXEC_MARGIN_S = 30.0  # on top of the run's own timeout: the server answers after it
RETRY_ATTEMPTS = 3
STREAM_CHUNK_BYTES = 1 << 20


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
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=DEFAULT_TIMEOUT_S
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, url: str, *, idempotent: bool, **kwargs: Any
    ) -> httpx.Response:
        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, httpx.ConnectError):
                return True  # nothing reached the server
            return idempotent and isinstance(exc, httpx.TransportError)

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(RETRY_ATTEMPTS),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            reraise=True,
        ):
            with attempt:
                response = await self._http.request(method, url, **kwargs)
        if response.status_code >= 400:
            raise _error(response)
        return response

    async def _json(self, method: str, url: str, *, idempotent: bool, **kwargs: Any) -> Any:
        return (await self._call(method, url, idempotent=idempotent, **kwargs)).json()

    # -- lifecycle

    async def create(
        self,
        *,
        backend: str | None = None,
        runtime: str | None = None,
        environment: str | None = None,
        limits: SandboxLimits | None = None,
        network: bool | None = None,
        env: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        ttl_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> SandboxInfo:
        body: dict[str, Any] = limits.model_dump(exclude_none=True) if limits else {}
        for name, value in (
            ("backend", backend),
            ("runtime", runtime),
            ("environment", environment),
            ("network", network),
            ("env", env),
            ("metadata", metadata),
            ("ttl_s", ttl_s),
            ("idle_timeout_s", idle_timeout_s),
        ):
            if value is not None:
                body[name] = value
        data = await self._json("POST", "/v1/sandboxes", idempotent=False, json=body)
        return SandboxInfo.model_validate(data)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        data = await self._json("GET", f"/v1/sandboxes/{sandbox_id}", idempotent=True)
        return SandboxInfo.model_validate(data)

    async def list(self, include_ended: bool = False) -> list[SandboxInfo]:
        params = {"include_ended": str(include_ended).lower()}
        data = await self._json("GET", "/v1/sandboxes", idempotent=True, params=params)
        return [SandboxInfo.model_validate(item) for item in data]

    async def destroy(self, sandbox_id: str) -> SandboxInfo:
        data = await self._json("DELETE", f"/v1/sandboxes/{sandbox_id}", idempotent=True)
        return SandboxInfo.model_validate(data)

    async def extend(self, sandbox_id: str, ttl_s: float) -> SandboxInfo:
        data = await self._json(
            "POST", f"/v1/sandboxes/{sandbox_id}/timeout", idempotent=True, json={"ttl_s": ttl_s}
        )
        return SandboxInfo.model_validate(data)

    async def usage(self, sandbox_id: str) -> ResourceUsage:
        data = await self._json("GET", f"/v1/sandboxes/{sandbox_id}/usage", idempotent=True)
        return ResourceUsage.model_validate(data)

    # -- execution

    async def run_code(
        self,
        sandbox_id: str,
        code: str,
        *,
        timeout_s: float | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        body: dict[str, Any] = {"code": code}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if on_stdout is not None or on_stderr is not None:
            return await self._stream(
                sandbox_id, {"type": "run_code", **body}, on_stdout, on_stderr
            )
        return await self._exec(f"/v1/sandboxes/{sandbox_id}/code", body, timeout_s)

    async def run_command(
        self,
        sandbox_id: str,
        command: str,
        *,
        session: str = "default",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        body: dict[str, Any] = {"command": command, "session": session}
        for name, value in (("timeout_s", timeout_s), ("env", env), ("cwd", cwd), ("input", input)):
            if value is not None:
                body[name] = value
        if on_stdout is not None or on_stderr is not None:
            return await self._stream(sandbox_id, {"type": "command", **body}, on_stdout, on_stderr)
        return await self._exec(f"/v1/sandboxes/{sandbox_id}/commands", body, timeout_s)

    async def _exec(self, url: str, body: dict[str, Any], timeout_s: float | None) -> ExecResult:
        timeout = (timeout_s or DEFAULT_TIMEOUT_S) + EXEC_MARGIN_S
        data = await self._json("POST", url, idempotent=False, json=body, timeout=timeout)
        return ExecResult.model_validate(data)

    async def _stream(
        self,
        sandbox_id: str,
        message: dict[str, Any],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> ExecResult:
        from websockets.asyncio.client import connect

        url = self.base_url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/stream"
        headers = {k: v for k, v in self._headers.items() if k == "Authorization"}
        async with connect(url, additional_headers=headers, max_size=16 << 20) as ws:
            await ws.send(json.dumps(message))
            async for raw in ws:
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "stdout" and on_stdout is not None:
                    on_stdout(event["data"])
                elif kind == "stderr" and on_stderr is not None:
                    on_stderr(event["data"])
                elif kind == "result":
                    return ExecResult.model_validate(event["result"])
                elif kind == "error":
                    raise error_from_code(event["error"]["code"], event["error"]["message"])
        raise SandboxError("the server closed the stream before sending a result")

    # -- files

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644
    ) -> int:
        reply = await self._json(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files/content",
            idempotent=True,
            params={"path": path},
            content=data,
        )
        return int(reply["size_bytes"])

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

        reply = await self._json(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files/content",
            idempotent=False,
            params={"path": path},
            content=chunks(),
            timeout=None,
        )
        return int(reply["size_bytes"])

    async def download(
        self,
        sandbox_id: str,
        path: str,
        dest: Path,
        on_progress: Callable[[int], None] | None = None,
    ) -> int:
        """Stream ``path`` out of the sandbox into the local file ``dest``."""
        size = 0
        url = f"/v1/sandboxes/{sandbox_id}/files/content"
        async with self._http.stream("GET", url, params={"path": path}, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise _error(response)
            with dest.open("wb") as out:
                async for chunk in response.aiter_bytes(STREAM_CHUNK_BYTES):
                    out.write(chunk)
                    size += len(chunk)
                    if on_progress is not None:
                        on_progress(len(chunk))
        return size

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        response = await self._call(
            "GET",
            f"/v1/sandboxes/{sandbox_id}/files/content",
            idempotent=True,
            params={"path": path},
        )
        return response.content

    async def list_files(
        self, sandbox_id: str, path: str = ".", *, depth: int = 1
    ) -> builtins.list[dict[str, Any]]:
        entries: builtins.list[dict[str, Any]] = await self._json(
            "GET",
            f"/v1/sandboxes/{sandbox_id}/files",
            idempotent=True,
            params={"path": path, "depth": depth},
        )
        return entries

    async def stat_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        entry: dict[str, Any] = await self._json(
            "GET",
            f"/v1/sandboxes/{sandbox_id}/files/stat",
            idempotent=True,
            params={"path": path},
        )
        return entry

    async def remove_file(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        await self._call(
            "DELETE",
            f"/v1/sandboxes/{sandbox_id}/files",
            idempotent=True,
            params={"path": path, "recursive": str(recursive).lower()},
        )

    async def make_dir(self, sandbox_id: str, path: str) -> None:
        await self._call(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/directories",
            idempotent=True,
            params={"path": path},
        )


def _error(response: httpx.Response) -> SandboxError:
    try:
        detail = response.json()["error"]
        return error_from_code(str(detail["code"]), str(detail["message"]))
    except (ValueError, KeyError, TypeError):
        return SandboxError(f"HTTP {response.status_code}: {response.text[:500]}")
