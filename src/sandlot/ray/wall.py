"""The wall between a Ray node's sandboxes and the node itself.

A networked bubblewrap sandbox reaches the outside through its host, and reaches the host at
its gateway address; on a Ray node every Ray process (GCS, raylet, object manager, workers)
listens on the node's addresses, and anyone who reaches those ports can ask to run code on
the cluster (token auth is the second wall, not the only one). So a node agent refuses every
new connection from the sandboxes' network to any address of the node (INPUT); replies to
connections the node opened, and the sandboxes' traffic to the outside (FORWARD), pass.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sandlot.backends.bubblewrap.netns import IPTABLES, SANDBOX_NET
from sandlot.errors import ConfigError

CHAIN = "SANDLOT-RAY-INPUT"


def _iptables(*rule: str, check: bool = True) -> bool:
    done = subprocess.run([IPTABLES, "-w", *rule], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ConfigError(f"iptables {' '.join(rule)} failed: {done.stderr.strip()}")
    return done.returncode == 0


def wall_off_node() -> bool:
    """Install the wall (idempotent); False where no sandbox can have a network of its own
    (not root: rootless sandboxes get no network namespace from us).

    Raises:
        ConfigError: root without a working iptables: a networked sandbox could reach Ray.
    """
    if os.geteuid() != 0:
        return False
    if not Path(IPTABLES).is_file():
        raise ConfigError(f"a Ray node agent needs {IPTABLES} to wall sandboxes off Ray's ports")
    net = str(SANDBOX_NET)
    _iptables("-N", CHAIN, check=False)  # fails when it exists already
    _iptables("-F", CHAIN)
    _iptables("-A", CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN")
    _iptables("-A", CHAIN, "-j", "REJECT")
    if not _iptables("-C", "INPUT", "-s", net, "-j", CHAIN, check=False):
        _iptables("-I", "INPUT", "1", "-s", net, "-j", CHAIN)
    return True
