"""Fuzz the HTTP API from its own OpenAPI document with schemathesis, against a real server.

One `sandlot serve` process (auth on, a fresh data directory, an admin key made with
``AuthStore`` before it starts) serves every operation of its OpenAPI document; the WebSocket
stream is not in the document, so it is not fuzzed. For each operation schemathesis generates
valid and invalid requests (its examples, coverage and fuzzing phases, deterministic;
``MAX_EXAMPLES`` bounds the fuzzing phase) and the test sends them with the admin key.

The document is built in-process from ``create_app()`` so that schemathesis' pytest integration
can collect one test per operation at import time (its fixture-based loader,
``schemathesis.pytest.from_fixture``, fails on pytest 9: it sets ``node._nodeid``, which pytest 9
removed); :func:`test_served_document_is_the_fuzzed_one` checks that the live server serves
exactly that document.

Half of the generated requests have their sandbox id (path ``sandbox_id``/``session_id`` or body
``session_id``) replaced by the id of a live sandbox, so the fuzzer reaches past the 404 of an
unknown id into the code, command and file handlers. That sandbox belongs to another tenant
(``keeper``), so the admin tenant's small quota (``TENANT_MAX_SANDBOXES=3``) bounds only the
sandboxes the fuzzer itself creates; those expire after ``SANDBOX_TTL_SECONDS=20``, and creates
past the quota are 429s, which is fine.

What must hold for every request:

* no 5xx response, ever;
* every 4xx response has the body ``{"error": {"code": str, "message": str, "request_id": ...}}``;
* no request hangs: each one has a timeout, and a timeout fails the test.

:func:`test_inputs_the_fuzzer_found` replays, deterministically, requests that the fuzzer once
answered with a 5xx, so they stay covered whatever the fuzzer draws next time.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import hypothesis.configuration
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck
from hypothesis import strategies as st

from tests.conftest import skip_reason, start_server, stop_server

# Hypothesis keeps caches (not only its example database) under .hypothesis/ in the working
# directory; keep them out of the repository.
hypothesis.configuration.set_hypothesis_home_dir(
    Path(tempfile.gettempdir()) / "sandlot-test-hypothesis"
)

REQUEST_TIMEOUT_S = 30.0  # the server's call timeout is 10 s; 30 s without an answer is a hang
MAX_EXAMPLES = 10  # per operation, fuzzing phase
RUN_TIMEOUT_CAP_S = 5.0  # fuzzed `timeout_s` of runs in the live sandbox is capped at this
LIVE_TTL_S = 600.0
SERVER_ENV = {
    "TENANT_MAX_SANDBOXES": "3",
    "SANDBOX_TTL_SECONDS": "20",
    # The fuzzer sends a few hundred requests in bursts; rate limiting is tested elsewhere.
    "API_RATE_LIMIT_PER_SECOND": "10000",
    "API_RATE_LIMIT_BURST": "10000",
}
SANDBOX_PATH_PARAMS = ("sandbox_id", "session_id")

# The whole file takes ~20 s on 2 cores; this bounds each test (one per API operation).
pytestmark = pytest.mark.timeout(180)

# No files from schemathesis or hypothesis in the repository: no example database, no cache,
# no reports. Deterministic generation keeps a failure reproducible from run to run.
CONFIG = schemathesis.Config.from_dict(
    {
        "cache": {"enabled": False},
        "generation": {
            "mode": "all",
            "max-examples": MAX_EXAMPLES,
            "database": "none",
            "deterministic": True,
        },
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": REQUEST_TIMEOUT_S,
        "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
    }
)


def _openapi_document() -> dict[str, Any]:
    """The document the server serves, built in-process (no sandbox, no server needed)."""
    from sandlot.config import Settings
    from sandlot.server.app import create_app

    settings = Settings(_env_file=None, data_dir=Path("/nonexistent/sandlot-openapi"))  # type: ignore[call-arg]
    document: dict[str, Any] = json.loads(json.dumps(create_app(settings).openapi()))
    return document


OPENAPI = _openapi_document()
schema = schemathesis.openapi.from_dict(OPENAPI, config=CONFIG)


@dataclass
class FuzzServer:
    url: str
    data_dir: Path
    log: Path
    admin: dict[str, str] = field(repr=False)
    keeper: dict[str, str] = field(repr=False)
    live: str = ""
    seen: dict[int, int] = field(default_factory=dict, repr=False)  # status -> count

    def live_id(self) -> str:
        """A running sandbox's id (the keeper's; recreated if the fuzzer ended it)."""
        if self.live:
            r = httpx.get(f"{self.url}/v1/sandboxes/{self.live}", headers=self.keeper, timeout=10)
            if r.status_code == 200 and r.json()["status"] == "running":
                return self.live
        r = httpx.post(
            f"{self.url}/v1/sandboxes",
            json={"ttl_s": LIVE_TTL_S, "memory_mb": 128, "disk_mb": 16},
            headers=self.keeper,
            timeout=REQUEST_TIMEOUT_S,
        )
        # With the server's log: an unexpected start failure's traceback is there.
        assert r.status_code == 201, (r.text, self.log.read_text()[-4000:])
        self.live = r.json()["id"]
        # Something in the workspace for the file routes to find.
        r = httpx.post(
            f"{self.url}/v1/sandboxes/{self.live}/commands",
            json={"command": "mkdir -p artifacts d && echo hi > a.txt && echo x > artifacts/x"},
            headers=self.keeper,
            timeout=REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        return self.live


@pytest.fixture(scope="module")
def fuzz_server(data_root: Path) -> Iterator[FuzzServer]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    from sandlot.server.auth import AuthStore

    data_dir = data_root / "fuzz"
    data_dir.mkdir()
    data_dir.chmod(0o711)
    store = AuthStore(data_dir / "sandlot.db")
    admin_key = store.create_key("ops", "admin", "fuzzer")[1]
    keeper_key = store.create_key("keeper", "user", "live sandbox")[1]
    store.close()
    process, url, log = start_server(data_dir, SERVER_ENV)
    server = FuzzServer(
        url=url,
        data_dir=data_dir,
        log=log,
        admin={"Authorization": f"Bearer {admin_key}"},
        keeper={"Authorization": f"Bearer {keeper_key}"},
    )
    try:
        yield server
    finally:
        stop_server(process)
        print(f"fuzz responses by status: {dict(sorted(server.seen.items()))}")


def _use_live_sandbox(case: Any, sandbox_id: str) -> None:
    for name in SANDBOX_PATH_PARAMS:
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = sandbox_id
    if isinstance(case.body, dict) and "session_id" in case.body:
        case.body["session_id"] = sandbox_id


def _cap_run_timeout(case: Any) -> None:
    """A request for a day-long run may take a day; keep runs short enough to tell a hang."""
    if not isinstance(case.body, dict):
        return
    value = case.body.get("timeout_s")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        case.body["timeout_s"] = min(value, RUN_TIMEOUT_CAP_S)


def _describe(
    method: str, url: str, status: int | str, body: str, request: str | None = None
) -> str:
    return f"\n  request: {request or f'{method} {url}'}\n  status: {status}\n  body: {body[:2000]}"


def _check_response(what: str, status: int, text: str) -> None:
    """No 5xx; a 4xx has the error body every route promises."""
    assert status < 500, f"server error {status}{what}"
    if not 400 <= status < 500:
        return
    try:
        body = json.loads(text)
    except ValueError:
        pytest.fail(f"a {status} whose body is not JSON{what}")
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"no error object{what}"
    assert isinstance(error.get("code"), str), f"no error.code string{what}"
    assert isinstance(error.get("message"), str), f"no error.message string{what}"
    assert "request_id" in error, f"no error.request_id{what}"
    assert error["request_id"] is None or isinstance(error["request_id"], str), what


def _curl(case: Any, server: FuzzServer) -> str | None:
    try:
        command: str = case.as_curl_command(headers=server.admin)  # the key shows as [Filtered]
    except Exception:
        return None  # the description must never hide the failure itself
    return command


def test_served_document_is_the_fuzzed_one(fuzz_server: FuzzServer) -> None:
    served = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert served.status_code == 200
    assert served.json() == OPENAPI
    assert not any("/stream" in path for path in OPENAPI["paths"])


@hypothesis.settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,  # a create takes ~0.3 s; REQUEST_TIMEOUT_S is what catches a hang
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@schema.parametrize()
@schema.given(live=st.booleans())
def test_openapi_fuzz(case: Any, live: bool, fuzz_server: FuzzServer) -> None:
    if live:
        _use_live_sandbox(case, fuzz_server.live_id())
    _cap_run_timeout(case)
    started = time.monotonic()
    try:
        response = case.call(
            base_url=fuzz_server.url, headers=fuzz_server.admin, timeout=REQUEST_TIMEOUT_S
        )
    except requests.Timeout:
        pytest.fail(
            f"no answer within {REQUEST_TIMEOUT_S:g} s (after {time.monotonic() - started:.1f} s)"
            f"{_describe(case.method, case.formatted_path, '-', '', _curl(case, fuzz_server))}"
        )
    except requests.ConnectionError as exc:
        pytest.fail(
            f"the server closed the connection without a response ({exc})"
            f"{_describe(case.method, case.formatted_path, '-', '', _curl(case, fuzz_server))}"
        )
    status = response.status_code
    fuzz_server.seen[status] = fuzz_server.seen.get(status, 0) + 1
    _check_response(
        _describe(
            case.method, case.formatted_path, status, response.text, _curl(case, fuzz_server)
        ),
        status,
        response.text,
    )


# Requests the fuzzer found answered with a 5xx, replayed every run. `{sid}` is a live sandbox.
FOUND = [
    # A NUL byte in a command, or in its env, reaches subprocess in the guest: 502 guest_error.
    pytest.param(
        "POST", "/v1/sandboxes/{sid}/commands", {"json": {"command": "\0"}}, id="command-nul"
    ),
    pytest.param(
        "POST",
        "/v1/sandboxes/{sid}/commands",
        {"json": {"command": "true", "env": {"A": "\0"}}},
        id="command-env-nul",
    ),
    pytest.param(
        "POST",
        "/v1/sandboxes/{sid}/commands",
        {"json": {"command": "true", "env": {"A=B": "1"}}},
        id="command-env-name-with-equals",
    ),
    pytest.param(
        "POST", "/execute", {"json": {"session_id": "{sid}", "command": "\0"}}, id="execute-nul"
    ),
    # The guest refuses a NUL or empty path with code invalid_request, which the host does not
    # know: a plain SandboxError, so a 500.
    *(
        pytest.param(method, path, {"params": {"path": "\0"}, **extra}, id=f"{name}-path-nul")
        for name, method, path, extra in (
            ("stat", "GET", "/v1/sandboxes/{sid}/files/stat", {}),
            ("list", "GET", "/v1/sandboxes/{sid}/files", {}),
            ("download", "GET", "/v1/sandboxes/{sid}/files/content", {}),
            ("upload", "PUT", "/v1/sandboxes/{sid}/files/content", {"content": b"x"}),
            ("mkdir", "POST", "/v1/sandboxes/{sid}/directories", {}),
            ("delete", "DELETE", "/v1/sandboxes/{sid}/files", {}),
            ("e2b-list", "GET", "/api/e2b/files/{sid}", {}),
        )
    ),
    pytest.param(
        "POST",
        "/api/e2b/files",
        {"json": {"session_id": "{sid}", "path": "", "content": ""}},
        id="e2b-write-empty-path",
    ),
    # A name over 255 bytes: ENAMETOOLONG, code file_error, which has no HTTP status: a 500.
    *(
        pytest.param(method, path, {"params": {"path": "x" * 300}, **extra}, id=f"{name}-long")
        for name, method, path, extra in (
            ("stat", "GET", "/v1/sandboxes/{sid}/files/stat", {}),
            ("mkdir", "POST", "/v1/sandboxes/{sid}/directories", {}),
            ("upload", "PUT", "/v1/sandboxes/{sid}/files/content", {"content": b""}),
        )
    ),
]


def _fill(value: Any, sid: str) -> Any:
    if isinstance(value, str):
        return value.replace("{sid}", sid)
    if isinstance(value, dict):
        return {k: _fill(v, sid) for k, v in value.items()}
    return value


@pytest.mark.parametrize(("method", "path", "request_kwargs"), FOUND)
def test_inputs_the_fuzzer_found(
    fuzz_server: FuzzServer, method: str, path: str, request_kwargs: dict[str, Any]
) -> None:
    sid = fuzz_server.live_id()
    url = fuzz_server.url + _fill(path, sid)
    kwargs = _fill(request_kwargs, sid)
    response = httpx.request(
        method, url, headers=fuzz_server.admin, timeout=REQUEST_TIMEOUT_S, **kwargs
    )
    _check_response(
        _describe(method, f"{url} {kwargs!r}", response.status_code, response.text),
        response.status_code,
        response.text,
    )


# The fuzzer uploaded files with such names, then downloading them failed: the file name goes
# into Content-Disposition unencoded. A control character makes uvicorn drop the connection
# without a response, and a character outside latin-1 is a 500 (quotes and latin-1 pass today).
@pytest.mark.parametrize(
    "name",
    ["ctl\x17", "\u0287\u01dd", 'quote"d', "caf\u00e9"],
    ids=["control", "non-latin-1", "quote", "latin-1"],
)
def test_download_keeps_any_file_name(fuzz_server: FuzzServer, name: str) -> None:
    url = f"{fuzz_server.url}/v1/sandboxes/{fuzz_server.live_id()}/files/content"
    with httpx.Client(headers=fuzz_server.admin, timeout=REQUEST_TIMEOUT_S) as client:
        put = client.put(url, params={"path": name}, content=b"payload")
        assert put.status_code == 200, put.text
        try:
            got = client.get(url, params={"path": name})
        except httpx.RemoteProtocolError as exc:
            pytest.fail(f"the server closed the connection without a response: {exc}")
    assert got.status_code == 200, got.text
    assert got.content == b"payload"
    header = got.headers["content-disposition"]
    assert _rfc6266_filename(header) == name, header
    # The plain `filename` fallback is printable ASCII for clients that only read that one.
    fallback = Message()
    fallback["Content-Disposition"] = header
    assert all(c.isascii() and c.isprintable() for c in fallback.get_filename() or "")


def _rfc6266_filename(header: str) -> str | None:
    """The file name as RFC 6266 says to read it: `filename*` wins over `filename`."""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key.lower() == "filename*" and value.lower().startswith("utf-8''"):
            return urllib.parse.unquote(value[len("utf-8''") :])
    message = Message()
    message["Content-Disposition"] = header
    return message.get_filename()
