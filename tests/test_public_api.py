"""The package's public surface and its error contract."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot
from sandlot import errors


def test_all_lists_every_public_name() -> None:
    public = {
        name
        for name, value in vars(sandlot).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert public <= set(sandlot.__all__) | {"annotations"}
    for name in sandlot.__all__:
        assert hasattr(sandlot, name), name


def test_every_error_derives_from_one_root_and_a_builtin() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, Exception)
    ]
    for cls in classes:
        assert issubclass(cls, errors.SandboxError)
        if cls is not errors.SandboxError:
            builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins"]
            assert len(builtin_bases) > 2, f"{cls.__name__} should also inherit a built-in"


def test_codes_are_unique_and_map_back() -> None:
    classes = [
        v
        for v in vars(errors).values()
        if inspect.isclass(v) and issubclass(v, errors.SandboxError)
    ]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert type(errors.error_from_code(cls.code, "m")) is cls


def test_unknown_wire_code_never_imports_anything() -> None:
    error = errors.error_from_code("os.system", "m")
    assert type(error) is errors.SandboxError
    assert error.message == "m"


def test_host_and_guest_agree_on_the_launcher() -> None:
    import re

    from sandlot.guest import GUEST_SCRIPT, LAUNCHER

    match = re.search(r'^LAUNCHER = "(.*)"$', GUEST_SCRIPT.read_text(), re.M)
    assert match is not None and match.group(1) == LAUNCHER


def test_blocking_twins_cover_every_async_method() -> None:
    from sandlot._sync import twin_of
    from sandlot.sandbox import AsyncCommands, AsyncFiles, Commands, Files

    assert twin_of(sandlot.Sandbox, sandlot.AsyncSandbox) == []
    assert twin_of(Files, AsyncFiles) == []
    assert twin_of(Commands, AsyncCommands) == []


def test_blocking_methods_keep_signature_and_docstring() -> None:
    from sandlot.sandbox import AsyncCommands, Commands

    pairs = [
        (sandlot.Sandbox.run_code, sandlot.AsyncSandbox.run_code),
        (sandlot.Sandbox.set_timeout, sandlot.AsyncSandbox.set_timeout),
    ]
    for blocking, original in pairs:
        assert inspect.signature(blocking) == inspect.signature(original)
        assert blocking.__doc__ == original.__doc__
    # run(background=True) returns a handle, the blocking one its own: the same parameters.
    run, original_run = inspect.signature(Commands.run), inspect.signature(AsyncCommands.run)
    assert run.parameters == original_run.parameters
    assert run.return_annotation == "ExecResult | CommandHandle"
    assert Commands.run.__doc__ == AsyncCommands.run.__doc__
    create = inspect.signature(sandlot.Sandbox.create)
    original = inspect.signature(sandlot.AsyncSandbox.create)
    assert list(create.parameters) == list(original.parameters)
    assert create.parameters["memory_mb"].kind is inspect.Parameter.KEYWORD_ONLY
    assert create.return_annotation == "Sandbox"


def test_mypy_checks_calls_to_the_blocking_sdk(tmp_path: Path) -> None:
    # The twin is generated, yet a type checker still sees every parameter and result.
    program = tmp_path / "uses_sdk.py"
    program.write_text(
        "from sandlot import Sandbox\n"
        "sb = Sandbox.create(memory_mb=128)\n"
        "reveal_type(sb)\n"
        "reveal_type(sb.run_code('1').text)\n"
        "sb.run_code(42)\n"
        "Sandbox.create(memory=128)\n"
        "sb.commands.run('ls', sesion='x')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(program)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    out = done.stdout
    assert 'Revealed type is "sandlot.sandbox.Sandbox"' in out, out
    assert 'Revealed type is "str | None"' in out, out
    assert 'Argument 1 has incompatible type "int"; expected "str"' in out, out
    assert 'Unexpected keyword argument "memory"' in out, out
    assert 'Unexpected keyword argument "sesion"' in out, out


def test_old_variable_names_are_read_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sandlot.config import Settings, warn_old_names

    monkeypatch.setenv("AGENT_SANDBOX_DATA_DIR", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="AGENT_SANDBOX_DATA_DIR -> SANDLOT_DATA_DIR"):
        assert warn_old_names() == ["AGENT_SANDBOX_DATA_DIR"]
    assert Settings(_env_file=None).data_dir == tmp_path / "old"  # type: ignore[call-arg]
    monkeypatch.setenv("SANDLOT_DATA_DIR", str(tmp_path / "new"))  # the new name wins
    assert Settings(_env_file=None).data_dir == tmp_path / "new"  # type: ignore[call-arg]
