"""The launch namespace (backends/bubblewrap/launchns.py): bwrap starts in a mount namespace
that holds no sandbox's volume, pinned per instance and removed at its close; the manager
attaches each sandbox's volume in the sandbox's own namespace once bwrap has made it."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from sandlot import SandboxManager
from sandlot.backends.bubblewrap import backend as bubblewrap_backend
from sandlot.backends.bubblewrap import launchns
from sandlot.requests import RunCode, RunCommand, SandboxSpec
from tests import leaks
from tests.conftest import make_settings


def _mount_points(pin: Path) -> list[str]:
    """The mount points of the namespace pinned at ``pin``, as root sees them there."""
    out = subprocess.run(
        ["/usr/bin/nsenter", f"--mount={pin}", "cat", "/proc/self/mountinfo"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[4] for line in out.splitlines()]


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_the_launch_namespace_holds_no_live_sandboxs_volume(data_root: Path) -> None:
    data_dir = data_root / "launchns"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir)) as mgr:
        pin = mgr.instance_dir / launchns.PIN
        assert not launchns.pinned(pin)  # made by the first create, not at start
        # Where each sandbox's bwrap runs, read while it does: a template's guest (the
        # default as root) joins bwrap's namespaces, and bwrap ends right after.
        backend = mgr._backend("bubblewrap")
        seen: list[int] = []
        join = backend._join

        async def recorded(template: Any, box: Any, spec: Any, chain: Any, pid: int) -> Any:
            seen.append(os.stat(f"/proc/{chain.pid}/ns/mnt").st_ino)
            return await join(template, box, spec, chain, pid)

        backend._join = recorded
        first, second = await asyncio.gather(*(mgr.create(SandboxSpec()) for _ in range(2)))
        assert launchns.pinned(pin)
        # Both bwraps started in it, the first create's too (failed before: the launcher
        # was built before the first create made the pin, and ran in the host's namespace).
        assert seen == [pin.stat().st_ino] * 2, seen
        volumes = [str(mgr.instance_dir / "sandboxes" / i.id / "volume") for i in (first, second)]
        # On the host, as before; in the launch namespace, never.
        assert all(os.path.ismount(v) for v in volumes)
        inside = _mount_points(pin)
        assert not [p for p in inside if p.startswith(str(data_root))], inside
        # Each sandbox still has its own workspace, and nothing of the other's.
        for info, other in ((first, second), (second, first)):
            got = await mgr.run_code(
                info.id,
                RunCode(
                    code="open('/workspace/me', 'w').write('x'); "
                    "open('/proc/self/mountinfo').read()"
                ),
            )
            assert got.error is None and got.text is not None
            # (The roots of its /proc masks show: the manager's shared set of files, which
            # names no sandbox; SECURITY.md.)
            assert other.id not in got.text and info.id not in got.text
            assert f"/{bubblewrap_backend.PROC_SETS_DIR}/" in got.text
        # A guest restart starts a new bwrap in the launch namespace, and its volume is
        # attached in the new sandbox namespace (a restart once found no workspace).
        guest = mgr._backend("bubblewrap")._boxes[first.id].guest
        guest.kill()
        await guest.wait()
        conn = mgr._live[first.id].conn
        for _ in range(100):  # until the manager has read the connection's end
            if conn is None or not conn.alive:
                break
            await asyncio.sleep(0.05)
        lost = await mgr.run_code(first.id, RunCode(code="1"))
        assert lost.state_lost, lost  # the death is reported; the next call restarts it
        again = await mgr.run_code(first.id, RunCode(code="open('/workspace/me').read()"))
        assert again.text == "'x'", again
        assert not [p for p in _mount_points(pin) if p.startswith(str(data_root))]
        await mgr.destroy(first.id)
        await mgr.settle()  # its volume goes after the destroy returns
        assert not os.path.exists(volumes[0])
    # Its close unpins it: nothing of the instance stays mounted.
    assert leaks.mounts_below(data_dir, pins=True) == []
    assert not pin.exists()


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
@pytest.mark.parametrize(
    "failing", ["wait_for_block", "wait_for_exec", "clone_writable", "make_sandbox_disk"]
)
async def test_a_create_that_fails_while_its_volume_is_made_or_attached_leaves_nothing(
    data_root: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The volume is made while bwrap starts, and attached once bwrap has made the sandbox's
    namespace: a start that fails at any of the three must leave no mount and no loop
    device, whichever of the two ends first. (bwrap's child is waited for at its block-fd
    where a template's guest joins it, and at its exec where the guest starts afresh.)"""
    import sandlot.backends.bubblewrap.backend as module
    import sandlot.backends.bubblewrap.launching as launching
    from sandlot.backends import mountns

    data_dir = data_root / f"launchns-fail-{failing}"
    data_dir.mkdir()
    afresh = failing == "wait_for_exec"
    async with SandboxManager(make_settings(data_dir, guest_template=not afresh)) as mgr:
        await mgr.destroy((await mgr.create(SandboxSpec())).id)  # the namespace exists
        pin = mgr.instance_dir / launchns.PIN

        def fails(*args: object, **kwargs: object) -> None:
            raise OSError(5, f"{failing} failed today")

        async def fails_later(*args: object, **kwargs: object) -> None:
            await asyncio.sleep(0.05)  # bwrap is under way by then
            fails()

        owners = {"clone_writable": mountns, "make_sandbox_disk": module}
        owner = owners.get(failing, launching)  # wait_for_block, wait_for_exec
        monkeypatch.setattr(
            owner, failing, fails_later if failing == "make_sandbox_disk" else fails
        )
        with pytest.raises(Exception, match="failed today"):
            await mgr.create(SandboxSpec())
        monkeypatch.undo()
        await mgr.settle()
        assert not [p for p in _mount_points(pin) if p.startswith(str(data_root))]
        assert leaks.mounts_below(data_dir) == []
        assert leaks.loop_devices_below(data_dir) == []
        assert list((mgr.instance_dir / "sandboxes").iterdir()) == []
        fresh = await mgr.create(SandboxSpec())
        assert (await mgr.run_code(fresh.id, RunCode(code="6 * 7"))).text == "42"


VOLUME_PROBE = """
import os, subprocess
options = {}
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    options[fields[4]] = fields[5].split(",")
open("by-the-kernel", "w").write("k")
subprocess.run(["sh", "-c", "echo s > by-a-shell; echo t > /tmp/in-tmp"], check=True)
os.getcwd(), options["/workspace"], options["/tmp"]
"""


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
@pytest.mark.parametrize("system", ["tree", "host"])
async def test_the_volume_is_attached_nosuid_nodev_and_the_guest_works_in_it(
    data_root: Path, system: str
) -> None:
    """bwrap starts the guest in an empty /workspace of the sandbox's read-only root, and the
    manager attaches the volume over it before the guest gets its key: every process of the
    sandbox must work in the volume (the supervisor kept the empty directory as its working
    directory before it changed there again on its key), with bwrap's bind's flags. On an
    environment's tree, whose /workspace is a directory of its own, and on the host's /usr
    (a fresh machine's default, no tree built), where bwrap makes it."""
    data_dir = data_root / f"volume-attached-{system}"
    data_dir.mkdir()
    extra = {} if system == "tree" else {"rootfs_dir": data_root / "no-trees"}
    async with SandboxManager(make_settings(data_dir, **extra)) as mgr:
        info = await mgr.create(SandboxSpec())
        got = await mgr.run_code(info.id, RunCode(code=VOLUME_PROBE))
        assert got.error is None and got.text is not None, got
        cwd, workspace_options, tmp_options = ast.literal_eval(got.text)
        assert cwd == "/workspace"
        for options in (workspace_options, tmp_options):
            assert {"rw", "nosuid", "nodev"} <= set(options) and "noexec" not in options
        box = mgr._backend("bubblewrap")._boxes[info.id]
        assert (box.system is None) == (system == "host"), box.system
        assert (box.workspace / "by-the-kernel").read_text() == "k"
        assert (box.workspace / "by-a-shell").read_text() == "s\n"
        assert (box.tmp / "in-tmp").read_text() == "t\n"
        shell = await mgr.run_command(info.id, RunCommand(command="pwd; echo c > by-command"))
        assert shell.stdout == "/workspace\n" and (box.workspace / "by-command").exists()
        volume = os.stat(box.workspace).st_dev
        pids = (leaks.pids_cgroup_dir(mgr, info.id) / "cgroup.procs").read_text().split()
        ours = os.stat("/proc/self/ns/pid").st_ino
        # bwrap's outer process stays in the launch namespace (and ours for pids).
        inside = [p for p in pids if os.stat(f"/proc/{p}/ns/pid").st_ino != ours]
        assert len(inside) >= 2  # the guest and its kernel
        for pid in inside:
            assert os.stat(f"/proc/{pid}/cwd").st_dev == volume, pid
        await mgr.destroy(info.id)


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_another_data_directorys_volumes_stay_out(data_root: Path) -> None:
    """A launch namespace is copied from the host's, where other managers' (other data
    directories') sandboxes have their volumes mounted: it is made without them."""
    (data_root / "other").mkdir()
    (data_root / "mine").mkdir()
    async with SandboxManager(make_settings(data_root / "other")) as other:
        theirs = await other.create(SandboxSpec())
        async with SandboxManager(make_settings(data_root / "mine")) as mine:
            await mine.create(SandboxSpec())
            inside = _mount_points(mine.instance_dir / launchns.PIN)
            assert not [p for p in inside if p.startswith(str(data_root))], inside
        assert (await other.run_code(theirs.id, RunCode(code="6 * 7"))).text == "42"


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
@pytest.mark.parametrize("launcher", ["template", "nsenter", "setpriv"])
async def test_sandbox_processes_hold_none_of_the_managers_groups(
    data_root: Path, launcher: str
) -> None:
    """The launcher drops to the sandbox's uid and gid with no supplementary group: the guest
    template's fork that execs bwrap (the default), nsenter (guests started afresh, the launch
    namespace) and setpriv (none to enter). A group of the manager's kept would open the
    host's files of that group to sandboxed code."""
    data_dir = data_root / f"groups-{launcher}"
    data_dir.mkdir()
    kept = os.getgroups()
    os.setgroups([0, 4242])  # every thread's: the launcher is forked with them
    try:
        settings = make_settings(data_dir, guest_template=launcher == "template")
        async with SandboxManager(settings) as mgr:
            backend = mgr._backend("bubblewrap")
            if launcher == "setpriv":
                backend._launch_ns_failed = True  # as where the mount API is missing
            chains: list[list[str]] = []
            build = backend._argvs.chain

            def recorded(*args: Any, **kwargs: Any) -> list[str]:
                chains.append(build(*args, **kwargs))
                return chains[-1]

            backend._argvs.chain = recorded
            bwraps: list[leaks.Proc | None] = []
            join = backend._join

            async def seen(template: Any, box: Any, spec: Any, chain: Any, pid: int) -> Any:
                bwraps.append(leaks.read_proc(chain.pid))  # bwrap, its child made
                return await join(template, box, spec, chain, pid)

            backend._join = seen
            info = await mgr.create(SandboxSpec())
            uid = leaks.host_uid(mgr, info.id)
            if launcher == "template":
                assert chains == []
                [bwrap] = bwraps
                assert bwrap is not None and bwrap.name == "bwrap", bwrap
                assert (set(bwrap.uids), set(bwrap.gids), bwrap.groups) == ({uid}, {uid}, ())
                # In the sandbox's cgroup before it ran: a destroy's emptying catches it.
                assert str(leaks.pids_cgroup_dir(mgr, info.id)).endswith(bwrap.cgroup)
            else:
                (chain,) = chains
                assert chain[chain.index("--") + 1] == f"/usr/bin/{launcher}"  # after sh's
            code = "import subprocess; subprocess.Popen(['sleep', '30'])"
            await mgr.run_code(info.id, RunCode(code=code))
            pids = (leaks.pids_cgroup_dir(mgr, info.id) / "cgroup.procs").read_text().split()
            procs = [p for p in map(leaks.read_proc, map(int, pids)) if p is not None]
            assert len(procs) >= 3  # the guest, its kernel and the sleep
            for proc in procs:
                assert set(proc.uids) == {uid} and set(proc.gids) == {uid}, proc
                assert proc.groups == (), proc
            await mgr.destroy(info.id)
    finally:
        os.setgroups(kept)


def test_unneeded_keeps_the_root_the_way_to_each_need_and_what_lies_inside() -> None:
    points = [
        "/",
        "/sys",
        "/sys/fs/cgroup/memory",
        "/usr",
        "/usr/local",
        "/dev",
        "/dev/pts",
        "/srv/data",
        "/srv/data/sandlot",
        "/var/lib/docker",
        "/usr2",
        "/etc/resolv.conf",
    ]
    needs = ["/usr", "/usr/bin/bwrap", "/dev", "/srv/data/sandlot/root", "/etc/resolv.conf"]
    assert launchns.unneeded(points, needs) == [
        "/sys",
        "/sys/fs/cgroup/memory",
        "/var/lib/docker",
        "/usr2",
    ]
    spelled_otherwise = [
        "/usr/",
        "/usr/bin/bwrap",
        "/dev/",
        "/srv/data/sandlot/root/",
        "/etc/resolv.conf",
    ]
    assert launchns.unneeded(points, spelled_otherwise) == launchns.unneeded(points, needs)
    assert launchns.unneeded(points, [*needs, "/"]) == []


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_the_hosts_other_mounts_stay_out_of_the_launch_namespace(data_root: Path) -> None:
    """A mount of the host's that no sandbox binds from (a Kubernetes node has hundreds)
    is not copied into the launch namespace, so neither bwrap's parses nor the sandbox see
    it; those on the way to or inside a path the launchers use (/, /dev/pts) are kept."""
    data_dir = data_root / "prune"
    data_dir.mkdir()
    elsewhere = Path(tempfile.mkdtemp(prefix="sandlot-prune-", dir="/var/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", elsewhere], check=True)
    try:
        async with SandboxManager(make_settings(data_dir)) as mgr:
            info = await mgr.create(SandboxSpec())
            inside = _mount_points(mgr.instance_dir / launchns.PIN)
            assert str(elsewhere) not in inside and "/sys" not in inside, inside
            assert {"/", "/proc", "/dev", "/dev/pts"} <= set(inside)
            code = f"import os; os.path.ismount({str(elsewhere)!r}), os.path.exists('/usr/bin')"
            got = await mgr.run_code(info.id, RunCode(code=code))
            assert got.text == "(False, True)"
    finally:
        subprocess.run(["umount", elsewhere], check=False)
        elsewhere.rmdir()


PIN_IN_A_CONTAINER = """
import os, sys, tempfile
from pathlib import Path
from sandlot.backends.bubblewrap import launchns
where = Path(tempfile.mkdtemp(prefix="sandlot-pins-"))
failed = []
cpus = sorted(os.sched_getaffinity(0))
for n in range(int(sys.argv[1])):
    os.sched_setaffinity(0, {cpus[n % len(cpus)]})  # its namespace made on each CPU in turn
    try:
        launchns.make(where / "pin", where, ["/usr"])
    except OSError as exc:
        failed.append(str(exc))
    launchns.drop(where / "pin")
where.rmdir()
print(len(failed), failed[:1])
"""


@pytest.mark.usefixtures("root_bubblewrap")
def test_the_launch_namespace_is_pinned_from_a_manager_in_a_namespace_of_its_own() -> None:
    """Failed before (2026-12-06, the fresh-root run's log): a manager whose own mount
    namespace is not the host's first (a container, a pod, the fresh root's bwrap) had its
    pin refused with EINVAL in 143 and 216 of 300 tries on 2 CPUs, and ran without a launch
    namespace: Linux 6.18 deals namespace ids out of per-CPU batches, and refuses to pin a
    namespace whose id is not above the pinning thread's own. A manager bound to one CPU
    (here, by turns) has its tries made on the others too."""
    import sys

    repo = Path(__file__).resolve().parent.parent
    container = [
        "bwrap", "--dev-bind", "/", "/", "--bind", "/proc", "/proc", "--unshare-ipc",
        "--die-with-parent", "--cap-add", "ALL",
    ]  # fmt: skip
    # Each container's own namespace was made on one CPU: the pins fail only on CPUs whose
    # batch is older than that one's, so several containers are tried.
    for _ in range(6):
        done = subprocess.run(
            [*container, sys.executable, "-c", PIN_IN_A_CONTAINER, "20"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(repo / "src")},
            timeout=120,
            check=True,
        )
        assert done.stdout.startswith("0 "), done.stdout + done.stderr
