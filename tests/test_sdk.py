"""SDK niceties (issue 14, item 5): listing by metadata, connecting by id, kept artifacts from
the sandbox object, embedded and over a real server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from sandlot import Sandbox, SandboxFileNotFound, SandboxManager
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
