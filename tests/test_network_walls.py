"""Where a networked sandbox may go (``backends/hostnet.py``): out, but not to cloud metadata,
the private ranges or another sandbox, on bubblewrap and on docker's own bridge.

A "neighbour" network namespace stands in for the places around a host: one veth pair, its
far end holding a cloud metadata address (169.254.169.254), a private one (10.252.0.2) and
one the walls leave open (198.18.200.2, the benchmarking range), with one TCP server on all
three that answers "pong"."""

from __future__ import annotations

import ast
import contextlib
import ipaddress
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandlot import ConfigError, SandboxManager
from sandlot.config import DEFAULT_DENY_CIDRS, Settings
from sandlot.requests import RunCode, SandboxSpec
from tests.conftest import BACKENDS, make_settings, placement, skip_reason

IP = "/usr/sbin/ip"
METADATA, PRIVATE, OPEN = "169.254.169.254", "10.252.0.2", "198.18.200.2"
PORT = 18081
SERVE = r"""
import socket, sys, threading
servers = []
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    servers.append(s)
def serve(s):
    while True:
        conn, _ = s.accept()
        conn.sendall(b"pong")
        conn.close()
for s in servers[1:]:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("ready", flush=True)
serve(servers[0])
"""
# What a sandbox sees when it connects: "pong", or the errno's name.
CONNECT = r"""
import errno, socket
def reach(host, port):
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            return s.recv(4).decode()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc)) if exc.errno else type(exc).__name__
{{host: reach(host, port) for host, port in {targets!r}}}
"""


HTTP_GET = r"""
import errno, socket
try:
    with socket.create_connection(({host!r}, {port}), timeout=3) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        seen = s.recv(12).decode()
except OSError as exc:
    seen = errno.errorcode.get(exc.errno, repr(exc)) if exc.errno else repr(exc)
seen
"""


def _ip(*argv: str, check: bool = True) -> None:
    subprocess.run([IP, *argv], check=check, capture_output=True)


@pytest.fixture(scope="module")
def neighbour() -> Iterator[None]:
    if os.geteuid() != 0 or not Path(IP).exists():
        pytest.skip("a neighbour network namespace needs root and iproute2")
    name, veth = f"sl-neighbour-{os.getpid()}", f"slnb{os.getpid() % 100000}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        for host_side in ("169.254.169.1/24", "10.252.0.1/24", "198.18.200.1/24"):
            _ip("addr", "add", host_side, "dev", veth)
        _ip("link", "set", veth, "up")
        for far_side in (f"{METADATA}/24", f"{PRIVATE}/24", f"{OPEN}/24"):
            _ip("-n", name, "addr", "add", far_side, "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        with _serving(IP, "netns", "exec", name, sys.executable, "-c", SERVE, str(PORT), "53"):
            yield
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", name, check=False)


@contextlib.contextmanager
def _serving(*argv: str) -> Iterator[None]:
    """``argv`` (SERVE, run in whatever namespace the command enters), ready to answer."""
    server = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        yield
    finally:
        server.kill()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()


def _usable(backend: str) -> bool:
    """Asked for in this run (docker only where ``TEST_BACKENDS`` names it) and able to run."""
    return backend in BACKENDS and not skip_reason(backend)


@pytest.fixture(params=["bubblewrap", "docker"])
def networked_backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if not _usable(name):
        pytest.skip(f"{name} is not run here (TEST_BACKENDS) or cannot run")
    if os.geteuid() != 0:
        pytest.skip("networked sandboxes of their own are root's")
    return name


@contextlib.asynccontextmanager
async def _manager(data_dir: Path, **overrides: object) -> AsyncIterator[SandboxManager]:
    """A manager whose settings shape the host's walls; they go back to the defaults after
    (they are the host's, for every manager of the session)."""
    from sandlot.backends import hostnet

    async with SandboxManager(make_settings(data_dir, **overrides)) as mgr:
        try:
            yield mgr
        finally:
            await hostnet.ensure_walls(Settings(_env_file=None))  # type: ignore[call-arg]


async def _reach(mgr: SandboxManager, sandbox_id: str, *targets: tuple[str, int]) -> dict[str, str]:
    result = await mgr.run_code(sandbox_id, RunCode(code=CONNECT.format(targets=list(targets))))
    assert result.text is not None, result
    reached: dict[str, str] = ast.literal_eval(result.text)
    return reached


async def test_a_networked_sandbox_reaches_out_but_not_cloud_metadata_nor_private_ranges(
    data_root: Path, networked_backend: str, neighbour: None
) -> None:
    # Failed before (both backends): all three answered "pong". On a cloud VM the metadata
    # service hands the host's credentials to whoever asks; the private ranges are the
    # host's LAN and its neighbours' services.
    async with _manager(data_root / f"egress-{networked_backend}") as mgr:
        info = await mgr.create(SandboxSpec(**placement(networked_backend), network=True))
        reached = await _reach(mgr, info.id, (OPEN, PORT), (METADATA, PORT), (PRIVATE, PORT))
        assert reached[OPEN] == "pong", reached  # the path out works ...
        # ... and the walls refuse at once (an ICMP error, not a silent drop).
        assert reached[METADATA] == reached[PRIVATE] == "EHOSTUNREACH", reached


async def test_a_networked_sandbox_reaches_the_hosts_resolvers_for_dns_only(
    data_root: Path, monkeypatch: pytest.MonkeyPatch, neighbour: None
) -> None:
    # A resolver in a private range (this VM's is 10.255.255.53) must still answer.
    if not _usable("bubblewrap") or os.geteuid() != 0:
        pytest.skip("root's bubblewrap: its sandboxes get the host's resolv.conf")
    from sandlot.backends import hostnet

    # Where the sandbox's uid can read it: the sandbox gets this file as its resolv.conf.
    etc = data_root / "fake-etc"
    etc.mkdir(mode=0o755)
    resolv = etc / "resolv.conf"
    resolv.write_text(f"nameserver 127.0.0.53\nnameserver {PRIVATE}\nnameserver ::1\n")
    resolv.chmod(0o644)
    monkeypatch.setattr(hostnet, "RESOLV_CONF", resolv)
    assert hostnet.resolvers() == [PRIVATE]
    async with _manager(data_root / "resolver") as mgr:
        info = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
        seen = await mgr.run_code(info.id, RunCode(code="open('/etc/resolv.conf').read()"))
        assert seen.text is not None and PRIVATE in seen.text, seen
        # DNS's port on the resolver is open; the resolver's other ports are not.
        assert await _reach(mgr, info.id, (PRIVATE, 53)) == {PRIVATE: "pong"}
        assert await _reach(mgr, info.id, (PRIVATE, PORT)) == {PRIVATE: "EHOSTUNREACH"}


def test_a_host_whose_resolver_is_a_loopback_stub_gives_sandboxes_its_upstream_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ubuntu's /etc/resolv.conf names systemd-resolved's stub (127.0.0.53), which a sandbox
    # cannot reach (its loopback is its own): networked sandboxes had no DNS there.
    from sandlot.backends import hostnet

    host, upstream = tmp_path / "resolv.conf", tmp_path / "upstream.conf"
    monkeypatch.setattr(hostnet, "RESOLV_CONF", host)
    monkeypatch.setattr(hostnet, "UPSTREAM_RESOLV_CONF", upstream)
    host.write_text("nameserver 127.0.0.53\noptions edns0 trust-ad\n")
    assert hostnet.sandbox_resolv_conf() == host  # no upstream list: nothing better to give
    upstream.write_text("nameserver 10.0.0.2\nnameserver fd00::1\n")
    assert hostnet.sandbox_resolv_conf() == upstream
    assert hostnet.resolvers() == ["10.0.0.2"]  # and DNS to it is let through the walls
    host.write_text("nameserver 192.0.2.53\nnameserver 127.0.0.1\n")  # one reachable
    assert hostnet.sandbox_resolv_conf() == host
    assert hostnet.resolvers() == ["192.0.2.53"]


async def test_the_operator_can_open_the_lan_and_metadata_stays_shut(
    data_root: Path, networked_backend: str, neighbour: None
) -> None:
    async with _manager(
        data_root / f"lan-{networked_backend}", network_deny_cidrs="169.254.0.0/16"
    ) as mgr:
        info = await mgr.create(SandboxSpec(**placement(networked_backend), network=True))
        reached = await _reach(mgr, info.id, (PRIVATE, PORT), (METADATA, PORT))
        assert reached == {PRIVATE: "pong", METADATA: "EHOSTUNREACH"}, reached


PEER_SERVE = r"""
import socket, threading
s = socket.socket()
s.bind(("0.0.0.0", 18082))
s.listen(4)
def serve():
    while True:
        conn, _ = s.accept()
        conn.sendall(b"peer")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect(("198.18.0.1", 9))  # no packet: only the route, and so the source address
probe.getsockname()[0]
"""


async def test_networked_sandboxes_do_not_reach_each_other(data_root: Path) -> None:
    # Failed before on docker: the default bridge let every networked container connect to
    # every other one (another tenant's, and the host's own containers). Both backends,
    # and across them where both run.
    backends = [b for b in ("bubblewrap", "docker") if _usable(b)]
    if os.geteuid() != 0 or not backends:
        pytest.skip("networked sandboxes of their own are root's")
    async with _manager(data_root / "peers", network_deny_cidrs="") as mgr:
        made = {}
        for backend in backends:
            for role in ("peer", "attacker"):
                info = await mgr.create(SandboxSpec(**placement(backend), network=True))
                made[backend, role] = info.id
        addresses = {}
        for backend in backends:
            served = await mgr.run_code(made[backend, "peer"], RunCode(code=PEER_SERVE))
            assert served.text is not None, served
            address = ast.literal_eval(served.text)
            addresses[backend] = address
            own = await _reach(mgr, made[backend, "peer"], (address, 18082))
            assert own == {address: "peer"}, own  # it serves, to itself
        # With the deny list empty, only the wall between sandboxes stands in the way.
        for attacker in backends:
            for target, address in addresses.items():
                seen = await _reach(mgr, made[attacker, "attacker"], (address, 18082))
                assert seen[address] != "peer", (attacker, target, seen)


async def test_a_bubblewrap_sandbox_reaches_no_docker_container_whatever_the_rule_order(
    data_root: Path,
) -> None:
    # Failed before (red team, 2026-12-06): a dockerd started after the walls puts its rules
    # above SANDLOT-FORWARD, and its DOCKER chain accepted a bubblewrap sandbox's connection
    # to a container whose port was published on the host's loopback alone, past the deny
    # list and the connection cap. Docker runs DOCKER-USER first, so the chain is there too.
    if not (_usable("docker") and _usable("bubblewrap")) or os.geteuid() != 0:
        pytest.skip("needs bubblewrap and the docker backend (TEST_BACKENDS), as root")
    from sandlot.backends import hostnet
    from sandlot.backends.docker.dockerd import connect
    from sandlot.environments import get_environment

    client = connect()
    image = get_environment("python3", make_settings(data_root / "img").registry_dir).image
    web = client.containers.run(
        image,
        ["python3", "-m", "http.server", "8000"],
        detach=True,
        remove=True,
        ports={"8000/tcp": ("127.0.0.1", None)},
        labels={"sandlot-test": "1"},
    )
    try:
        web.reload()
        address = web.attrs["NetworkSettings"]["IPAddress"]
        async with _manager(data_root / "docker-order") as mgr:
            info = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
            # As after a dockerd restart: Docker's rules first, the backend's jump last.
            for verb in ("-D", "-A"):
                jump = [hostnet.IPTABLES, "-w", verb, "FORWARD", "-j", hostnet.FORWARD_CHAIN]
                subprocess.run(jump, check=True)
            for _ in range(100):  # the server in the container answers the host
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://{address}:8000/", timeout=1).close()
                    break
                time.sleep(0.1)
            get = HTTP_GET.format(host=address, port=8000)
            seen = await mgr.run_code(info.id, RunCode(code=get))
            assert seen.text == "'EHOSTUNREACH'", seen  # before: 'HTTP/1.0 200'
    finally:
        web.remove(force=True)


def test_a_deny_list_that_is_not_ipv4_networks_is_refused_naming_its_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sandlot.config import get_settings

    monkeypatch.setenv("SANDBOX_NETWORK_DENY_CIDRS", "169.254.0.0/16, metadata.internal")
    get_settings.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"metadata\.internal.*SANDBOX_NETWORK_DENY_CIDRS"):
            get_settings()
    finally:
        get_settings.cache_clear()
    monkeypatch.delenv("SANDBOX_NETWORK_DENY_CIDRS")
    assert Settings(_env_file=None).network_deny_list() == DEFAULT_DENY_CIDRS.split(",")  # type: ignore[call-arg]
    one = Settings(_env_file=None, network_deny_cidrs=" 10.0.0.5 ,")  # type: ignore[call-arg]
    assert one.network_deny_list() == ["10.0.0.5/32"]


async def test_a_networked_docker_sandbox_has_no_ipv6(data_root: Path) -> None:
    if not _usable("docker") or os.geteuid() != 0:
        pytest.skip("needs the docker backend (TEST_BACKENDS), as root")
    async with _manager(data_root / "docker-v6") as mgr:
        info = await mgr.create(SandboxSpec(backend="docker", runtime="runc", network=True))
        code = "open('/proc/net/if_inet6').read()"
        result = await mgr.run_code(info.id, RunCode(code=code))
        assert result.text == "''", result


GATEWAY = r"""
import socket
routes = [line.split() for line in open('/proc/net/route').read().splitlines()[1:]]
socket.inet_ntoa(bytes.fromhex([r[2] for r in routes if r[1] == '00000000'][0])[::-1])
"""


async def test_a_network_left_by_a_dead_manager_does_not_cut_off_the_next_sandbox_of_its_slot(
    data_root: Path,
) -> None:
    # Failed before: a manager killed with a networked sandbox leaves its namespace and the
    # host end of its veth (the namespace is bound under /run/netns). Where no manager starts
    # on its data directory again, nothing removed them, and the next sandbox given that /30
    # (by any manager: another uid range, 16,384 apart) got no network: the host routed its
    # address to the dead one's veth.
    if not _usable("bubblewrap") or os.geteuid() != 0:
        pytest.skip("networked bubblewrap sandboxes are root's")
    dead_ns, dead_veth = f"sandlot-deadbeef-sb-{os.getpid()}", f"sl{4_000_000 + os.getpid()}"[:15]
    try:
        with _serving(sys.executable, "-c", SERVE, "18083"):
            await _cut_off_by_a_dead_holder(data_root, dead_ns, dead_veth)
    finally:
        _ip("link", "del", dead_veth, check=False)
        _ip("netns", "del", dead_ns, check=False)


async def _cut_off_by_a_dead_holder(data_root: Path, dead_ns: str, dead_veth: str) -> None:
    async with _manager(data_root / "dead-slot") as mgr:
        info = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
        gateway = await mgr.run_code(info.id, RunCode(code=GATEWAY))
        assert gateway.text is not None, gateway
        # Uids are handed out in turn, and a uid's /30 is its own where free: the next
        # sandbox's gateway is the next /30's.
        address = str(ipaddress.IPv4Address(ast.literal_eval(gateway.text)) + 4)
        # What the dead manager left: a namespace, and a veth holding that /30's gateway.
        _ip("netns", "add", dead_ns)
        _ip("link", "add", dead_veth, "type", "veth", "peer", "name", "eth0", "netns", dead_ns)
        _ip("addr", "add", f"{address}/30", "dev", dead_veth)
        _ip("link", "set", dead_veth, "up")
        again = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
        assert (await mgr.run_code(again.id, RunCode(code=GATEWAY))).text == repr(address)
        reached = await _reach(mgr, again.id, (address, 18083))
        assert reached == {address: "pong"}, reached  # before: 'timed out'
        assert not Path("/sys/class/net", dead_veth).exists()
        assert not Path("/run/netns", dead_ns).exists()


# A networked sandbox's flows, one per UDP socket, to a port of the gateway nothing answers
# (each a tracked entry for 30 s); its own address, printed.
FLOWS = r"""
import resource, socket
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
routes = [line.split() for line in open('/proc/net/route').read().splitlines()[1:]]
gateway = socket.inet_ntoa(bytes.fromhex([r[2] for r in routes if r[1] == '00000000'][0])[::-1])
held = []
for port in range(40000, 40000 + {count}):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    s.sendto(b"x", (gateway, 18085))
    held.append(s)
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((gateway, 9))
probe.getsockname()[0]
"""


def _tracked_from(address: str) -> int:
    listed = subprocess.run(
        ["/usr/sbin/conntrack", "-L", "-s", address], capture_output=True, text=True, check=False
    )
    return len(listed.stdout.splitlines())


async def test_the_next_holder_of_a_slot_inherits_none_of_its_flows(data_root: Path) -> None:
    # Failed before (red team, 2026-12-07): a destroyed sandbox's tracked flows outlived it,
    # and the next sandbox given its /30 (any tenant's) inherited them: its 1,024 left open
    # counted against the next one's connection cap, whose every connect was refused, and
    # the dead sandbox's peers could still send into it (a UDP flow lives on while its peer
    # sends on it, a TCP one whose close never left 300 s).
    if not _usable("bubblewrap") or os.geteuid() != 0:
        pytest.skip("networked bubblewrap sandboxes are root's")
    # One uid: the second sandbox gets the first one's, so its /30.
    overrides = {"uid_base": 290_000, "uid_count": 1}
    with _serving(sys.executable, "-c", SERVE, "18084"):
        async with _manager(data_root / "slot-flows", **overrides) as mgr:
            first = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
            filled = await mgr.run_code(first.id, RunCode(code=FLOWS.format(count=1024)))
            assert filled.text is not None, filled
            address = ast.literal_eval(filled.text)
            # As many as the per-address rate limit let through: its bucket is the
            # address's, kept 120 s, so an earlier holder's burst leaves it short.
            assert _tracked_from(address) > 0
            await mgr.destroy(first.id)
            await mgr.settle()
            assert _tracked_from(address) == 0
            second = await mgr.create(SandboxSpec(backend="bubblewrap", network=True))
            gateway = await mgr.run_code(second.id, RunCode(code=GATEWAY))
            assert gateway.text is not None
            host = ast.literal_eval(gateway.text)
            assert str(ipaddress.IPv4Address(host) + 1) == address  # the same /30
            reached = await _reach(mgr, second.id, (host, 18084))
            assert reached == {host: "pong"}, reached  # before: ECONNREFUSED


def test_a_slot_whose_holder_died_says_its_flows_are_left(tmp_path: Path) -> None:
    # A holder that ends deletes its flows and marks its lock clean; one that dies (a crash)
    # leaves its mark, and the next holder of the /30 deletes them at create, as it does for
    # a slot it cannot vouch for: a new one, or one an older sandlot (which never deleted
    # them, and leaves the file empty) held (red team on the fixes, 2026-12-07).
    from sandlot.backends.bubblewrap import netns
    from sandlot.backends.uids import unlock

    net, fd = netns.plan("inst", "sb-1", 290_000, tmp_path)
    assert net.flows_left  # never held before: not known to be clean
    netns.mark_clean(fd)
    unlock(fd)
    clean, fd = netns.plan("inst", "sb-2", 290_000, tmp_path)
    assert clean.address == net.address and not clean.flows_left
    unlock(fd)  # died holding it: its mark stays
    again, fd = netns.plan("inst", "sb-3", 290_000, tmp_path)
    assert again.address == net.address and again.flows_left
    os.ftruncate(fd, 0)  # as an older sandlot leaves it
    unlock(fd)
    older, fd = netns.plan("inst", "sb-4", 290_000, tmp_path)
    assert older.flows_left
    unlock(fd)
