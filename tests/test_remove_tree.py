"""Deleting what sandboxed code left (``sandlot._fs.remove_tree``), and a manager that still
starts after a sandbox that made its tree deeper than Python's recursion limit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot._fs import BATCH, MAX_DEPTH, remove_tree
from sandlot.requests import RunCode, SandboxSpec
from tests import leaks
from tests.conftest import make_settings


def _deep(root: Path, depth: int) -> Path:
    """``root/a/a/...`` ``depth`` levels, made by descriptors (a path that long is too long
    for one system call)."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=fd)
            child = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)
    return root


def test_a_tree_deeper_than_the_recursion_limit_is_deleted(tmp_path: Path) -> None:
    """Failed before (red team, 2026-12-06): shutil.rmtree recursed once a level and raised
    RecursionError past ~1,000, ignore_errors or not."""
    import shutil

    tree = _deep(tmp_path / "deep", 1500)
    with pytest.raises(RecursionError):
        shutil.rmtree(tree, ignore_errors=True)
    assert remove_tree(tree) and not tree.exists()
    assert MAX_DEPTH < 1500  # it was moved up, level by level, not held open


def test_links_are_deleted_never_followed_and_other_mounts_left_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file").write_text("keep")
    tree = tmp_path / "t"
    (tree / "d" / "locked").mkdir(parents=True)
    (tree / "d" / "to-dir").symlink_to(outside / "dir")
    (tree / "d" / "to-file").symlink_to(outside / "file")
    os.link(outside / "file", tree / "d" / "hard")
    (tree / "d" / "locked" / "x").write_text("x")
    (tree / "d" / "locked").chmod(0)
    (tree / "d").chmod(0o500)
    for n in range(BATCH + 10):  # more than one batch in one directory
        (tree / f"f{n}").touch()
    mounted = tree / "mnt"
    mounted.mkdir()
    mount = os.geteuid() == 0
    if mount:
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mounted)], check=True)
        (mounted / "theirs").write_text("a mount someone made")
    try:
        gone = remove_tree(tree)
        assert (outside / "file").read_text() == "keep" and (outside / "dir").is_dir()
        if mount:  # another file system: neither emptied nor crossed, so the tree stays
            assert not gone and (mounted / "theirs").exists()
            assert sorted(p.name for p in tree.iterdir()) == ["mnt"]
        else:
            assert gone and not tree.exists()
    finally:
        if mount:
            subprocess.run(["umount", str(mounted)], check=True)
    assert remove_tree(tree) and not tree.exists()


def test_a_file_or_a_link_where_the_tree_was_is_removed_itself(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").touch()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert remove_tree(link) and not os.path.lexists(link)
    assert (target / "keep").exists()
    assert remove_tree(tmp_path / "missing")


MAKE_DEEP = """
import os
os.chdir('/workspace')
for _ in range(1500):
    os.mkdir('a')
    os.chdir('a')
"""


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_a_deep_workspace_without_a_disk_of_its_own_is_destroyed_and_swept(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before (red team, 2026-12-06): where no loop disk can be made (a container
    without /dev/loop-control), a workspace is a plain host directory; 1,500 levels of it
    failed the destroy (the directory and the sandbox's uid kept), and every later start on
    the data dir failed in recovery's sweep."""
    from sandlot.backends.bubblewrap import backend

    monkeypatch.setattr(backend, "loop_disks_available", lambda: (False, "a test: no loop"))
    settings = make_settings(data_root / "deep-workspace", backend="bubblewrap")
    async with SandboxManager(settings) as mgr:
        info = await mgr.create(SandboxSpec())
        root = leaks.sandbox_root(mgr, info.id)
        made = await mgr.run_code(info.id, RunCode(code=MAKE_DEEP, timeout_s=60))
        assert made.ok, made
        await mgr.destroy(info.id)
        await mgr.settle()
        assert not root.exists()
        # One the backend no longer knows (as a dead manager's are to the next): the sweep
        # at close (the same as recovery's at a start) deletes it.
        again = await mgr.create(SandboxSpec())
        orphan = leaks.sandbox_root(mgr, again.id)
        made = await mgr.run_code(again.id, RunCode(code=MAKE_DEEP, timeout_s=60))
        assert made.ok, made
        box = mgr._backend("bubblewrap")._boxes.pop(again.id)  # type: ignore[attr-defined]
        await mgr._backend("bubblewrap")._end_guest(box)  # type: ignore[attr-defined]
        assert orphan.exists()
    assert not orphan.exists()
    async with SandboxManager(settings) as restarted:
        assert (await restarted.create(SandboxSpec())).id


@pytest.mark.asyncio
@pytest.mark.usefixtures("root_bubblewrap")
async def test_the_files_api_removes_a_tree_deeper_than_the_recursion_limit(
    data_root: Path,
) -> None:
    """Failed before: the guest's recursive removal raised RecursionError past ~1,000
    levels, and the call failed; links inside are removed, never followed."""
    from sandlot.requests import RemoveFile, WriteFile

    async with SandboxManager(make_settings(data_root / "deep-remove")) as mgr:
        info = await mgr.create(SandboxSpec())
        made = await mgr.run_code(
            info.id,
            RunCode(code=MAKE_DEEP.replace("'a'", "'d'") + "os.symlink('/workspace/keep', 'l')\n"),
        )
        assert made.ok, made
        await mgr.write_file(info.id, WriteFile(path="keep"), b"kept")
        await mgr.remove_file(info.id, RemoveFile(path="d", recursive=True))
        listing = await mgr.run_code(
            info.id, RunCode(code="import os; sorted(os.listdir('/workspace'))")
        )
        assert listing.text == "['keep']", listing
