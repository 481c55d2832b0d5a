"""The workspace image's loop mount, done with LOOP_CONFIGURE + mount(2) (backends/disk.py).

Real loop devices and mounts, as root: the options the walls rely on (nosuid, nodev, ext4 of
the requested size), distinct devices for creates racing for the same free one, and no loop
device left behind once unmounted (autoclear).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from sandlot.backends import disk
from sandlot.backends.disk import create_loop_disk, loop_disks_available, unmount

pytestmark = pytest.mark.skipif(not loop_disks_available()[0], reason="needs loop devices")


def _mount_of(point: Path) -> tuple[str, str, set[str]]:
    for line in _mounts():
        device, where, fstype, options, *_ = line.split()
        if where == str(point):
            return device, fstype, set(options.split(","))
    raise AssertionError(f"{point} is not mounted")


async def _no_device_left(root: Path) -> bool:
    """Whether every loop device backed by a file below ``root`` is gone within 2 s (the
    autoclear detach runs as the last reference goes)."""
    for _ in range(100):
        if not _devices_backed_by(root):
            return True
        await asyncio.sleep(0.02)
    return not _devices_backed_by(root)


def _devices_backed_by(root: Path) -> list[str]:
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().startswith(str(root)):
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found


async def test_racing_creates_get_their_own_devices_nosuid_nodev_and_none_is_left(
    tmp_path: Path,
) -> None:
    count = 6
    points = [tmp_path / f"m{i}" for i in range(count)]
    await asyncio.gather(
        *(
            create_loop_disk(tmp_path / f"d{i}.img", point, 8, tmp_path / "t")
            for i, point in enumerate(points)
        )
    )
    try:
        mounts = [_mount_of(point) for point in points]
        assert len({device for device, _, _ in mounts}) == count, mounts
        for device, fstype, options in mounts:
            assert device.startswith("/dev/loop") and fstype == "ext4"
            assert {"nosuid", "nodev", "rw"} <= options, options
        stats = os.statvfs(points[0])
        assert 6 * 1024 * 1024 < stats.f_blocks * stats.f_frsize <= 8 * 1024 * 1024
        assert len(_devices_backed_by(tmp_path)) == count
    finally:
        for point in points:
            await unmount(point)
    assert await _no_device_left(tmp_path)


async def test_a_busy_mount_is_detached_lazily_and_its_device_freed_when_let_go(
    tmp_path: Path,
) -> None:
    point = tmp_path / "m"
    await create_loop_disk(tmp_path / "d.img", point, 8, tmp_path / "t")
    held = os.open(point / "held", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        await unmount(point)  # the open file makes the plain unmount fail with EBUSY
        assert all(line.split()[1] != str(point) for line in _mounts())
        assert len(_devices_backed_by(tmp_path)) == 1  # still held by the open file
    finally:
        os.close(held)
    assert await _no_device_left(tmp_path)


async def test_disks_copied_from_one_template_share_nothing_and_leave_it_unchanged(
    tmp_path: Path,
) -> None:
    # Every disk of a size is a copy of one empty image (disk.py): what one sandbox writes
    # must reach neither the template nor another disk, and each copy is the full size.
    templates = tmp_path / "t"
    points = [tmp_path / "a", tmp_path / "b"]
    for i, point in enumerate(points):
        await create_loop_disk(tmp_path / f"d{i}.img", point, 8, templates)
    (template,) = templates.glob("*.img")
    before = hashlib.sha256(template.read_bytes()).hexdigest()
    try:
        # ENOSPC: the copy is capped like a fresh disk.
        with open(points[0] / "fill", "wb") as f, contextlib.suppress(OSError):
            for _ in range(16):
                f.write(os.urandom(1 << 20))
        assert not (points[1] / "fill").exists()
        assert 5 * 1024 * 1024 < (points[0] / "fill").stat().st_size <= 8 * 1024 * 1024
        assert os.statvfs(points[1]).f_bfree > 0.9 * os.statvfs(points[1]).f_blocks
    finally:
        for point in points:
            await unmount(point)
    assert hashlib.sha256(template.read_bytes()).hexdigest() == before
    assert template.stat().st_mode & 0o777 == 0o600 and templates.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "d0.img").stat().st_size == 8 * 1024 * 1024
    assert not [p for p in templates.iterdir() if p.name.startswith(".")]  # no partials left


@pytest.mark.parametrize("size_mb", [64, 1024])
async def test_a_new_disk_holds_little_but_its_file_system(tmp_path: Path, size_mb: int) -> None:
    # Every create copies its template's written blocks and LOOP_CONFIGURE writes them out
    # to the host's disk (it fsyncs the backing file): with the resize inode an empty image
    # held 376 KiB at 64 MB and 656 KiB at 1 GB, without it 116 and 144. Nearly the whole
    # size stays the sandbox's: no blocks are reserved for root.
    templates = tmp_path / "t"
    point = tmp_path / "m"
    await create_loop_disk(tmp_path / "d.img", point, size_mb, templates)
    try:
        (template,) = templates.glob("*.img")
        for image in (template, tmp_path / "d.img"):
            assert image.stat().st_blocks * 512 <= 192 * 1024, image
        fs = os.statvfs(point)
        assert fs.f_bavail > 0.9 * fs.f_blocks
    finally:
        await unmount(point)


async def test_templates_made_with_other_mkfs_options_are_dropped_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A change of MKFS_ARGV (the resize inode left out) gives templates a new tag: the old
    # ones, never copied again, counted against MAX_TEMPLATES, so an upgraded data directory
    # fell back to mkfs for every create once enough of them were there (a review's find).
    monkeypatch.setattr(disk, "MAX_TEMPLATES", 2)
    templates = tmp_path / "t"
    templates.mkdir(mode=0o700)
    stale = [templates / f"ext4-{size}mb-000000000000.img" for size in (8, 9)]
    for image in stale:
        image.write_bytes(b"")
    point = tmp_path / "m"
    await create_loop_disk(tmp_path / "d.img", point, 10, templates)
    try:
        assert [p.name.split("-")[1] for p in templates.glob("*.img")] == ["10mb"]
    finally:
        await unmount(point)


async def test_past_the_template_cap_a_disk_is_made_by_mkfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One template per size asked for would let a tenant fill the data directory with them
    # (a review's find): past MAX_TEMPLATES sizes, mkfs.ext4 makes the disk itself.
    monkeypatch.setattr(disk, "MAX_TEMPLATES", 1)
    templates = tmp_path / "t"
    points = [tmp_path / "a", tmp_path / "b"]
    await create_loop_disk(tmp_path / "d0.img", points[0], 8, templates)
    await create_loop_disk(tmp_path / "d1.img", points[1], 9, templates)
    try:
        assert [p.name.split("-")[1] for p in templates.glob("*.img")] == ["8mb"]
        sizes = [os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in points]
        assert 6 << 20 < sizes[0] <= 8 << 20 < sizes[1] <= 9 << 20, sizes
    finally:
        for point in points:
            await unmount(point)


def test_a_template_is_copied_whole_where_copy_file_range_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "source"
    with open(source, "wb") as f:
        f.write(os.urandom(3 << 20))
        f.seek(9 << 20)
        f.write(b"tail")

    def refused(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refused)
    disk._sparse_copy(source, tmp_path / "copy", 16 << 20)
    copy = (tmp_path / "copy").read_bytes()
    assert len(copy) == 16 << 20 and copy[: (9 << 20) + 4] == source.read_bytes()


async def test_a_volume_is_removed_without_reading_the_mount_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mount table grows with every live sandbox (3.7 ms a read with 1,000): a destroy
    # unmounts the volume by name, busy or not, and reads it only when something else is
    # mounted below the sandbox's directory.
    root = tmp_path / "sb-1"
    await disk.make_sandbox_disk(root, 8, os.getuid(), capped=True, templates=tmp_path / "t")
    held = os.open(root / "volume" / "tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def no_table(_root: Path) -> list[Path]:
        raise AssertionError("the mount table was read")

    monkeypatch.setattr(disk, "mounted_below", no_table)
    try:
        await disk.remove_sandbox_disk(root)  # the open directory makes the plain unmount EBUSY
        assert not root.exists()
        assert all(line.split()[1] != str(root / "volume") for line in _mounts())
    finally:
        os.close(held)
    await disk.remove_sandbox_disk(root)  # idempotent
    assert await _no_device_left(tmp_path)


async def test_a_mount_someone_else_made_in_a_volume_root_is_unmounted_not_emptied(
    tmp_path: Path,
) -> None:
    # An operator's bind into a sandbox's directory (to look inside): the destroy unmounts it
    # before deleting anything, so what it shows outside survives (rmtree crosses mounts; a
    # red team's find).
    root = tmp_path / "sb-2"
    await disk.make_sandbox_disk(root, 8, os.getuid(), capped=True, templates=tmp_path / "t")
    outside = tmp_path / "operator"
    outside.mkdir()
    (outside / "notes").write_text("keep")
    (root / "other").mkdir()
    subprocess.run(["mount", "--bind", str(outside), str(root / "other")], check=True)
    await disk.remove_sandbox_disk(root)
    assert not root.exists()
    assert all(not line.split()[1].startswith(str(root)) for line in _mounts())
    assert (outside / "notes").read_text() == "keep"


def _mounts() -> list[str]:
    return Path("/proc/self/mounts").read_text().splitlines()
