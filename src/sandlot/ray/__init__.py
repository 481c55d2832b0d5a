"""sandlot on a Ray cluster (``pip install 'sandlot[ray]'``).

One node agent per node (:mod:`~sandlot.ray.node`) runs that node's SandboxManager; a
:class:`ClusterManager` routes by sandbox id (``sb-<node>-<hex>``) and places new sandboxes
(:mod:`~sandlot.ray.routing`); one ledger actor keeps tenant quotas cluster-wide. A trainer
already on the cluster uses :class:`ClusterManager` directly, without the HTTP hop::

    async with ClusterManager() as cluster:          # inside ray.init(...)
        info = await cluster.create(SandboxSpec())
        result = await cluster.run_code(info.id, RunCode(code="1 + 1"))
"""

from __future__ import annotations

from sandlot.ray.agents import shutdown_agents
from sandlot.ray.cluster import ClusterManager
from sandlot.ray.routing import NodeLoad

__all__ = ["ClusterManager", "NodeLoad", "shutdown_agents"]
