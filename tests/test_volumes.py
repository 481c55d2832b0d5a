"""Named volumes: files a tenant keeps across sandboxes, on real bubblewrap sandboxes.

What must hold: a volume's files survive its sandboxes and nothing else (another tenant, a
teardown, a restart of the guest) reaches them; one sandbox at a time; a cap no write passes;
the quota and the host's disk bound how many; sandboxed code cannot turn the attach into a
mount elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from sandlot import (
    ConfigError,
    QuotaExceeded,
    Sandbox,
    SandboxManager,
    Volume,
    VolumeExists,
    VolumeInUse,
    VolumeMount,
    VolumeNotFound,
)
from sandlot._portal import get_portal
from sandlot.backends import volumes as host_volumes
from sandlot.core.volumes import IMAGE, VolumeStore, tenant_dir_name
from sandlot.errors import BackendUnavailable, CapacityExhausted
from sandlot.models import Quota, volume_mounts
from sandlot.requests import SandboxSpec
from tests.conftest import EXTRA_TARGETS, LiveServer, make_settings, run_cli


def _tenant() -> str:
    return f"vol-{secrets.token_hex(4)}"


def _run(sb: Sandbox, command: str) -> str:
    result = sb.commands.run(command)
    assert result.exit_code == 0, (command, result.stdout, result.stderr)
    return result.stdout


# ---------------------------------------------------------------------- the request


@pytest.mark.parametrize(
    ("given", "normalized"),
    [
        ("/workspace/data", "/workspace/data"),
        ("data", "/workspace/data"),
        ("/workspace/a//b/", "/workspace/a/b"),
    ],
)
def test_a_mount_path_is_a_directory_under_the_workspace(given: str, normalized: str) -> None:
    assert VolumeMount(name="v", mount_path=given).mount_path == normalized


@pytest.mark.parametrize(
    "path", ["/workspace", "/etc", "/workspace/../etc", "/tmp/x", "a/../b", "/", "", "a/./b"]
)
def test_a_mount_path_outside_the_workspace_is_refused(path: str) -> None:
    with pytest.raises(ValidationError, match="under /workspace"):
        VolumeMount(name="v", mount_path=path)


@pytest.mark.parametrize("path", ["artifacts", "/workspace/artifacts", "artifacts/sub"])
def test_no_volume_is_mounted_where_the_artifacts_are_kept_from(path: str) -> None:
    # Artifacts are copied from the sandbox's own disk, within its use: a volume there kept
    # most of its files from being kept (red team, 2026-12-07).
    with pytest.raises(ValidationError, match="not be mounted at or under /workspace/artifacts"):
        SandboxSpec(volumes=[VolumeMount(name="v", mount_path=path)])
    assert SandboxSpec(volumes=[{"name": "v", "mount_path": "artifacts2"}]).volumes
    # A record that has one (made before the check) still reads: the check is the create's.
    assert VolumeMount(name="v", mount_path=path).mount_path.startswith("/workspace/artifacts")


def test_two_mounts_may_not_share_a_volume_or_nest() -> None:
    with pytest.raises(ValidationError, match="named twice"):
        SandboxSpec(
            volumes=[VolumeMount(name="a", mount_path="x"), {"name": "a", "mount_path": "y"}]
        )
    with pytest.raises(ValidationError, match="overlap"):
        SandboxSpec(volumes=[{"name": "a", "mount_path": "x"}, {"name": "b", "mount_path": "x/z"}])
    with pytest.raises(ValidationError, match="name"):
        VolumeMount(name="../x", mount_path="x")


# ---------------------------------------------------------------------- on bubblewrap


@pytest.fixture
def volumes_here(root_bubblewrap: None) -> None:
    ok, why = host_volumes.available()
    if not ok:
        pytest.skip(f"no named volumes here: {why}")


@pytest.fixture
def owner(manager: SandboxManager, volumes_here: None) -> Iterator[str]:
    tenant = _tenant()
    yield tenant
    portal = get_portal()
    portal.call(manager.settle())
    for info in portal.call(manager.list_volumes(owner=tenant)):
        portal.call(manager.delete_volume(info.name, owner=tenant))


def _create(manager: SandboxManager, owner: str, **volumes: str) -> Sandbox:
    mounts = [VolumeMount(name=name, mount_path=path) for name, path in volumes.items()]
    info = get_portal().call(manager.create(SandboxSpec(volumes=mounts), owner=owner))
    return Sandbox.connect(info.id, manager=manager)


def _volume(manager: SandboxManager, owner: str, name: str, size_mb: int = 32) -> None:
    from sandlot.requests import CreateVolume

    get_portal().call(manager.create_volume(CreateVolume(name=name, size_mb=size_mb), owner=owner))


def test_a_volumes_files_outlive_its_sandbox_and_are_the_next_ones(
    manager: SandboxManager, owner: str
) -> None:
    _volume(manager, owner, "data")
    with _create(manager, owner, data="/workspace/data") as first:
        _run(first, "echo kept > /workspace/data/note && mkdir /workspace/data/d")
        first_uid = _run(first, "stat -c %u /workspace/data/note")
    # The next sandbox has another host uid, and sees the files as its own.
    with _create(manager, owner, data="/workspace/x/y") as second:
        assert _run(second, "cat /workspace/x/y/note") == "kept\n"
        assert _run(second, "stat -c %u /workspace/x/y/note") == first_uid  # 65534 inside
        _run(second, "echo more >> /workspace/x/y/note && rmdir /workspace/x/y/d")
        # The directories made for the mount point are the sandbox's, like its workspace.
        assert _run(second, "stat -c %u /workspace/x") == first_uid
        # nosuid and nodev, as the workspace.
        options = _run(second, "grep ' /workspace/x/y ' /proc/self/mountinfo")
        assert "nosuid" in options and "nodev" in options, options
    with _create(manager, owner, data="data") as third:
        assert _run(third, "cat /workspace/data/note") == "kept\nmore\n"


def test_a_volume_is_one_sandboxs_at_a_time_and_not_deleted_under_it(
    manager: SandboxManager, owner: str
) -> None:
    _volume(manager, owner, "one")
    portal = get_portal()
    with _create(manager, owner, one="one"):
        with pytest.raises(VolumeInUse):
            _create(manager, owner, one="elsewhere")
        with pytest.raises(VolumeInUse):
            portal.call(manager.delete_volume("one", owner=owner))
        assert portal.call(manager.get_volume("one", owner=owner)).attached
    # Destroyed: free at once for the next create (no wait for the teardown).
    with _create(manager, owner, one="one"):
        pass
    portal.call(manager.delete_volume("one", owner=owner))
    with pytest.raises(VolumeNotFound):
        portal.call(manager.get_volume("one", owner=owner))


def test_another_tenants_volume_does_not_exist_for_it(manager: SandboxManager, owner: str) -> None:
    _volume(manager, owner, "mine")
    other = _tenant()
    portal = get_portal()
    with pytest.raises(VolumeNotFound):
        _create(manager, other, mine="mine")
    with pytest.raises(VolumeNotFound):  # a reader's shared lease finds it no more
        _create_ro(manager, other, "mine")
    with pytest.raises(VolumeNotFound):
        portal.call(manager.delete_volume("mine", owner=other))
    assert portal.call(manager.list_volumes(owner=other)) == []
    # The same name is another tenant's own volume, with its own files.
    _volume(manager, other, "mine")
    try:
        with _create(manager, other, mine="mine") as sb:
            assert _run(sb, "ls -A /workspace/mine") == ""
    finally:
        portal.call(manager.settle())
        portal.call(manager.delete_volume("mine", owner=other))


def test_no_write_passes_a_volumes_size(manager: SandboxManager, owner: str) -> None:
    _volume(manager, owner, "small", size_mb=16)
    with _create(manager, owner, small="small") as sb:
        result = sb.commands.run("dd if=/dev/zero of=/workspace/small/big bs=1M count=64")
        assert result.exit_code != 0
        assert "No space left" in result.stderr
        # Its workspace and the host are untouched: the rest of the sandbox still writes.
        _run(sb, "echo ok > /workspace/elsewhere")
    image = manager.settings.data_dir / "volumes" / tenant_dir_name(owner) / "small" / IMAGE
    assert image.stat().st_blocks * 512 <= 16 * 1024 * 1024


def _create_ro(manager: SandboxManager, owner: str, name: str) -> Sandbox:
    mounts = [VolumeMount(name=name, mount_path="data", read_only=True)]
    info = get_portal().call(manager.create(SandboxSpec(volumes=mounts), owner=owner))
    return Sandbox.connect(info.id, manager=manager)


def test_many_sandboxes_read_a_volume_at_once_and_none_writes_beside_them(
    manager: SandboxManager, owner: str
) -> None:
    """A dataset for many rollouts: read-only mounts of one volume share it; a writer waits
    for every reader to go, and a reader for the writer (two mounts of an ext4 where one
    writes would corrupt it)."""
    _volume(manager, owner, "shared")
    portal = get_portal()
    with _create(manager, owner, shared="data") as writer:
        _run(writer, "echo v1 > /workspace/data/f")
        with pytest.raises(VolumeInUse, match="read-write"):
            _create_ro(manager, owner, "shared")
    readers = [_create_ro(manager, owner, "shared") for _ in range(3)]
    try:
        for reader in readers:
            assert _run(reader, "cat /workspace/data/f") == "v1\n"
            assert reader.commands.run("echo x > /workspace/data/g").exit_code != 0
        assert _run(readers[0], "grep ' /workspace/data ' /proc/self/mountinfo").split()[5][:2] == (
            "ro"
        )
        with pytest.raises(VolumeInUse):
            _create(manager, owner, shared="data")
        with pytest.raises(VolumeInUse):
            portal.call(manager.delete_volume("shared", owner=owner))
        # Each reader's idmapped mount shows the files as its own sandbox user's.
        assert {_run(r, "stat -c %u /workspace/data/f") for r in readers} == {
            _run(readers[0], "id -u")
        }
        readers.pop().kill()
        with pytest.raises(VolumeInUse):
            _create(manager, owner, shared="data")  # two readers are still there
    finally:
        for reader in readers:
            reader.kill()
    # The readers gone, a writer has it again (no wait for their teardowns).
    with _create(manager, owner, shared="data") as writer:
        _run(writer, "echo v2 > /workspace/data/f")


def test_a_journal_to_replay_is_said_to_a_reader_and_a_writer_replays_it(
    manager: SandboxManager, owner: str
) -> None:
    _volume(manager, owner, "crashed")
    image = manager.settings.data_dir / "volumes" / tenant_dir_name(owner) / "crashed" / IMAGE
    # As a host crash mid-write leaves it.
    subprocess.run(
        ["debugfs", "-w", "-R", "feature needs_recovery", str(image)],
        check=True,
        capture_output=True,
    )
    from sandlot.errors import SandboxStartError

    with pytest.raises(SandboxStartError, match="journal needs replaying"):
        _create_ro(manager, owner, "crashed")
    with _create(manager, owner, crashed="data") as writer:
        _run(writer, "echo ok > /workspace/data/f")
    get_portal().call(manager.settle())
    with _create_ro(manager, owner, "crashed") as reader:
        assert _run(reader, "cat /workspace/data/f") == "ok\n"


def test_a_read_only_mount_refuses_writes(manager: SandboxManager, owner: str) -> None:
    _volume(manager, owner, "ro")
    mounts = [VolumeMount(name="ro", mount_path="ro", read_only=True)]
    portal = get_portal()
    info = portal.call(manager.create(SandboxSpec(volumes=mounts), owner=owner))
    with Sandbox.connect(info.id, manager=manager) as sb:
        result = sb.commands.run("touch /workspace/ro/x")
        assert result.exit_code != 0 and "Read-only" in result.stderr
    # The SDK's {name: path} takes ":ro" as docker's -v does (and MCP's create_sandbox).
    assert volume_mounts({"ro": "data:ro", "rw": "/workspace/w", "rw2": "x:rw"}) == [
        {"name": "ro", "mount_path": "data", "read_only": True},
        {"name": "rw", "mount_path": "/workspace/w", "read_only": False},
        {"name": "rw2", "mount_path": "x", "read_only": False},
    ]


def test_a_symlink_where_the_volume_goes_does_not_move_the_mount(
    manager: SandboxManager, owner: str
) -> None:
    """Sandboxed code plants a symlink (and a file) on the mount point's path, then breaks
    its guest so that a restart attaches the volume again: the attach never follows the
    link (nothing is mounted on what it names); the sandbox's own entries on the path are
    replaced by the mount point, and the sandbox goes on with its volume where it asked."""
    _volume(manager, owner, "trap")
    with _create(manager, owner, trap="/workspace/a/b") as sb:
        _run(sb, "echo secret > /workspace/a/b/f")
        # The mount point cannot be moved while mounted; its parent can be swapped.
        _run(sb, "mv /workspace/a /workspace/old && ln -s /usr /workspace/a")
        # What a guest the sandbox broke gets (a fork bomb, a killed supervisor): a restart.
        get_portal().call(manager._live[sb.id].drop_guest())
        assert _run(sb, "cat /workspace/a/b/f") == "secret\n"
        assert _run(sb, "test -L /workspace/a || echo dir") == "dir\n"
        # Inside the sandbox (where a followed link would have put it): nothing on /usr/b,
        # and the volume's mount is at the path asked for.
        assert _run(sb, "test -e /usr/b || echo none") == "none\n"
        assert " /workspace/a/b " in _run(sb, "cat /proc/self/mountinfo")
        # A file where a directory of the path goes.
        _run(sb, "mv /workspace/a /workspace/old2 && echo x > /workspace/a")
        get_portal().call(manager._live[sb.id].drop_guest())
        assert _run(sb, "cat /workspace/a/b/f") == "secret\n"
    with _create(manager, owner, trap="t") as again:
        assert _run(again, "cat /workspace/t/f") == "secret\n"


# ---------------------------------------------------------------------- bounds


def test_a_tenants_volumes_are_bounded_by_its_quota(tmp_path: Path, volumes_here: None) -> None:
    store = VolumeStore(tmp_path, max_volume_mb=64)
    quota = Quota(max_sandboxes=1, max_memory_mb=1, max_volumes=2, max_volume_mb=48)
    store.create("t", "a", 16, quota)
    with pytest.raises(VolumeExists):
        store.create("t", "a", 16, quota)
    with pytest.raises(QuotaExceeded, match="48 MB"):
        store.create("t", "b", 40, quota)
    store.create("t", "b", 16, quota)
    with pytest.raises(QuotaExceeded, match="2 volumes"):
        store.create("t", "c", 8, quota)
    with pytest.raises(ConfigError, match="SANDBOX_MAX_VOLUME_MB"):
        store.create("u", "big", 65, None)
    assert [v.name for v in store.list("t")] == ["a", "b"]
    assert store.list("u") == []


def test_a_lease_and_a_delete_of_one_volume_never_interleave(
    tmp_path: Path, volumes_here: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red team: a lease that opened the volume's lock file, then was delayed before its
    flock, while the tenant deleted the volume and made one of the same name, locked the
    old file and got the new image: a second lease of it was granted (two loop devices on
    one ext4 image). The lease's open and flock now happen under the tenant's lock."""
    import fcntl
    import threading

    import sandlot.core.volumes as core_volumes

    store = VolumeStore(tmp_path, max_volume_mb=64)
    store.create("t", "v", 8, None)
    real_flock = fcntl.flock
    in_window, go_on = threading.Event(), threading.Event()

    def slow_flock(fd: int, op: int) -> None:
        if threading.current_thread().name == "leaser" and op & fcntl.LOCK_NB:
            in_window.set()
            go_on.wait(10)
        real_flock(fd, op)

    monkeypatch.setattr(core_volumes.fcntl, "flock", slow_flock)
    leased: list[object] = []
    leaser = threading.Thread(
        target=lambda: leased.append(store.lease("t", [VolumeMount(name="v", mount_path="v")])),
        name="leaser",
    )
    leaser.start()
    assert in_window.wait(10)
    outcome: list[BaseException | None] = []

    def delete() -> None:
        try:
            store.delete("t", "v")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    deleter = threading.Thread(target=delete)
    deleter.start()
    deleter.join(0.3)
    assert deleter.is_alive()  # waits for the lease, instead of slipping in between
    go_on.set()
    leaser.join(10)
    deleter.join(10)
    assert isinstance(outcome[0], VolumeInUse)
    with pytest.raises(VolumeInUse):
        store.lease("t", [VolumeMount(name="v", mount_path="w")])
    leased[0].release()  # type: ignore[attr-defined]


def test_a_volume_that_cannot_be_made_is_a_typed_error(
    tmp_path: Path, volumes_here: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    store = VolumeStore(tmp_path, max_volume_mb=64)
    with pytest.raises(ConfigError, match="8 to 64 MB"):
        store.create("t", "tiny", 7, None)  # under 2 MB mkfs.ext4 makes no journal

    def full(image: Path, size_mb: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host_volumes, "mkfs_volume", full)
    with pytest.raises(CapacityExhausted, match="no room"):
        store.create("t", "v", 8, None)
    assert store.list("t") == []  # nothing half-made is left


async def test_a_create_cancelled_while_it_takes_its_lease_holds_no_volume(
    data_root: Path, volumes_here: None
) -> None:
    """Red team: the lease is taken in a thread; a create cancelled meanwhile (the tenant's
    lock held a moment by another of its calls) left a lease nobody held, and the volume was
    "in use" until the process ended."""
    import fcntl

    from sandlot.core.volumes import DIR_LOCK, VOLUMES_DIR

    data_dir = data_root / f"cancel-{secrets.token_hex(3)}"
    manager = SandboxManager(make_settings(data_dir))
    await manager.start()
    try:
        from sandlot.requests import CreateVolume

        await manager.create_volume(CreateVolume(name="v", size_mb=8), owner="t")
        lock = data_dir / VOLUMES_DIR / tenant_dir_name("t") / DIR_LOCK
        fd = os.open(lock, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another call of the tenant's, under way
        spec = SandboxSpec(volumes=[VolumeMount(name="v", mount_path="v")])
        create = asyncio.create_task(manager.create(spec, owner="t"))
        await asyncio.sleep(0.3)
        create.cancel()
        with pytest.raises(asyncio.CancelledError):
            await create
        os.close(fd)  # that call ends; the cancelled create's thread takes the lease now
        await asyncio.sleep(0.3)
        info = await manager.create(spec, owner="t")  # was: volume_in_use, for good
        await manager.destroy(info.id)
        await manager.settle()
        await manager.delete_volume("v", owner="t")
    finally:
        await manager.close()


def test_volumes_never_promise_more_disk_than_the_host_has(
    tmp_path: Path, volumes_here: None
) -> None:
    """Sparse images could all fill up at once: a new volume needs room for itself and for
    every volume's unwritten part."""
    small = tmp_path / "fs.img"
    small.write_bytes(b"")
    subprocess.run(["truncate", "-s", "200M", str(small)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(small)], check=True)
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(small), str(mount)], check=True)
    try:
        store = VolumeStore(mount, max_volume_mb=1000)
        store.create("t", "a", 100, None)
        with pytest.raises(CapacityExhausted, match="no room on the host's disk"):
            store.create("t", "b", 100, None)
        store.delete("t", "a")
        store.create("t", "b", 100, None)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def small_disk(data_root: Path, volumes_here: None) -> Iterator[Path]:
    """A data directory on a file system of its own, 300 MB (sandbox uids can walk in)."""
    image = data_root / f"small-{secrets.token_hex(4)}.img"
    subprocess.run(["truncate", "-s", "300M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    mount = data_root / f"small-{secrets.token_hex(4)}"
    mount.mkdir(mode=0o711)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    mount.chmod(0o711)
    try:
        yield mount / "data"
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        image.unlink()


def _small_manager(data_dir: Path, ledger: Path | None = None) -> SandboxManager:
    extra = {"host_ledger_dir": ledger} if ledger is not None else {}
    manager = SandboxManager(make_settings(data_dir, disk_mb=16, max_disk_mb=1000, **extra))
    get_portal().call(manager.start())
    return manager


def _capacity_mb(manager: SandboxManager) -> float:
    return manager._capacity.disk_mb


def test_volumes_and_sandbox_disks_share_one_count_of_the_disk(small_disk: Path) -> None:
    """A volume and a sandbox's disk are sparse files on one disk, either may fill: each is
    counted at its full size against the same room. Counted apart, a volume and a sandbox
    each passed its own check, filled the disk together, and the volume's ext4 was
    corrupted, another sandbox's writes were lost and the store could write nothing (red
    team, 2026-12-07)."""
    from sandlot.requests import CreateVolume

    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        room = _capacity_mb(manager)
        assert 200 < room < 300
        # A volume first: the sandboxes' disks get what is left of the room.
        portal.call(manager.create_volume(CreateVolume(name="big", size_mb=150)))
        with pytest.raises(CapacityExhausted, match="named volumes 150"):
            portal.call(manager.create(SandboxSpec(disk_mb=int(room - 150) + 8)))
        live = portal.call(manager.create(SandboxSpec(disk_mb=int(room - 150) - 24)))
        # A sandbox's disk counts against a new volume, as the volumes count against it.
        with pytest.raises(CapacityExhausted, match="no room on the host's disk"):
            portal.call(manager.create_volume(CreateVolume(name="more", size_mb=40)))
        portal.call(manager.create_volume(CreateVolume(name="small", size_mb=16)))
        portal.call(manager.destroy(live.id))
        portal.call(manager.settle())
        # Its disk is the room's again.
        portal.call(manager.create_volume(CreateVolume(name="more", size_mb=40)))
    finally:
        portal.call(manager.close())


def test_a_volumes_written_part_is_not_counted_twice_after_a_restart(small_disk: Path) -> None:
    """The free space a manager measures at its start leaves out what the volumes hold
    already; counted at their full size beside it, that part is given back."""
    from sandlot.requests import CreateVolume

    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        room = _capacity_mb(manager)
        portal.call(manager.create_volume(CreateVolume(name="filled", size_mb=120)))
        mounts = [VolumeMount(name="filled", mount_path="v")]
        info = portal.call(manager.create(SandboxSpec(volumes=mounts)))
        sb = Sandbox.connect(info.id, manager=manager)
        _run(sb, "dd if=/dev/urandom of=v/data bs=1M count=100 conv=fsync status=none")
        sb.kill()
    finally:
        portal.call(manager.close())
    manager = _small_manager(small_disk)
    try:
        # The same room as before the volume was filled, within a few MB of metadata.
        assert abs(_capacity_mb(manager) - room) < 12
        portal.call(manager.create(SandboxSpec(disk_mb=int(room - 120) - 16)))
    finally:
        portal.call(manager.close())


def test_two_data_directories_on_one_disk_count_each_others_volumes(small_disk: Path) -> None:
    """Two data directories' managers on one file system (one host ledger, as
    /run/sandlot/reserved is): one's volumes and the other's disks fill the same disk. Each
    counted only its own volumes: a 500 MB volume and a 700 MB disk were admitted on 900 MB
    free, and the volume's ext4 was corrupted (red team, 2026-12-07)."""
    from sandlot.requests import CreateVolume

    portal = get_portal()
    ledger = small_disk.parent / "ledger"
    a = _small_manager(small_disk.parent / "a", ledger)
    b = _small_manager(small_disk.parent / "b", ledger)
    try:
        room = _capacity_mb(b)
        portal.call(a.create_volume(CreateVolume(name="a-vol", size_mb=150)))
        with pytest.raises(CapacityExhausted):
            portal.call(b.create(SandboxSpec(disk_mb=int(room - 150) + 8)))
        disk = portal.call(b.create(SandboxSpec(disk_mb=int(room - 150) - 40)))
        # And the other way: B's disk counts against a volume of A's.
        with pytest.raises(CapacityExhausted, match="no room on the host's disk"):
            portal.call(a.create_volume(CreateVolume(name="more", size_mb=60)))
        portal.call(b.destroy(disk.id))
        portal.call(b.settle())
        portal.call(a.delete_volume("a-vol"))
        # The volume deleted, B has the room again.
        portal.call(b.create(SandboxSpec(disk_mb=int(room - 150) + 8)))
    finally:
        portal.call(a.close())
        portal.call(b.close())


def test_what_was_written_since_the_start_is_room_no_more(small_disk: Path) -> None:
    """The count against the start's free space misses what is written outside it since:
    kept artifacts (a tenant's 380 MB of them, then a disk admitted to the room they took,
    whose fill corrupted another tenant's volume: red team, 2026-12-07), the store, other
    programs. Each create also measures the disk as it is now."""
    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        room = _capacity_mb(manager)
        info = portal.call(manager.create(SandboxSpec(disk_mb=120)))
        sb = Sandbox.connect(info.id, manager=manager)
        _run(sb, "mkdir -p artifacts && head -c 100M /dev/urandom > artifacts/kept.bin")
        sb.kill()  # its artifacts are kept in the data directory: 100 MB of the disk
        portal.call(manager.settle())
        assert [a.size_bytes for a in sb.artifacts()] == [100 << 20]
        with pytest.raises(CapacityExhausted, match="MB free now"):
            portal.call(manager.create(SandboxSpec(disk_mb=int(room) - 60)))
        portal.call(manager.create(SandboxSpec(disk_mb=int(room) - 130)))
    finally:
        portal.call(manager.close())


def test_a_data_directorys_volumes_count_after_the_manager_that_made_them_ends(
    small_disk: Path,
) -> None:
    """Each manager kept its own data directory's volume totals in the ledger; one that made
    a volume and ended took the volume out of every other data directory's count, and the
    disk filled under it (red team, 2026-12-07). The totals are read from the data
    directory itself now."""
    from sandlot.requests import CreateVolume

    portal = get_portal()
    ledger = small_disk.parent / "ledger"
    a1 = _small_manager(small_disk.parent / "a", ledger)
    a2 = _small_manager(small_disk.parent / "a", ledger)
    b = _small_manager(small_disk.parent / "b", ledger)
    try:
        room = _capacity_mb(b)
        portal.call(a2.create_volume(CreateVolume(name="kept", size_mb=150)))
        portal.call(a2.close())
        with pytest.raises(CapacityExhausted):
            portal.call(b.create(SandboxSpec(disk_mb=int(room - 150) + 8)))
    finally:
        for manager in (a1, a2, b):
            portal.call(manager.close())


def test_a_disks_written_part_is_not_counted_twice(small_disk: Path) -> None:
    """The free space leaves out what a live disk has written, and its reservation counted
    it again: a tenant writing within its own disk took twice that of the host's room, and a
    create that fit was refused (red team, 2026-12-07)."""
    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        writer = Sandbox.connect(
            portal.call(manager.create(SandboxSpec(disk_mb=150))).id, manager=manager
        )
        _run(writer, "head -c 110M /dev/zero > big && sync")
        # Counted twice, nothing more fit; counted once, 60 MB does.
        portal.call(manager.create(SandboxSpec(disk_mb=60)))
        writer.kill()
    finally:
        portal.call(manager.close())


def test_artifacts_are_kept_only_where_the_disk_has_room_for_them(small_disk: Path) -> None:
    """A destroy copies its artifacts out while its disk still holds them: 270 MB copied so
    filled the disk under another tenant's volume (red team, 2026-12-07). An export holds
    room on the disk first, and keeps what fits, smallest first."""
    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        other = portal.call(manager.create(SandboxSpec(disk_mb=60)))  # may fill at any time
        sb = Sandbox.connect(
            portal.call(manager.create(SandboxSpec(disk_mb=150))).id, manager=manager
        )
        _run(
            sb,
            "mkdir -p artifacts && head -c 1M /dev/urandom > artifacts/small"
            " && head -c 120M /dev/urandom > artifacts/big",
        )
        sb.kill()
        portal.call(manager.settle())
        assert [a.path for a in sb.artifacts()] == ["small"]
        # What the other sandbox was promised is still there to write.
        fs = os.statvfs(small_disk)
        assert fs.f_bavail * fs.f_frsize >= 60 << 20
        portal.call(manager.destroy(other.id))
    finally:
        portal.call(manager.close())


def test_a_crashed_managers_artifacts_are_kept_only_where_the_disk_has_room(
    small_disk: Path,
) -> None:
    """A manager that recovers a crashed one's sandboxes copies their artifacts while their
    disks still hold them; unbounded by the disk, 371 MB so copied took the room another
    manager's volume was promised, and its writes failed (red team, 2026-12-07)."""
    from sandlot.requests import CreateVolume
    from tests.test_recovery import crash_a_manager

    portal = get_portal()
    small_disk.mkdir()
    big = "import os\nopen('artifacts/big.bin', 'wb').write(os.urandom(50 << 20))"
    crashed = crash_a_manager(small_disk, count=1, extra=big)
    live = _small_manager(small_disk)  # recovers the crashed one's sandbox at its start
    live_ids = {a.path for a in portal.call(live.list_artifacts(crashed[0]["id"]))}
    assert "big.bin" in live_ids  # room enough then: kept
    portal.call(live.close())

    survivor = _small_manager(small_disk)
    try:
        fs = os.statvfs(small_disk)
        free_mb = fs.f_bavail * fs.f_frsize / (1 << 20)
        # Promised to a volume: all that is free past the slack but a disk of 64 MB and 10.
        size = int(free_mb - survivor._capacity.disk_slack_mb - 74)
        portal.call(survivor.create_volume(CreateVolume(name="promised", size_mb=size)))
        crashed = crash_a_manager(small_disk, count=1, extra=big)
        recovering = _small_manager(small_disk)
        kept = {a.path for a in portal.call(recovering.list_artifacts(crashed[0]["id"]))}
        assert "out.txt" in kept and "big.bin" not in kept
        fs = os.statvfs(small_disk)
        assert fs.f_bavail * fs.f_frsize >= size << 20  # the volume can still be filled
        portal.call(recovering.close())
    finally:
        portal.call(survivor.close())


def test_kept_artifacts_pay_for_their_inodes_and_directories(small_disk: Path) -> None:
    """Empty files cost an export nothing: 10,000 of them 8 deep took 138 MB and every inode
    of the data directory's file system at 0 bytes charged (red team, 2026-12-07). Each kept
    file now costs its blocks, one more, and a block for each directory above it, and an
    export takes of the host's disk its content and at most as much again; it leaves a tenth
    of the inodes."""
    portal = get_portal()
    manager = _small_manager(small_disk)
    try:
        info = portal.call(manager.create(SandboxSpec(disk_mb=64)))
        sb = Sandbox.connect(info.id, manager=manager)
        _run(
            sb,
            "cd /workspace && for i in $(seq 2000); do mkdir -p artifacts/$i/a/b; "
            ": > artifacts/$i/a/b/f; done",
        )
        used = portal.call(manager.usage(info.id)).disk_used_bytes
        assert used is not None
        before = os.statvfs(small_disk).f_ffree
        sb.kill()
        portal.call(manager.settle())
        kept = portal.call(manager.list_artifacts(info.id))
        taken = sum(1 for _ in (small_disk / "artifacts" / info.id).rglob("*"))
        # Each kept file took its inode and at most its three directories', all paid for.
        assert taken <= 4 * len(kept)
        # The host's disk it took: its content and at most as much again (at least 1 MiB).
        assert len(kept) * 4 * 4096 <= used + max(used, 1 << 20) + 4096
        assert 0 < len(kept) < 2000
        assert os.statvfs(small_disk).f_ffree >= before - taken
    finally:
        portal.call(manager.close())


def test_a_backend_without_volumes_says_so(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d", backend="unsafe-local")
    portal = get_portal()
    manager = SandboxManager(settings)
    portal.call(manager.start())
    try:
        from sandlot.requests import CreateVolume

        portal.call(manager.create_volume(CreateVolume(name="v", size_mb=8)))
        spec = SandboxSpec(volumes=[VolumeMount(name="v", mount_path="v")])
        with pytest.raises(BackendUnavailable, match="named volumes are not available"):
            portal.call(manager.create(spec))
        # The refused create held nothing: the volume is free.
        portal.call(manager.delete_volume("v"))
    finally:
        portal.call(manager.close())


# ---------------------------------------------------------------------- over the API


def test_volumes_over_rest_are_the_keys_tenants(
    live_server: LiveServer, volumes_here: None
) -> None:
    url = live_server.url
    alice, bob = live_server.headers("alice"), live_server.headers("bob")
    name = f"r{secrets.token_hex(3)}"
    with httpx.Client(base_url=url, timeout=60) as http:
        # No key, a bad key: nothing of any route; a viewer: nothing that writes.
        bad = {"Authorization": "Bearer asb_not-a-key"}
        for headers in ({}, bad):
            assert http.post("/v1/volumes", json={"name": name}, headers=headers).status_code == 401
            assert http.get("/v1/volumes", headers=headers).status_code == 401
            assert http.get(f"/v1/volumes/{name}", headers=headers).status_code == 401
            assert http.delete(f"/v1/volumes/{name}", headers=headers).status_code == 401
        viewer = live_server.headers("viewer")
        assert http.post("/v1/volumes", json={"name": name}, headers=viewer).status_code == 403
        made = http.post("/v1/volumes", json={"name": name, "size_mb": 16}, headers=alice)
        assert made.status_code == 201, made.text
        again = http.post("/v1/volumes", json={"name": name}, headers=alice)
        assert again.status_code == 409 and again.json()["error"]["code"] == "volume_exists"
        bad = http.post("/v1/volumes", json={"name": "../x"}, headers=alice)
        assert bad.status_code == 422
        assert http.get(f"/v1/volumes/{name}", headers=bob).status_code == 404
        own = http.get(f"/v1/volumes/{name}", headers=alice)
        assert own.status_code == 200 and own.json()["size_mb"] == 16
        assert name not in [v["name"] for v in http.get("/v1/volumes", headers=bob).json()]
        body = {"volumes": [{"name": name, "mount_path": "/workspace/v"}]}
        refused = http.post("/v1/sandboxes", json=body, headers=bob)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "volume_not_found"
        created = http.post("/v1/sandboxes", json=body, headers=alice)
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        assert http.delete(f"/v1/volumes/{name}", headers=viewer).status_code == 403
        busy = http.delete(f"/v1/volumes/{name}", headers=alice)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "volume_in_use"
        assert http.delete(f"/v1/sandboxes/{sandbox_id}", headers=alice).status_code == 200
        assert http.delete(f"/v1/volumes/{name}", headers=bob).status_code == 404
        assert http.delete(f"/v1/volumes/{name}", headers=alice).status_code == 204
    # The SDK against the same server.
    remote = {"api_url": url, "api_key": live_server.keys["alice"]}
    Volume.create(name, size_mb=16, **remote)
    with Sandbox.create(volumes={name: "/workspace/v"}, **remote) as sb:
        _run(sb, "echo hi > /workspace/v/f")
    with Sandbox.create(volumes={name: "w"}, **remote) as sb:
        assert _run(sb, "cat /workspace/w/f") == "hi\n"
    assert [v.name for v in Volume.list(**remote) if v.name == name] == [name]
    assert Volume.get(name, **remote).used_bytes > 0
    Volume.delete(name, **remote)


# ---------------------------------------------------------------------- on docker


@pytest.mark.skipif(
    not any(t.startswith("docker") for t in EXTRA_TARGETS),
    reason="docker targets run with TEST_BACKENDS=docker,... (make test-docker)",
)
def test_docker_runc_attaches_volumes_and_its_teardown_leaves_their_files(
    manager: SandboxManager, owner: str
) -> None:
    """On runc the volume is bound from a host directory of the sandbox's (``vol-<i>``);
    the container's removal and the directory's teardown leave the volume's files whole,
    for the next sandbox."""
    _volume(manager, owner, "dv")
    portal = get_portal()
    spec = SandboxSpec(
        backend="docker", runtime="runc", volumes=[VolumeMount(name="dv", mount_path="a/v")]
    )
    info = portal.call(manager.create(spec, owner=owner))
    with Sandbox.connect(info.id, manager=manager) as sb:
        _run(sb, "echo kept > /workspace/a/v/f")
        assert "idmapped" in _run(sb, "grep ' /workspace/a/v ' /proc/self/mountinfo")
        assert int(_run(sb, "id -u")) != 65534  # docker runs as the sandbox's host uid
        # The way to the mount point is the sandbox's, as on bubblewrap (red team: runc
        # made it root's).
        _run(sb, "touch /workspace/a/mine")
    portal.call(manager.settle())
    info = portal.call(manager.create(spec, owner=owner))
    with Sandbox.connect(info.id, manager=manager) as sb:
        assert _run(sb, "cat /workspace/a/v/f") == "kept\n"


@pytest.mark.skipif(
    "docker+runsc" not in EXTRA_TARGETS, reason="runs with TEST_BACKENDS=...,docker+runsc"
)
def test_docker_runsc_refuses_volumes_rather_than_failing_every_write(
    manager: SandboxManager, owner: str
) -> None:
    """gVisor's gofer reaches a bind as root, which an idmapped mount does not map: every
    write failed with EOVERFLOW (measured 2026-12-07). So it is refused, saying why."""
    _volume(manager, owner, "gv")
    spec = SandboxSpec(
        backend="docker", runtime="runsc", volumes=[VolumeMount(name="gv", mount_path="v")]
    )
    with pytest.raises(BackendUnavailable, match="runsc"):
        get_portal().call(manager.create(spec, owner=owner))


def test_the_cli_makes_lists_attaches_and_removes_volumes(
    live_server: LiveServer, volumes_here: None
) -> None:
    env = {
        **os.environ,
        "SANDLOT_URL": live_server.url,
        "SANDLOT_API_KEY": live_server.keys["bob"],
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, *args)

    name = f"c{secrets.token_hex(3)}"
    made_volume = cli("volume", "create", name, "--size-mb", "16", "--json")
    assert json.loads(made_volume.stdout)["size_mb"] == 16, made_volume.stderr
    got = cli("volume", "get", name, "--json")
    assert json.loads(got.stdout)["attached"] is False, got.stderr
    listed = cli("volume", "ls", "--json")
    assert name in [v["name"] for v in json.loads(listed.stdout)], listed.stderr
    bad = cli("sandbox", "create", "--volume", f"{name}:/etc")
    assert bad.returncode == 2 and "--volume" in bad.stderr and "/workspace" in bad.stderr
    made = cli("sandbox", "create", "--volume", f"{name}:/workspace/v:ro")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.strip()
    wrote = cli("sandbox", "exec", sandbox_id, "touch /workspace/v/x")
    assert wrote.returncode != 0 and "Read-only" in wrote.stderr
    busy = cli("volume", "rm", name)
    assert busy.returncode == 2 and "attached" in busy.stderr
    assert cli("sandbox", "rm", sandbox_id).returncode == 0
    assert cli("volume", "rm", name).returncode == 0
    gone = cli("volume", "rm", name)
    assert gone.returncode == 2 and "no volume" in gone.stderr


async def test_an_mcp_client_attaches_its_tenants_volume(
    live_server: LiveServer, volumes_here: None
) -> None:
    """An agent over MCP keeps files across sessions: ``create_sandbox`` takes volumes,
    as the key's tenant's (another tenant's name is not found)."""
    from tests.test_mcp import http_session, texts

    name = f"m{secrets.token_hex(3)}"
    remote = {"api_url": live_server.url, "api_key": live_server.keys["alice"]}
    Volume.create(name, size_mb=16, **remote)
    try:
        url = live_server.url + "/mcp"
        for text in ("first", "second"):
            async with http_session(url, live_server.headers("alice")) as session:
                made = await session.call_tool("create_sandbox", {"volumes": {name: "mem"}})
                assert not made.is_error, texts(made)
                sandbox_id = texts(made)[0]
                ran = await session.call_tool(
                    "run_command",
                    {"command": f"cat mem/log; echo {text} >> mem/log", "sandbox_id": sandbox_id},
                )
                seen = "\n".join(texts(ran))
                assert ("first" in seen) == (text == "second"), seen
                await session.call_tool("destroy_sandbox", {"sandbox_id": sandbox_id})
        async with http_session(url, live_server.headers("alice")) as session:
            made = await session.call_tool("create_sandbox", {"volumes": {name: "mem:ro"}})
            sandbox_id = texts(made)[0]
            ran = await session.call_tool(
                "run_command", {"command": "echo x >> mem/log", "sandbox_id": sandbox_id}
            )
            assert "Read-only" in "\n".join(texts(ran)), texts(ran)
            await session.call_tool("destroy_sandbox", {"sandbox_id": sandbox_id})
        async with http_session(url, live_server.headers("bob")) as session:
            refused = await session.call_tool("create_sandbox", {"volumes": {name: "mem"}})
            assert refused.is_error and "no volume" in "\n".join(texts(refused))
    finally:
        await asyncio.to_thread(Volume.delete, name, **remote)
