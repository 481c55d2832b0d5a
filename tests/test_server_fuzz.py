"""Fuzz the HTTP API from its own OpenAPI document with schemathesis, against a real server.

One `agent-sandbox serve` process (auth on, a fresh data directory) serves every operation of
``/openapi.json`` (the WebSocket stream is not in the document, so it is not fuzzed). For each
operation schemathesis generates a few valid and invalid requests (examples, coverage and
fuzzing phases; ``max_examples`` bounds the fuzzing phase) and sends them with an admin key.

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
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck
from hypothesis import strategies as st

from tests.conftest import skip_reason, start_server, stop_server

REQUEST_TIMEOUT_S = 30.0  # a trivial request answers in milliseconds; 30 s means it hung
MAX_EXAMPLES = 6  # per operation, fuzzing phase
LIVE_TTL_S = 600.0
SERVER_ENV = {
    "TENANT_MAX_SANDBOXES": "3",
    "SANDBOX_TTL_SECONDS": "20",
    # The fuzzer sends a few hundred requests in bursts; rate limiting is tested elsewhere.
    "API_RATE_LIMIT_PER_SECOND": "10000",
    "API_RATE_LIMIT_BURST": "10000",
}

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

SANDBOX_PATH_PARAMS = ("sandbox_id", "session_id")


@dataclass
class FuzzServer:
    url: str
    data_dir: Path
    log: Path
    admin: dict[str, str]
    keeper: dict[str, str]
    live: str = ""
    seen: dict[int, int] = field(default_factory=dict)  # status -> count

    def live_id(self) -> str:
        """A running sandbox's id (the keeper's; recreated if the fuzzer ended it)."""
        if self.live:
            r = httpx.get(
                f"{self.url}/v1/sandboxes/{self.live}", headers=self.keeper, timeout=10
            )
            if r.status_code == 200 and r.json()["status"] == "running":
                return self.live
        r = httpx.post(
            f"{self.url}/v1/sandboxes",
            json={"ttl_s": LIVE_TTL_S, "memory_mb": 128, "disk_mb": 16},
            headers=self.keeper,
            timeout=REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 201, r.text
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
    from agent_sandbox.server.auth import AuthStore

    data_dir = data_root / "fuzz"
    data_dir.mkdir()
    data_dir.chmod(0o711)
    store = AuthStore(data_dir / "agent-sandbox.db")
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


def _openapi_document() -> dict[str, Any]:
    """The document the server serves, built in-process (no sandbox, no server needed)."""
    from agent_sandbox.config import Settings
    from agent_sandbox.server.app import create_app

    settings = Settings(_env_file=None, data_dir=Path("/nonexistent/agent-sandbox-openapi"))  # type: ignore[call-arg]
    document: dict[str, Any] = json.loads(json.dumps(create_app(settings).openapi()))
    return document


OPENAPI = _openapi_document()
schema = schemathesis.openapi.from_dict(OPENAPI, config=CONFIG)


def test_served_document_is_the_fuzzed_one(fuzz_server: FuzzServer) -> None:
    served = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert served.status_code == 200
    assert served.json() == OPENAPI


def _use_live_sandbox(case: Any, sandbox_id: str) -> None:
    for name in SANDBOX_PATH_PARAMS:
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = sandbox_id
    if isinstance(case.body, dict) and "session_id" in case.body:
        case.body["session_id"] = sandbox_id


def _describe(case: Any, response: Any) -> str:
    try:
        request = case.as_curl_command(headers={"Authorization": "Bearer <admin key>"})
    except Exception as exc:  # noqa: BLE001 - the description must not hide the failure
        request = f"{case.method} {case.formatted_path} ({exc})"
    body = response.text[:2000] if response is not None else "-"
    status = response.status_code if response is not None else "-"
    return f"\n  request: {request}\n  status: {status}\n  body: {body}"


def _check_error_body(case: Any, response: Any) -> None:
    try:
        body = json.loads(response.text)
    except ValueError:
        pytest.fail(f"a {response.status_code} whose body is not JSON{_describe(case, response)}")
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"no error object{_describe(case, response)}"
    assert isinstance(error.get("code"), str), f"no error.code string{_describe(case, response)}"
    assert isinstance(error.get("message"), str), f"no error.message{_describe(case, response)}"
    assert "request_id" in error, f"no error.request_id{_describe(case, response)}"
    assert error["request_id"] is None or isinstance(error["request_id"], str), _describe(
        case, response
    )


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
    started = time.monotonic()
    try:
        response = case.call(
            base_url=fuzz_server.url, headers=fuzz_server.admin, timeout=REQUEST_TIMEOUT_S
        )
    except requests.Timeout:
        pytest.fail(
            f"no answer within {REQUEST_TIMEOUT_S:g} s (after {time.monotonic() - started:.1f} s)"
            f"{_describe(case, None)}"
        )
    status = response.status_code
    fuzz_server.seen[status] = fuzz_server.seen.get(status, 0) + 1
    assert status < 500, f"server error {status}{_describe(case, response)}"
    if 400 <= status < 500:
        _check_error_body(case, response)
