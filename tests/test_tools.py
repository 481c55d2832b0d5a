"""Tools (seed 003's tool system, seed 001's registry/tools): declared in YAML or a plugin,
their arguments checked before anything runs, each run as one command in the sandbox, from
the SDK, the REST API, MCP (test_mcp.py) and the CLI."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot import Sandbox
from sandlot.errors import ConfigError, InvalidRequest
from sandlot.requests import RunCommand, build
from sandlot.tools import (
    DeclaredTool,
    Parameter,
    ToolBase,
    ToolExecutor,
    ToolRegistry,
    ToolSpec,
    ToolValidator,
)
from tests.conftest import LiveServer, run_cli

PACKAGED = {"edit_file", "file_tree", "search_files"}


def test_the_packaged_tools_load_with_their_schemas() -> None:
    registry = ToolRegistry.load(plugins=False)
    infos = {info.name: info for info in registry.list()}
    assert set(infos) >= PACKAGED
    search = infos["search_files"].input_schema
    assert search["required"] == ["pattern"] and search["additionalProperties"] is False
    assert search["properties"]["max_count"] == {
        "type": "integer",
        "description": "At most this many matches a file.",
        "default": 100,
        "minimum": 1,
        "maximum": 10000,
    }


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({}, "pattern"),  # required
        ({"pattern": "x", "nope": 1}, "nope"),  # unknown
        ({"pattern": 5}, "pattern"),  # not a string (no coercion)
        ({"pattern": "x", "max_count": "5"}, "max_count"),  # "5" is not an integer
        ({"pattern": "x", "max_count": 0}, "max_count"),  # under its minimum
        ({"pattern": "x" * 1001}, "pattern"),  # over its max_length
        ({"pattern": "x", "path": "y" * 70_000}, "65536 bytes"),  # the whole call over 64 KiB
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    arguments: dict[str, Any], says: str
) -> None:
    ran: list[RunCommand] = []

    async def run(command: RunCommand) -> Any:
        ran.append(command)

    executor = ToolExecutor(ToolRegistry.load(plugins=False), run)
    from sandlot._portal import get_portal

    with pytest.raises(InvalidRequest, match=says):
        get_portal().call(executor.run("search_files", arguments))
    assert ran == []


def test_an_argument_is_one_argv_element_whatever_it_holds() -> None:
    tool = ToolRegistry.load(plugins=False).get("search_files")
    hostile = "x'; touch /workspace/pwned; echo '$(id)`id`\n"
    command = tool.request(ToolValidator.arguments(tool, {"pattern": hostile}), None).command
    assert shlex.split(command) == ["grep", "-rnE", "--max-count=100", "--", hostile, "."]
    # A Python tool's arguments reach it as JSON on stdin, never in its code.
    edit = ToolRegistry.load(plugins=False).get("edit_file")
    request = edit.request(
        ToolValidator.arguments(edit, {"path": "a", "old": hostile, "new": "n"}), None
    )
    assert hostile not in request.command and json.loads(request.input or "")["old"] == hostile


@pytest.mark.parametrize(
    ("declared", "says"),
    [
        ({"command": ["true"], "python": "pass"}, "exactly one"),
        ({}, "exactly one"),
        ({"command": ["echo", "{missing}"]}, "names no parameter"),
        ({"command": ["true"], "parameters": {"n": {"type": "integer", "default": "x"}}}, "n"),
        ({"command": ["true"], "parameters": {"not-an-id": {"type": "string"}}}, "identifier"),
        ({"name": "Bad Name", "command": ["true"]}, "name"),
    ],
)
def test_a_bad_tool_file_stops_the_load_and_names_itself(
    tmp_path: Path, declared: dict[str, Any], says: str
) -> None:
    (tmp_path / "tools").mkdir()
    path = tmp_path / "tools" / "bad.yaml"
    path.write_text(json.dumps({"name": "bad", "description": "d", **declared}))
    with pytest.raises(ConfigError, match=says) as raised:
        ToolRegistry.load(tmp_path, plugins=False)
    assert "bad.yaml" in str(raised.value)


def test_a_registry_dir_adds_tools_and_replaces_by_name(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "mine.yaml").write_text(
        "name: search_files\ndescription: ours\ncommand: [echo, ours]\n"
    )
    registry = ToolRegistry.load(tmp_path, plugins=False)
    assert registry.get("search_files").description == "ours"
    assert {"edit_file", "file_tree"} <= {info.name for info in registry.list()}
    with pytest.raises(InvalidRequest, match=r"unknown tool 'nope'.*edit_file"):
        registry.get("nope")


class Greeter(ToolBase):
    """A plugin: host code builds the command, from validated arguments only."""

    name = "greet"
    description = "Say hello."
    parameters = {"who": Parameter(type="string", max_length=50)}  # noqa: RUF012

    def request(self, arguments: Mapping[str, Any], timeout_s: float | None) -> RunCommand:
        return build(RunCommand, command=shlex.join(["echo", "hello", arguments["who"]]))


def test_a_plugin_is_registered_and_checked() -> None:
    registry = ToolRegistry.load(plugins=False)
    registry.register(Greeter())
    assert registry.get("greet").info().input_schema["required"] == ["who"]
    bad = Greeter()
    bad.name = "no spaces allowed"
    with pytest.raises(ConfigError, match="name"):
        registry.register(bad)
    with pytest.raises(ConfigError):
        registry.register(object())  # type: ignore[arg-type]


def test_tools_run_in_a_real_sandbox(sandbox: Sandbox) -> None:
    sandbox.files.write("src/a.py", "def f():\n    return 1\n")
    sandbox.files.write("src/b.py", "x = 1\ny = 1\n")
    found = sandbox.run_tool("search_files", {"pattern": "return [0-9]"})
    assert found.exit_code == 0 and found.stdout.strip() == "./src/a.py:2:    return 1"
    # The hostile pattern is grep's pattern, not a shell's command.
    missed = sandbox.run_tool("search_files", {"pattern": "x'; touch pwned; echo '"})
    assert missed.exit_code == 1 and not sandbox.files.exists("pwned")
    edited = sandbox.run_tool(
        "edit_file", {"path": "src/a.py", "old": "return 1", "new": "return 2"}
    )
    assert edited.exit_code == 0, edited.stderr
    assert sandbox.files.read("src/a.py") == "def f():\n    return 2\n"
    twice = sandbox.run_tool("edit_file", {"path": "src/b.py", "old": "= 1", "new": "= 3"})
    assert twice.exit_code != 0 and "occurs 2 times" in twice.stderr
    assert sandbox.files.read("src/b.py") == "x = 1\ny = 1\n"  # nothing changed
    tree = sandbox.run_tool("file_tree", {"path": "src", "depth": 1})
    assert "a.py (" in tree.stdout and "b.py (12)" in tree.stdout
    with pytest.raises(InvalidRequest):
        sandbox.run_tool("file_tree", {"depth": "deep"})


def test_tools_over_rest_are_checked_audited_and_the_tenants_own(
    live_server: LiveServer,
) -> None:
    url = live_server.url
    alice, bob, viewer = (live_server.headers(w) for w in ("alice", "bob", "viewer"))
    listed = httpx.get(f"{url}/v1/tools", headers=alice)
    assert listed.status_code == 200 and {t["name"] for t in listed.json()} >= PACKAGED
    assert httpx.get(f"{url}/v1/tools/file_tree", headers=alice).json()["name"] == "file_tree"
    sid = httpx.post(f"{url}/v1/sandboxes", json={}, headers=alice).json()["id"]
    try:
        httpx.post(
            f"{url}/v1/sandboxes/{sid}/commands",
            json={"command": "echo needle > n.txt"},
            headers=alice,
        )
        path = f"{url}/v1/sandboxes/{sid}/tools/search_files"
        ran = httpx.post(path, json={"arguments": {"pattern": "needle"}}, headers=alice)
        assert ran.status_code == 200 and "n.txt:1:needle" in ran.json()["stdout"]
        bad = httpx.post(path, json={"arguments": {"pattern": 1}}, headers=alice)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
        unknown = httpx.post(f"{url}/v1/sandboxes/{sid}/tools/nope", json={}, headers=alice)
        assert unknown.status_code == 404 and "search_files" in unknown.text
        assert unknown.json()["error"]["code"] == "tool_not_found"
        assert httpx.get(f"{url}/v1/tools/nope", headers=alice).status_code == 404
        extra = httpx.post(path, json={"arguments": {}, "x": 1}, headers=alice)
        assert extra.status_code == 422
        assert (
            httpx.post(path, json={"arguments": {"pattern": "n"}}, headers=bob).status_code == 404
        )
        assert (
            httpx.post(path, json={"arguments": {"pattern": "n"}}, headers=viewer).status_code
            == 403
        )
    finally:
        httpx.delete(f"{url}/v1/sandboxes/{sid}", headers=alice)
    audit = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "keys", "audit", "--json"],
        env={**__import__("os").environ, "SANDLOT_DATA_DIR": str(live_server.data_dir)},
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [r for r in json.loads(audit.stdout) if r["action"] == "sandbox.tool"]
    assert {(r["sandbox_id"], r["outcome"]) for r in rows} >= {
        (sid, "ok"),
        (sid, "invalid_request"),
    }


def test_the_cli_lists_and_runs_tools(live_server: LiveServer) -> None:
    import os

    env = {**os.environ, "SANDLOT_URL": live_server.url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, *args)

    listed = cli("tools", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {t["name"] for t in json.loads(listed.stdout)} >= PACKAGED
    sid = httpx.post(
        f"{live_server.url}/v1/sandboxes", json={}, headers=live_server.headers("alice")
    ).json()["id"]
    try:
        tool = ("sandbox", "tool", sid, "file_tree", "--api-key", live_server.keys["alice"])
        tree = cli(*tool, "--arg", "depth=1")
        assert tree.returncode == 0 and tree.stdout.startswith("./"), tree.stderr
        bad = cli(*tool, "--arg", "depth=deep")
        assert bad.returncode == 2 and "depth" in bad.stdout + bad.stderr
        # Not JSON: a message and status 2, not a traceback (red team, 2026-12-07).
        broken = cli(*tool, "--args", "{bad")
        said = broken.stdout + broken.stderr
        assert broken.returncode == 2 and "--args is not JSON" in said and "Traceback" not in said
    finally:
        httpx.delete(f"{live_server.url}/v1/sandboxes/{sid}", headers=live_server.headers("alice"))


def test_a_declared_tool_keeps_its_own_timeout_unless_the_call_gives_one() -> None:
    spec = ToolSpec(name="t", description="d", command=("true",), timeout_s=7)
    tool = DeclaredTool(spec)
    assert tool.request({}, None).timeout_s == 7
    assert tool.request({}, 2).timeout_s == 2


def test_unknown_arguments_are_one_short_error_whatever_their_number() -> None:
    """Failed before (red team, 2026-12-07): over MCP and the SDK (REST takes 64 names at
    most), 5,400 unknown names in 64 KB came back as one clause each: a 220 KB error."""
    tool = ToolRegistry.load(plugins=False).get("search_files")
    many = {f"name{i}": "v" * 3 for i in range(5000)}
    with pytest.raises(InvalidRequest) as refused:
        ToolValidator.arguments(tool, {"pattern": "x", **many})
    assert len(str(refused.value)) < 600 and "and 4990 more" in str(refused.value)


def test_what_a_command_cannot_hold_is_the_calls_error() -> None:
    """Failed before (red team, 2026-12-07): a NUL in an argument came back as
    ``invalid_config`` (the server's configuration), and an int of 5,000 digits raised a
    bare ValueError from the SDK."""
    tool = ToolRegistry.load(plugins=False).get("search_files")
    with pytest.raises(InvalidRequest, match="NUL"):
        ToolValidator.arguments(tool, {"pattern": "a\0b"})
    with pytest.raises(InvalidRequest, match="JSON"):
        ToolValidator.arguments(tool, {"pattern": "x", "max_count": 10**5000})


def test_the_tool_and_agent_routes_take_a_key(live_server: LiveServer) -> None:
    """Listing or running tools, and listing agents, with no key or a bad one: 401, typed,
    before any route reads a thing."""
    url = live_server.url
    routes = [
        ("GET", "/v1/tools", None),
        ("GET", "/v1/tools/file_tree", None),
        ("POST", "/v1/sandboxes/sb-0123456789abcdef/tools/file_tree", {"arguments": {}}),
        ("GET", "/v1/agents", None),
    ]
    for headers in ({}, {"Authorization": "Bearer asb_not-a-key"}):
        for method, path, body in routes:
            answer = httpx.request(method, url + path, json=body, headers=headers)
            assert answer.status_code == 401, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "unauthenticated"
    viewer = live_server.headers("viewer")
    assert httpx.get(url + "/v1/agents", headers=viewer).status_code == 200
