"""``sandlot tools``: the registry's tools (sandlot.tools), and ``sandlot sandbox tool``."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sandlot.cli.common import (
    JsonOpt,
    KeyOpt,
    TimeoutOpt,
    UrlOpt,
    errors_exit_2,
    finish,
    print_json,
    remote_call,
    shown,
)
from sandlot.config import get_settings
from sandlot.errors import InvalidRequest
from sandlot.tools import ToolBase, ToolExecutor, default_registry

BOOLEAN_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

tools_app = typer.Typer(
    no_args_is_help=True,
    help="The tools a sandbox can run (package's, SANDLOT_REGISTRY_DIR/tools' and plugins').",
)


def register(app: typer.Typer, sandbox_app: typer.Typer) -> None:
    app.add_typer(tools_app, name="tools")
    sandbox_app.command("tool")(sandbox_tool)


@tools_app.command("list")
def tools_list(as_json: JsonOpt = False) -> None:
    """The tools, with their arguments."""
    with errors_exit_2():
        infos = default_registry(get_settings().registry_dir).list()
    if as_json:
        print_json([info.model_dump(mode="json") for info in infos])
        return
    table = Table("name", "arguments", "description")
    for info in infos:
        required = set(info.input_schema["required"])
        names = [f"{n}{'' if n in required else '?'}" for n in info.input_schema["properties"]]
        table.add_row(shown(info.name), shown(" ".join(names)), shown(info.description))
    Console().print(table)


def _arguments(tool: ToolBase, pairs: list[str], as_json: str | None) -> dict[str, Any]:
    """``--arg name=value`` pairs, each value read as its parameter's type, over ``--args``
    (a JSON object)."""
    try:
        given: dict[str, Any] = json.loads(as_json) if as_json else {}
    except ValueError as exc:
        raise InvalidRequest(f"--args is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise InvalidRequest("--args must be a JSON object")
    for pair in pairs:
        name, sep, text = pair.partition("=")
        parameter = tool.parameters.get(name)
        if not sep or parameter is None:
            known = ", ".join(tool.parameters) or "none"
            raise InvalidRequest(f"--arg {pair!r}: give NAME=VALUE, NAME one of: {known}")
        if parameter.type == "string":
            given[name] = text
        elif parameter.type == "boolean":
            word = text.lower()
            if word not in BOOLEAN_WORDS:
                raise InvalidRequest(f"--arg {name}: {text!r} is not one of true, false")
            given[name] = BOOLEAN_WORDS[word]
        else:
            try:
                given[name] = int(text) if parameter.type == "integer" else float(text)
            except ValueError:
                raise InvalidRequest(f"--arg {name}: {text!r} is not a {parameter.type}") from None
    return given


def sandbox_tool(
    sandbox_id: str,
    name: str,
    arg: Annotated[
        list[str] | None, typer.Option("--arg", help="NAME=VALUE, once per argument.")
    ] = None,
    args: Annotated[str | None, typer.Option("--args", help="All arguments as JSON.")] = None,
    timeout_s: TimeoutOpt = None,
    api_url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Run a tool (`sandlot tools list`) in a sandbox; its output as it comes."""
    with errors_exit_2():
        registry = default_registry(get_settings().registry_dir)
        arguments = _arguments(registry.get(name), arg or [], args)
    result = remote_call(
        api_url,
        api_key,
        lambda s: ToolExecutor(registry, lambda command: s.run_command(sandbox_id, command)).run(
            name, arguments, timeout_s
        ),
    )
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    raise typer.Exit(finish(result))
