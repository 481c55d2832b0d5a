"""What a server answers when its own code fails: a typed 500 that names its request."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import make_settings


def test_an_unexpected_error_is_a_typed_500_with_its_request_id(data_root: Path) -> None:
    # Failed before: the body named the request id, the headers did not (Starlette answers
    # an unexpected error outside the layer that adds it to every other response).
    from fastapi.testclient import TestClient

    from sandlot.server.app import create_app

    data_dir = data_root / "server-errors"
    data_dir.mkdir()
    app = create_app(make_settings(data_dir, backend="unsafe-local", auth_enabled=False))

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug of ours")

    # A keyless server answers loopback names only (server/origins.py).
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
        response = http.get("/v1/boom", headers={"x-request-id": "rid-boom"})
        fine = http.get("/v1/sandboxes", headers={"x-request-id": "rid-fine"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["code"], error["request_id"]) == ("internal_error", "rid-boom")
    assert "a bug of ours" not in response.text  # the log has it, the client does not
    assert response.headers["x-request-id"] == "rid-boom"
    assert fine.headers["x-request-id"] == "rid-fine"
