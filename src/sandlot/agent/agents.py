"""Agents declared in the registry (seed 001's ``registry/agents``): named presets of what an
agent task is, no logic. An agent names its strategy (``mode``), its attempts, and the sandbox
its tasks run in::

    name: code_executor
    description: Writes Python for the task, runs it, and fixes it with a critic's review.
    mode: loop                 # loop (AGENT_STRATEGY) | single | swarm
    max_attempts: 3
    sandbox: {environment: python3, memory_mb: 256, timeout_s: 10}

The package's are ``registry/agents/*.yaml``; ``SANDLOT_REGISTRY_DIR/agents/*.yaml`` adds its
own or replaces one by name. ``POST /execute {"task", "agent"}``, ``WS /stream`` and
``sandlot run --agent`` take one; what a request gives itself (``mode``, ``max_attempts``)
comes first. The sandbox is still its tenant's, within its quota.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandlot.environments import NAME_PATTERN, PACKAGED_REGISTRY, read_declared
from sandlot.errors import InvalidRequest
from sandlot.requests import SandboxSpec, build

AGENT_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"
AgentMode = Literal["loop", "single", "swarm"]


class AgentSandbox(BaseModel):
    """The sandbox an agent's tasks run in: what differs from the server's defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: str | None = Field(default=None, pattern=NAME_PATTERN)
    memory_mb: int | None = Field(default=None, ge=16, le=1 << 20)
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    network: bool = False

    def spec(self) -> SandboxSpec:
        return build(
            SandboxSpec,
            environment=self.environment,
            memory_mb=self.memory_mb,
            timeout_s=self.timeout_s,
            network=self.network or None,
        )


class AgentDefinition(BaseModel):
    """One declared agent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=AGENT_NAME_PATTERN)
    description: str = Field(min_length=1, max_length=4096)
    mode: AgentMode = "loop"
    max_attempts: int | None = Field(default=None, ge=1, le=10)
    sandbox: AgentSandbox = AgentSandbox()


def _load_dir(directory: Path) -> dict[str, AgentDefinition]:
    found: dict[str, AgentDefinition] = {}
    for path in sorted(directory.glob("*.yaml")):
        agent = read_declared(path, AgentDefinition, "agent")
        found[agent.name] = agent
    return found


@cache
def load_agents(registry_dir: Path | None = None) -> dict[str, AgentDefinition]:
    """Every agent by name: the package's, then ``registry_dir/agents``' over them.

    Raises:
        ConfigError: an agent file that is not one.
    """
    agents = _load_dir(PACKAGED_REGISTRY / "agents")
    if registry_dir is not None:
        agents.update(_load_dir(registry_dir / "agents"))
    return agents


def get_agent(name: str, registry_dir: Path | None = None) -> AgentDefinition:
    """Raises InvalidRequest: no agent has that name (the message names those there are)."""
    agents = load_agents(registry_dir)
    if name not in agents:
        known = ", ".join(sorted(agents)) or "none"
        raise InvalidRequest(f"unknown agent {name!r}; the agents here: {known}")
    return agents[name]
