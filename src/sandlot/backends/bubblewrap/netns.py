"""A network of its own for each sandbox that asks for one: a network namespace made by root
before the sandbox starts, one veth pair to the host, routed and masqueraded out.

Why not the host's namespace (``bwrap --share-net``, as before): abstract unix sockets are
scoped by network namespace, not by file permissions, so a sandbox sharing the host's could
connect to any abstract socket of the host (``@/tmp/.X11-unix``, a D-Bus or container
runtime's) and of every other networked sandbox; and the host's loopback, with every service
bound to it (this server's own API included), was the sandbox's loopback. A seccomp rule
cannot refuse abstract addresses: the address is behind a pointer classic BPF cannot read.

Rejected: slirp4netns and pasta (user-mode networking into a fresh namespace). Neither is
installed by default, each sandbox would need one more long-lived process that parses the
sandbox's packets with root's reach into its namespace (libslirp has had several memory-safety
CVEs), that the manager must supervise and sweep after a crash, and they move every byte
through user space. A veth pair is kernel-only and costs three short ``ip`` runs per sandbox.

What a networked sandbox reaches: the outside world (NATed through the host), and the host
itself at its gateway address (like Docker's bridge gateway), not the host's loopback nor
another sandbox's address. The namespace lives as long as the sandbox (guest restarts keep
it); ``remove`` and the start-up sweep delete it with the host's end of the veth.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import structlog

from sandlot.backends.uids import lock_first_free
from sandlot.errors import SandboxStartError

log = structlog.get_logger(__name__)

# One /30 per sandbox uid (uid modulo the 16,384 it holds): the sandbox at .2, the host at .1.
SANDBOX_NET = ipaddress.IPv4Network("10.231.0.0/16")
NETNS_DIR = Path("/run/netns")
CHAIN = "SANDLOT-FORWARD"
IP = "/usr/sbin/ip"
IPTABLES = "/usr/sbin/iptables"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# The host's connection-tracking table (one for every namespace): each networked sandbox's
# flows are tracked in it (its masquerade needs them), and a full table drops every new
# connection of the host's, the server's included. One networked sandbox filled 255,744 of
# this host's 262,144 in 4.5 s with UDP to many addresses (2026-11-28).
CONNTRACK_MAX = Path("/proc/sys/net/netfilter/nf_conntrack_max")
LIMIT_CHAIN = "SANDLOT-LIMIT"


@dataclass(frozen=True)
class SandboxNet:
    name: str  # of the namespace, under /run/netns
    veth: str  # the host's end (an interface name has at most 15 characters)
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address

    @property
    def path(self) -> Path:
        return NETNS_DIR / self.name


def netns_prefix(instance: str) -> str:
    return f"sandlot-{instance}-"


def plan(instance: str, sandbox_id: str, uid: int, lock_dir: Path) -> tuple[SandboxNet, int]:
    """Names and addresses of a sandbox's network, and the fd of the lock that holds its /30
    (keep it open while the network lives). The interface is named by the sandbox's host
    uid, which no other live sandbox holds (uids are locked host-wide); the /30 is the uid's
    slot (uid modulo 16,384) or the next free one, each locked host-wide in ``lock_dir``:
    keyed by the uid alone, two managers whose uid ranges were 16,384 apart gave two
    sandboxes one address, and one received the other's replies (red team).

    Raises:
        SandboxStartError: every /30 is held.
    """
    slots = SANDBOX_NET.num_addresses // 4
    lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    taken = lock_first_free(lock_dir, ((uid + step) % slots for step in range(slots)))
    if taken is None:
        raise SandboxStartError(f"all {slots} sandbox networks of {SANDBOX_NET} are in use")
    slot, lock_fd = taken
    base = SANDBOX_NET.network_address + 4 * slot
    name = f"{netns_prefix(instance)}{sandbox_id}"
    return SandboxNet(name, f"sl{uid}", base + 2, base + 1), lock_fd


async def _run(*argv: str, stdin: str | None = None, check: bool = True) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if check and proc.returncode != 0:
        raise SandboxStartError(
            f"could not set up the sandbox's network ({' '.join(argv[:4])}): "
            f"{err.decode(errors='replace').strip()}"
        )


async def _iptables_once(table: str, chain: str, *rule: str) -> None:
    probe = await asyncio.create_subprocess_exec(
        IPTABLES, "-w", "-t", table, "-C", chain, *rule,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    if await probe.wait() != 0:
        insert = ("-A", chain) if table == "nat" else ("-I", chain, "1")
        await _run(IPTABLES, "-w", "-t", table, *insert, *rule)


async def ensure_routing(max_connections: int) -> None:
    """The host's side, shared by every networked sandbox (idempotent): forwarding on, the
    sandboxes' traffic out masqueraded, replies in, nothing from one sandbox to another nor
    from the outside in, and their tracked connections bounded (:func:`_limit_connections`)."""
    for tool in (IP, IPTABLES):
        if not Path(tool).is_file():
            raise SandboxStartError(
                f"network=True needs `{tool}`: apt-get install -y iproute2 iptables"
            )
    if IP_FORWARD.read_text().strip() != "1":
        log.warning("turning on IPv4 forwarding for networked sandboxes")
        IP_FORWARD.write_text("1\n")
    net = str(SANDBOX_NET)
    await _run(IPTABLES, "-w", "-N", CHAIN, check=False)  # fails when it exists already
    await _run(IPTABLES, "-w", "-F", CHAIN)
    rules = (
        ("-s", net, "-d", net, "-j", "DROP"),
        ("-s", net, "-j", "ACCEPT"),
        ("-d", net, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"),
        ("-d", net, "-j", "DROP"),
    )
    for rule in rules:
        await _run(IPTABLES, "-w", "-A", CHAIN, *rule)
    # First in FORWARD: Docker's FORWARD policy is DROP, and its own rules know no sandbox.
    await _iptables_once("filter", "FORWARD", "-j", CHAIN)
    await _iptables_once("nat", "POSTROUTING", "-s", net, "!", "-d", net, "-j", "MASQUERADE")
    await _limit_connections(net, max_connections)


# How long the host keeps a closed TCP connection's entry (nf_conntrack_tcp_timeout_time_wait's
# default): connlimit counts open connections only, so closed ones are bounded by a rate.
TIME_WAIT_S = 120


async def _limit_connections(net: str, per_sandbox: int) -> None:
    """A networked sandbox's entries in the host's connection-tracking table, bounded.

    New connections are refused past ``per_sandbox`` open at once (``connlimit``), or past
    half of the table for all networked sandboxes together. ``connlimit`` does not count a
    closed TCP connection, whose entry the host keeps :data:`TIME_WAIT_S` more: 20,000
    connects and closes in 1.1 s left 11,000 entries past a cap of 1,024 (red team,
    2026-11-28). So new connections are also rate-limited (``hashlimit``): a 32nd of the cap
    a second for one sandbox, past a burst of the cap (its closed ones then hold ~4-8 times
    its cap at most: 32 a second for 1,024 let ~65 through a second under load, measured), and
    a quarter of the table per :data:`TIME_WAIT_S` for all together. One chain, jumped to
    first from FORWARD and INPUT, so that each rule counts a sandbox's flows on both paths
    (a rule counts only what it has seen). A refused packet takes no entry: one joins the
    table only once its first packet has passed."""
    table = int(CONNTRACK_MAX.read_text()) if CONNTRACK_MAX.exists() else 65536
    await _run(IPTABLES, "-w", "-N", LIMIT_CHAIN, check=False)
    await _run(IPTABLES, "-w", "-F", LIMIT_CHAIN)
    new = ("-m", "conntrack", "--ctstate", "NEW")
    per_second = max(8, per_sandbox // 32)
    all_per_second = max(per_second, table // 4 // TIME_WAIT_S)
    # hashlimit forgets a source idle for its htable's expiry (by default one unit of the
    # rate: 1 s), and its next packet starts a full burst again: bursts 2 s apart got
    # ~500 a second past a rate of 32 (review, 2026-11-28). Kept as long as an entry is.
    # Bursts past 10,000 are refused by iptables before 1.6.1.
    keep = ("--hashlimit-htable-expire", str(TIME_WAIT_S * 1000))
    burst_one, burst_all = min(per_sandbox, 10_000), min(max(per_sandbox, table // 16), 10_000)
    limits = (
        ("connlimit", "--connlimit-above", str(per_sandbox), "--connlimit-mask", "32"),
        ("connlimit", "--connlimit-above", str(max(per_sandbox, table // 2)),
         "--connlimit-mask", "0"),
        ("hashlimit", "--hashlimit-above", f"{per_second}/sec", "--hashlimit-burst",
         str(burst_one), "--hashlimit-mode", "srcip", "--hashlimit-name", "sandlot-one", *keep),
        ("hashlimit", "--hashlimit-above", f"{all_per_second}/sec", "--hashlimit-burst",
         str(burst_all), "--hashlimit-name", "sandlot-all", *keep),
    )  # fmt: skip
    for match, *options in limits:
        await _run(IPTABLES, "-w", "-A", LIMIT_CHAIN, *new, "-m", match, *options, "-j", "REJECT")
    for chain in ("FORWARD", "INPUT"):
        await _iptables_once("filter", chain, "-s", net, "-j", LIMIT_CHAIN)


async def create(net: SandboxNet) -> None:
    """Make the namespace, its veth pair and routes; the sandbox joins it with ``nsenter``."""
    if Path("/sys/class/net", net.veth).exists():
        # Left by an earlier holder of this uid that was never removed (a crash).
        await _run(IP, "link", "del", net.veth, check=False)
    await _run(IP, "netns", "add", net.name)
    try:
        # No IPv6 on the link, either end (addrgenmode none: no link-local address is made,
        # and without CAP_NET_ADMIN the sandbox cannot add one). The walls are IPv4's; with
        # a link-local address a sandbox reached the host's [::] services past them, and
        # every fe80:: address is on the link, so each datagram to a new one took an entry
        # of the host-wide IPv6 neighbour table (1,024 at most; red team, 2026-11-28).
        host_side = (
            f"link add {net.veth} type veth peer name eth0 netns {net.name}\n"
            f"link set {net.veth} addrgenmode none\n"
            f"addr add {net.gateway}/30 dev {net.veth}\n"
            f"link set {net.veth} up\n"
        )
        await _run(IP, "-batch", "-", stdin=host_side)
        inside = (
            "link set eth0 addrgenmode none\n"
            f"addr add {net.address}/30 dev eth0\n"
            "link set eth0 up\n"
            "link set lo up\n"
            f"route add default via {net.gateway}\n"
        )
        await _run(IP, "-n", net.name, "-batch", "-", stdin=inside)
    except BaseException:
        await remove(net.name, net.veth)
        raise


async def remove(name: str, veth: str | None = None) -> None:
    """Delete a namespace (and the host's end of its veth, at once, so that the next holder of
    the uid can make its own); idempotent."""
    if veth is not None and Path("/sys/class/net", veth).exists():
        await _run(IP, "link", "del", veth, check=False)
    if (NETNS_DIR / name).exists():
        await _run(IP, "netns", "del", name, check=False)


def leftovers(instance: str) -> dict[str, str]:
    """Sandbox id -> namespace name, for every namespace of this backend instance."""
    prefix = netns_prefix(instance)
    with contextlib.suppress(FileNotFoundError):
        return {
            p.name.removeprefix(prefix): p.name
            for p in NETNS_DIR.iterdir()
            if p.name.startswith(prefix)
        }
    return {}
