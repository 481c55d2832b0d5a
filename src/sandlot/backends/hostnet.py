"""The host's walls around networked sandboxes' traffic, for every backend that routes it:
the bubblewrap backend's veth pairs (``10.231.0.0/16``, :mod:`~sandlot.backends.bubblewrap.netns`)
and the docker backend's own bridge (``10.232.0.0/16``, :mod:`~sandlot.backends.docker.network`).

Three chains, host-wide (one set for every manager on the host, as the networks are):

* ``SANDLOT-FORWARD``, first in FORWARD: nothing from one sandbox to another (either
  backend's), the bubblewrap sandboxes' traffic out accepted and their replies let in, nothing
  else in;
* ``SANDLOT-EGRESS``: the places a networked sandbox may not reach through the host
  (``SANDBOX_NETWORK_DENY_CIDRS``: by default link-local, where every cloud's metadata service
  answers with the host's credentials, and the private ranges, the host's LAN and its
  neighbours' services), except DNS to the host's own resolvers;
* ``SANDLOT-LIMIT``: how many connections a sandbox may have tracked by the host.

Docker's bridge traffic goes through Docker's own FORWARD rules, which Docker rewrites when it
likes; its sandboxes' jumps go in ``DOCKER-USER``, the chain Docker promises to run first.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import ipaddress
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import structlog

from sandlot.config import Settings, ipv4_networks
from sandlot.errors import ConfigError, SandboxStartError

log = structlog.get_logger(__name__)

IP = "/usr/sbin/ip"
IPTABLES = "/usr/sbin/iptables"
IPTABLES_RESTORE = "/usr/sbin/iptables-restore"
CONNTRACK = "/usr/sbin/conntrack"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
RESOLV_CONF = Path("/etc/resolv.conf")
# systemd-resolved's list of the servers it asks (the host's own file names its stub).
UPSTREAM_RESOLV_CONF = Path("/run/systemd/resolve/resolv.conf")
# One /30 per bubblewrap sandbox (netns.py); one address per docker container on its bridge.
BUBBLEWRAP_NET = ipaddress.IPv4Network("10.231.0.0/16")
DOCKER_NET = ipaddress.IPv4Network("10.232.0.0/16")
SANDBOX_NETS = (BUBBLEWRAP_NET, DOCKER_NET)
FORWARD_CHAIN = "SANDLOT-FORWARD"
RAY_FORWARD_CHAIN = "SANDLOT-RAY-FORWARD"  # a Ray node's cluster wall (ray/wall.py)
EGRESS_CHAIN = "SANDLOT-EGRESS"
LIMIT_CHAIN = "SANDLOT-LIMIT"
DOCKER_USER = "DOCKER-USER"
# The host's connection-tracking table (one for every namespace): each networked sandbox's
# flows are tracked in it (its masquerade needs them), and a full table drops every new
# connection of the host's, the server's included. One networked sandbox filled 255,744 of
# this host's 262,144 in 4.5 s with UDP to many addresses (2026-11-28).
CONNTRACK_MAX = Path("/proc/sys/net/netfilter/nf_conntrack_max")
# Every sandlot process that edits the host's chains (managers, Ray node agents) holds this
# lock for the whole edit: iptables -w makes each command atomic, not a read, then a write
# by position (three Ray agents on one host deleted each other's rule numbers, tests).
WALLS_LOCK = Path("/run/sandlot/walls.lock")
# How long the host keeps a closed TCP connection's entry (nf_conntrack_tcp_timeout_time_wait's
# default): connlimit counts open connections only, so closed ones are bounded by a rate.
TIME_WAIT_S = 120


@contextlib.contextmanager
def walls_locked() -> Iterator[None]:
    """Hold :data:`WALLS_LOCK` (blocking)."""
    WALLS_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(WALLS_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


@contextlib.asynccontextmanager
async def _walls_locked() -> AsyncIterator[None]:
    """:func:`walls_locked` for the event loop: the wait in a thread."""
    lock = walls_locked()
    await asyncio.to_thread(lock.__enter__)
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def parse_cidrs(text: str, setting: str) -> list[str]:
    """A comma-separated setting of IPv4 networks (``"10.0.0.5, 169.254.0.0/16"``), each
    normalized (``10.0.0.5/32``).

    Raises:
        ConfigError: an entry that is not an IPv4 address or network, naming ``setting``.
    """
    try:
        return ipv4_networks(text)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}") from exc


def sandbox_resolv_conf() -> Path:
    """The resolver file a networked sandbox gets: the host's, unless every server it names
    is on the loopback (systemd-resolved's stub at 127.0.0.53, a local dnsmasq), which a
    sandbox cannot reach (its loopback is its own): then systemd-resolved's list of the
    servers it asks, where there is one, as Docker does."""
    named = _nameservers(RESOLV_CONF)
    stub_only = bool(named) and all(address.is_loopback for address in named)
    return UPSTREAM_RESOLV_CONF if stub_only and UPSTREAM_RESOLV_CONF.is_file() else RESOLV_CONF


def resolvers() -> list[str]:
    """The IPv4 name servers a networked sandbox's ``resolv.conf`` sends it to (not the
    loopback ones: a sandbox's loopback is its own)."""
    found = []
    for address in _nameservers(sandbox_resolv_conf()):
        if not address.is_loopback and str(address) not in found:
            found.append(str(address))
    return found


def _nameservers(resolv_conf: Path) -> list[ipaddress.IPv4Address]:
    try:
        lines = resolv_conf.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for fields in (line.split() for line in lines):
        if len(fields) >= 2 and fields[0] == "nameserver":
            with contextlib.suppress(ValueError):  # IPv6: the sandboxes have none
                found.append(ipaddress.IPv4Address(fields[1]))
    return found


async def run_tool(*argv: str, stdin: str | None = None, check: bool = True) -> None:
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


async def _iptables(*args: str) -> tuple[bool, str]:
    """``iptables -w *args``: whether it succeeded, and what it printed (errors dropped:
    the callers ask a question, "is this rule there?", that a failure answers)."""
    proc = await asyncio.create_subprocess_exec(
        IPTABLES, "-w", *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return proc.returncode == 0, out.decode(errors="replace")


async def iptables_once(table: str, chain: str, *rule: str) -> None:
    """Add ``rule`` to ``chain`` where it is missing: first in a filter chain, last in nat."""
    present, _ = await _iptables("-t", table, "-C", chain, *rule)
    if not present:
        insert = ("-A", chain) if table == "nat" else ("-I", chain, "1")
        await run_tool(IPTABLES, "-w", "-t", table, *insert, *rule)


async def _replace_chains(chains: dict[str, list[tuple[str, ...]]]) -> None:
    """Make each chain hold exactly its rules, all in one ``iptables-restore`` transaction:
    a chain flushed and refilled rule by rule would let a sandbox's packets through it empty
    for a moment (another manager's sandboxes run while this one sets up)."""
    lines = ["*filter"]
    lines += [f":{name} - [0:0]" for name in chains]  # made where missing, emptied where not
    lines += [f"-A {name} {' '.join(rule)}" for name, rules in chains.items() for rule in rules]
    lines.append("COMMIT\n")
    await run_tool(IPTABLES_RESTORE, "-w", "--noflush", stdin="\n".join(lines))


def check_tools() -> None:
    for tool in (IP, IPTABLES, CONNTRACK):
        if not Path(tool).is_file():
            raise SandboxStartError(
                f"network=True needs `{tool}`: apt-get install -y iproute2 iptables conntrack"
            )


async def forget_flows(address: str) -> bool:
    """Delete the host's tracked flows from a bubblewrap sandbox's address, while its /30's
    lock is held (Docker does as much for its containers' addresses when they leave their
    network). A destroyed sandbox's flows outlived it, and the next sandbox given its /30, any
    tenant's, inherited them: counted against its connection cap (1,024 left open was every
    connect refused), and the accept rule for established flows let the dead sandbox's peers
    send into it (red team, 2026-12-07). A flow whose closing packets never left (a full send
    window) is kept 300 s, and a UDP flow for as long as its peer sends on it. Whether it
    worked (``conntrack`` says 1 where it found none to delete)."""
    proc = await asyncio.create_subprocess_exec(
        CONNTRACK, "-D", "-s", address,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode in (0, 1):
        return True
    log.warning("tracked flows not deleted", address=address, error=err.decode(errors="replace"))
    return False


async def ensure_walls(settings: Settings) -> None:
    """Under the host's walls lock: :func:`_ensure_walls`."""
    async with _walls_locked():
        await _ensure_walls(settings)


async def _ensure_walls(settings: Settings) -> None:
    """The chains every networked sandbox's traffic goes through, made or remade in one
    transaction (idempotent); the jumps to them from FORWARD and INPUT where missing. The
    last manager to call it sets the host's limits and the places denied."""
    check_tools()
    if IP_FORWARD.read_text().strip() != "1":
        log.warning("turning on IPv4 forwarding for networked sandboxes")
        IP_FORWARD.write_text("1\n")
    bubblewrap = str(BUBBLEWRAP_NET)
    nets = [str(net) for net in SANDBOX_NETS]
    between = [("-s", a, "-d", b, "-j", "DROP") for a in nets for b in nets]
    # Every packet from a bubblewrap sandbox gets its verdict in this chain (so it is counted
    # once, wherever the chain is reached from): the Ray cluster's wall, the limit, nothing
    # to another sandbox, the egress wall, then out.
    forward = [
        ("-s", bubblewrap, "-j", RAY_FORWARD_CHAIN),
        ("-s", bubblewrap, "-j", LIMIT_CHAIN),
        *between,
        ("-s", bubblewrap, "-j", EGRESS_CHAIN),
        ("-s", bubblewrap, "-j", "ACCEPT"),
        ("-d", bubblewrap, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"),
        ("-d", bubblewrap, "-j", "DROP"),
    ]  # fmt: skip
    # Ray's node agent fills its chain (ray/wall.py); made empty here where it is not.
    await run_tool(IPTABLES, "-w", "-N", RAY_FORWARD_CHAIN, check=False)
    limit = _limit_rules(settings.network_max_connections)
    egress = _egress_rules(settings.network_deny_list())
    # The host has one set of walls for every manager on it: say so when this one's differ
    # from those in place (another manager's limit or deny list is replaced by this one's).
    mark = "sandlot-walls-" + hashlib.sha256(repr((limit, egress)).encode()).hexdigest()[:12]
    before = await _marks(EGRESS_CHAIN)
    if before and mark not in before:
        log.warning(
            "networked sandboxes' walls replaced by this manager's: the host has one set, "
            "and another manager's connection cap or deny list differed "
            "(SANDBOX_NETWORK_MAX_CONNECTIONS, SANDBOX_NETWORK_DENY_CIDRS)"
        )
    await _replace_chains(
        {
            LIMIT_CHAIN: limit,
            EGRESS_CHAIN: [("-m", "comment", "--comment", mark), *egress],
            FORWARD_CHAIN: forward,
        }
    )
    # First in FORWARD, where it is missing: Docker's FORWARD policy is DROP, and its own
    # rules know no sandbox. But a dockerd started later puts its rules above it, and its
    # DOCKER chain accepted a bubblewrap sandbox's connection to a container whose port was
    # published on the host's loopback alone, past the deny list and the limit (red team,
    # 2026-12-06): so the chain is also first in DOCKER-USER, which Docker runs ahead of its
    # own rules however it rewrites them (made here where Docker has not made it yet: it
    # keeps what it finds).
    await run_tool(IPTABLES, "-w", "-N", DOCKER_USER, check=False)
    await iptables_once("filter", DOCKER_USER, "-j", FORWARD_CHAIN)
    await iptables_once("filter", "FORWARD", "-j", FORWARD_CHAIN)
    await _drop_rule("FORWARD", "-s", bubblewrap, "-j", LIMIT_CHAIN)  # now in the chain
    await iptables_once(
        "nat", "POSTROUTING", "-s", bubblewrap, "!", "-d", bubblewrap, "-j", "MASQUERADE"
    )
    await iptables_once("filter", "INPUT", "-s", bubblewrap, "-j", LIMIT_CHAIN)


async def _marks(chain: str) -> list[str]:
    """The ``sandlot-walls-*`` comments in ``chain`` (none where it is missing)."""
    _, out = await _iptables("-S", chain)
    return [word for word in out.split() if "sandlot-walls-" in word]


async def _drop_rule(chain: str, *rule: str) -> None:
    """Delete every copy of ``rule`` from ``chain`` (one a version before put there)."""
    for _ in range(16):
        deleted, _ = await _iptables("-D", chain, *rule)
        if not deleted:
            return


async def wall_docker_bridge() -> None:
    """Under the host's walls lock: :func:`_wall_docker_bridge`."""
    async with _walls_locked():
        await _wall_docker_bridge()


async def _wall_docker_bridge() -> None:
    """The docker bridge's containers through the same limit and egress chains (made by
    :func:`ensure_walls` first), from ``DOCKER-USER``, which Docker runs ahead of its own
    rules however it rewrites them, and from INPUT (their connections to the host)."""
    net, bubblewrap = str(DOCKER_NET), str(BUBBLEWRAP_NET)
    # Each goes in first: the last one added runs first. Nothing to a bubblewrap sandbox
    # (Docker's own rules, ahead of SANDLOT-FORWARD once dockerd has started, accept
    # whatever leaves its bridge: a container reached a bubblewrap sandbox's server, tests),
    # then the egress wall, then the limit.
    await iptables_once("filter", DOCKER_USER, "-s", net, "-j", EGRESS_CHAIN)
    await iptables_once("filter", DOCKER_USER, "-s", net, "-j", LIMIT_CHAIN)
    await iptables_once("filter", DOCKER_USER, "-s", net, "-d", bubblewrap, "-j", "DROP")
    await iptables_once("filter", "INPUT", "-s", net, "-j", LIMIT_CHAIN)


def _egress_rules(deny_cidrs: list[str]) -> list[tuple[str, ...]]:
    """``SANDLOT-EGRESS``: DNS to the host's resolvers passes (they sit in a private range
    as often as not: 10.255.255.53 on this VM, 169.254.169.254 on Google Cloud), then every
    network of ``deny_cidrs`` is refused (an ICMP error: a connect fails at once, not after
    its timeout)."""
    rules: list[tuple[str, ...]] = []
    for server in resolvers():
        for proto in ("udp", "tcp"):
            rules.append(("-d", server, "-p", proto, "--dport", "53", "-j", "RETURN"))
    for cidr in deny_cidrs:
        rules.append(("-d", cidr, "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"))
    return rules


def _limit_rules(per_sandbox: int) -> list[tuple[str, ...]]:
    """A networked sandbox's entries in the host's connection-tracking table, bounded.

    New connections are refused past ``per_sandbox`` open at once (``connlimit``), or past
    half of the table for all networked sandboxes together. ``connlimit`` does not count a
    closed TCP connection, whose entry the host keeps :data:`TIME_WAIT_S` more: 20,000
    connects and closes in 1.1 s left 11,000 entries past a cap of 1,024 (red team,
    2026-11-28). So new connections are also rate-limited (``hashlimit``): a 32nd of the cap
    a second for one sandbox, past a burst of the cap (its closed ones then hold ~4-8 times
    its cap at most: 32 a second for 1,024 let ~65 through a second under load, measured), and
    a quarter of the table per :data:`TIME_WAIT_S` for all together. One chain, jumped to
    from FORWARD (or ``DOCKER-USER``) and INPUT, so that each rule counts a sandbox's flows
    on both paths (a rule counts only what it has seen). A refused packet takes no entry: one
    joins the table only once its first packet has passed."""
    table = int(CONNTRACK_MAX.read_text()) if CONNTRACK_MAX.exists() else 65536
    new = ("-m", "conntrack", "--ctstate", "NEW")
    per_second = max(8, per_sandbox // 32)
    all_per_second = max(per_second, table // 4 // TIME_WAIT_S)
    # hashlimit forgets a source idle for its htable's expiry (by default one unit of the
    # rate: 1 s), and its next packet starts a full burst again: bursts 2 s apart got
    # ~500 a second past a rate of 32 (review, 2026-11-28). Kept as long as an entry is.
    # Bursts past 10,000 are refused by iptables before 1.6.1.
    keep = ("--hashlimit-htable-expire", str(TIME_WAIT_S * 1000))
    burst_one, burst_all = min(per_sandbox, 10_000), min(max(per_sandbox, table // 16), 10_000)
    # A rule whose table name is taken reuses that table, rate and burst included; the chain
    # is replaced in one transaction, so the old rule still holds it then: the name carries
    # the figures (a cap of 100 got the old cap's burst of 1,024, tests).
    one_name, all_name = f"sl1-{per_second}-{burst_one}", f"sla-{all_per_second}-{burst_all}"
    limits = (
        ("connlimit", "--connlimit-above", str(per_sandbox), "--connlimit-mask", "32"),
        ("connlimit", "--connlimit-above", str(max(per_sandbox, table // 2)),
         "--connlimit-mask", "0"),
        ("hashlimit", "--hashlimit-above", f"{per_second}/sec", "--hashlimit-burst",
         str(burst_one), "--hashlimit-mode", "srcip", "--hashlimit-name", one_name, *keep),
        ("hashlimit", "--hashlimit-above", f"{all_per_second}/sec", "--hashlimit-burst",
         str(burst_all), "--hashlimit-name", all_name, *keep),
    )  # fmt: skip
    return [(*new, "-m", match, *options, "-j", "REJECT") for match, *options in limits]
