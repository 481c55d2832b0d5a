"""The sandlot command, run as a real process."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import sandlot
from tests.conftest import skip_reason

CLI = [sys.executable, "-m", "sandlot.cli"]


def _run(
    args: list[str], data_dir: Path, env: dict[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    env = {
        **(env or os.environ),
        "SANDLOT_DATA_DIR": str(data_dir),
        "SANDBOX_BACKEND": "bubblewrap",
    }
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=120, check=False, **kwargs
    )  # type: ignore[call-overload]


@pytest.fixture
def cli_data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    path = data_root / f"cli-{request.node.name}"
    path.mkdir()
    return path


def test_doctor_reports_every_feature(cli_data_dir: Path) -> None:
    out = _run(["doctor"], cli_data_dir)
    assert out.returncode == 0, out.stderr
    for feature in ("bubblewrap", "user namespaces", "cgroups", "seccomp", "disk cap"):
        assert feature in out.stdout
    if os.geteuid() == 0:  # what network=True needs, conntrack among it (2026-12-07)
        assert "network tools" in out.stdout


def test_doctor_says_whether_guests_come_from_a_template(
    cli_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the guest template is root's")
    report = _json_of(["doctor"], cli_data_dir)
    assert isinstance(report, dict)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["guest template"]["ok"] is True, checks["guest template"]
    assert "per system and owner" in checks["guest template"]["detail"]
    monkeypatch.setenv("SANDBOX_GUEST_TEMPLATE_SCOPE", "system")
    report = _json_of(["doctor"], cli_data_dir)
    assert isinstance(report, dict)
    checks = {c["name"]: c for c in report["checks"]}
    assert "share its memory layout" in checks["guest template"]["detail"]
    monkeypatch.setenv("SANDBOX_GUEST_TEMPLATE", "false")
    report = _json_of(["doctor"], cli_data_dir)
    assert isinstance(report, dict)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["guest template"]["ok"] is False
    assert "SANDBOX_GUEST_TEMPLATE=false" in checks["guest template"]["detail"]


def _json_of(args: list[str], data_dir: Path) -> object:
    """The command's stdout, which must be one JSON document and nothing else."""
    out = _run([*args, "--json"], data_dir)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_doctor_json(cli_data_dir: Path) -> None:
    report = _json_of(["doctor"], cli_data_dir)
    assert isinstance(report, dict) and report["ok"] is True
    names = {check["name"] for check in report["checks"]}
    assert {"bubblewrap", "cgroups", "seccomp"} <= names
    for check in report["checks"]:
        assert check.keys() == {"name", "ok", "detail", "why", "required"}


def test_listings_json(cli_data_dir: Path) -> None:
    images = _json_of(["image", "ls"], cli_data_dir)
    assert isinstance(images, list) and "python3" in {i["environment"] for i in images}
    for image in images:
        # Without dockerd the image's status is unknown and docker_error says why; the JSON
        # still parses, with the bubblewrap tree's status beside it.
        assert {
            "packages",
            "tree",
            "bubblewrap",
            "image",
            "image_present",
            "image_current",
            "image_same_tree",
            "image_size_mb",
            "docker_error",
        } <= image.keys()
        assert image["bubblewrap"] in ("tree", "host", "missing")
    models = _json_of(["models", "ls"], cli_data_dir)
    assert isinstance(models, list) and models
    assert {"name", "model", "size_bytes", "license", "fetched", "path"} <= models[0].keys()


def test_keys_json_keeps_stored_text_exact_and_escaped(cli_data_dir: Path) -> None:
    from sandlot.server.auth import LOCAL_PRINCIPAL, AuthStore

    hostile = "sb-\x1b[2J\x1b]0;owned\x07[blink]x"
    store = AuthStore(cli_data_dir / "sandlot.db")
    try:
        key_id, _ = store.create_key("acme", "viewer", "ci \x1b[31mred")
        store.audit(
            principal=LOCAL_PRINCIPAL,
            action="sandbox.delete",
            outcome="ok",
            sandbox_id=hostile,
            detail={"why": "test"},
        )
    finally:
        store.close()
    keys = _run(["keys", "list", "--json"], cli_data_dir)
    audit = _run(["keys", "audit", "--json"], cli_data_dir)
    for out in (keys, audit):
        assert out.returncode == 0, out.stderr
        assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    (key,) = json.loads(keys.stdout)
    assert (key["key_id"], key["tenant"], key["role"]) == (key_id, "acme", "viewer")
    assert key["name"] == "ci \x1b[31mred" and key["revoked_at"] is None
    (row,) = json.loads(audit.stdout)
    assert row["sandbox_id"] == hostile and row["detail"] == {"why": "test"}
    assert {"seq", "at", "tenant", "key_id", "action", "outcome"} <= row.keys()


def test_openapi_declares_the_bearer_key_on_authenticated_routes(tmp_path: Path) -> None:
    from sandlot.config import Settings
    from sandlot.server.app import create_app
    from sandlot.server.guard import PUBLIC_PATHS

    settings = Settings(_env_file=None, data_dir=tmp_path / "never-used")  # type: ignore[call-arg]
    document = create_app(settings).openapi()
    scheme = document["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    operations = [
        (path, operation)
        for path, methods in document["paths"].items()
        for operation in methods.values()
    ]
    assert any(path.startswith("/v1/") for path, _ in operations)
    for path, operation in operations:
        expected = None if path in PUBLIC_PATHS else [{"bearer": []}]
        assert operation.get("security") == expected, path
    assert {"/health", "/ready", "/metrics"} <= {path for path, _ in operations}


@pytest.mark.parametrize("name", ["sandlot", "agent-sandbox"])
def test_shell_completion_completes_commands(name: str) -> None:
    # What the script from `NAME --install-completion` runs on each <TAB> in bash.
    script = Path(sys.executable).parent / name
    variable = f"_{name.replace('-', '_').upper()}_COMPLETE"
    env = {**os.environ, variable: "complete_bash", "COMP_WORDS": f"{name} sa", "COMP_CWORD": "1"}
    out = subprocess.run(
        [str(script)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sandbox"]


def test_run_code_prints_output_and_value(cli_data_dir: Path) -> None:
    out = _run(["run-code", "print('hello'); 6 * 7"], cli_data_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello\n42\n"


def test_run_code_reads_stdin_and_fails_like_the_code(cli_data_dir: Path) -> None:
    out = _run(["run-code", "-"], cli_data_dir, input="raise ValueError('bad')\n")
    assert out.returncode == 1
    assert "ValueError: bad" in out.stderr


def test_exec_exit_status_follows_the_command(cli_data_dir: Path) -> None:
    out = _run(["exec", "echo hi; exit 3"], cli_data_dir)
    assert (out.returncode, out.stdout) == (3, "hi\n")


def test_timeout_is_reported(cli_data_dir: Path) -> None:
    out = _run(["exec", "--timeout-s", "1", "sleep 30"], cli_data_dir)
    assert out.returncode == 137
    assert "killed: timeout" in out.stderr


def test_bad_option_names_the_option(cli_data_dir: Path) -> None:
    out = _run(["exec", "--memory-mb", "1", "true"], cli_data_dir)
    assert out.returncode == 2
    assert "memory_mb" in out.stderr


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [("SANDBOX_POOL_SIZE", "abc", "pool_size"), ("API_EVENT_LOOP", "bogus", "api_event_loop")],
)
def test_a_bad_setting_in_the_environment_names_its_variable(
    tmp_path: Path, variable: str, value: str, field: str
) -> None:
    """A typo in a variable is the caller's to fix: the variable and what it takes, exit
    status 2, and no traceback (it was pydantic's, forty lines of it)."""
    for command in (["doctor"], ["serve", "--port", "1"]):
        out = _run(command, tmp_path, env={**os.environ, variable: value})
        assert out.returncode == 2, out.stderr
        assert variable in out.stderr and field in out.stderr and value in out.stderr
        assert "Traceback" not in out.stderr + out.stdout


def test_sandbox_commands_against_a_server(live_server: object, tmp_path: Path) -> None:
    from tests.conftest import LiveServer

    assert isinstance(live_server, LiveServer)
    env = {
        **os.environ,
        "SANDLOT_URL": live_server.url,
        "SANDLOT_API_KEY": live_server.keys["alice"],
    }

    cli = _sandbox_cli(env)

    created = cli("create", "--memory-mb", "128")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    assert sandbox_id in cli("ls").stdout
    listed = cli("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    (mine,) = [info for info in json.loads(listed.stdout) if info["id"] == sandbox_id]
    assert mine["status"] == "running" and mine["limits"]["memory_mb"] == 128
    assert {"backend", "owner", "created_at", "expires_at"} <= mine.keys()
    assert cli("run-code", sandbox_id, "v = 6").returncode == 0
    code = cli("run-code", sandbox_id, "print('x'); v * 7")
    assert (code.returncode, code.stdout) == (0, "x\n42\n")
    failed = cli("exec", sandbox_id, "echo out; echo err >&2; exit 5")
    assert (failed.returncode, failed.stdout) == (5, "out\n")
    assert "err" in failed.stderr
    local = tmp_path / "payload.bin"
    local.write_bytes(os.urandom(3 * 1024 * 1024))
    up = cli("upload", sandbox_id, str(local), "in/payload.bin")
    assert up.returncode == 0 and "uploaded 3145728 bytes" in up.stderr
    back = tmp_path / "back.bin"
    down = cli("download", sandbox_id, "in/payload.bin", str(back))
    assert down.returncode == 0, down.stderr
    assert back.read_bytes() == local.read_bytes()
    missing = cli("download", sandbox_id, "nope", str(tmp_path / "x"))
    assert missing.returncode == 2 and "file_not_found" in missing.stderr
    assert cli("rm", sandbox_id).returncode == 0
    assert sandbox_id not in cli("ls").stdout
    gone = cli("exec", sandbox_id, "true")
    assert gone.returncode == 2 and "sandbox_not_running" in gone.stderr


def test_what_a_sandbox_names_reaches_the_terminal_shown_not_obeyed(
    live_server: object, tmp_path: Path
) -> None:
    """Sandboxed code chose the target of a dangling link, and the guest's error message
    names it: the CLI printed it raw (the escapes set the terminal's title and hid text),
    and a target with "[/]" crashed it with Rich's MarkupError (red team, 2026-12-06). The
    output of a command the user runs is still passed through byte for byte."""
    from tests.conftest import LiveServer

    assert isinstance(live_server, LiveServer)
    env = {
        **os.environ,
        "SANDLOT_URL": live_server.url,
        "SANDLOT_API_KEY": live_server.keys["alice"],
        "COLUMNS": "400",  # one line each: Rich wraps at 80 when it is not a terminal
    }

    cli = _sandbox_cli(env)

    created = cli("create")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    try:
        title = "/workspace/x\x1b]0;PWNED-TITLE\x1b\\\x1b[8m hidden\x07\x9b2J"
        for target in (title, "/workspace/a[/]b", "/workspace/[bold red]c\\"):
            link = f"import os; os.symlink({target!r}, 'report.csv')"
            ran = cli(
                "run-code",
                sandbox_id,
                f"import os\nif os.path.lexists('report.csv'): os.unlink('report.csv')\n{link}",
            )
            assert ran.returncode == 0, ran.stderr
            out = cli("download", sandbox_id, "report.csv", str(tmp_path / "r.csv"))
            assert out.returncode == 2, out.stderr
            err = out.stderr
            assert "Traceback" not in err and "MarkupError" not in err, err
            assert "error (file_not_found):" in err, err
            raw = [c for c in err if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]
            assert not raw, err
            shown = target.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
            assert shown.replace("\x9b", "\\x9b") in err, (shown, err)
        # What the user asked to run: its output verbatim, escapes and all (as docker exec).
        styled = cli("exec", sandbox_id, "printf '\\033[31mred [/] \\033]0;t\\007'")
        assert styled.returncode == 0, styled.stderr
        assert styled.stdout == "\x1b[31mred [/] \x1b]0;t\x07"
    finally:
        cli("rm", sandbox_id)


def test_shown_escapes_markup_and_control_characters() -> None:
    from rich.console import Console

    from sandlot.cli.common import shown, visible

    hostile = "a\x1b]0;T\x07[/]b\u202e[bold]c\\\n\td\x9b"
    assert visible(hostile) == "a\\x1b]0;T\\x07[/]b\\u202e[bold]c\\\\x0a\\x09d\\x9b"
    assert visible(hostile, lines=True) == "a\\x1b]0;T\\x07[/]b\\u202e[bold]c\\\n\td\\x9b"
    console = Console(width=400, record=True, force_terminal=False)
    for lines in (False, True):
        console.print(f"[red]x:[/] {shown(hostile, lines=lines)}")  # no MarkupError
        printed = console.export_text()
        # Exactly the visible text (Rich expands a tab as expandtabs does).
        assert printed.rstrip("\n") == ("x: " + visible(hostile, lines=lines)).expandtabs(), printed


@pytest.mark.parametrize(
    "message",
    [
        "No such file or directory: /workspace/a[/]b",  # was Rich's MarkupError
        "No such file or directory: /workspace/x\x1b]0;PWNED\x1b\\\x1b[8m hidden",
        "[link=https://example.com]click[/link] [bold red]c\\[/]d",
    ],
)
def test_an_error_message_is_shown_not_obeyed(
    message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import typer
    from rich.console import Console

    from sandlot.cli import common
    from sandlot.errors import SandboxFileNotFound

    console = Console(width=400, record=True, force_terminal=True, color_system=None)
    monkeypatch.setattr(common, "console", console)
    with pytest.raises(typer.Exit), common.errors_exit_2():
        raise SandboxFileNotFound(message)
    printed = console.export_text()  # what reached the terminal, less Rich's own styles
    expected = "error (file_not_found): " + message.replace("\x1b", "\\x1b")
    assert printed == expected + "\n", printed


def test_sandbox_commands_say_when_no_server_answers(tmp_path: Path) -> None:
    env = {**os.environ, "SANDLOT_URL": "http://127.0.0.1:9"}
    out = subprocess.run(
        [*CLI, "sandbox", "ls"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert out.returncode == 2
    assert "cannot reach the server" in out.stderr and "SANDLOT_URL" in out.stderr


def test_python_m_sandlot_is_the_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sandlot", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Usage: sandlot " in out.stdout and "run-code" in out.stdout


@pytest.mark.parametrize("name", ["sandlot", "agent-sandbox"])
def test_console_scripts_run(name: str) -> None:
    # Installing the package puts its scripts beside the interpreter (a venv's bin/).
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{script} is missing: is the package installed?"
    out = subprocess.run(
        [str(script), "version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == sandlot.__version__


def _modules_under(package: str) -> dict[str, Path]:
    root = Path(sandlot.__file__).parent / package.removeprefix("sandlot.").replace(".", "/")
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it is running the command
        name = ".".join((package, *parts)).removesuffix(".__init__")
        found[name] = path
    return found


def _imported_names(module: str, path: Path) -> set[str]:
    names = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_agent_layer_never_imports_the_cli() -> None:
    # The CLI is the top layer: it may import the agent, never the other way round.
    cli_modules = _modules_under("sandlot.cli")
    agent_modules = _modules_under("sandlot.agent")
    for name in [*cli_modules, *agent_modules]:
        importlib.import_module(name)
    assert "sandlot.agent.loop" in agent_modules and "sandlot.agent.bench.runner" in agent_modules
    offenders = [
        (name, imported)
        for name, path in agent_modules.items()
        for imported in sorted(_imported_names(name, path))
        if imported == "sandlot.cli" or imported.startswith("sandlot.cli.")
    ]
    assert offenders == []


def test_keys_create_quota_and_revoke_run_as_commands(cli_data_dir: Path) -> None:
    from sandlot.errors import SandboxError
    from sandlot.models import Quota
    from sandlot.server.auth import AuthStore, Principal

    made = _run(["keys", "create", "--tenant", "acme", "--name", "ci"], cli_data_dir)
    assert made.returncode == 0, made.stderr
    # The key alone on stdout (for a pipe), what it is on stderr.
    key, key_id = made.stdout.strip(), made.stderr.split()[1]
    assert key.startswith("asb_") and key_id.startswith("key_"), (made.stdout, made.stderr)
    quota = ["keys", "quota", "acme", "--max-sandboxes", "2", "--max-memory-mb", "512"]
    set_quota = _run(quota, cli_data_dir)
    assert set_quota.returncode == 0, set_quota.stderr
    store = AuthStore(cli_data_dir / "sandlot.db")
    try:
        assert isinstance(store.authenticate(key), Principal)
        defaults = Quota(max_sandboxes=10, max_memory_mb=4096, max_pids=4096, max_disk_mb=8192)
        own = store.quota("acme", defaults)
        assert (own.max_sandboxes, own.max_memory_mb, own.max_pids) == (2, 512, 4096)
        revoked = _run(["keys", "revoke", key_id], cli_data_dir)
        assert revoked.returncode == 0, revoked.stderr
        with pytest.raises(SandboxError):
            store.authenticate(key)
        again = _run(["keys", "revoke", "key_nonexistent"], cli_data_dir)
        assert again.returncode != 0 and "key_nonexistent" in again.stdout + again.stderr
    finally:
        store.close()


def test_serve_refuses_more_than_one_worker_and_says_why(cli_data_dir: Path) -> None:
    # Sandboxes live in the process that made them: a second worker would not find them.
    flag = _run(["serve", "--workers", "2", "--port", "1"], cli_data_dir)
    assert flag.returncode == 2 and "--workers must be 1" in flag.stdout + flag.stderr
    env = {**os.environ, "API_WORKERS": "3"}
    setting = _run(["serve", "--port", "1"], cli_data_dir, env=env)
    assert setting.returncode != 0, setting.stdout
    assert "API_WORKERS" in setting.stdout + setting.stderr


def _sandbox_cli(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``sandlot sandbox ARGS...`` against the server ``env`` names."""

    def cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            [*CLI, "sandbox", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
            **kwargs,
        )

    return cli
