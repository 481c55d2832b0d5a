"""What only the docker backend has: the seeds' container hardening, gVisor, environments from
the YAML registry, warm pools per environment, and containers that outlive a killed client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandlot import ConfigError, Sandbox, SandboxManager, SandboxStatus
from sandlot._portal import get_portal
from sandlot.backends.docker.dockerd import LABEL_INSTANCE, LABEL_SANDBOX, connect, labelled
from sandlot.requests import RunCode, SandboxSpec
from tests import leaks
from tests.conftest import EXTRA_TARGETS, LiveServer, make_settings
from tests.test_cli import _run as run_cli
from tests.test_recovery import crash_a_manager

pytestmark = pytest.mark.skipif(
    not any(t.startswith("docker") for t in EXTRA_TARGETS),
    reason="docker targets not asked for: TEST_BACKENDS=docker,docker+runsc (make test-docker)",
)
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def client() -> Any:
    return connect()


def _container(client: Any, sandbox_id: str) -> Any:
    found = labelled(client, [f"{LABEL_SANDBOX}={sandbox_id}"])
    assert len(found) == 1, found
    return found[0]


# Every instance ever seen in a data dir: a recovered one's directory is gone, and a
# container of it that survived must still count.
_INSTANCES: dict[Path, set[str]] = {}


def _ours(client: Any, data_dir: Path, *, running_only: bool = False) -> list[Any]:
    """The containers of every instance (manager) of ``data_dir``."""
    seen = _INSTANCES.setdefault(data_dir, set())
    seen.update(leaks.instance_of(d) for d in leaks.instance_dirs(data_dir))
    found = [c for name in sorted(seen) for c in labelled(client, [f"{LABEL_INSTANCE}={name}"])]
    return [c for c in found if c.status == "running"] if running_only else found


@pytest.fixture
def docker_sb(manager: SandboxManager) -> Iterator[Sandbox]:
    sb = Sandbox.create(manager=manager, backend="docker", runtime="runc", timeout_s=10)
    yield sb
    sb.kill()


def test_container_carries_the_seed_hardening(
    manager: SandboxManager, docker_sb: Sandbox, client: Any
) -> None:
    attrs = _container(client, docker_sb.id).attrs
    host, config = attrs["HostConfig"], attrs["Config"]
    limits = docker_sb.info.limits
    uid = leaks.host_uid(manager, docker_sb.id)
    # Its own host uid, from the pool bubblewrap's sandboxes draw from: not root, not shared.
    assert uid >= manager.settings.uid_base and config["User"] == f"{uid}:{uid}"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert not any("seccomp" in opt for opt in host["SecurityOpt"])  # Docker's default profile
    assert host["NetworkMode"] == "none"
    assert host["Memory"] == host["MemorySwap"] == limits.memory_mb * MiB
    assert host["NanoCpus"] == int(limits.cpu_cores * 1e9)
    assert host["PidsLimit"] == limits.pids + 2  # + the reaper loop and its sleep
    assert host["Privileged"] is False
    assert config["Labels"]["sandlot"] == "1"

    inside = docker_sb.commands.run(
        "id -u; grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status; "
        "touch /etc/x 2>&1; touch /usr/x 2>&1; touch /workspace/ok /tmp/ok && echo writable"
    )
    lines = inside.stdout.splitlines()
    assert lines[0] == str(uid)
    status = dict(line.split(":\t") for line in lines[1:4])
    assert status == {"CapEff": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}
    assert "Read-only file system" in lines[4] and "Read-only file system" in lines[5]
    assert lines[6] == "writable"
    workspace = leaks.sandbox_root(manager, docker_sb.id) / "workspace"
    assert (workspace / "ok").stat().st_uid == uid  # never root on the host either


def test_runsc_sandbox_runs_on_gvisor(manager: SandboxManager, client: Any) -> None:
    with Sandbox.create(manager=manager, backend="docker", runtime="runsc") as sb:
        assert sb.info.runtime == "runsc"
        assert _container(client, sb.id).attrs["HostConfig"]["Runtime"] == "runsc"
        # gVisor's own kernel answers uname, and logs its start in its own dmesg.
        assert sb.run_code("import platform; platform.release()").text == "'4.4.0'"
        assert "gVisor" in sb.commands.run("dmesg").stdout


def test_node_environment_from_the_registry(manager: SandboxManager) -> None:
    with Sandbox.create(manager=manager, backend="docker", environment="Node") as sb:
        assert sb.info.environment == "node"  # seed 001's name is an alias
        node = sb.commands.run("node -e 'console.log([1, 2, 3].map(x => x * 2).join())'")
        assert node.stdout == "2,4,6\n", node
        assert sb.run_code("6 * 7").text == "42"  # the guest's python is there too
    with pytest.raises(ConfigError, match="needs its own root file system"):
        Sandbox.create(manager=manager, backend="unsafe-local", environment="node")
    with pytest.raises(ConfigError, match="unknown environment"):
        Sandbox.create(manager=manager, backend="docker", environment="cobol")
    with pytest.raises(ConfigError, match="runtimes: runc, runsc"):
        Sandbox.create(manager=manager, backend="docker", runtime="kata")


def test_killed_client_leaves_the_container_running_until_destroy(
    manager: SandboxManager, docker_sb: Sandbox, client: Any
) -> None:
    """Cutting the guest's stream (what a killed Docker client does) stops nothing inside:
    the container and a daemon in it keep running. Only destroy ends them, for sure."""
    daemon = (
        "setsid sh -c 'while :; do date +%s%N > b.tmp && mv b.tmp beat; sleep 0.1; done' "
        "</dev/null >/dev/null 2>&1 &"
    )
    assert docker_sb.commands.run(daemon).ok
    container = _container(client, docker_sb.id)
    beat = leaks.sandbox_root(manager, docker_sb.id) / "workspace" / "beat"
    deadline = time.monotonic() + 10
    while not beat.exists() and time.monotonic() < deadline:  # its first beat may come late
        time.sleep(0.05)

    async def cut_the_stream() -> None:  # on the manager's loop: what a dying client does
        box = manager._backends["docker"]._boxes[docker_sb.id]  # type: ignore[attr-defined]
        box.guest.kill()

    get_portal().call(cut_the_stream())
    first = beat.read_text()
    time.sleep(0.5)
    container.reload()
    assert container.status == "running"
    assert beat.read_text() != first, "the daemon stopped with the client"

    # The manager notices the dead stream and restarts the guest; the daemon dies with it.
    assert docker_sb.run_code("1 + 1").text == "2"
    docker_sb.kill()
    # The container is gone when the kill returns (halt removes it), its directory just after.
    assert client.containers.list(all=True, filters={"id": container.id}) == []
    get_portal().call(manager.settle())
    assert not leaks.sandbox_root(manager, docker_sb.id).exists()


def test_kill_9_of_the_server_with_10_docker_sandboxes(data_root: Path, client: Any) -> None:
    data_dir = data_root / "crash-docker"
    data_dir.mkdir()
    sandboxes = crash_a_manager(data_dir, count=10, target="docker")
    ids = {s["id"] for s in sandboxes}
    (crashed,) = leaks.instance_dirs(data_dir)
    assert {p.name for p in (crashed / "docker-sandboxes").iterdir()} == ids
    # The manager is dead; its containers are not (nobody told Docker).
    running = _ours(client, data_dir, running_only=True)
    assert {c.labels[LABEL_SANDBOX] for c in running} == ids

    async def restart() -> None:
        async with SandboxManager(make_settings(data_dir)) as mgr:
            for sandbox_id in ids:
                info = await mgr.get(sandbox_id)
                assert (info.status, info.end_reason) == (SandboxStatus.DESTROYED, "recovered")
            assert _ours(client, data_dir) == []  # zero containers the store does not know
            assert leaks.instance_dirs(data_dir) == [mgr.instance_dir]  # the dead one went
            fresh = await mgr.create(SandboxSpec(backend="docker"))
            assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"

    asyncio.run(restart())
    assert _ours(client, data_dir) == []


def test_a_killed_managers_container_keeps_its_uid_from_a_running_manager(
    data_root: Path, client: Any
) -> None:
    # Failed before (read from the code, then tried): the uid's lock died with the manager,
    # its container ran on as that uid, and another manager's next sandbox got the same
    # uid, sharing the kernel's per-uid counts (processes, inotify, mqueue) with it. The
    # other manager is running before the crash, so it does not remove the container first.
    crashed_dir, other_dir = data_root / "uid-crashed", data_root / "uid-other"
    crashed_dir.mkdir()
    other_dir.mkdir()

    async def other_manager() -> None:
        async with SandboxManager(make_settings(other_dir)) as mgr:
            await mgr.create(SandboxSpec(backend="docker"))
            (left,) = await asyncio.to_thread(crash_a_manager, crashed_dir, 1, target="docker")
            uid = int(_container(client, left["id"]).attrs["Config"]["User"].split(":")[0])
            assert leaks.procs_of_uid(uid), "the container should outlive its manager"
            fresh = await mgr.create(SandboxSpec(backend="docker"))
            assert leaks.host_uid(mgr, fresh.id) != uid
            assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"

    async def recover() -> None:  # the crashed data dir's next manager removes the container
        async with SandboxManager(make_settings(crashed_dir)):
            pass

    try:
        asyncio.run(other_manager())
    finally:
        asyncio.run(recover())
    assert _ours(client, crashed_dir) == []


def test_a_killed_managers_containers_are_removed_by_the_next_manager_on_the_host(
    data_root: Path, client: Any, docker_sb: Sandbox
) -> None:
    # Failed before: they ran on, each holding its memory, CPU, processes and uid, until a
    # manager started on their own data directory again (which may be never).
    crashed_dir, other_dir = data_root / "reap-crashed", data_root / "reap-other"
    crashed_dir.mkdir()
    other_dir.mkdir()
    sandboxes = crash_a_manager(crashed_dir, count=2, target="docker")
    ids = {s["id"] for s in sandboxes}
    assert {c.labels[LABEL_SANDBOX] for c in _ours(client, crashed_dir, running_only=True)} == ids

    async def other_manager() -> None:
        async with SandboxManager(make_settings(other_dir)) as mgr:
            # Its docker backend looks when it first connects: at its first docker create.
            fresh = await mgr.create(SandboxSpec(backend="docker"))
            assert _ours(client, crashed_dir) == []
            assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"

    asyncio.run(other_manager())
    # A live manager's container is not touched (the fixture's manager runs).
    assert _container(client, docker_sb.id).status == "running"
    assert docker_sb.run_code("1 + 1").text == "2"

    async def recover() -> None:  # the dead one's own data dir still ends its records
        async with SandboxManager(make_settings(crashed_dir)) as mgr:
            for sandbox_id in ids:
                info = await mgr.get(sandbox_id)
                assert (info.status, info.end_reason) == (SandboxStatus.DESTROYED, "recovered")

    asyncio.run(recover())


def test_pools_per_environment_refill_and_survive_a_crash(data_root: Path, client: Any) -> None:
    data_dir = data_root / "pool-docker"
    data_dir.mkdir()
    pools = {"docker:python3": 2, "docker+runsc:python3": 1}
    crash_a_manager(data_dir, count=1, target="docker", pools=pools)
    # Left by the crash: the one taken and the 3 pooled (a 4th may be refilling).
    assert len(_ours(client, data_dir)) >= 4 - 1

    async def run() -> None:
        async with SandboxManager(make_settings(data_dir, pools=pools)) as mgr:
            deadline = time.monotonic() + 60
            while mgr.pooled_count() < 3:
                assert time.monotonic() < deadline, "pools did not fill"
                await asyncio.sleep(0.1)
            assert len(_ours(client, data_dir)) == 3  # never more than the pools' sizes
            pooled = {c.labels[LABEL_SANDBOX] for c in _ours(client, data_dir)}
            info = await mgr.create(SandboxSpec(backend="docker"))
            assert info.id in pooled, "create did not take a pooled container"
            gvisor = await mgr.create(SandboxSpec(backend="docker", runtime="runsc"))
            assert gvisor.id in pooled and gvisor.runtime == "runsc"
            assert (await mgr.run_code(gvisor.id, RunCode(code="1 + 1"))).text == "2"
            while mgr.pooled_count() < 3:  # refilled in the background
                assert time.monotonic() < deadline, "pools did not refill"
                await asyncio.sleep(0.1)
            assert len(_ours(client, data_dir)) == 5

    asyncio.run(run())
    assert _ours(client, data_dir) == []


def test_rest_create_takes_backend_runtime_and_environment(live_server: LiveServer) -> None:
    headers = live_server.headers("alice")
    with httpx.Client(base_url=live_server.url, headers=headers, timeout=60) as http:
        made = http.post(
            "/v1/sandboxes", json={"backend": "docker", "runtime": "runsc", "environment": "node"}
        )
        assert made.status_code == 201, made.text
        info = made.json()
        assert (info["backend"], info["runtime"], info["environment"]) == (
            "docker",
            "runsc",
            "node",
        )
        ran = http.post(f"/v1/sandboxes/{info['id']}/commands", json={"command": "node -v"})
        assert ran.json()["stdout"].startswith("v"), ran.text
        assert http.delete(f"/v1/sandboxes/{info['id']}").status_code == 200
        bad = http.post("/v1/sandboxes", json={"backend": "docker", "runtime": "kata"})
        assert bad.status_code == 422
        assert bad.json()["error"]["code"] == "invalid_config"
        legacy = http.post("/api/sessions", json={"provider": "docker", "environment": "Python3"})
        assert legacy.status_code == 200 and legacy.json()["provider"] == "docker"
        session = legacy.json()["session_id"]
        assert http.delete(f"/api/sessions/{session}").status_code == 200


def test_image_list_shows_built_environments(data_root: Path) -> None:
    # In a child process, as a user runs it: the CLI configures logging for its own process.
    listed = run_cli(["image", "ls"], data_root)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("│")[1].strip(): line for line in listed.stdout.splitlines() if "│" in line}
    assert "yes" in rows["python3"] and "yes" in rows["node"]
    built = run_cli(["image", "build", "python3"], data_root)
    assert built.returncode == 0 and "up to date" in built.stderr, built.stderr
    unknown = run_cli(["image", "build", "cobol"], data_root)
    assert unknown.returncode == 2 and "unknown environment" in unknown.stderr


INOTIFY_HOG = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 1000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
len(held)
"""


def test_one_containers_per_uid_limits_are_not_anothers(
    manager: SandboxManager, docker_sb: Sandbox
) -> None:
    # Failed before (red team, 2026-11-28): every runc container ran as uid 65534, so the
    # kernel's per-uid limits were one for all: A's 127 inotify instances left B none.
    hog = docker_sb.run_code(INOTIFY_HOG)
    assert hog.text is not None and 0 < int(hog.text) < 1000, hog  # A is at its own limit
    with Sandbox.create(manager=manager, backend="docker", runtime="runc", timeout_s=10) as other:
        assert leaks.host_uid(manager, other.id) != leaks.host_uid(manager, docker_sb.id)
        fresh = other.run_code("import ctypes\nctypes.CDLL(None).inotify_init1(0) >= 0")
        assert fresh.text == "True", fresh
