"""The bridge a networked docker sandbox is attached to: Docker's own network ``sandlot``,
not the default bridge.

On the default bridge (as until 2026-12-06) every networked container reached every other
one, another tenant's and the host's own containers alike (inter-container traffic is on
there), each could fill the host's connection-tracking table (the bridge is the host's other
containers' too, so no cap could be put on it alone), and cloud metadata and the host's LAN
were a connect away. This bridge has inter-container traffic off, an address range of its own
(:data:`~sandlot.backends.hostnet.DOCKER_NET`) that the host's walls
(:mod:`~sandlot.backends.hostnet`) know: the same connection caps and the same refused
places as a bubblewrap sandbox's. One for every manager of the host, as those walls are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandlot.backends.docker.dockerd import LABEL
from sandlot.backends.hostnet import DOCKER_NET
from sandlot.errors import SandboxStartError

if TYPE_CHECKING:
    import docker

NETWORK = "sandlot"
BRIDGE = "sandlot0"
OPTIONS = {
    "com.docker.network.bridge.name": BRIDGE,
    "com.docker.network.bridge.enable_icc": "false",
    "com.docker.network.bridge.enable_ip_masquerade": "true",
}
# No IPv6 in a networked container either: the walls are IPv4's (hostnet.py), and a
# link-local address reaches the host's [::] services past them (bubblewrap: netns.py).
SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}


def ensure_network(client: docker.DockerClient) -> None:
    """Make the network where it is missing (another manager may make it at the same time);
    check one found by that name is ours as made here.

    Raises:
        SandboxStartError: Docker refused to make it (its range taken by another network), or
            a network of that name is not this one.
    """
    import docker.errors  # optional dependency
    from docker.types import IPAMConfig, IPAMPool

    try:
        found = client.api.inspect_network(NETWORK)
    except docker.errors.NotFound:
        try:
            client.api.create_network(
                NETWORK,
                driver="bridge",
                options=OPTIONS,
                ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=str(DOCKER_NET))]),
                enable_ipv6=False,
                labels={LABEL: "1"},
                check_duplicate=True,
            )
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: made by another manager meanwhile
                raise SandboxStartError(
                    f"could not make docker network {NETWORK!r} on {DOCKER_NET} for "
                    f"networked sandboxes: {exc.explanation or exc}"
                ) from exc
        found = client.api.inspect_network(NETWORK)
    _check(found)


def _check(found: dict[str, Any]) -> None:
    options = found.get("Options") or {}
    subnets = [c.get("Subnet") for c in (found.get("IPAM") or {}).get("Config") or []]
    if (
        found.get("Driver") != "bridge"
        or any(options.get(key) != value for key, value in OPTIONS.items())
        or subnets != [str(DOCKER_NET)]
        or found.get("EnableIPv6")
    ):
        raise SandboxStartError(
            f"docker network {NETWORK!r} exists but is not sandlot's (a bridge on "
            f"{DOCKER_NET}, inter-container traffic off, no IPv6); remove it with "
            f"`docker network rm {NETWORK}` and create the sandbox again"
        )
