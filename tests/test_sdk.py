"""SDK niceties (issue 14, item 5): listing by metadata, connecting by id, kept artifacts from
the sandbox object, embedded and over a real server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sandlot import Sandbox, SandboxFileNotFound, SandboxManager
from sandlot.client import KEEPALIVE_EXPIRY_S, RemoteService
from sandlot.config import Settings
from tests.conftest import LiveServer


def _where(kind: str, manager: SandboxManager, live_server: Any) -> dict[str, Any]:
    if kind == "embedded":
        return {"manager": manager}
    server: LiveServer = live_server
    return {"api_url": server.url, "api_key": server.keys["alice"]}


@pytest.fixture(params=["embedded", "server"])
def where(request: pytest.FixtureRequest, manager: SandboxManager) -> dict[str, Any]:
    live_server = request.getfixturevalue("live_server") if request.param == "server" else None
    return _where(request.param, manager, live_server)


def test_list_filters_on_metadata_and_connect_attaches(where: dict[str, Any]) -> None:
    run = uuid.uuid4().hex  # other tests' sandboxes share the manager and the server
    mine = Sandbox.create(metadata={"run": run, "team": "a"}, **where)
    other = Sandbox.create(metadata={"run": run, "team": "b"}, **where)
    try:
        assert [i.id for i in Sandbox.list(metadata={"run": run, "team": "a"}, **where)] == [
            mine.id
        ]
        assert {i.id for i in Sandbox.list(metadata={"run": run}, **where)} == {mine.id, other.id}
        assert Sandbox.list(metadata={"run": run, "team": "c"}, **where) == []

        mine.run_code("x = 41")
        again = Sandbox.connect(mine.id, **where)
        assert again.run_code("x + 1").text == "42"  # the same interpreter
    finally:
        other.kill()
    running = {i.id for i in Sandbox.list(metadata={"run": run}, **where)}
    assert running == {mine.id}
    ended = {i.id for i in Sandbox.list(metadata={"run": run}, include_ended=True, **where)}
    assert ended == {mine.id, other.id}
    mine.kill()
    again.kill()  # the same sandbox, already gone: idempotent, and it closes its client


def test_a_list_comes_in_pages_and_the_sdk_reads_them_all(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed before (red team, 2026-12-06): one GET returned every kept record of a tenant
    # (7,774 of them: 129 MB, a second of the server's loop). Now at most a page a call.
    import httpx

    from sandlot import client

    where = {"api_url": live_server.url, "api_key": live_server.keys["alice"]}
    headers = {"Authorization": f"Bearer {live_server.keys['alice']}"}
    run = uuid.uuid4().hex
    made = [Sandbox.create(metadata={"run": run}, **where) for _ in range(3)]
    for sb in made:
        sb.kill()
    pages = []
    with httpx.Client(base_url=live_server.url, headers=headers) as http:
        for limit in (0, 1001):
            refused = http.get("/v1/sandboxes", params={"limit": limit})
            assert refused.status_code == 422, refused.text
        offset = 0
        while True:
            page = http.get(
                "/v1/sandboxes", params={"include_ended": "true", "limit": 2, "offset": offset}
            ).json()
            assert len(page) <= 2
            pages.append([info["id"] for info in page])
            offset += len(page)
            if len(page) < 2:
                break
    listed = [i for page in pages for i in page]
    assert len(listed) == len(set(listed))  # no record twice
    assert {sb.id for sb in made} <= set(listed)
    # The SDK pages on by itself (a page of 2 here, 1,000 against a real server).
    monkeypatch.setattr(client, "LIST_PAGE", 2)
    seen = {i.id for i in Sandbox.list(metadata={"run": run}, include_ended=True, **where)}
    assert seen == {sb.id for sb in made}


def test_artifacts_are_read_from_the_sandbox_object_after_it_is_gone(
    where: dict[str, Any],
) -> None:
    sb = Sandbox.create(**where)
    sb.commands.run("mkdir -p artifacts/plots && printf 'kept' > artifacts/plots/report.txt")
    sb.kill()
    (kept,) = sb.artifacts()
    assert kept.path == "plots/report.txt" and kept.size_bytes == 4
    assert sb.read_artifact("plots/report.txt") == b"kept"
    with pytest.raises(SandboxFileNotFound):
        sb.read_artifact("plots/missing.txt")


def _local_port(response: Any) -> int:
    stream = response.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


async def test_an_idle_connection_is_let_go_before_the_server_would_close_it(
    live_server: LiveServer,
) -> None:
    # Kept past the server's keep-alive, an idle connection can be closed by the server just
    # as a create is sent on it: that create fails having run nothing, and is not sent again.
    assert Settings.model_fields["keepalive_timeout_s"].default > KEEPALIVE_EXPIRY_S
    service = RemoteService(live_server.url, live_server.keys["alice"])
    try:
        first = _local_port(await service._call("GET", "/health", idempotent=True))
        again = _local_port(await service._call("GET", "/health", idempotent=True))
        assert again == first  # kept alive while fresh
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
        later = _local_port(await service._call("GET", "/health", idempotent=True))
        assert later != first
    finally:
        await service.aclose()


# 7,000 names of 250 characters: past a listing's 4 MiB of names and paths (~6,200 of them).
MANY_LONG_NAMES = """
import os
os.makedirs("artifacts", exist_ok=True)
for i in range(7000):
    open("artifacts/%06d" % i + "x" * 244, "w").close()
"""


def test_a_listing_cut_at_its_bound_says_so(where: dict[str, Any]) -> None:
    # Failed before (red team, 2026-12-06): a listing stopped at its bound said nothing, and a
    # client took ~6,200 entries for the whole of 7,000.
    with Sandbox.create(disk_mb=64, **where) as sb:
        # Not under artifacts/, which a destroy keeps (against the tenant's quota).
        assert sb.run_code(MANY_LONG_NAMES.replace("artifacts", "many")).error is None
        cut = sb.files.list("many")
        assert 5_000 < len(cut) < 7_000
        assert cut.truncated is not None and "narrower path" in cut.truncated
        whole = sb.files.list(".")
        assert [e.path for e in whole] == ["many"] and whole.truncated is None


def test_a_seed_execute_says_when_its_artifact_list_is_cut(live_server: LiveServer) -> None:
    import httpx

    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        sid = http.post("/api/sessions", json={"provider": "e2b"}).json()["session_id"]
        try:
            small = http.post("/api/e2b/execute", json={"session_id": sid, "code": "1"}).json()
            assert small["artifacts"] == [] and small["artifacts_truncated"] is False
            body = {"session_id": sid, "code": MANY_LONG_NAMES}
            many = http.post("/api/e2b/execute", json=body).json()
            assert 5_000 < len(many["artifacts"]) < 7_000
            assert many["artifacts_truncated"] is True
            listed = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "artifacts"})
            assert "narrower path" in listed.headers["x-listing-truncated"]
            seed = http.get(f"/api/e2b/files/{sid}", params={"path": "artifacts"})
            assert "narrower path" in seed.headers["x-listing-truncated"]
            gone = {"session_id": sid, "code": "import shutil; shutil.rmtree('artifacts')"}
            http.post("/api/e2b/execute", json=gone)  # not kept against the tenant's quota
        finally:
            http.delete(f"/api/sessions/{sid}")


def test_a_call_its_keys_rate_refused_is_sent_again_when_the_server_says() -> None:
    """A call refused by its key's rate did nothing; since a large listing or transfer costs
    its key more after it is answered (server/metering.py), the SDK's next call would fail
    at once. It waits out a short Retry-After and sends the call again, a few times; a
    longer wait, a streamed body (it cannot be sent twice) and other 429s are raised."""
    import httpx

    from sandlot.client import RATE_RETRIES
    from sandlot.errors import RateLimited

    refusals: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        wait = request.headers.get("x-wait", "0")
        if len(refusals) < int(request.headers.get("x-refusals", "0")):
            refusals.append(1)
            body = {"error": {"code": "rate_limited", "message": "over 50 requests/s"}}
            return httpx.Response(429, json=body, headers={"retry-after": wait})
        return httpx.Response(200, json=[])

    async def call(refusals_wanted: int, wait: str = "0", **kwargs: Any) -> httpx.Response:
        refusals.clear()
        service = RemoteService("http://sandlot.test", "key")
        service._client = httpx.AsyncClient(
            base_url="http://sandlot.test", transport=httpx.MockTransport(answer)
        )
        headers = {"x-refusals": str(refusals_wanted), "x-wait": wait}
        try:
            return await service._call("POST", "/v1/x", idempotent=False, headers=headers, **kwargs)
        finally:
            await service.aclose()

    assert asyncio.run(call(RATE_RETRIES)).status_code == 200  # before: RateLimited at once
    assert len(refusals) == RATE_RETRIES
    with pytest.raises(RateLimited):
        asyncio.run(call(RATE_RETRIES + 1))
    with pytest.raises(RateLimited) as refused:
        asyncio.run(call(1, wait="60"))  # longer than the SDK waits: the caller decides
    assert len(refusals) == 1 and refused.value.retry_after_s == 60

    async def streamed() -> AsyncIterator[bytes]:
        yield b"x"

    with pytest.raises(RateLimited):
        asyncio.run(call(1, content=streamed()))
