"""Where a new sandbox goes: pure functions over the nodes' reported loads (no Ray here, so
the policy is unit-tested with plain values).

The policy: a node with a matching warm sandbox first (its create costs no boot); else the
less loaded of two nodes drawn at random (power of two choices: near-best balance from two
probes instead of asking every node); never a node without room for the sandbox's memory or
one more sandbox.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sandlot.errors import CapacityExhausted


@dataclass(frozen=True)
class NodeLoad:
    """What a node agent reports about itself."""

    node: str
    live: int
    max_sandboxes: int
    memory_free_mb: float
    # Warm sandboxes waiting, by pool key ("bubblewrap/python3"); only default-shaped
    # requests can take one.
    warm: dict[str, int] = field(default_factory=dict)

    def fits(self, memory_mb: float) -> bool:
        return self.live < self.max_sandboxes and self.memory_free_mb >= memory_mb

    @property
    def load(self) -> float:
        """The fuller of the two dimensions placement respects, 0 (idle) to 1 (full)."""
        return self.live / self.max_sandboxes


def choose(
    loads: list[NodeLoad],
    memory_mb: float,
    warm_key: str | None,
    rng: random.Random | None = None,
) -> NodeLoad:
    """The node for a new sandbox of ``memory_mb``; ``warm_key`` is the pool key a
    default-shaped request can take from a warm pool (None: it cannot).

    Raises:
        CapacityExhausted: no node has room (the message names the nodes and their room).
    """
    rng = rng or random.Random()  # noqa: S311 - placement, not secrets
    fitting = [load for load in loads if load.fits(memory_mb)]
    if not fitting:
        seen = ", ".join(
            f"{load.node}: {load.live}/{load.max_sandboxes} live, {load.memory_free_mb:g} MB free"
            for load in loads
        )
        raise CapacityExhausted(
            f"no cluster node has room for a sandbox of {memory_mb:g} MB ({seen or 'no nodes'});"
            " add nodes, destroy sandboxes, or raise SANDLOT_RAY_NODE_MAX_SANDBOXES"
        )
    if warm_key is not None:
        warm = [load for load in fitting if load.warm.get(warm_key, 0) > 0]
        if warm:
            return min(warm, key=lambda load: load.load)
    if len(fitting) == 1:
        return fitting[0]
    first, second = rng.sample(fitting, 2)
    return first if first.load <= second.load else second
