"""Seed 004's client library (its ``sandbox_client.py``), for agents written against it::

    client = SandboxClient("http://vps-ip:5000", api_key="asb_...")
    client.create_session()
    result = client.execute("ls -la")      # {"exit_code": 0, "output": "...", ...}
    client.cleanup()

It speaks the seed's three endpoints (``POST /create_session``, ``/execute``, ``/cleanup``,
served by ``sandlot serve``: server/compat.py), one session at a time, in bash. New code
should use :class:`sandlot.Sandbox` (``Sandbox.create(api_url=...)``): files, Python cells,
streaming, background commands. Errors are this package's own classes, as the SDK's.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import httpx

from sandlot._version import __version__
from sandlot.client import response_error
from sandlot.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
EXEC_MARGIN_S = 30.0  # on top of a command's own timeout: the server answers after it


class SandboxClient:
    """One session in a sandbox of a ``sandlot serve`` at ``base_url`` (default
    ``SANDLOT_URL``), authenticated with ``api_key`` (default ``SANDLOT_API_KEY``)."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout_s: float = 60.0
    ) -> None:
        url = base_url or os.environ.get("SANDLOT_URL") or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url {url!r} must start with http:// or https://")
        key = api_key if api_key is not None else os.environ.get("SANDLOT_API_KEY")
        headers = {"User-Agent": f"sandlot/{__version__}"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.session_id: str | None = None

    def create_session(self) -> str:
        """Start a sandbox for this client's session; its id."""
        session_id = str(self._post("/create_session")["session_id"])
        self.session_id = session_id
        return session_id

    def execute(self, command: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Run a bash command in the session's sandbox: ``exit_code`` and ``output`` (stdout
        then stderr), as the seed's, with ``stdout``, ``stderr`` and ``kill_reason`` too. A
        command that fails or times out is a result, not an error."""
        body: dict[str, Any] = {"session_id": self._session(), "command": command}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        # The server ends the command at its timeout (the server's default without one):
        # wait for its answer past that, however long it is.
        wait_s = None if timeout_s is None else timeout_s + EXEC_MARGIN_S
        return self._post("/execute", body, timeout=httpx.Timeout(10.0, read=wait_s))

    def cleanup(self) -> None:
        """Destroy the session's sandbox (nothing to do without one)."""
        if self.session_id is not None:
            self._post("/cleanup", {"session_id": self.session_id})
            self.session_id = None

    def close(self) -> None:
        """Clean up, then let go of the connection."""
        try:
            self.cleanup()
        finally:
            self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _session(self) -> str:
        if self.session_id is None:
            raise ConfigError("no session: call create_session() first")
        return self.session_id

    def _post(
        self, path: str, body: dict[str, Any] | None = None, timeout: httpx.Timeout | None = None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"json": body or {}}
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = self._http.post(path, **kwargs)
        if response.status_code >= 400:
            raise response_error(response)
        reply: dict[str, Any] = response.json()
        return reply
