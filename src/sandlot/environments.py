"""Environments: what a sandbox's root file system holds, declared in YAML (seed 001's registry).

The registry ships ``registry/environments/*.yaml`` in the package; a directory named by
``SANDLOT_REGISTRY_DIR`` adds its own ``environments/*.yaml`` (and replaces shipped ones
of the same name). No environment is defined in code. :func:`read_declared` reads any file of
the registry (tools, agents and prompts too).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandlot.config import explain_invalid
from sandlot.errors import ConfigError

PACKAGED_REGISTRY = Path(__file__).with_name("registry")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
# The environment a bubblewrap sandbox can run without a built tree: the host's own /usr.
HOST_ENVIRONMENT = "python3"
M = TypeVar("M", bound=BaseModel)


class Environment(BaseModel):
    """One declared environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    aliases: tuple[str, ...] = ()
    description: str = ""
    image: str = Field(min_length=1, description="the Docker tag the image is built as")
    suite: str = "bookworm"
    variant: str = "minbase"
    mirror: str = DEFAULT_MIRROR
    # The guest agent is Python, so every environment includes python3.
    packages: tuple[str, ...] = Field(min_length=1)
    # Python requirements installed into the tree at build time (never at create time), as
    # binary wheels for the tree's own python: from the package index, or only from
    # ``find_links`` (directories or URLs of wheels) with ``pip_no_index``.
    pip: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    pip_no_index: bool = False

    def debootstrap_spec(self) -> str:
        """What debootstrap alone makes: two environments that share it share a base tree."""
        return f"{self.suite}|{self.variant}|{self.mirror}|{','.join(sorted(self.packages))}"

    def spec_hash(self) -> str:
        """What the tree and image are built from; a changed YAML means a rebuild."""
        spec = self.debootstrap_spec()
        if self.pip:
            # Only when there is pip: environments without it keep the hash (and the images)
            # they had before pip requirements existed.
            spec += f"|pip={','.join(self.pip)}|links={','.join(self.find_links)}"
            spec += f"|no-index={self.pip_no_index}"
        return hashlib.sha256(spec.encode()).hexdigest()[:16]


def read_declared(path: Path, model: type[M], what: str) -> M:
    """One file of the registry (an environment, a tool, an agent, the prompts) as ``model``.

    Raises:
        ConfigError: not YAML, or not a ``what``: the file and each problem named.
    """
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what} file {path} is invalid: {exc}") from exc
    try:
        return model.model_validate({} if raw is None else raw)
    except ValidationError as exc:
        raise ConfigError(explain_invalid(exc, f"{what} file {path}")) from None


def _load_dir(directory: Path) -> dict[str, Environment]:
    found: dict[str, Environment] = {}
    for path in sorted(directory.glob("environments/*.yaml")):
        env = read_declared(path, Environment, "environment")
        if "python3" not in env.packages:
            raise ConfigError(f"environment file {path}: packages must include python3")
        found[env.name] = env
    return found


@cache
def load_registry(extra_dir: Path | None = None) -> dict[str, Environment]:
    """Every environment by name: the shipped ones, then ``extra_dir``'s over them."""
    registry = _load_dir(PACKAGED_REGISTRY)
    if extra_dir is not None:
        if not extra_dir.is_dir():
            raise ConfigError(f"SANDLOT_REGISTRY_DIR={extra_dir} is not a directory")
        registry.update(_load_dir(extra_dir))
    return registry


def get_environment(name: str, extra_dir: Path | None = None) -> Environment:
    """The environment called ``name`` (or one of its aliases, such as seed 001's "Python3").

    Raises:
        ConfigError: no environment has that name.
    """
    registry = load_registry(extra_dir)
    if name in registry:
        return registry[name]
    for env in registry.values():
        if name in env.aliases:
            return env
    known = ", ".join(sorted(registry))
    raise ConfigError(f"unknown environment {name!r}; choose one of: {known}")
