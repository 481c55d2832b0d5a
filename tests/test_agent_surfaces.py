"""The agent's surfaces end to end: `sandlot run`, `POST /execute {"task"}` and
`WS /stream` on a real server process, with the model behind a real HTTP server that speaks
OpenAI's chat-completions wire format and replays scripted replies.

Nothing is faked inside our process: the CLI and the server build their provider from
``LLM_PROVIDER=openai`` and ``OPENAI_BASE_URL``, call it over HTTP, and run the code in real
bubblewrap sandboxes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .conftest import skip_reason, start_server, stop_server
from .wire_servers import WireServer, serve

pytestmark = pytest.mark.skipif(bool(skip_reason("bubblewrap")), reason="needs bubblewrap")

GOOD = "```python\nprint(sum([1, 2, 3]))\n```"
BROKEN = "```python\nprint(sum([1, 2, 3]) +)\n```"
CRITIQUE = json.dumps({"diagnosis": "stray plus", "fix": "remove it"})


class Script:
    """Replies of the fake model, in order, shared by every request to it."""

    def __init__(self) -> None:
        self.replies: list[str] = []
        self.lock = threading.Lock()

    def load(self, *replies: str) -> None:
        with self.lock:
            self.replies = list(replies)

    def next(self) -> str | None:
        with self.lock:
            return self.replies.pop(0) if self.replies else None


def openai_app(script: Script) -> Starlette:
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        reply = script.next()
        if reply is None:
            return JSONResponse({"error": {"message": "script exhausted"}}, status_code=500)
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(reply.split()),
                    "total_tokens": prompt_tokens + len(reply.split()),
                },
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[WireServer, Script]]:
    script = Script()
    with serve(openai_app(script)) as server:
        yield server, script


def model_env(server: WireServer, strategy: str | None = "reflexion") -> dict[str, str]:
    """The env of a CLI or server on the scripted model; ``strategy`` pins AGENT_STRATEGY
    (these tests script the reflexion loop's calls), None leaves the default."""
    env = {
        "LLM_PROVIDER": "openai",
        "OPENAI_BASE_URL": server.url + "/v1",
        "OPENAI_API_KEY": "sk-test-key",
        "LLM_RETRIES": "0",
    }
    if strategy is not None:
        env["AGENT_STRATEGY"] = strategy
    return env


@pytest.fixture(scope="module")
def agent_server(data_root: Path, model: tuple[WireServer, Script]) -> Iterator[str]:
    data_dir = data_root / "agent-server"
    data_dir.mkdir()
    process, url, _log = start_server(data_dir, model_env(model[0]), "--no-auth")
    yield url
    stop_server(process)


def test_post_execute_runs_the_default_strategy_in_the_callers_one_sandbox(
    data_root: Path, model: tuple[WireServer, Script]
) -> None:
    # The default strategy is sample-and-select. Its first candidate fails, so the other
    # samples are drawn (one call; this fake model answers each call with one reply), and
    # the candidates take turns in the one sandbox the server made for the caller.
    server, script = model
    server.clear()
    script.load(BROKEN, GOOD)
    env = {**model_env(server, None), "AGENT_SAMPLES": "2"}
    data_dir = data_root / "agent-server-default"
    data_dir.mkdir()
    process, url, _log = start_server(data_dir, env, "--no-auth")
    try:
        response = httpx.post(url + "/execute", json={"task": "print 6"}, timeout=60)
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["mode"] == "sample_select"
        assert result["status"] == "solved" and result["output"] == "6\n"
        assert [a["code"] for a in result["attempts"]] == [
            "print(sum([1, 2, 3]) +)",
            "print(sum([1, 2, 3]))",
        ]
        assert [c["selected"] for c in result["candidates"]] == [False, True]
        assert len([r for r in server.requests if r.path == "/v1/chat/completions"]) == 2
        listed = httpx.get(url + "/v1/sandboxes", timeout=10).json()
        assert (listed["sandboxes"] if isinstance(listed, dict) else listed) == []
    finally:
        stop_server(process)


def test_post_execute_task_runs_the_loop(
    agent_server: str, model: tuple[WireServer, Script]
) -> None:
    server, script = model
    server.clear()
    script.load(BROKEN, CRITIQUE, GOOD)
    response = httpx.post(agent_server + "/execute", json={"task": "print 6"}, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["status"] == "solved" and result["success"] is True
    assert result["output"] == "6\n"
    assert len(result["attempts"]) == 2 and "SyntaxError" in result["errors"][0]
    assert result["critiques"] == ["stray plus Fix: remove it"]
    assert result["provider"] == "openai" and result["model"] == "gpt-4o-mini"
    assert result["input_tokens"] > 0 and result["output_tokens"] > 0
    # The server called the model over HTTP with the key and the recommended model.
    calls = [r for r in server.requests if r.path == "/v1/chat/completions"]
    assert len(calls) == 3
    assert calls[0].headers["authorization"] == "Bearer sk-test-key"
    assert calls[0].json["model"] == "gpt-4o-mini"
    assert "print 6" in calls[0].json["messages"][-1]["content"]
    # The task's sandbox is gone.
    listed = httpx.get(agent_server + "/v1/sandboxes", timeout=10).json()
    assert listed["sandboxes"] == [] if isinstance(listed, dict) else listed == []


def test_the_agents_memory_never_carries_one_tenants_task_into_anothers_prompt(
    data_root: Path, model: tuple[WireServer, Script]
) -> None:
    # Failed before (red team, 2026-11-25): with AGENT_MEMORY on, the server's one memory
    # recalled tenant A's solved task, secret and all, into tenant B's prompt.
    pytest.importorskip("qdrant_client")
    from sandlot.server.auth import AuthStore

    server, script = model
    data_dir = data_root / "agent-server-memory"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    keys = {t: store.create_key(t, "user")[1] for t in ("tenant-a", "tenant-b")}
    store.close()
    secret = "```python\nSECRET_OF_A = 'hunter2'\nprint(SECRET_OF_A)\n```"
    env = {**model_env(server, "single"), "AGENT_MEMORY": "true"}
    process, url, _log = start_server(data_dir, env)
    try:

        def execute(tenant: str, task: str, **fields: Any) -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            body = {"task": task, **fields}
            response = httpx.post(url + "/execute", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()
            return result

        task = "print the database password of the reporting service"
        script.load(secret, GOOD, GOOD)
        assert execute("tenant-a", task)["status"] == "solved"
        server.clear()
        # Another tenant's similar task: nothing of A's in its prompt; with its own
        # max_attempts too (that once made a second runtime and a second memory).
        assert execute("tenant-b", task + " please", max_attempts=2)["status"] == "solved"
        (call,) = [r for r in server.requests if r.path == "/v1/chat/completions"]
        prompt = json.dumps(call.json["messages"])
        assert "SECRET_OF_A" not in prompt and "Similar past tasks" not in prompt
        # A's own next task recalls A's.
        server.clear()
        assert execute("tenant-a", task + " again")["status"] == "solved"
        (call,) = [r for r in server.requests if r.path == "/v1/chat/completions"]
        assert "SECRET_OF_A" in json.dumps(call.json["messages"])
    finally:
        stop_server(process)


def test_post_execute_bad_task_is_a_typed_4xx(agent_server: str) -> None:
    response = httpx.post(agent_server + "/execute", json={"task": ""}, timeout=10)
    assert response.status_code == 422
    assert response.json()["error"]["code"] in ("invalid_request", "invalid_config")
    response = httpx.post(
        agent_server + "/execute", json={"task": "x", "mode": "telepathy"}, timeout=10
    )
    assert response.status_code == 422


def test_provider_failure_is_reported_not_a_500(
    agent_server: str, model: tuple[WireServer, Script]
) -> None:
    _server, script = model
    script.load()  # the model answers 500: the agent reports an error status
    response = httpx.post(agent_server + "/execute", json={"task": "print 6"}, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["status"] == "error" and "HTTP 500" in result["error"]


def test_ws_stream_sends_each_step_then_the_result(
    agent_server: str, model: tuple[WireServer, Script]
) -> None:
    _server, script = model
    script.load(BROKEN, CRITIQUE, GOOD)
    ws_url = agent_server.replace("http://", "ws://") + "/stream"
    messages: list[dict[str, Any]] = []
    with connect(ws_url, open_timeout=10) as ws:
        ws.send(json.dumps({"task": "print 6", "max_attempts": 2}))
        while True:
            message = json.loads(ws.recv(timeout=60))
            messages.append(message)
            if message["type"] in ("result", "error"):
                break
        # A malformed task on the same socket gets a typed error, and the socket stays usable.
        ws.send(json.dumps({"task": 42}))
        error = json.loads(ws.recv(timeout=10))
    events = [m["event"]["event"] for m in messages if m["type"] == "event"]
    assert events == [
        "start",
        "generate",
        "code",
        "execute",
        "critique",
        "generate",
        "code",
        "execute",
        "final",
    ]
    assert messages[-1]["type"] == "result"
    assert messages[-1]["result"]["status"] == "solved"
    assert error["type"] == "error" and error["error"]["code"] == "invalid_config"


def run_cli(
    model_server: WireServer, data_dir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **model_env(model_server),
        "SANDLOT_DATA_DIR": str(data_dir),
        "LOG_LEVEL": "WARNING",
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_run_prints_each_attempt_and_the_output(
    data_root: Path, model: tuple[WireServer, Script]
) -> None:
    server, script = model
    script.load(BROKEN, CRITIQUE, GOOD)
    done = run_cli(server, data_root / "cli-run", "print 6")
    assert done.returncode == 0, done.stderr
    assert "attempt 1" in done.stderr and "attempt 2" in done.stderr
    assert "critique" in done.stderr and "stray plus" in done.stderr
    assert "solved after 2 attempt(s)" in done.stderr
    assert "print(sum([1, 2, 3]))" in done.stdout and "6" in done.stdout


def test_cli_run_json_and_failure_exit_code(
    data_root: Path, model: tuple[WireServer, Script]
) -> None:
    server, script = model
    script.load(BROKEN)
    done = run_cli(server, data_root / "cli-run-json", "print 6", "--mode", "single", "--json")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "failed" and result["mode"] == "single"

    done = run_cli(server, data_root / "cli-run-json", "print 6", "--mode", "nonsense")
    assert done.returncode == 2 and "--mode" in done.stderr


def test_cli_benchmark_runs_a_strategy_on_a_task_file(
    data_root: Path, model: tuple[WireServer, Script], tmp_path: Path
) -> None:
    server, script = model
    right = "```python\ndef add_one(n):\n    return n + 1\n```"
    # Two samples and the test writer ask at once: every reply is the same right code (the
    # writer's then holds no assert, so only running decides).
    script.load(right, right, right)
    tasks = tmp_path / "mine.jsonl"
    prompt = 'def add_one(n: int) -> int:\n    """Return n plus one."""\n'
    test = "def check(candidate):\n    assert candidate(41) == 42\n"
    tasks.write_text(json.dumps({"prompt": prompt, "entry_point": "add_one", "test": test}))
    out = tmp_path / "results"
    env = {
        **os.environ,
        **model_env(server),
        "SANDLOT_DATA_DIR": str(data_root / "cli-bench"),
        "LOG_LEVEL": "WARNING",
        "COLUMNS": "200",
    }
    args = ["--tasks", str(tasks), "--strategy", "sample_select", "--samples", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "benchmark", *args, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = (out / "mine-sample_select.jsonl").read_text().splitlines()
    [row] = [json.loads(line) for line in lines]
    assert row["task_id"] == "mine/1" and row["strategy"] == "sample_select"
    assert row["loop_pass"] and row["single_pass"] and row["candidates"] == 1  # one code, twice
    assert "sample_select pass@1" in (out / "mine-sample_select.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", "benchmark", "--strategy", "best", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "unknown strategy" in bad.stderr


def test_a_revoked_key_ends_its_agent_task_on_the_stream(data_root: Path) -> None:
    """Failed before (red team, 2026-12-06): the key of ``WS /stream`` was checked when a
    task began, and the task (up to ten attempts of model calls and sandbox time) went on
    to its end for a key revoked meanwhile. Here the model takes 30 s to answer."""
    import asyncio

    from sandlot.server.auth import AuthStore

    async def slow(request: Request) -> JSONResponse:
        await asyncio.sleep(30)
        return JSONResponse({"error": {"message": "too late"}}, status_code=500)

    data_dir = data_root / "agent-revoked"
    data_dir.mkdir()
    store = AuthStore(data_dir / "sandlot.db")
    key_id, key = store.create_key("acme", "user")
    store.close()
    app = Starlette(routes=[Route("/v1/chat/completions", slow, methods=["POST"])])
    with serve(app) as model_server:
        process, url, _log = start_server(data_dir, model_env(model_server))
        try:
            ws_url = url.replace("http://", "ws://") + "/stream"
            headers = {"Authorization": f"Bearer {key}"}
            events: list[dict[str, Any]] = []
            with connect(ws_url, open_timeout=10, additional_headers=headers) as ws:
                ws.send(json.dumps({"task": "print 6", "max_attempts": 1}))
                events.append(json.loads(ws.recv(timeout=30)))  # "start": the task runs
                store = AuthStore(data_dir / "sandlot.db")
                assert store.revoke_key(key_id)
                store.close()
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        events.append(json.loads(ws.recv(timeout=5)))
        finally:
            stop_server(process)
    assert events[-1]["type"] == "error", events
    assert events[-1]["error"]["code"] == "unauthenticated"


def test_an_agent_from_the_registry_sets_the_mode_attempts_and_sandbox(
    agent_server: str, model: tuple[WireServer, Script]
) -> None:
    """Seed 001's registry/agents: quick_answer is one attempt, single mode, in a 128 MB
    sandbox; what a request gives itself comes first; an unknown agent is a typed 4xx."""
    server, script = model
    server.clear()
    script.load(BROKEN, GOOD)
    listed = httpx.get(agent_server + "/v1/agents", timeout=10)
    assert {"code_executor", "quick_answer", "review_swarm"} <= {a["name"] for a in listed.json()}
    task = {"task": "print 6", "agent": "quick_answer"}
    result = httpx.post(agent_server + "/execute", json=task, timeout=60).json()
    assert result["mode"] == "single" and len(result["attempts"]) == 1
    assert result["status"] == "failed"  # its one attempt was the broken one
    ended = httpx.get(agent_server + "/v1/sandboxes", params={"include_ended": "true"}).json()
    assert ended[-1]["limits"]["memory_mb"] == 128 and ended[-1]["limits"]["timeout_s"] == 5
    script.load(BROKEN, CRITIQUE, GOOD)
    own = httpx.post(
        agent_server + "/execute",
        json={**task, "mode": "loop", "max_attempts": 2},
        timeout=60,
    ).json()
    assert own["status"] == "solved" and len(own["attempts"]) == 2
    unknown = httpx.post(agent_server + "/execute", json={"task": "x", "agent": "nobody"})
    assert unknown.status_code == 422 and "quick_answer" in unknown.text


def test_a_registry_dir_adds_and_replaces_agents(tmp_path: Path) -> None:
    from sandlot.agent.agents import get_agent, load_agents
    from sandlot.errors import ConfigError, InvalidRequest

    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "mine.yaml").write_text(
        "name: quick_answer\ndescription: ours\nmode: swarm\nsandbox: {network: true}\n"
    )
    ours = load_agents.__wrapped__(tmp_path)
    assert ours["quick_answer"].mode == "swarm" and ours["quick_answer"].sandbox.spec().network
    assert "code_executor" in ours
    with pytest.raises(InvalidRequest, match="code_executor"):
        get_agent("nobody")
    (tmp_path / "agents" / "mine.yaml").write_text("name: x\ndescription: d\nmode: telepathy\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml"):
        load_agents.__wrapped__(tmp_path)
