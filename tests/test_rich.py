"""Rich outputs (issue 14, item 1): the display protocol in the guest kernel, on every backend,
through the SDK, REST and the WebSocket, and against cell code that forges display frames."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from sandlot import Sandbox, SandboxManager
from sandlot._portal import get_portal
from sandlot.models import Result
from sandlot.requests import SandboxSpec
from tests.conftest import LiveServer, placement

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CAP_BYTES = 64 << 10

RICH_CLASS = """
class Rich:
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_markdown_(self): return "**rich**"
    def _repr_svg_(self): return "<svg></svg>"
    def _repr_latex_(self): return "$x^2$"
    def _repr_json_(self): return {"k": [1, 2]}
    def _repr_png_(self): return b"\\x89PNG\\r\\n\\x1a\\n-not-really"
    def __repr__(self): return "Rich()"
"""


def test_display_and_repr_methods_give_every_format(sandbox: Sandbox) -> None:
    result = sandbox.run_code(RICH_CLASS + "display(Rich())\nRich()")
    assert result.ok, result
    assert result.text == "Rich()"  # unchanged: the repr of the last expression
    shown, main = result.results
    for r in (shown, main):
        assert r.text == "Rich()"
        assert (r.html, r.markdown, r.svg, r.latex) == (
            "<b>rich</b>",
            "**rich**",
            "<svg></svg>",
            "$x^2$",
        )
        assert r.json_data == {"k": [1, 2]}
        assert base64.b64decode(r.png or "").startswith(PNG_MAGIC)
        assert r.formats() == ["html", "markdown", "svg", "png", "latex", "json"]
    assert (shown.is_main_result, main.is_main_result) == (False, True)


def test_plain_values_and_statements(sandbox: Sandbox) -> None:
    assert sandbox.run_code("x = 1").results == []
    assert sandbox.run_code("None").results == []
    (only,) = sandbox.run_code("41 + 1").results
    assert (only.text, only.is_main_result, only.formats()) == ("42", True, [])
    # A class has the methods of its instances: showing the class is its repr only.
    (cls,) = sandbox.run_code(RICH_CLASS + "Rich").results
    assert cls.formats() == [] and cls.text is not None and "Rich" in cls.text


def test_a_broken_repr_method_costs_its_format_not_the_cell(sandbox: Sandbox) -> None:
    code = (
        "class Half:\n"
        "    def _repr_html_(self): raise RuntimeError('no html today')\n"
        "    def _repr_markdown_(self): return '*ok*'\n"
        "display(Half())\n'after'"
    )
    result = sandbox.run_code(code)
    assert result.ok and result.text == "'after'"
    assert result.results[0].markdown == "*ok*" and result.results[0].html is None
    assert "_repr_html_ failed: RuntimeError: no html today" in result.stderr


def test_results_stream_in_order_with_the_output(sandbox: Sandbox) -> None:
    seen: list[tuple[str, str]] = []
    result = sandbox.run_code(
        "import sys\nprint('a', flush=True)\ndisplay(1)\nprint('b', flush=True)\ndisplay(2)\n3",
        on_stdout=lambda text: seen.append(("out", text)),
        on_result=lambda r: seen.append(("result", r.text or "")),
    )
    assert [r.text for r in result.results] == ["1", "2", "3"]
    assert [text for kind, text in seen if kind == "result"] == ["1", "2", "3"]
    # Each display is sent as it happens: "a" is out before display(1) reaches us.
    kinds = [kind for kind, _ in seen]
    assert kinds.index("out") < kinds.index("result")


def test_results_of_a_failed_cell_are_kept(sandbox: Sandbox) -> None:
    result = sandbox.run_code("display('before')\n1 / 0")
    assert not result.ok and result.error is not None
    assert [r.text for r in result.results] == ["'before'"]


@pytest.fixture
def capped(manager: SandboxManager, backend_name: str) -> Iterator[Sandbox]:
    spec = SandboxSpec(**placement(backend_name), output_limit_bytes=CAP_BYTES)
    sb = Sandbox.connect(get_portal().call(manager.create(spec)).id, manager=manager)
    yield sb
    sb.kill()


def test_results_share_the_output_cap(capped: Sandbox) -> None:
    """Images are big: a cell's results together stay under the sandbox's output cap; one
    that does not fit keeps only its text, and the cell says results were cut."""
    sb = capped
    code = (
        "class Big:\n"
        "    def _repr_html_(self): return 'x' * 40000\n"
        "for _ in range(3):\n"
        "    display(Big())\n"
    )
    result = sb.run_code(code)
    assert result.ok
    assert [r.html is not None for r in result.results] == [True, False, False]
    assert "over the cell's remaining" in result.stderr
    total = sum(len(json.dumps(r.model_dump())) for r in result.results)
    assert total < CAP_BYTES


def test_forged_display_frames_cannot_pass_the_cap_or_break_the_result(capped: Sandbox) -> None:
    """Cell code runs in the kernel's process and can write to its control socket directly:
    frames of any shape and size. The supervisor keeps the cap; the host keeps the schema."""
    sb = capped
    code = (
        "shown = display.__self__\n"  # the kernel's own Display: its sender of frames
        "send = shown._send\n"
        "for _ in range(20):\n"
        "    send({'data': {'text/html': 'y' * 30000}, 'is_main_result': False})\n"
        "send({'data': {'text/html': 5, 'image/png': ['no'], 'text/plain': 'odd',"
        " 'application/x-thing': {'a': 1}}, 'is_main_result': True})\n"
        "'end'"
    )
    result = sb.run_code(code)
    assert result.ok, result
    assert result.results_truncated
    assert sum(len(json.dumps(r.model_dump())) for r in result.results) < CAP_BYTES
    odd = [r for r in result.results if r.text == "odd"]
    if odd:  # it fits only if the flood left room; its bad values are left out
        assert odd[0].html is None and odd[0].png is None
    # The sandbox is fine afterwards, its state intact.
    assert sb.run_code("shown is not None").text == "True"


@pytest.fixture
def data_box(manager: SandboxManager, isolated_backend: str) -> Iterator[Sandbox]:
    """A sandbox of the python-data environment (its tree or image comes from `make image`:
    missing, the create fails and says how to build it)."""
    sb = Sandbox.create(manager=manager, **placement(isolated_backend), environment="python-data")
    yield sb
    sb.kill()


def test_matplotlib_figures_come_back_as_png(data_box: Sandbox) -> None:
    sandbox = data_box
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.show()\n"  # shown here, before the value below
        "plt.figure()\n"
        "plt.bar([1, 2], [3, 4])\n"  # left open: shown at the end of the cell
        "'value'"
    )
    result = sandbox.run_code(code)
    assert result.ok, result
    assert "non-interactive" not in result.stderr  # Agg's show() warning is gone
    first, main, second = result.results
    assert main.is_main_result and main.text == "'value'"
    for figure in (first, second):
        assert base64.b64decode(figure.png or "").startswith(PNG_MAGIC)
        assert figure.text is not None and "Figure" in figure.text
    # Shown figures are closed: the next cell shows nothing again.
    assert sandbox.run_code("len(plt.get_fignums())").text == "0"
    assert sandbox.run_code("plt.plot([1]); None").results[0].png is not None


def test_a_dataframe_is_html_and_text(data_box: Sandbox) -> None:
    result = data_box.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    (table,) = result.results
    assert table.is_main_result
    assert table.html is not None and "<table" in table.html
    assert table.text is not None and "a  b" in table.text


# ------------------------------------------------------------------ REST and WebSocket


@pytest.fixture
def server_box(live_server: LiveServer) -> Iterator[str]:
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        created = http.post("/v1/sandboxes", json={}, headers=live_server.headers("alice"))
        sandbox_id = created.json()["id"]
        yield sandbox_id
        http.delete(f"/v1/sandboxes/{sandbox_id}", headers=live_server.headers("alice"))


def test_rest_returns_results(live_server: LiveServer, server_box: str) -> None:
    response = httpx.post(
        f"{live_server.url}/v1/sandboxes/{server_box}/code",
        json={"code": RICH_CLASS + "display(Rich())\n6 * 7"},
        headers=live_server.headers("alice"),
        timeout=30,
    )
    assert response.status_code == 200
    body = response.json()
    assert body["text"] == "42"
    shown, main = body["results"]
    assert shown["html"] == "<b>rich</b>" and shown["json"] == {"k": [1, 2]}
    assert main == Result(text="42", is_main_result=True).model_dump(mode="json")


def test_websocket_streams_display_events_before_the_result(
    live_server: LiveServer, server_box: str
) -> None:
    url = live_server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{server_box}/stream"
    events: list[dict[str, Any]] = []
    with connect(url, additional_headers=live_server.headers("alice"), open_timeout=10) as ws:
        ws.send(json.dumps({"type": "run_code", "code": "display('a')\nprint('x')\n'b'"}))
        while not events or events[-1]["type"] not in ("result", "error"):
            events.append(json.loads(ws.recv(timeout=30)))
    kinds = [e["type"] for e in events]
    assert kinds.count("display") == 2 and kinds[-1] == "result"
    shown = [e["result"]["text"] for e in events if e["type"] == "display"]
    assert shown == ["'a'", "'b'"]
    assert [r["text"] for r in events[-1]["result"]["results"]] == ["'a'", "'b'"]


def test_remote_sdk_gets_results_and_streams_them(live_server: LiveServer) -> None:
    seen: list[Result] = []
    with Sandbox.create(api_url=live_server.url, api_key=live_server.keys["alice"]) as sb:
        assert [r.text for r in sb.run_code("display(1)\n2").results] == ["1", "2"]
        result = sb.run_code("display(3)\n4", on_result=seen.append)
    assert [r.text for r in seen] == ["3", "4"] == [r.text for r in result.results]
