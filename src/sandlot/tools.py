"""Tools: named, typed actions that run inside a sandbox (seed 003's tool system, seed 001's
``registry/tools``).

A tool has a name, a description, typed parameters and what it runs in the sandbox. Most are
declared in YAML, no logic (``registry/tools/*.yaml`` in the package, and
``SANDLOT_REGISTRY_DIR/tools/*.yaml`` over them by name), as either:

* ``command``: an argv template, each element a literal or ``{parameter}`` (inside a
  string too: ``--depth={depth}``). The arguments never pass through a shell: every element
  is quoted whole, so an argument cannot add a command, only be one argument (a tool whose
  program takes options should put ``--`` before the arguments, or an argument starting with
  ``-`` is an option to it);
* ``python``: code run by the sandbox's ``python3 -I``, with the arguments as ``args`` (a dict
  read from its stdin as JSON: never spliced into the code).

A plugin is a :class:`ToolBase` subclass in a package the operator installs, registered under
the ``sandlot.tools`` entry point group (or by :meth:`ToolRegistry.register`): its
:meth:`~ToolBase.request` builds the command the sandbox runs, on the host, from arguments
already validated, and never runs anything on the host itself.

:class:`ToolValidator` checks a tool's declaration and each call's arguments (unknown ones,
wrong types, values out of range: a typed :class:`~sandlot.errors.InvalidRequest`), and
:class:`ToolExecutor` runs a call as one :class:`~sandlot.requests.RunCommand` through the SDK,
the server or MCP: whatever the sandbox can do, a tool can, and nothing more.
"""

from __future__ import annotations

import json
import re
import shlex
import string
from collections.abc import Awaitable, Callable, Mapping
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from sandlot._strict import problems
from sandlot.config import explain_invalid
from sandlot.environments import read_declared
from sandlot.errors import ConfigError, InvalidRequest, ToolNotFound
from sandlot.models import ExecResult
from sandlot.requests import MAX_COMMAND_BYTES, NoNul, RunCommand, build

PACKAGED_TOOLS = Path(__file__).with_name("registry") / "tools"
TOOL_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"
ENTRY_POINT_GROUP = "sandlot.tools"
# A call's arguments as JSON: a tool is a small action, not a way to ship data (files are).
MAX_ARGUMENTS_BYTES = 64 * 1024
# A string parameter's length when its declaration names none.
DEFAULT_MAX_LENGTH = 16 * 1024
# The shell session tools run in: it starts in the workspace, and no tool changes its cwd or
# env (each is one program), whatever the user's own sessions did with theirs.
TOOL_SESSION = "tools"
PYTHON_PRELUDE = "import json, sys\nargs = json.loads(sys.stdin.read() or '{}')\n"

ParameterType = Literal["string", "integer", "number", "boolean"]
_PY_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool}


class Parameter(BaseModel):
    """One parameter of a tool: JSON Schema's scalar types and their common bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: ParameterType
    description: str = ""
    default: str | int | float | bool | None = None
    enum: tuple[str | int | float, ...] | None = None
    max_length: int | None = Field(default=None, ge=1, le=MAX_ARGUMENTS_BYTES)
    minimum: float | None = None
    maximum: float | None = None

    def json_schema(self) -> dict[str, Any]:
        """This parameter as JSON Schema (what MCP clients and ``GET /v1/tools`` show)."""
        out: dict[str, Any] = {"type": self.type}
        if self.description:
            out["description"] = self.description
        if self.default is not None:
            out["default"] = self.default
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.type == "string":
            out["maxLength"] = self.max_length or DEFAULT_MAX_LENGTH
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


class ToolInfo(BaseModel):
    """What a client is told of a tool."""

    name: str
    description: str
    input_schema: dict[str, Any]
    timeout_s: float | None = None


class ToolBase:
    """A tool. Subclass it for a plugin: set the class attributes and implement
    :meth:`request`."""

    name: str = ""
    description: str = ""
    parameters: Mapping[str, Parameter] = {}
    timeout_s: float | None = None

    def request(self, arguments: Mapping[str, Any], timeout_s: float | None) -> RunCommand:
        """The command the sandbox runs for ``arguments`` (validated already)."""
        raise NotImplementedError

    def info(self) -> ToolInfo:
        required = [n for n, p in self.parameters.items() if p.default is None]
        schema = {
            "type": "object",
            "properties": {n: p.json_schema() for n, p in self.parameters.items()},
            "required": required,
            "additionalProperties": False,
        }
        return ToolInfo(
            name=self.name,
            description=self.description,
            input_schema=schema,
            timeout_s=self.timeout_s,
        )

    def _command(self, command: str, timeout_s: float | None, stdin: str | None) -> RunCommand:
        try:
            return build(
                RunCommand,
                command=command,
                session=TOOL_SESSION,
                input=stdin,
                timeout_s=timeout_s or self.timeout_s,
            )
        except ConfigError as exc:  # the call's, not the server's configuration
            raise InvalidRequest(f"tool {self.name}: {exc.message}") from None


class ToolSpec(BaseModel):
    """A tool as declared in YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str = Field(min_length=1, max_length=4096)
    parameters: dict[str, Parameter] = Field(default_factory=dict, max_length=64)
    command: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=256)
    python: str | None = Field(default=None, min_length=1, max_length=64 * 1024)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)


class DeclaredTool(ToolBase):
    """A tool from YAML: an argv template or Python code."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.description = spec.description
        self.parameters = spec.parameters
        self.timeout_s = spec.timeout_s

    def request(self, arguments: Mapping[str, Any], timeout_s: float | None) -> RunCommand:
        if self.spec.python is not None:
            program = PYTHON_PRELUDE + self.spec.python
            command = shlex.join(["python3", "-I", "-c", program])
            return self._command(command, timeout_s, json.dumps(dict(arguments)))
        assert self.spec.command is not None
        values = {name: _text(value) for name, value in arguments.items()}
        argv = [element.format_map(values) for element in self.spec.command]
        command = shlex.join(argv)
        if len(command.encode()) > MAX_COMMAND_BYTES:
            raise InvalidRequest(f"tool {self.name}: its arguments make a command too long")
        return self._command(command, timeout_s, None)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class ToolValidator:
    """Checks a tool's declaration once, and each call's arguments."""

    @staticmethod
    def check_spec(spec: ToolSpec, where: str) -> None:
        """Raises ConfigError: the declaration cannot run as written."""
        if (spec.command is None) == (spec.python is None):
            raise ConfigError(f"tool file {where}: give exactly one of `command` or `python`")
        for name, parameter in spec.parameters.items():
            if not name.isidentifier():
                raise ConfigError(f"tool file {where}: parameter {name!r} is not an identifier")
            if parameter.default is not None:
                try:
                    ToolValidator._model(spec.name, {name: parameter}).model_validate(
                        {name: parameter.default}
                    )
                except ValidationError as exc:
                    said = explain_invalid(exc, f"tool file {where}: the default of {name}")
                    raise ConfigError(said) from None
        for element in spec.command or ():
            for _, field, _, _ in string.Formatter().parse(element):
                if field is not None and field not in spec.parameters:
                    raise ConfigError(
                        f"tool file {where}: {{{field}}} in `command` names no parameter"
                    )

    @staticmethod
    def arguments(tool: ToolBase, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """``given`` checked against ``tool``'s parameters, defaults filled in.

        Raises:
            InvalidRequest: an unknown, missing or mistyped argument, or one out of range.
        """
        given = dict(given or {})
        unknown = sorted(str(name)[:64] for name in given if name not in tool.parameters)
        if unknown:
            # One short error, whatever their number: each one a clause echoing its value
            # was 220 KB of error for 64 KB of unknown names (red team, 2026-12-07).
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise InvalidRequest(
                f"tool {tool.name}: unknown arguments {', '.join(unknown[:10])}{more}; "
                f"it takes: {', '.join(tool.parameters) or 'none'}"
            )
        try:
            size = len(json.dumps(given).encode())
        except (TypeError, ValueError):  # not JSON (an int past Python's 4,300 digits)
            raise InvalidRequest(f"tool {tool.name}: arguments must be JSON values") from None
        if size > MAX_ARGUMENTS_BYTES:
            raise InvalidRequest(
                f"tool {tool.name}: arguments over {MAX_ARGUMENTS_BYTES} bytes as JSON; "
                "write large inputs to a file in the sandbox and pass its path"
            )
        model = ToolValidator._model(tool.name, dict(tool.parameters))
        try:
            checked = model.model_validate(given)
        except ValidationError as exc:
            said = problems(exc.errors())
            raise InvalidRequest(f"tool {tool.name}: {said}") from None
        return checked.model_dump()

    @staticmethod
    @cache
    def _model_for(name: str, frozen: tuple[tuple[str, Parameter], ...]) -> type[BaseModel]:
        fields: dict[str, Any] = {}
        for field_name, p in frozen:
            kind: Any = NoNul if p.type == "string" else _PY_TYPES[p.type]
            if p.enum is not None:
                kind = Literal[p.enum]
            constraints: dict[str, Any] = {"strict": p.type != "number"}
            if p.type == "string":
                constraints["max_length"] = p.max_length or DEFAULT_MAX_LENGTH
            if p.minimum is not None:
                constraints["ge"] = p.minimum
            if p.maximum is not None:
                constraints["le"] = p.maximum
            default = ... if p.default is None else p.default
            fields[field_name] = (kind, Field(default, **constraints))
        config = ConfigDict(extra="forbid")
        return create_model(f"Arguments_{name}", __config__=config, **fields)

    @staticmethod
    def _model(name: str, parameters: Mapping[str, Parameter]) -> type[BaseModel]:
        return ToolValidator._model_for(name, tuple(sorted(parameters.items())))


class ToolRegistry:
    """Every tool by name: the package's, then ``SANDLOT_REGISTRY_DIR``'s, then plugins'."""

    def __init__(self, tools: Mapping[str, ToolBase] | None = None) -> None:
        self._tools: dict[str, ToolBase] = dict(tools or {})

    @classmethod
    def load(cls, extra_dir: Path | None = None, *, plugins: bool = True) -> ToolRegistry:
        """Raises ConfigError: a tool file or plugin that is not a valid tool."""
        registry = cls(_load_dir(PACKAGED_TOOLS))
        if extra_dir is not None:
            if not extra_dir.is_dir():
                raise ConfigError(f"SANDLOT_REGISTRY_DIR={extra_dir} is not a directory")
            registry._tools.update(_load_dir(extra_dir / "tools"))
        if plugins:
            for point in entry_points(group=ENTRY_POINT_GROUP):
                registry.register(point.load()())
        return registry

    def register(self, tool: ToolBase) -> None:
        """Add (or replace by name) a tool.

        Raises:
            ConfigError: not a tool, or a bad name.
        """
        if not isinstance(tool, ToolBase):
            raise ConfigError(f"{tool!r} is not a sandlot ToolBase")
        if not re.fullmatch(TOOL_NAME_PATTERN, tool.name):
            raise ConfigError(f"tool name {tool.name!r} must match {TOOL_NAME_PATTERN}")
        for name, parameter in tool.parameters.items():
            if not name.isidentifier() or not isinstance(parameter, Parameter):
                raise ConfigError(f"tool {tool.name}: parameter {name!r} is not a Parameter")
        self._tools[tool.name] = tool

    def get(self, name: str) -> ToolBase:
        """Raises ToolNotFound: no tool has that name (it names the ones there are)."""
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            raise ToolNotFound(f"unknown tool {name!r}; the tools here: {known}")
        return tool

    def list(self) -> list[ToolInfo]:
        return [self._tools[name].info() for name in sorted(self._tools)]


@cache
def default_registry(extra_dir: Path | None = None) -> ToolRegistry:
    """The registry for ``SANDLOT_REGISTRY_DIR`` (read once per process)."""
    return ToolRegistry.load(extra_dir)


def _load_dir(directory: Path) -> dict[str, ToolBase]:
    found: dict[str, ToolBase] = {}
    for path in sorted(directory.glob("*.yaml")):
        spec = read_declared(path, ToolSpec, "tool")
        ToolValidator.check_spec(spec, str(path))
        found[spec.name] = DeclaredTool(spec)
    return found


RunCommandFn = Callable[[RunCommand], Awaitable[ExecResult]]


class ToolExecutor:
    """Runs tool calls: ``run_command`` runs one command in the sandbox (the SDK's, the
    server's manager's)."""

    def __init__(self, registry: ToolRegistry, run_command: RunCommandFn) -> None:
        self.registry = registry
        self._run_command = run_command

    async def run(
        self, name: str, arguments: Mapping[str, Any] | None = None, timeout_s: float | None = None
    ) -> ExecResult:
        """Raises InvalidRequest: an unknown tool or bad arguments (nothing ran)."""
        tool = self.registry.get(name)
        request = tool.request(ToolValidator.arguments(tool, arguments), timeout_s)
        return await self._run_command(request)
