"""Starting and finding sandlot's named actors on a Ray cluster: one node agent per node that
offers the ``sandlot_node`` resource, and the one quota ledger.

A node is named by a resource ``sandlot_node_<name>`` when it has one (a stable name: the
agent's data directory is ``<data dir>/nodes/<name>``, so a node that comes back under its name
sweeps what its dead agent left), else by the start of its Ray node id.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sandlot.core.live import NODE_NAME_PATTERN
from sandlot.ray.ledger import LEDGER_NAME, QuotaLedger
from sandlot.ray.node import NODE_RESOURCE, NodeAgent, agent_name

log = structlog.get_logger(__name__)

NAME_RESOURCE_PREFIX = NODE_RESOURCE + "_"
# Ray gives the head node this resource (its own state actors use it the same way).
HEAD_RESOURCE = "node:__internal_head__"
# An agent's own start (manager start-up, recovery sweep) may take this long.
AGENT_START_TIMEOUT_S = 120.0


# Ray lists a dead node without its resources: its name as last seen alive, by Ray node id.
_names_by_id: dict[str, str] = {}


def node_name(entry: dict[str, Any]) -> str:
    """The sandlot name of a ``ray.nodes()`` entry."""
    if not entry.get("Alive") and entry["NodeID"] in _names_by_id:
        return _names_by_id[entry["NodeID"]]
    for resource in entry.get("Resources", {}):
        if resource.startswith(NAME_RESOURCE_PREFIX):
            name: str = resource.removeprefix(NAME_RESOURCE_PREFIX)
            if re.fullmatch(NODE_NAME_PATTERN, name):
                return name
    return "n" + str(entry["NodeID"])[:11]


def _nodes() -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def ensure_ledger(namespace: str) -> Any:
    """The cluster's quota ledger, started on the head node if there is none: it lives as
    long as the GCS does (a worker node's loss must not take every tenant's count with it)."""
    return (
        ray.remote(QuotaLedger)
        .options(
            name=LEDGER_NAME,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources={HEAD_RESOURCE: 0.001},
        )
        .remote()
    )


def ensure_agents(
    namespace: str, overrides: dict[str, Any], ledger: Any
) -> tuple[dict[str, Any], list[str]]:
    """Start a node agent on every live sandlot node without one; return the live nodes'
    agents by name, and the names of sandlot nodes Ray reports dead."""
    found: dict[str, Any] = {}
    dead: list[str] = []
    starting: list[tuple[str, Any, Any]] = []
    for entry in _nodes():
        if not entry.get("Alive"):
            if entry["NodeID"] in _names_by_id:  # a sandlot node we saw alive
                dead.append(node_name(entry))
            continue
        if NODE_RESOURCE not in entry.get("Resources", {}):
            continue
        name = node_name(entry)
        _names_by_id[entry["NodeID"]] = name
        try:
            found[name] = ray.get_actor(agent_name(name), namespace=namespace)
            continue
        except ValueError:
            pass  # none yet, or its old one died with the node: start one
        agent: Any = (
            ray.remote(NodeAgent)
            .options(
                name=agent_name(name),
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                resources={NODE_RESOURCE: 1},
                max_concurrency=10_000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(entry["NodeID"], soft=False),
            )
            .remote(name, overrides)
        )
        starting.append((name, agent, agent.start.remote(ledger)))
        ray.get(ledger.add_node.remote(name))
    for name, agent, started in starting:
        try:
            envelope = ray.get(started, timeout=AGENT_START_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            # A node listed alive that is dying: the next refresh sees it dead, or tries again.
            log.warning("node agent did not start", node=name, error=repr(exc))
            continue
        if envelope[0] == "ok":
            found[name] = agent
        else:
            log.warning("node agent refused to start", node=name, error=envelope[2])
    # A name that is alive again (a node that came back) is not dead.
    return found, [name for name in dead if name not in found]


def shutdown_agents(namespace: str) -> None:
    """Destroy every live node's sandboxes and end the agents and the ledger."""
    for entry in _nodes():
        if not entry.get("Alive") or NODE_RESOURCE not in entry.get("Resources", {}):
            continue
        try:
            agent = ray.get_actor(agent_name(node_name(entry)), namespace=namespace)
        except ValueError:
            continue
        ray.get(agent.shutdown.remote(), timeout=AGENT_START_TIMEOUT_S)
        ray.kill(agent)
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(LEDGER_NAME, namespace=namespace))
