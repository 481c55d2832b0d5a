"""The walls between a Ray node's sandboxes and the Ray cluster.

A networked bubblewrap sandbox reaches the outside through its host, and reaches the host at
its gateway address; on a Ray node every Ray process (GCS, raylet, object manager, workers)
listens on the node's addresses, and anyone who reaches those ports can ask to run code on
the cluster (token auth is the second wall, not the only one). So a node agent refuses:

* every new connection from the sandboxes' network to any address of the node itself (INPUT);
* every connection from the sandboxes' network to every Ray node's address (the head's GCS
  and client ports, other raylets) and to the operator's extra CIDRs (Redis, the Kubernetes
  API, cloud metadata) through the node (FORWARD), ahead of the bubblewrap backend's own
  FORWARD chain, which accepts the sandboxes' traffic out. The agent refreshes this list from
  ``ray.nodes()`` as nodes join.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from sandlot.backends import hostnet
from sandlot.backends.hostnet import BUBBLEWRAP_NET as SANDBOX_NET
from sandlot.backends.hostnet import IPTABLES
from sandlot.errors import ConfigError

CHAIN = "SANDLOT-RAY-INPUT"
FORWARD_CHAIN = hostnet.RAY_FORWARD_CHAIN  # also jumped to first from the backend's own chain


def _iptables(*rule: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([IPTABLES, "-w", *rule], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ConfigError(f"iptables {' '.join(rule)} failed: {done.stderr.strip()}")
    return done


def _can_wall() -> bool:
    if os.geteuid() != 0:
        return False
    if not Path(IPTABLES).is_file():
        raise ConfigError(f"a Ray node agent needs {IPTABLES} to wall sandboxes off Ray's ports")
    return True


def wall_off_node() -> bool:
    """Install the node's own wall (idempotent); False where no sandbox can have a network of
    its own (not root: rootless sandboxes get no network namespace from us).

    Raises:
        ConfigError: root without a working iptables: a networked sandbox could reach Ray.
    """
    if not _can_wall():
        return False
    with hostnet.walls_locked():
        _wall_node()
    return True


def _wall_node() -> None:
    net = str(SANDBOX_NET)
    _iptables("-N", CHAIN, check=False)  # fails when it exists already
    _iptables("-F", CHAIN)
    _iptables("-A", CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN")
    _iptables("-A", CHAIN, "-j", "REJECT")
    if _iptables("-C", "INPUT", "-s", net, "-j", CHAIN, check=False).returncode != 0:
        _iptables("-I", "INPUT", "1", "-s", net, "-j", CHAIN)


def parse_cidrs(text: str) -> list[str]:
    """The extra CIDRs setting as networks (``"10.0.0.5, 169.254.169.254/32"``).

    Raises:
        ConfigError: an entry that is not an IPv4 address or network.
    """
    return hostnet.parse_cidrs(text, "SANDLOT_RAY_WALL_EXTRA_CIDRS")


def cluster_targets(node_addresses: Iterable[str], extra_cidrs: Iterable[str]) -> list[str]:
    """The networks the sandboxes may not reach through the node, sorted (IPv4 only: the
    sandboxes' network has no IPv6)."""
    targets = set()
    for address in [*node_addresses, *extra_cidrs]:
        try:
            targets.add(str(ipaddress.IPv4Network(address, strict=False)))
        except ValueError:
            continue
    return sorted(targets)


def _rule(target: str) -> list[str]:
    return ["-d", target, "-j", "REJECT"]


def wall_off_cluster(targets: list[str]) -> bool:
    """Make the FORWARD wall refuse exactly ``targets`` (rules added before stale ones go,
    so no moment passes without a wall), first in FORWARD; False where it does not apply.

    Raises:
        ConfigError: root without a working iptables.
    """
    if not _can_wall():
        return False
    with hostnet.walls_locked():
        _wall_cluster(targets)
    return True


def _wall_cluster(targets: list[str]) -> None:
    net = str(SANDBOX_NET)
    _iptables("-N", FORWARD_CHAIN, check=False)
    listed = _iptables("-S", FORWARD_CHAIN).stdout.splitlines()
    have = {line.split()[3] for line in listed if line.startswith(f"-A {FORWARD_CHAIN} -d ")}
    for target in targets:
        if target not in have:
            _iptables("-A", FORWARD_CHAIN, *_rule(target))
    for target in have - set(targets):
        _iptables("-D", FORWARD_CHAIN, *_rule(target))
    # First in FORWARD, ahead of the backend's chain that accepts the sandboxes' traffic:
    # the new first jump goes in before any later one comes out.
    mine = f"-A FORWARD -s {net} -j {FORWARD_CHAIN}"
    if _iptables("-S", "FORWARD").stdout.splitlines()[1:2] != [mine]:
        _iptables("-I", "FORWARD", "1", "-s", net, "-j", FORWARD_CHAIN)
        rules = _iptables("-S", "FORWARD").stdout.splitlines()  # [0] is the policy
        for number in reversed([n for n, line in enumerate(rules) if line == mine and n > 1]):
            _iptables("-D", "FORWARD", str(number))
