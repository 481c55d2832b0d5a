"""The HTTP + WebSocket API, against a real `sandlot serve` process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from sandlot import (
    AsyncSandbox,
    PathOutsideWorkspace,
    Sandbox,
    SandboxFileNotFound,
    SandboxNotFound,
)
from tests.conftest import LiveServer

SANDBOX_ROUTES: list[tuple[str, str, dict[str, Any] | None, bool]] = [
    # method, path (with {id}), json body, writes?
    ("GET", "/v1/sandboxes/{id}", None, False),
    ("GET", "/v1/sandboxes/{id}/usage", None, False),
    ("POST", "/v1/sandboxes/{id}/timeout", {"ttl_s": 600}, True),
    ("POST", "/v1/sandboxes/{id}/code", {"code": "1"}, True),
    ("POST", "/v1/sandboxes/{id}/commands", {"command": "true"}, True),
    ("GET", "/v1/sandboxes/{id}/files?path=.", None, False),
    ("GET", "/v1/sandboxes/{id}/files/stat?path=hello.txt", None, False),
    ("GET", "/v1/sandboxes/{id}/files/content?path=hello.txt", None, False),
    ("PUT", "/v1/sandboxes/{id}/files/content?path=x.txt", None, True),
    ("POST", "/v1/sandboxes/{id}/directories?path=d", None, True),
    ("DELETE", "/v1/sandboxes/{id}/files?path=nothing.txt", None, True),
    ("GET", "/v1/sandboxes/{id}/artifacts", None, False),
    ("DELETE", "/v1/sandboxes/{id}/artifacts", None, True),
    ("DELETE", "/v1/sandboxes/{id}", None, True),
]
GLOBAL_ROUTES: list[tuple[str, str, dict[str, Any] | None, bool]] = [
    ("GET", "/v1/sandboxes", None, False),
    ("POST", "/v1/sandboxes", {}, True),
    ("POST", "/create_session", None, True),
    ("POST", "/api/sessions", {"provider": "e2b"}, True),
    # An agent task runs on the server's own CPU: no key, no task (and no viewer's).
    ("POST", "/execute", {"task": "print 6"}, True),
    ("GET", "/metrics", None, False),  # every tenant's activity
]


@pytest.fixture(scope="module")
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        yield client


@pytest.fixture
def alice_box(http: httpx.Client, live_server: LiveServer) -> Iterator[str]:
    """A sandbox of tenant acme (alice's), with one file in it."""
    created = http.post("/v1/sandboxes", json={}, headers=live_server.headers("alice"))
    assert created.status_code == 201, created.text
    sandbox_id: str = created.json()["id"]
    put = http.put(
        f"/v1/sandboxes/{sandbox_id}/files/content",
        params={"path": "hello.txt"},
        content=b"hi",
        headers=live_server.headers("alice"),
    )
    assert put.status_code == 200
    yield sandbox_id
    http.delete(f"/v1/sandboxes/{sandbox_id}", headers=live_server.headers("admin"))


def _call(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]
) -> httpx.Response:
    if method == "PUT":
        return http.request(method, path, content=b"data", headers=headers)
    return http.request(method, path, json=body, headers=headers)


def _error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) == {"code", "message", "request_id"}
    assert body["error"]["request_id"] == response.headers["x-request-id"]
    code: str = body["error"]["code"]
    return code


# ------------------------------------------------------------------ auth on every endpoint


@pytest.mark.parametrize(("method", "path", "body", "writes"), SANDBOX_ROUTES + GLOBAL_ROUTES)
def test_every_endpoint_needs_a_valid_key(
    http: httpx.Client,
    live_server: LiveServer,
    alice_box: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    writes: bool,
) -> None:
    url = path.format(id=alice_box)
    for headers in ({}, {"Authorization": "Bearer asb_wrong"}, live_server.headers("revoked")):
        response = _call(http, method, url, body, headers)
        assert response.status_code == 401, (url, response.text)
        assert _error_code(response) == "unauthenticated"


@pytest.mark.parametrize(("method", "path", "body", "writes"), SANDBOX_ROUTES)
def test_other_tenants_get_404_not_403(
    http: httpx.Client,
    live_server: LiveServer,
    alice_box: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    writes: bool,
) -> None:
    response = _call(http, method, path.format(id=alice_box), body, live_server.headers("bob"))
    assert response.status_code == 404, response.text
    assert _error_code(response) == "sandbox_not_found"


@pytest.mark.parametrize(
    ("method", "path", "body", "writes"), [r for r in SANDBOX_ROUTES + GLOBAL_ROUTES if r[3]]
)
def test_viewers_cannot_write(
    http: httpx.Client,
    live_server: LiveServer,
    alice_box: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    writes: bool,
) -> None:
    response = _call(http, method, path.format(id=alice_box), body, live_server.headers("viewer"))
    assert response.status_code == 403, response.text
    assert _error_code(response) == "forbidden"


@pytest.mark.parametrize(
    ("method", "path", "body", "writes"), [r for r in SANDBOX_ROUTES if not r[3]]
)
def test_viewers_and_teammates_can_read(
    http: httpx.Client,
    live_server: LiveServer,
    alice_box: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    writes: bool,
) -> None:
    for who in ("viewer", "alice2", "admin"):
        response = _call(http, method, path.format(id=alice_box), body, live_server.headers(who))
        assert response.status_code == 200, (who, response.text)


def test_listing_shows_only_your_tenant(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    def ids(who: str) -> set[str]:
        return {s["id"] for s in http.get("/v1/sandboxes", headers=live_server.headers(who)).json()}

    assert alice_box in ids("alice") and alice_box in ids("viewer") and alice_box in ids("admin")
    assert alice_box not in ids("bob")


# ------------------------------------------------------------------ behaviour


def test_code_and_commands_over_http(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    headers = live_server.headers("alice")
    base = f"/v1/sandboxes/{alice_box}"
    assert (
        http.post(f"{base}/code", json={"code": "n = 20"}, headers=headers).json()["exit_code"] == 0
    )
    assert (
        http.post(f"{base}/code", json={"code": "n * 2 + 2"}, headers=headers).json()["text"]
        == "42"
    )
    crash = http.post(f"{base}/code", json={"code": "raise KeyError('k')"}, headers=headers)
    assert crash.status_code == 200  # sandboxed code failing is a result, never a 5xx
    assert crash.json()["error"]["type"] == "KeyError"
    cmd = {"command": "cd /tmp && echo $X && exit 4", "env": {"X": "y"}, "session": "s1"}
    result = http.post(f"{base}/commands", json=cmd, headers=headers).json()
    assert (result["exit_code"], result["stdout"]) == (4, "y\n")
    assert (
        http.post(
            f"{base}/commands", json={"command": "pwd", "session": "s1"}, headers=headers
        ).json()["stdout"]
        == "/tmp\n"
    )
    timed = http.post(
        f"{base}/commands", json={"command": "sleep 30", "timeout_s": 1}, headers=headers
    )
    assert timed.status_code == 200 and timed.json()["kill_reason"] == "timeout"


def test_files_upload_download_list_delete(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    headers = live_server.headers("alice")
    base = f"/v1/sandboxes/{alice_box}"
    blob = bytes(range(256)) * 8192  # 2 MiB, several chunks each way
    raw = http.put(
        f"{base}/files/content", params={"path": "in/raw.bin"}, content=blob, headers=headers
    )
    assert raw.json() == {"path": "in/raw.bin", "size_bytes": len(blob)}
    form = http.post(
        f"{base}/files",
        params={"path": "in/form.txt"},
        files={"file": ("f.txt", b"multipart")},
        headers=headers,
    )
    assert form.status_code == 201 and form.json()["size_bytes"] == 9
    down = http.get(f"{base}/files/content", params={"path": "in/raw.bin"}, headers=headers)
    assert down.content == blob
    listed = http.get(f"{base}/files", params={"path": "in"}, headers=headers).json()
    assert sorted(e["name"] for e in listed) == ["form.txt", "raw.bin"]
    assert (
        http.post(f"{base}/directories", params={"path": "made/deep"}, headers=headers).json()[
            "type"
        ]
        == "dir"
    )
    assert (
        http.delete(
            f"{base}/files", params={"path": "in", "recursive": "true"}, headers=headers
        ).status_code
        == 204
    )
    missing = http.get(f"{base}/files/content", params={"path": "in/raw.bin"}, headers=headers)
    assert missing.status_code == 404 and _error_code(missing) == "file_not_found"
    escape = http.get(f"{base}/files/content", params={"path": "../../etc/passwd"}, headers=headers)
    assert escape.status_code == 400 and _error_code(escape) == "path_outside_workspace"


def test_upload_over_the_cap_is_refused_and_leaves_nothing(
    data_root: Any, live_server: LiveServer
) -> None:
    from tests.conftest import start_server, stop_server

    data_dir = data_root / "server-smallcap"
    data_dir.mkdir()
    process, url, _ = start_server(data_dir, {"API_MAX_UPLOAD_MB": "1"}, "--no-auth")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            sandbox_id = client.post("/v1/sandboxes", json={}).json()["id"]
            base = f"/v1/sandboxes/{sandbox_id}"

            def body() -> Iterator[bytes]:  # chunked: no Content-Length to refuse early on
                for _ in range(3):
                    yield b"x" * (1 << 20)

            big = client.put(f"{base}/files/content", params={"path": "big.bin"}, content=body())
            assert big.status_code == 413 and _error_code(big) == "too_large"
            assert client.get(f"{base}/files/stat", params={"path": "big.bin"}).status_code == 404
    finally:
        stop_server(process)


def test_artifacts_listing_and_download_after_delete(
    http: httpx.Client, live_server: LiveServer
) -> None:
    headers = live_server.headers("alice")
    sandbox_id = http.post("/v1/sandboxes", json={}, headers=headers).json()["id"]
    base = f"/v1/sandboxes/{sandbox_id}"
    http.post(
        f"{base}/commands",
        json={"command": "mkdir -p artifacts && echo result > artifacts/out.txt"},
        headers=headers,
    )
    assert http.delete(base, headers=headers).json()["status"] == "destroyed"
    listed = http.get(f"{base}/artifacts", headers=headers).json()
    assert [a["path"] for a in listed] == ["out.txt"]
    assert http.get(f"{base}/artifacts/out.txt", headers=headers).text == "result\n"
    assert (
        http.get(f"{base}/artifacts/out.txt", headers=live_server.headers("bob")).status_code == 404
    )
    assert http.get(f"{base}/artifacts/nope.txt", headers=headers).status_code == 404
    # The download's path converter takes any character: its route is behind the key too.
    for path in ("out.txt", "out.txt%0A", "a%0Ab"):
        assert http.get(f"{base}/artifacts/{path}").status_code == 401
    assert http.delete(f"{base}/artifacts", headers=headers).status_code == 204
    assert http.get(f"{base}/artifacts", headers=headers).json() == []


def _kept(http: httpx.Client, headers: dict[str, str], code: str) -> str:
    """A destroyed sandbox of ``headers``' tenant that ran ``code`` (Python) first."""
    sandbox_id: str = http.post("/v1/sandboxes", json={}, headers=headers).json()["id"]
    ran = http.post(f"/v1/sandboxes/{sandbox_id}/code", json={"code": code}, headers=headers)
    assert ran.status_code == 200 and ran.json()["error"] is None, ran.text
    assert http.delete(f"/v1/sandboxes/{sandbox_id}", headers=headers).status_code == 200
    return sandbox_id


# Names a sandbox may give its artifacts; the one ending in a newline beside the one without.
_ODD_NAMES = {"nl\nname": b"newline", "cr\rname": b"return", "tab\tname": b"tab"}
_ODD_NAMES |= {"end\n": b"ends in a newline", "end": b"plain", "sub/in\ndir": b"nested"}


def test_artifacts_with_control_characters_in_their_names_download(
    http: httpx.Client, live_server: LiveServer
) -> None:
    """Starlette's ``{path:path}`` is ``.*`` without DOTALL: an artifact named with a newline
    was listed and charged but 404 to download, and ``end\n`` served ``end`` (red team,
    2026-12-06)."""
    from urllib.parse import quote

    headers = live_server.headers("alice")
    write = "import os\nos.makedirs('artifacts/sub')\n"
    write += f"for n, d in {_ODD_NAMES!r}.items(): open('artifacts/' + n, 'wb').write(d)"
    sandbox_id = _kept(http, headers, write)
    base = f"/v1/sandboxes/{sandbox_id}/artifacts"
    listed = http.get(base, headers=headers).json()
    assert sorted(a["path"] for a in listed) == sorted(_ODD_NAMES)
    for name, data in _ODD_NAMES.items():
        got = http.get(f"{base}/{quote(name)}", headers=headers)
        assert (got.status_code, got.content) == (200, data), name
        assert (
            "filename*=utf-8''" + quote(name.rsplit("/", 1)[-1], safe="")
            in (got.headers["content-disposition"])
        )
    missing = http.get(f"{base}/nl%0Anope", headers=headers)
    assert missing.status_code == 404 and _error_code(missing) == "file_not_found"
    # And through the SDK, which quotes the name.
    with Sandbox.connect(
        sandbox_id, api_url=live_server.url, api_key=live_server.keys["alice"]
    ) as sb:
        for name, data in _ODD_NAMES.items():
            assert sb.read_artifact(name) == data, name


def test_artifact_download_keeps_ranges(http: httpx.Client, live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    write = "import os; os.makedirs('artifacts')\n"
    sandbox_id = _kept(
        http, headers, write + "open('artifacts/r.bin', 'wb').write(bytes(range(100)))"
    )
    url = f"/v1/sandboxes/{sandbox_id}/artifacts/r.bin"
    whole = http.get(url, headers=headers)
    assert whole.status_code == 200 and whole.content == bytes(range(100))
    assert whole.headers["content-length"] == "100"
    assert whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-type"] == "application/octet-stream"
    part = http.get(url, headers={**headers, "Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == bytes(range(10, 20))
    assert part.headers["content-range"] == "bytes 10-19/100"
    tail = http.get(url, headers={**headers, "Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == bytes(range(95, 100))
    rest = http.get(url, headers={**headers, "Range": "bytes=98-"})
    assert rest.status_code == 206 and rest.content == b"\x62\x63"
    past = http.get(url, headers={**headers, "Range": "bytes=100-"})
    assert past.status_code == 416 and past.headers["content-range"] == "bytes */100"
    # If-Range naming another version: the whole file.
    stale = http.get(url, headers={**headers, "Range": "bytes=0-0", "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == bytes(range(100))
    fresh = {**headers, "Range": "bytes=0-0", "If-Range": whole.headers["etag"]}
    assert http.get(url, headers=fresh).content == b"\x00"
    # Numbers past Python's 4,300-digit conversion limit: ignored, the whole file (they were
    # a 500 with two tracebacks: red team, 2026-12-06), as are non-ASCII digits.
    for huge in ("bytes=" + "9" * 5000 + "-", "bytes=-" + "9" * 5000, "bytes=0-" + "9" * 4301):
        answer = http.get(url, headers={**headers, "Range": huge})
        assert answer.status_code == 200 and answer.content == bytes(range(100)), answer.text


def test_artifact_downloads_racing_their_delete_are_whole_or_404(
    http: httpx.Client, live_server: LiveServer
) -> None:
    """A DELETE of artifacts racing downloads of them: each download is the whole file or a
    typed 404, never a 500 or a body cut after its headers, and the server logs no traceback
    (the route checked the file, then FileResponse stat'ed and opened its path again: 10 of
    15 such rounds failed one way or the other, red team 2026-12-06)."""
    headers = live_server.headers("alice")
    size, files = 200_000, 20
    write = "import os\nos.makedirs('artifacts')\n"
    write += f"for i in range({files}): open(f'artifacts/f{{i}}', 'wb').write(bytes([i]) * {size})"
    log_from = live_server.log.stat().st_size
    outcomes: dict[str, int] = {}

    async def round_(client: httpx.AsyncClient, sandbox_id: str) -> None:
        base = f"/v1/sandboxes/{sandbox_id}/artifacts"

        async def get(i: int) -> None:
            try:
                got = await client.get(f"{base}/f{i % files}")
            except httpx.HTTPError as exc:  # a body cut short, a connection dropped
                outcome = type(exc).__name__
            else:
                if got.status_code == 200:
                    assert got.content == bytes([i % files]) * size
                    outcome = "200"
                else:
                    outcome = f"{got.status_code} {_error_code(got)}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        async def delete() -> None:
            await asyncio.sleep(0.002)
            assert (await client.delete(base)).status_code == 204

        await asyncio.gather(*(get(i) for i in range(40)), delete())

    async def main(sandbox_ids: list[str]) -> None:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(
            base_url=live_server.url, headers=headers, limits=limits, timeout=60
        ) as client:
            for sandbox_id in sandbox_ids:
                await round_(client, sandbox_id)

    asyncio.run(main([_kept(http, headers, write) for _ in range(12)]))
    assert set(outcomes) <= {"200", "404 file_not_found"}, outcomes
    log = live_server.log.read_bytes()[log_from:].decode(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def test_an_artifact_deleted_mid_download_still_arrives_whole(
    http: httpx.Client, live_server: LiveServer
) -> None:
    headers = live_server.headers("alice")
    size = 32 << 20
    write = f"import os; os.makedirs('artifacts'); open('artifacts/big', 'wb').write(b'x' * {size})"
    sandbox_id = _kept(http, headers, write)
    base = f"/v1/sandboxes/{sandbox_id}/artifacts"
    with http.stream("GET", f"{base}/big", headers=headers) as streamed:
        assert streamed.status_code == 200
        chunks = streamed.iter_raw(1 << 16)
        got = len(next(chunks))
        assert http.delete(base, headers=headers).status_code == 204
        assert http.get(f"{base}/big", headers=headers).status_code == 404
        got += sum(len(chunk) for chunk in chunks)
    assert got == size


def test_bad_input_is_a_typed_4xx(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    headers = live_server.headers("alice")
    cases = [
        ("POST", "/v1/sandboxes", {"memory_mb": 1}, 422, "invalid_request"),
        ("POST", "/v1/sandboxes", {"backend": "nope"}, 422, "invalid_config"),
        ("POST", "/v1/sandboxes", {"surprise": True}, 422, "invalid_request"),
        (
            "POST",
            f"/v1/sandboxes/{alice_box}/code",
            {"code": "1", "timeout_s": -1},
            422,
            "invalid_request",
        ),
        (
            "POST",
            f"/v1/sandboxes/{alice_box}/commands",
            {"command": "x", "session": "../x"},
            422,
            "invalid_request",
        ),
        # Past the kernel's limit on one environment string: refused here, not at the start.
        ("POST", "/v1/sandboxes", {"env": {"X": "\\" * 70_000}}, 422, "invalid_request"),
        (
            "POST",
            f"/v1/sandboxes/{alice_box}/commands",
            {"command": "x", "env": {"X": "\x01" * 30_000}},
            422,
            "invalid_request",
        ),
        # One argument past the kernel's limit: refused here, not as a 502 and a restart.
        (
            "POST",
            f"/v1/sandboxes/{alice_box}/commands",
            {"command": "x" * 140_000},
            422,
            "invalid_request",
        ),
        ("GET", "/v1/sandboxes/sb-missing", None, 404, "sandbox_not_found"),
        ("GET", "/no/such/route", None, 404, "not_found"),
    ]
    for method, path, body, status, code in cases:
        response = http.request(method, path, json=body, headers=headers)
        assert (response.status_code, _error_code(response)) == (status, code), (
            path,
            response.text,
        )
        assert "memory_mb" in response.text if body == {"memory_mb": 1} else True
        assert "as JSON; at most" in response.text if "env" in (body or {}) else True


def test_lone_surrogates_are_a_typed_422(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    # Failed before (red team, 2026-11-25): JSON's "\ud800" escape is valid JSON but no
    # text UTF-8 can carry; in metadata it was a 500, in a command's env a 502 from the guest.
    headers = {**live_server.headers("alice"), "content-type": "application/json"}
    box = f"/v1/sandboxes/{alice_box}"
    cases = [
        ("/v1/sandboxes", '{"metadata": {"k": "LONE"}}'),
        ("/v1/sandboxes", '{"metadata": {"kLONE": "v"}}'),
        (f"{box}/commands", '{"command": "true", "env": {"K": "LONE"}}'),
        (f"{box}/commands", '{"command": "true", "env": {"KLONE": "v"}}'),
        (f"{box}/commands", '{"command": "true", "cwd": "aLONE"}'),
        (f"{box}/pty", '{"command": "true", "env": {"K": "LONE"}}'),
    ]
    for path, body in cases:
        raw = body.replace("LONE", "\\ud800").encode()
        response = http.post(path, content=raw, headers=headers)
        assert (response.status_code, _error_code(response)) == (422, "invalid_request"), (
            body,
            response.text,
        )
        assert "surrogate" in response.text
    ran = http.post(
        f"/v1/sandboxes/{alice_box}/commands", json={"command": "echo ok"}, headers=headers
    )
    assert ran.json()["stdout"] == "ok\n"


def test_destroyed_sandbox_is_409(http: httpx.Client, live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    sandbox_id = http.post("/v1/sandboxes", json={}, headers=headers).json()["id"]
    http.delete(f"/v1/sandboxes/{sandbox_id}", headers=headers)
    response = http.post(f"/v1/sandboxes/{sandbox_id}/code", json={"code": "1"}, headers=headers)
    assert response.status_code == 409 and _error_code(response) == "sandbox_not_running"


def test_tenant_quota(http: httpx.Client, live_server: LiveServer) -> None:
    headers = live_server.headers("small")  # tenant "tiny": 1 sandbox, 300 MiB
    too_big = http.post("/v1/sandboxes", json={"memory_mb": 512}, headers=headers)
    assert too_big.status_code == 429 and _error_code(too_big) == "quota_exceeded"
    first = http.post("/v1/sandboxes", json={"memory_mb": 128}, headers=headers)
    assert first.status_code == 201
    second = http.post("/v1/sandboxes", json={"memory_mb": 128}, headers=headers)
    assert second.status_code == 429 and "TENANT_MAX_SANDBOXES" in second.json()["error"]["message"]
    http.delete(f"/v1/sandboxes/{first.json()['id']}", headers=headers)
    third = http.post("/v1/sandboxes", json={"memory_mb": 128}, headers=headers)
    assert third.status_code == 201
    http.delete(f"/v1/sandboxes/{third.json()['id']}", headers=headers)


def test_rate_limit_per_key(data_root: Path) -> None:
    # At the defaults (50 a second, a burst of 100), on a server of its own.
    from sandlot.server.auth import AuthStore
    from tests.conftest import start_server, stop_server

    data_dir = data_root / "rate"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    burst, other = (store.create_key(tenant, "user")[1] for tenant in ("bursty", "globex"))
    store.close()
    process, url, _log = start_server(data_dir)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            auth = {"Authorization": f"Bearer {burst}"}
            statuses = [http.get("/v1/sandboxes", headers=auth) for _ in range(160)]
            limited = [r for r in statuses if r.status_code == 429]
            assert limited, "160 requests at once must pass the burst of 100"
            assert _error_code(limited[0]) == "rate_limited"
            assert int(limited[0].headers["retry-after"]) >= 1
            # Another key is not slowed down by it.
            theirs = {"Authorization": f"Bearer {other}"}
            assert http.get("/v1/sandboxes", headers=theirs).status_code == 200
    finally:
        stop_server(process)


def test_audit_log_records_who_did_what(http: httpx.Client, live_server: LiveServer) -> None:
    from sandlot.server.auth import AuthStore

    headers = live_server.headers("alice")
    sandbox_id = http.post("/v1/sandboxes", json={}, headers=headers).json()["id"]
    http.post(f"/v1/sandboxes/{sandbox_id}/code", json={"code": "1"}, headers=headers)
    http.delete(f"/v1/sandboxes/{sandbox_id}", headers=headers)
    store = AuthStore(live_server.data_dir / "sandlot.db")
    try:
        rows = [r for r in store.audit_log("acme") if r["sandbox_id"] == sandbox_id]
        assert [r["action"] for r in reversed(rows)] == [
            "sandbox.create",
            "sandbox.run_code",
            "sandbox.delete",
        ]
        assert all(r["outcome"] == "ok" and r["request_id"] for r in rows)
        import sqlite3

        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            store._db.execute("DELETE FROM audit")
    finally:
        store.close()


def test_health_ready_metrics(http: httpx.Client, live_server: LiveServer) -> None:
    assert http.get("/health").json()["status"] == "ok"
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    http.post("/v1/sandboxes", json={}, headers=live_server.headers("alice"))
    # Every tenant's activity: an admin's to read (before, anyone's, without a key).
    assert http.get("/metrics").status_code == 401
    refused = http.get("/metrics", headers=live_server.headers("alice"))
    assert refused.status_code == 403 and "API_METRICS_PUBLIC" in refused.text
    metrics = http.get("/metrics", headers=live_server.headers("admin")).text
    for name in (
        "sandlot_sandboxes_live",
        "sandlot_sandboxes_created_total",
        "sandlot_exec_duration_seconds_bucket",
        "sandlot_http_requests_total",
    ):
        assert name in metrics
    openapi = http.get("/openapi.json").json()
    assert "/v1/sandboxes/{sandbox_id}/code" in openapi["paths"]


# ------------------------------------------------------------------ streaming


def _ws(live_server: LiveServer, sandbox_id: str, who: str = "alice") -> Any:
    url = live_server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/stream"
    return connect(url, additional_headers=live_server.headers(who), open_timeout=10)


def test_stream_delivers_output_in_order_then_result(
    live_server: LiveServer, alice_box: str
) -> None:
    code = "import sys, time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.05)\n"
    code += "print('err', file=sys.stderr)\n'done'"
    with _ws(live_server, alice_box) as ws:
        ws.send(json.dumps({"type": "run_code", "code": code}))
        events = []
        while True:
            event = json.loads(ws.recv(timeout=30))
            events.append(event)
            if event["type"] in ("result", "error"):
                break
    stdout = "".join(e["data"] for e in events if e["type"] == "stdout")
    assert stdout == "0\n1\n2\n3\n4\n"
    assert [e["type"] for e in events][-1] == "result"
    assert events[-1]["result"]["text"] == "'done'"
    assert any(e["type"] == "stderr" for e in events)


def test_stream_stdin_to_a_running_command(live_server: LiveServer, alice_box: str) -> None:
    with _ws(live_server, alice_box) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "command",
                    "command": "while read l; do echo got:$l; done",
                    "stdin": True,
                    "timeout_s": 20,
                }
            )
        )
        ws.send(json.dumps({"type": "stdin", "data": "a\nb\n"}))
        ws.send(json.dumps({"type": "stdin_eof"}))
        while True:
            event = json.loads(ws.recv(timeout=30))
            if event["type"] == "result":
                break
    assert event["result"]["stdout"] == "got:a\ngot:b\n"


def test_stream_disconnect_mid_run_stops_the_run(
    http: httpx.Client, live_server: LiveServer, alice_box: str
) -> None:
    headers = live_server.headers("alice")
    with _ws(live_server, alice_box) as ws:
        ws.send(json.dumps({"type": "command", "command": "echo up; sleep 300", "timeout_s": 600}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "stdout", "data": "up\n"}
    # The session's lock frees only when the run has really been stopped inside the sandbox.
    started = time.monotonic()
    result = http.post(
        f"/v1/sandboxes/{alice_box}/commands", json={"command": "echo next"}, headers=headers
    )
    assert result.json()["stdout"] == "next\n"
    assert time.monotonic() - started < 60
    procs = http.post(
        f"/v1/sandboxes/{alice_box}/commands",
        json={"command": "ps -eo args | grep -c '^sleep 300' || true"},
        headers=headers,
    )
    assert procs.json()["stdout"].strip() == "0"


def test_stream_refuses_bad_key_and_other_tenant(live_server: LiveServer, alice_box: str) -> None:
    # Refused at the handshake, with the typed body of the same error over HTTP: nothing is
    # upgraded, so nothing is held (red team, 2026-12-06).
    from websockets.exceptions import InvalidStatus

    for who, status, code in (
        ("bob", 404, "sandbox_not_found"),
        ("revoked", 401, "unauthenticated"),
    ):
        with pytest.raises(InvalidStatus) as refused, _ws(live_server, alice_box, who):
            pass
        assert refused.value.response.status_code == status
        assert json.loads(refused.value.response.body)["error"]["code"] == code


async def test_the_sdk_raises_the_typed_error_of_a_refused_stream(
    live_server: LiveServer, alice_box: str
) -> None:
    from sandlot.client import RemoteService
    from sandlot.errors import AuthenticationError, SandboxNotFound
    from sandlot.requests import RunCode

    for who, error in (("revoked", AuthenticationError), ("bob", SandboxNotFound)):
        service = RemoteService(live_server.url, live_server.keys[who])
        try:
            with pytest.raises(error):
                await service.run_code(alice_box, RunCode(code="1"), on_stdout=print)
        finally:
            await service.aclose()


# ------------------------------------------------------------------ seed compatibility


def test_seed_004_flow(http: httpx.Client, live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    session_id = http.post("/create_session", headers=headers).json()["session_id"]
    out = http.post(
        "/execute",
        json={"session_id": session_id, "command": "ls -la /workspace; exit 2"},
        headers=headers,
    ).json()
    assert out["exit_code"] == 2 and "total" in out["output"]
    assert (
        http.post("/cleanup", json={"session_id": session_id}, headers=headers).json()["status"]
        == "cleaned"
    )


def test_seed_004_client_library(live_server: LiveServer) -> None:
    from sandlot import InvalidRequest, SandboxNotRunning
    from sandlot.seed_client import SandboxClient

    with SandboxClient(live_server.url, api_key=live_server.keys["alice"]) as client:
        session_id = client.create_session()
        out = client.execute("echo hello; echo oops >&2; exit 3")
        assert (out["exit_code"], out["output"]) == (3, "hello\noops\n"), out
        slow = client.execute("sleep 5", timeout_s=0.5)
        assert slow["kill_reason"] == "timeout", slow
        with pytest.raises(InvalidRequest):
            client.execute("true", timeout_s=-1)
        client.cleanup()
        assert client.session_id is None
    with SandboxClient(live_server.url, api_key=live_server.keys["alice"]) as again:
        again.session_id = session_id  # the one cleaned up: destroyed, its record kept
        with pytest.raises(SandboxNotRunning):
            again.execute("true")
        again.session_id = None


def test_seed_001_flow(http: httpx.Client, live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    created = http.post(
        "/api/sessions", json={"environment": "Python3", "provider": "e2b"}, headers=headers
    ).json()
    assert set(created) == {"session_id", "sandbox_id", "provider", "url"}
    assert created["provider"] == "bubblewrap"
    sid = created["session_id"]
    # A fresh session has no artifacts directory: its first execute answers all the same
    # (failed before, 2026-12-06: "not a directory", after the code had run).
    first = http.post(
        "/api/e2b/execute", json={"session_id": sid, "code": "print(1)"}, headers=headers
    )
    assert first.status_code == 200, first.text
    assert first.json()["stdout"] == "1\n" and first.json()["artifacts"] == []
    http.post(
        "/api/e2b/files",
        json={"session_id": sid, "path": "artifacts/note.txt", "content": "n"},
        headers=headers,
    )
    run = http.post(
        "/api/e2b/execute", json={"session_id": sid, "code": "print(42)\n6*7"}, headers=headers
    ).json()
    assert (
        run["stdout"] == "42\n"
        and run["results"] == ["42"]
        and run["artifacts"] == ["artifacts/note.txt"]
    )
    names = [f["name"] for f in http.get(f"/api/e2b/files/{sid}", headers=headers).json()]
    assert "artifacts" in names
    # The seed's API table names GET /api/e2b/files: the session as a query (405 before).
    by_query = http.get("/api/e2b/files", params={"session_id": sid}, headers=headers)
    assert [f["name"] for f in by_query.json()] == names
    inside = http.get(
        "/api/e2b/files", params={"session_id": sid, "path": "artifacts"}, headers=headers
    )
    assert [f["name"] for f in inside.json()] == ["note.txt"]
    bad = http.get("/api/e2b/files", params={"session_id": "../x"}, headers=headers)
    assert bad.status_code == 422
    assert http.get(f"/api/sessions/{sid}", headers=headers).json()["status"] == "running"
    assert http.delete(f"/api/sessions/{sid}", headers=headers).json()["status"] == "destroyed"


# ------------------------------------------------------------------ remote SDK


def test_remote_sdk_same_surface_as_embedded(live_server: LiveServer) -> None:
    with Sandbox.create(
        api_url=live_server.url, api_key=live_server.keys["alice"], timeout_s=5
    ) as sb:
        sb.run_code("x = 41")
        assert sb.run_code("x + 1").text == "42"
        r = sb.commands.run("echo hi && exit 3")
        assert (r.exit_code, r.stdout) == (3, "hi\n")
        sb.files.write("data/a.txt", "hello")
        assert sb.files.read("data/a.txt") == "hello"
        assert [f.name for f in sb.files.list("data")] == ["a.txt"]
        sb.files.make_dir("d")
        assert sb.files.exists("d") and not sb.files.exists("nope")
        chunks: list[str] = []
        streamed = sb.run_code("for i in range(3): print(i)", on_stdout=chunks.append)
        assert "".join(chunks) == streamed.stdout == "0\n1\n2\n"
        with pytest.raises(SandboxFileNotFound):
            sb.files.read("missing.txt")
        with pytest.raises(PathOutsideWorkspace):
            sb.files.read("../x")
        assert sb.usage().memory_bytes
    assert sb.info.status == "destroyed"


def test_remote_sdk_maps_errors_and_uses_env(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot.config import get_settings

    monkeypatch.setenv("SANDLOT_URL", live_server.url)
    monkeypatch.setenv("SANDLOT_API_KEY", live_server.keys["bob"])
    get_settings.cache_clear()
    try:

        async def scenario() -> None:
            async with await AsyncSandbox.create() as sb:
                assert sb.info.owner == "globex"
                got: list[str] = []
                r = await sb.commands.run(
                    "echo a; echo b >&2", on_stdout=got.append, on_stderr=got.append
                )
                assert r.stdout == "a\n" and sorted(got) == ["a\n", "b\n"]
            with pytest.raises(SandboxNotFound):
                await AsyncSandbox.connect("sb-missing")

        asyncio.run(scenario())
    finally:
        get_settings.cache_clear()


def test_json_logs_carry_the_request_id_of_the_error_body(data_root: Any) -> None:
    from tests.conftest import start_server, stop_server

    data_dir = data_root / "server-jsonlogs"
    data_dir.mkdir()
    env = {"LOG_FORMAT": "json", "LOG_LEVEL": "INFO"}
    process, url, log_path = start_server(data_dir, env, "--no-auth")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            created = client.post(
                "/v1/sandboxes", json={}, headers={"X-Request-ID": "req-create-1"}
            )
            assert created.status_code == 201
            # The caller's own request id is echoed in the error body and header.
            failed = client.post(
                "/v1/sandboxes", json={"backend": "nope"}, headers={"X-Request-ID": "req-bad-2"}
            )
            assert failed.json()["error"]["request_id"] == "req-bad-2"
            assert failed.headers["x-request-id"] == "req-bad-2"
    finally:
        stop_server(process)
    records = []
    lines = log_path.read_text().splitlines()
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    # Every line is JSON, uvicorn's too: its own log config printed its access and error
    # lines as console text whatever LOG_FORMAT said (until 2026-12-06).
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")][:3]
    access = [r for r in records if r.get("logger") == "uvicorn.access"]
    assert any(
        "POST /v1/sandboxes" in r["event"] and r["request_id"] == "req-bad-2" for r in access
    )
    created_logs = [r for r in records if r.get("event") == "sandbox created"]
    assert created_logs and created_logs[0]["request_id"] == "req-create-1"
    assert any(r.get("request_id") for r in records)
    warnings = [r for r in records if "AUTH IS OFF" in str(r.get("event"))]
    assert warnings and warnings[0]["level"] == "warning"  # --no-auth is said loudly


def test_exhaustion_guards(data_root: Any) -> None:
    """Uploads are checked before parsing, /ready probes one at a time, limits have ceilings."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import start_server, stop_server

    data_dir = data_root / "server-guards"
    data_dir.mkdir()
    process, url, _ = start_server(data_dir, {"SANDBOX_MAX_DISK_MB": "256"}, "--no-auth")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(lambda _: client.get("/ready").status_code, range(8)))
            assert statuses == [200] * 8
            created = [
                line
                for line in client.get("/metrics").text.splitlines()
                if line.startswith("sandlot_sandboxes_created_total")
            ]
            assert created == ['sandlot_sandboxes_created_total{backend="bubblewrap"} 1.0']

            big = client.post("/v1/sandboxes", json={"disk_mb": 100_000})
            assert big.status_code == 422 and "SANDBOX_MAX_DISK_MB" in big.text
            huge_output = client.post("/v1/sandboxes", json={"output_limit_bytes": 1 << 30})
            assert huge_output.status_code == 422

            sandbox_id = client.post("/v1/sandboxes", json={}).json()["id"]
            files_url = f"/v1/sandboxes/{sandbox_id}/files"

            def chunked() -> Iterator[bytes]:
                yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\n'
                yield b"x" * 1024 + b"\r\n--b--\r\n"

            no_length = client.post(
                files_url,
                params={"path": "f"},
                content=chunked(),
                headers={"content-type": "multipart/form-data; boundary=b"},
            )
            assert no_length.status_code == 413 and "Content-Length" in no_length.text
            wrong_field = client.post(files_url, params={"path": "f"}, files={"other": ("f", b"1")})
            assert wrong_field.status_code == 422 and "'file'" in wrong_field.text
    finally:
        stop_server(process)


def test_unauthenticated_multipart_is_refused(http: httpx.Client, alice_box: str) -> None:
    response = http.post(
        f"/v1/sandboxes/{alice_box}/files",
        params={"path": "x"},
        files={"file": ("x", b"y" * (2 << 20))},
    )
    assert response.status_code == 401


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _raw_ws_send(host: str, port: int, path: str, message: dict[str, Any]) -> Any:
    """Open a WebSocket by hand and send one text frame; the caller then never reads."""
    import base64
    import os as _os
    import socket
    import struct

    sock = socket.create_connection((host, port), timeout=10)
    key = base64.b64encode(_os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    assert b" 101 " in sock.recv(4096).split(b"\r\n", 1)[0]
    payload = json.dumps(message).encode()
    mask = _os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    header = struct.pack(">BBH", 0x81, 0x80 | 126, len(payload)) + mask
    sock.sendall(header + masked)
    return sock


def test_a_client_that_stops_reading_cannot_grow_the_server(data_root: Any) -> None:
    from tests.conftest import start_server, stop_server

    data_dir = data_root / "server-slow-reader"
    data_dir.mkdir()
    process, url, _ = start_server(data_dir, {}, "--no-auth")
    try:
        sandbox_id = httpx.post(f"{url}/v1/sandboxes", json={}, timeout=60).json()["id"]
        before = _rss_mib(process.pid)
        host, port = url.removeprefix("http://").split(":")
        # ~100 MiB of output while this client reads nothing at all.
        flood = {"type": "command", "command": "yes | head -c 100000000", "timeout_s": 60}
        sock = _raw_ws_send(host, int(port), f"/v1/sandboxes/{sandbox_id}/stream", flood)
        try:
            time.sleep(8)
            grown = _rss_mib(process.pid) - before
        finally:
            sock.close()
        assert grown < 48, f"the server grew by {grown:.0f} MiB for a client that did not read"
        # The run ended (or was cancelled with the disconnect): the sandbox answers again.
        answer = httpx.post(
            f"{url}/v1/sandboxes/{sandbox_id}/commands", json={"command": "echo ok"}, timeout=120
        )
        assert answer.json()["stdout"] == "ok\n"
    finally:
        stop_server(process)
