"""What the command's help says, as a user sees it (rich renders the help: markup-like text
such as ``[ray]`` must be escaped, or rich swallows it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sandlot

REGISTRY = Path(sandlot.__file__).resolve().parent / "registry" / "environments"


def _help(*args: str) -> str:
    """``sandlot ARGS --help`` in a child process, its table borders and line breaks gone."""
    out = subprocess.run(
        [sys.executable, "-m", "sandlot.cli", *args, "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"},
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", out.stdout))


def test_serve_help_names_the_ray_extra() -> None:
    assert "Needs the [ray] extra." in _help("serve")


@pytest.mark.parametrize("command", ["run-code", "exec"])
def test_environment_help_names_every_shipped_environment(command: str) -> None:
    text = _help(command)
    names = sorted(p.stem for p in REGISTRY.glob("*.yaml"))
    assert names, REGISTRY
    for name in names:
        assert name in text, (name, text)
    assert "sandlot image list" in text


# ------------------------------------------- .env.example and the .env precedence

REPO = Path(__file__).resolve().parent.parent


def _env_names(cls: type) -> set[str]:
    """Every environment variable a settings class reads (its upper-case aliases)."""
    from pydantic import AliasChoices

    found: set[str] = set()
    for field in cls.model_fields.values():  # type: ignore[attr-defined]
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            found |= {c for c in alias.choices if isinstance(c, str) and c.isupper()}
    return found


def test_env_example_names_only_settings_that_exist_at_their_defaults() -> None:
    from sandlot.agent.config import AgentSettings
    from sandlot.config import Settings

    known = _env_names(Settings) | _env_names(AgentSettings)
    lines = (REPO / ".env.example").read_text().splitlines()
    named = [re.match(r"#\s*([A-Z][A-Z0-9_]+)=", line) for line in lines]
    names = [m.group(1) for m in named if m]
    assert len(names) >= 20
    assert not set(names) - known, set(names) - known
    # Copied as it is, it changes nothing: every setting line is commented out.
    assert not [line for line in lines if re.match(r"[A-Z][A-Z0-9_]+=", line)]


def test_a_dotenv_file_is_read_under_the_environment_and_explicit_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandlot.agent.config import AgentSettings
    from sandlot.config import Settings

    for name in ("SANDBOX_TIMEOUT_SECONDS", "SANDBOX_MEMORY_LIMIT_MB", "LLM_PROVIDER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(
        "SANDBOX_TIMEOUT_SECONDS=7\nSANDBOX_MEMORY_LIMIT_MB=300\nLLM_PROVIDER=groq\n"
    )
    from_file = Settings()
    assert (from_file.timeout_s, from_file.memory_mb) == (7, 300)
    assert AgentSettings().llm_provider == "groq"
    monkeypatch.setenv("SANDBOX_TIMEOUT_SECONDS", "9")
    assert Settings().timeout_s == 9  # the environment over .env
    assert Settings(timeout_s=11).timeout_s == 11  # explicit over both
    assert Settings().memory_mb == 300


def test_the_readme_documents_every_setting_and_only_real_ones() -> None:
    """Each variable in the README's tables is read by a settings class, and each setting's
    variable is named somewhere in the README: neither drifts from the other."""
    from sandlot.agent.config import AgentSettings
    from sandlot.config import OLD_PREFIX, Settings

    text = (REPO / "README.md").read_text()
    documented: set[str] = set()
    for line in text.splitlines():
        row = re.match(r"\| (`[A-Z][A-Z0-9_]*`(?:, `[A-Z][A-Z0-9_]*`)*) \|", line)
        if row:
            documented |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", row.group(1)))
    known = _env_names(Settings) | _env_names(AgentSettings)
    assert len(documented) > 40 and documented <= known, documented - known
    # Each setting's own name (the first; the rest are aliases: GEMINI_API_KEY, old names).
    primary = {_env_names_in_order(f)[0] for f in _fields(Settings) + _fields(AgentSettings)}
    assert not {n for n in primary if f"`{n}`" not in text and not n.startswith(OLD_PREFIX)}


def _fields(cls: type) -> list[object]:
    fields: dict[str, object] = cls.model_fields  # type: ignore[attr-defined]
    return [f for f in fields.values() if _env_names_in_order(f)]


def _env_names_in_order(field: object) -> list[str]:
    from pydantic import AliasChoices

    alias = getattr(field, "validation_alias", None)
    if not isinstance(alias, AliasChoices):
        return []
    return [c for c in alias.choices if isinstance(c, str) and c.isupper()]
