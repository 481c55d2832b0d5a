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

What a networked sandbox reaches: the outside world (NATed through the host) but the places
``SANDBOX_NETWORK_DENY_CIDRS`` names (cloud metadata and private ranges, by default:
:mod:`~sandlot.backends.hostnet`), and the host itself at its gateway address (like Docker's
bridge gateway), not the host's loopback nor another sandbox's address. The namespace lives as
long as the sandbox (guest restarts keep it); ``remove`` and the start-up sweep delete it with
the host's end of the veth.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends.hostnet import BUBBLEWRAP_NET, IP, forget_flows, run_tool
from sandlot.backends.uids import lock_first_free
from sandlot.errors import SandboxStartError

# One /30 per sandbox uid (uid modulo the 16,384 it holds): the sandbox at .2, the host at .1.
# The host's side, shared by every networked sandbox: hostnet.py.
SANDBOX_NET = BUBBLEWRAP_NET
NETNS_DIR = Path("/run/netns")
SIOCGIFADDR = 0x8915
HOST_VETH = re.compile(r"sl\d+")
FLOWS_MARK = b"flows"
CLEAN_MARK = b"clean"


@dataclass(frozen=True)
class SandboxNet:
    name: str  # of the namespace, under /run/netns
    veth: str  # the host's end (an interface name has at most 15 characters)
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address
    # The /30's last holder is not known to have deleted its tracked flows (a crash, a new
    # slot, an older sandlot): create does.
    flows_left: bool = False

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
    # Marked while held, and "clean" once its holder has deleted its flows (mark_clean):
    # anything else, an empty file too (a new slot, or one an older sandlot held, which
    # never deleted them), may hold flows.
    flows_left = os.pread(lock_fd, len(CLEAN_MARK) + 1, 0) != CLEAN_MARK
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, FLOWS_MARK, 0)
    base = SANDBOX_NET.network_address + 4 * slot
    name = f"{netns_prefix(instance)}{sandbox_id}"
    return SandboxNet(name, f"sl{uid}", base + 2, base + 1, flows_left), lock_fd


def mark_clean(lock_fd: int) -> None:
    """Say that the /30's flows are gone (its next holder need not delete them)."""
    with contextlib.suppress(OSError):
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, CLEAN_MARK, 0)


async def create(net: SandboxNet) -> None:
    """Make the namespace, its veth pair and routes; the sandbox joins it with ``nsenter``."""
    if Path("/sys/class/net", net.veth).exists():
        # Left by an earlier holder of this uid that was never removed (a crash).
        await run_tool(IP, "link", "del", net.veth, check=False)
    for veth in stale_holders(net.gateway):
        await _remove_stale(veth)
    if net.flows_left:  # an earlier holder of the /30 may have left them
        await forget_flows(str(net.address))
    await run_tool(IP, "netns", "add", net.name)
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
        await run_tool(IP, "-batch", "-", stdin=host_side)
        inside = (
            "link set eth0 addrgenmode none\n"
            f"addr add {net.address}/30 dev eth0\n"
            "link set eth0 up\n"
            "link set lo up\n"
            f"route add default via {net.gateway}\n"
        )
        await run_tool(IP, "-n", net.name, "-batch", "-", stdin=inside)
    except BaseException:
        await remove(net.name, net.veth)
        raise


async def remove(name: str, veth: str | None = None) -> None:
    """Delete a namespace (and the host's end of its veth, at once, so that the next holder of
    the uid can make its own); idempotent."""
    if veth is not None and Path("/sys/class/net", veth).exists():
        await run_tool(IP, "link", "del", veth, check=False)
    if (NETNS_DIR / name).exists():
        await run_tool(IP, "netns", "del", name, check=False)


def stale_holders(gateway: ipaddress.IPv4Address) -> list[str]:
    """The host ends of sandbox veths (``sl<uid>``) that hold ``gateway``. The caller holds
    its /30's lock, host-wide, so any such end was left by a holder that died without its
    clean-up (a manager killed, whose data directory no manager starts on again): left, it
    kept the /30's route, and the next sandbox given the /30 had no network at all."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            if not HOST_VETH.fullmatch(name):
                continue
            request = struct.pack("256s", name.encode())
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # gone meanwhile, or no IPv4 address
            if socket.inet_ntoa(answer[20:24]) == str(gateway):
                found.append(name)
    return found


async def _remove_stale(veth: str) -> None:
    """Delete a dead holder's veth and the namespace at its other end, if it is ours."""
    proc = await asyncio.create_subprocess_exec(
        IP, "-o", "link", "show", "dev", veth,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    await run_tool(IP, "link", "del", veth, check=False)
    peer = re.search(r"link-netns (sandlot-\S+)", out.decode(errors="replace"))
    if peer is not None:
        await remove(peer.group(1))


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
