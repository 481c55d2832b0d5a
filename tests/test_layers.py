"""The import graph of ``src/sandlot``: no circle, and no module imports a higher layer.

Every import counts, the lazy ones inside functions too (a lazy import still ties two modules
together). An import of a submodule is an edge to that module, not to its package's
``__init__``. The package root (``sandlot/__init__.py``, the public surface) is the top and may
import anything; nothing inside the package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sandlot

ROOT = Path(sandlot.__file__).parent

# Lowest first. A module may import its own layer or any layer below it. The first prefix that
# matches a module's dotted name (without "sandlot.") gives its layer.
LAYERS: list[tuple[str, ...]] = [
    # No sandlot imports but these:
    ("errors", "_version", "_strict", "models", "log", "guest", "_sqlite", "_fs", "_turns"),
    ("config", "requests", "environments", "tools", "_portal", "_sync"),
    ("backends",),  # isolation: knows nothing of owners, pools, TTLs
    ("core",),  # the manager and its rooms
    (
        "service",
        "_runner",
        "client",
        "sandbox",
        "volume",
        "terminal",
        "_remote_jobs",
        "seed_client",
    ),  # SDK
    ("agent",),  # the LLM layer, built on the SDK only
    ("lifecycle",),  # seed 001's sessions: the SDK, with the registry's agents
    ("mcp",),  # the MCP tools, built on the SDK's service only
    ("ray",),  # node agents on a Ray cluster and the manager the server uses in front of them
    ("server",),  # REST/WS over the core (and the agent layer for /execute)
    ("cli", "__main__", "doctor"),  # the top: every surface (and doctor reports on all)
]


def module_name(path: Path) -> str:
    parts = ["sandlot", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    module_name(path): path for path in ROOT.rglob("*.py") if "__pycache__" not in path.parts
}


def layer_of(name: str) -> int:
    short = name.removeprefix("sandlot.")
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if short == prefix or short.startswith(prefix + "."):
                return level
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__}")


def imports_of(name: str) -> set[str]:
    """The sandlot modules ``name`` imports, anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t == "sandlot" or t.startswith("sandlot."))
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES if name != "sandlot"}


def test_every_module_has_a_layer() -> None:
    for name in GRAPH:
        layer_of(name)


def test_nothing_inside_imports_the_package_root() -> None:
    offenders = sorted(name for name, targets in GRAPH.items() if "sandlot" in targets)
    assert offenders == [], "import from the defining module, not from the package root"


def test_no_module_imports_a_higher_layer() -> None:
    upward = sorted(
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        for target in targets
        if target in GRAPH and layer_of(target) > layer_of(name)
    )
    assert upward == []


def test_the_import_graph_has_no_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH.get(name, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_agent_layer_uses_the_sdk_not_the_core() -> None:
    reaching_in = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith("sandlot.agent")
        for target in targets
        if target.startswith(("sandlot.core", "sandlot.backends", "sandlot.server"))
    )
    assert reaching_in == []
