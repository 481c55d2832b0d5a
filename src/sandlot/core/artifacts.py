"""Artifacts: what a sandbox leaves in /workspace/artifacts, kept on the host after it ends.

They are copied out through the guest, which only sees the sandbox's own view, so paths and
sizes come from inside the sandbox and are treated as hostile.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import itertools
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from sandlot._fs import remove_tree
from sandlot.backends.disk import disk_used_bytes
from sandlot.core.files import read_through
from sandlot.core.live import Live
from sandlot.core.store import BLOCK_BYTES, PENDING_ARTIFACT_TTL_S, Store, artifact_charge
from sandlot.errors import SandboxError, SandboxFileNotFound
from sandlot.guest.ops import Op
from sandlot.models import ArtifactInfo, Quota, SandboxInfo

log = structlog.get_logger(__name__)

ARTIFACTS_DIR = "artifacts"
# Holds room on the host's disk for an export that may copy up to the bytes given, for the
# block: the bytes it may copy (the manager's count of the disk, creates._disk_for_artifacts).
DiskRoom = Callable[[int], contextlib.AbstractContextManager[int]]
# Copies under way, beside the sandboxes' directories (whose names are sandbox ids): a name
# next to the kept files (``.<name>.partial``) could be an artifact's own, and the copy
# replaced that artifact, leaving its record with no file (red team, 2026-11-25).
STAGING_DIR = ".staging"
# Sets being deleted: out of reach first (a rename), then their rows, then their files. Rows
# first let a crash between the two (a kill -9, the OOM killer) leave a set's files with no
# row and no charge, for good: 0.86 s for 8,176 files (red team, 2026-12-07). Swept by every
# reaper pass, as the staging copies are.
TRASH_DIR = ".trash"
MIB = 1 << 20
# What any export may take of the host's disk beyond its content (a few hundred small files).
MIN_EXPORT_BYTES = MIB
# Artifacts are read through the guest, which sandboxed code can slow down: bound the wait.
# A crashed manager's orphans are read on the host, within the same time.
EXPORT_TIMEOUT_S = 60.0
# Files one sandbox may leave kept: each is a row, an inode and a file the host serves and
# expires, whatever its size (red team, 2026-12-06: 11,000 empty files a sandbox).
MAX_KEPT_FILES = 10_000

# The most sandboxes whose artifacts one reaper pass deletes for the records cap
# (Artifacts.delete_beyond): a store from before the cap counted them may hold 262,144 of a
# tenant's (red team, 2026-12-06), and a pass that deleted them all would hold back the
# next one, and the expiries it finds.
DELETED_BEYOND_A_PASS = 1000


class _Skips:
    """Files of one export not kept: the first few logged each, the rest counted in one line
    at the end (the sandbox chooses how many there are: 11,000 over the quota logged 11,000
    lines a destroy, red team 2026-12-06)."""

    LOGGED = 5

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        self.count = 0

    def add(self, why: str, **detail: Any) -> None:
        self.count += 1
        if self.count <= self.LOGGED:
            log.warning(f"artifact not kept: {why}", sandbox=self.sandbox_id, **detail)

    def close(self) -> None:
        if self.count > self.LOGGED:
            log.warning(
                "artifacts not kept", sandbox=self.sandbox_id, more=self.count - self.LOGGED
            )


async def _budget(live: Live) -> int:
    """What one export may read in all: the sandbox's disk size, or what its disk really
    holds where the backend says (a sparse file reads as its whole size in zeros, which the
    sandbox never paid for)."""
    try:
        used = (await live.backend.usage(live.id)).disk_used_bytes
    except (SandboxError, OSError):
        used = None
    return live.disk_bytes if used is None else min(live.disk_bytes, used)


def _host_budget(info: SandboxInfo, workspace: Path) -> int:
    """:func:`_budget` for an orphan's workspace on the host: its own file system's use where
    it is a capped disk (else the host's, above the disk size: no bound but that)."""
    used = disk_used_bytes(workspace)
    disk_bytes = info.limits.disk_mb * MIB
    return disk_bytes if used is None else min(disk_bytes, used)


def _room_wanted(budget: int) -> int:
    """The host's disk an export of ``budget`` bytes of content may take: the content and as
    much again (at least 1 MiB) for what each kept file costs beyond it, its inode's block
    and its directories' (``_host_cost``), where the sandbox's small disk held them in 1 KiB
    blocks."""
    return budget + max(MIN_EXPORT_BYTES, budget)


def artifact_limit_bytes(quota: Quota | None) -> int | None:
    """What all of an owner's kept artifacts may take, in bytes (None: no limit)."""
    if quota is None or quota.max_artifact_mb is None:
        return None
    return quota.max_artifact_mb * MIB


class Artifacts:
    """Kept artifacts under ``<data dir>/artifacts/<sandbox id>/``, indexed in the store."""

    def __init__(self, data_dir: Path, store: Store) -> None:
        self.root = data_dir / ARTIFACTS_DIR
        self.store = store

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def export(self, live: Live, disk_room: DiskRoom | None = None) -> None:
        """Copy /workspace/artifacts out of a sandbox about to be destroyed.

        Each path must be a plain relative path that stays below the artifact directory on
        the host. All files together stay within what the sandbox's disk holds (at most its
        size) and what is left of its owner's artifact quota, smallest first. One file that
        cannot be copied (unreadable, vanished, over the budget) is skipped and never leaves
        a partial copy; the others are still kept. ``disk_room(bytes)`` holds room on the
        host's disk for the copies and says how much (the manager's count of it).
        """
        if live.conn is None or not live.conn.alive:
            return
        if not _may_have_artifacts(live):
            return
        try:
            listing = await live.conn.request(Op.FILE_LIST, {"path": ARTIFACTS_DIR, "depth": 32})
        except (SandboxError, OSError):
            return  # no artifacts directory
        skips = _Skips(live.id)
        try:
            budget = await _budget(live)
            wanted = _room_wanted(budget)
            with disk_room(wanted) if disk_room is not None else _as_is(wanted) as room:
                if room < wanted:
                    skips.add("no room on the host's disk", bytes_kept_at_most=room)
                await self._export_listed(live, listing, skips, budget, room)
        finally:
            skips.close()

    async def _export_listed(
        self, live: Live, listing: dict[str, Any], skips: _Skips, budget: int, room: int
    ) -> None:
        """``budget``: the content it may copy (what its disk held); ``room``: what it may
        take of the host's disk, each file at its :func:`_host_cost`."""
        for problem in listing.get("errors", []):
            skips.add("the guest could not list it", problem=problem)
        dest_root = self._dir(live.id).resolve()
        owner = live.info.owner
        limit = artifact_limit_bytes(live.quota)
        files = [entry for entry in listing.get("entries", []) if entry.get("type") == "file"]
        # Smallest first: within the budget as many are kept as fit, and a file that would
        # spend it all (a sparse one of a TB, say) comes last.
        files.sort(key=_listed_size)
        if len(files) > MAX_KEPT_FILES:
            log.warning(
                "artifacts not kept: more files than a sandbox may keep",
                sandbox=live.id,
                files=len(files),
                kept=MAX_KEPT_FILES,
            )
        inodes = _inodes_left(self.root.parent)
        for entry in files[:MAX_KEPT_FILES]:
            target = _target(dest_root, entry)
            if target is None or budget <= 0:
                continue
            rel, kept = str(entry["path"]), str(target.relative_to(dest_root))
            if _host_cost(_listed_size(entry), kept) > room or _inodes(kept) > inodes:
                skips.add("more than the host's disk has left to keep", path=rel)
                continue
            inodes -= _inodes(kept)
            # Its listed size (the sandbox's word) is reserved against the owner's quota
            # before the copy, which may read no more than that.
            size_bytes = min(budget, _listed_size(entry))
            if not self.store.reserve_artifact(owner, live.id, kept, size_bytes, limit):
                skips.add("over the owner's quota", path=rel)
                continue
            try:
                size, digest = await self._copy(live, rel, target, size_bytes)
            except BaseException as exc:
                self.store.drop_artifact(live.id, kept)
                if not isinstance(exc, SandboxError | OSError):
                    raise
                skips.add("could not be copied", path=rel, error=repr(exc))
                # What it may have read counts too: a copy refused for its size was free
                # before, so each sparse file of a TB read a whole disk's worth again (50 of
                # them: 60 s, 20 s of the manager's CPU and 3.6 GiB written a destroy; red
                # team, 2026-12-06).
                budget -= size_bytes
                room -= _host_cost(size_bytes, kept)
                continue
            budget -= size
            room -= _host_cost(size, kept)
            self.store.add_artifact(
                ArtifactInfo(
                    sandbox_id=live.id,
                    path=kept,
                    size_bytes=size,
                    sha256=digest,
                    created_at=time.time(),
                )
            )

    async def _copy(self, live: Live, rel: str, target: Path, budget: int) -> tuple[int, str]:
        """Copy one file through the guest into ``target`` (readable by this user alone),
        via a partial file that is removed unless the copy completes.

        Raises:
            InvalidRequest: the file holds more than ``budget`` (it grew since listed).
            SandboxError, OSError: it could not be read or written.
        """
        assert live.conn is not None
        _private_dirs(self.root, target.parent)
        fd, partial = self._staged()
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                # Reads of at most what is left and one byte: a file listed empty, then grown,
                # was read a whole chunk (1 MiB) and refused for free, 3,000 of them 3 GiB a
                # destroy (red team, 2026-12-06).
                async for data in read_through(live.conn, rel, budget, budget):
                    out.write(data)
                    digest.update(data)
                    size += len(data)
            partial.replace(target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def _staged(self) -> tuple[int, Path]:
        """A new private file to copy into (open for writing), on the artifacts' file system,
        under a name no artifact can have."""
        staging = self.root / STAGING_DIR
        _private_dirs(self.root, staging)
        fd, name = tempfile.mkstemp(prefix="copy-", dir=staging)
        return fd, Path(name)

    async def export_from_host(
        self, info: SandboxInfo, workspace: Path, disk_room: DiskRoom | None = None
    ) -> None:
        """Keep the artifacts of an orphan (a crashed manager's sandbox, its guest gone) by
        reading its workspace on the host, as hostile: no symlink is followed at any depth,
        only regular files are read, within the sandbox's disk size and 100,000 entries, and
        within what is left of its owner's artifact quota (the one recorded at its create),
        as a destroy's export is: at most :data:`MAX_KEPT_FILES` files, for at most
        :data:`EXPORT_TIMEOUT_S`; and within the room ``disk_room`` holds on the disk."""
        budget = await asyncio.to_thread(_host_budget, info, workspace)
        wanted = _room_wanted(budget)
        with disk_room(wanted) if disk_room is not None else _as_is(wanted) as room:
            await asyncio.to_thread(self._copy_from_host, info, workspace, budget, room)

    def _copy_from_host(self, info: SandboxInfo, workspace: Path, budget: int, room: int) -> None:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            top = os.open(workspace, flags)
        except OSError:
            return
        try:
            artifacts = os.open(ARTIFACTS_DIR, flags, dir_fd=top)
        except OSError:
            return  # no artifacts directory
        finally:
            os.close(top)
        walk = _HostWalk(self, info, self._dir(info.id).resolve(), budget, room)
        try:
            walk.directory(artifacts, PurePosixPath(), depth=0)
        finally:
            os.close(artifacts)
            walk.skips.close()

    def list(self, sandbox_id: str) -> list[ArtifactInfo]:
        return self.store.artifacts(sandbox_id)

    def path(self, sandbox_id: str, path: str) -> Path:
        """Host path of a kept artifact.

        Raises:
            SandboxFileNotFound: the sandbox kept no such artifact.
        """
        if not self.store.kept(sandbox_id, path):
            raise SandboxFileNotFound(f"sandbox {sandbox_id} kept no artifact {path!r}")
        kept = self._dir(sandbox_id) / path
        if not kept.is_file():  # a record must name a file; a 404, not a 500, if it does not
            raise SandboxFileNotFound(f"sandbox {sandbox_id}'s artifact {path!r} is gone")
        return kept

    def open(self, sandbox_id: str, path: str) -> tuple[io.FileIO, os.stat_result]:
        """A kept artifact opened for reading (the caller closes it; dropped unclosed, it is
        closed when collected) and its ``fstat``. What is served comes from this one open,
        never from the path again: a DELETE racing a download removed the file between a
        check and the server's own open and stat, a 500 or a body cut after its headers
        (red team, 2026-12-06); a file unlinked once opened still reads whole.

        Raises:
            SandboxFileNotFound: the sandbox kept no such artifact, or it is gone (deleted,
                expired) or is not a plain file.
        """
        if not self.store.kept(sandbox_id, path):
            raise SandboxFileNotFound(f"sandbox {sandbox_id} kept no artifact {path!r}")
        gone = SandboxFileNotFound(f"sandbox {sandbox_id}'s artifact {path!r} is gone")
        # O_NONBLOCK: a FIFO put where a file was opens without waiting for a writer (and is
        # refused below); O_NOFOLLOW: a link is not followed off the artifact directory.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self._dir(sandbox_id) / path, flags)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # deleted, or a link
                raise gone from None
            raise
        file = io.FileIO(fd, "rb", closefd=True)
        info = os.fstat(fd)  # of an open descriptor: fails only on a bad one
        if not stat.S_ISREG(info.st_mode):  # a record must name a file; a 404, not a 500
            file.close()
            raise gone
        return file, info

    async def delete(self, sandbox_id: str) -> int:
        """Delete a sandbox's kept set: its files out of reach, its rows (and their charge),
        then the files. A crash after the rename leaves rows whose files read as gone (404)
        until they expire, never files that no row accounts for."""
        trash = await asyncio.to_thread(self._to_trash, sandbox_id)
        count = self.store.delete_artifacts(sandbox_id)
        if trash is not None:
            await asyncio.to_thread(remove_tree, trash)
        return count

    def _to_trash(self, sandbox_id: str) -> Path | None:
        trash = self.root / TRASH_DIR
        _private_dirs(self.root, trash)
        target = trash / f"{sandbox_id}-{os.urandom(4).hex()}"
        try:
            self._dir(sandbox_id).rename(target)
        except FileNotFoundError:
            return None
        return target

    async def delete_older_than(self, cutoff: float) -> None:
        for sandbox_id in self.store.sandboxes_with_artifacts_before(cutoff):
            await self.delete(sandbox_id)
        # And copies a process that died mid-copy left (a live one writes within the export's
        # timeout, and any process of the data directory may run this).
        await asyncio.to_thread(self._sweep_staging, time.time() - PENDING_ARTIFACT_TTL_S)
        await asyncio.to_thread(self._sweep_trash)

    async def delete_beyond(self, keep: int) -> int:
        """Delete the artifacts of each owner's ended records past its newest ``keep``
        (``SANDBOX_MAX_ENDED_RECORDS``), as :meth:`delete` does, which gives their quota
        back: the records cap counts the records that keep artifacts too, and
        ``Store.forget_beyond`` forgets them once their artifacts are gone. Return how many
        sandboxes' artifacts went: at most ``DELETED_BEYOND_A_PASS`` (the reaper's pass waits
        for them; the rest go in the next passes)."""
        doomed = (await asyncio.to_thread(self.store.kept_beyond, keep))[:DELETED_BEYOND_A_PASS]
        for sandbox_id in doomed:
            await self.delete(sandbox_id)
        return len(doomed)

    def _sweep_staging(self, cutoff: float) -> None:
        try:
            entries = list(os.scandir(self.root / STAGING_DIR))
        except OSError:
            return
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    Path(entry.path).unlink()

    def _sweep_trash(self) -> None:
        """Sets a crashed process left mid-delete (a live one removes its own at once; one
        removed twice is no harm)."""
        try:
            entries = list(os.scandir(self.root / TRASH_DIR))
        except OSError:
            return
        for entry in entries:
            remove_tree(entry.path)


def _listed_size(entry: dict[str, Any]) -> int:
    """The size the sandbox's listing gives a file (0 when it gives none that is a number)."""
    size = entry.get("size_bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def _target(dest_root: Path, entry: dict[str, Any]) -> Path | None:
    """Where a listed file goes on the host, or None if it is no plain file below the root."""
    rel = PurePosixPath(str(entry.get("path", "")))
    if entry.get("type") != "file" or rel.is_absolute() or ".." in rel.parts:
        return None
    inner = PurePosixPath(*rel.parts[1:]) if rel.parts[:1] == (ARTIFACTS_DIR,) else rel
    if not inner.parts:
        return None
    target = (dest_root / inner).resolve()
    if not str(target).startswith(str(dest_root) + os.sep):
        return None
    return target


def _may_have_artifacts(live: Live) -> bool:
    """False only if the sandbox's workspace, seen from the host, has no artifacts entry:
    most sandboxes keep none, and asking the guest costs a round trip and its file module's
    import (~2.5 ms of every destroy). Anything else (an entry of any kind, a backend with
    no host-side workspace, an error) leaves the answer to the guest's listing."""
    workspace = live.backend.workspace_on_host(live.id)
    if workspace is None:
        return True
    try:
        os.lstat(workspace / ARTIFACTS_DIR)  # the last name is the sandbox's: never followed
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


# Of the host file system's inodes, the share no export takes: the store, the sandboxes'
# disks and everything else need theirs (red team, 2026-12-07: 10,000 empty files 8 deep,
# kept at a recovery, took every inode of the data directory's file system).
INODE_RESERVE_FRACTION = 0.1


def _host_cost(size_bytes: int, kept: str) -> int:
    """What keeping a file of ``size_bytes`` at ``kept`` may take of the host's disk: its
    blocks, one more (its inode's share, as the quota charges), and a block for each
    directory it may need. An empty file cost nothing, and 10,000 of them 8 deep took 138 MB
    and 38,000 inodes at 0 bytes charged (red team, 2026-12-07)."""
    return artifact_charge(size_bytes) + BLOCK_BYTES * (_inodes(kept) - 1)


def _inodes(kept: str) -> int:
    """Inodes keeping a file at ``kept`` may take: itself and each directory above it."""
    return len(PurePosixPath(kept).parts)


def _inodes_left(path: Path) -> int:
    """Inodes an export may take on ``path``'s file system, past the reserve."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return 0
    if fs.f_files == 0:  # a file system without an inode count (btrfs)
        return MAX_KEPT_FILES * 33
    return max(0, fs.f_favail - int(fs.f_files * INODE_RESERVE_FRACTION))


def _private_dirs(root: Path, leaf: Path) -> None:
    """Make ``leaf`` and its parents up to ``root`` as directories only this user can enter."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    leaf.mkdir(mode=0o700, parents=True, exist_ok=True)


class _HostWalk:
    """One orphan's artifact tree, copied from the host side with directory descriptors."""

    MAX_DEPTH = 32
    MAX_ENTRIES = 100_000

    def __init__(
        self, artifacts: Artifacts, info: SandboxInfo, dest_root: Path, budget: int, room: int
    ) -> None:
        self.artifacts = artifacts
        self.info = info
        self.dest_root = dest_root
        self.budget = budget  # content: what its disk held
        self.room = room  # the host's disk, each file at its _host_cost
        self.inodes = _inodes_left(artifacts.root.parent)
        self.limit = artifacts.store.artifact_limit(info.id)
        self.entries = 0
        self.files = 0
        self.deadline = time.monotonic() + EXPORT_TIMEOUT_S
        self.stopped = False
        self.skips = _Skips(info.id)

    def directory(self, fd: int, rel: PurePosixPath, depth: int) -> None:
        # Read no more names than may still be walked: a directory of a million hard links
        # (they cost a sandbox no inodes) took a restarted manager's start from 47 to 308 MB
        # and 11.6 s when it was read whole first (red team, 2026-12-06).
        with os.scandir(fd) as found:
            names = list(itertools.islice((e.name for e in found), self._room()))
        for name in names:
            self.entries += 1
            if (
                self.entries > self.MAX_ENTRIES
                or self.budget <= 0
                or self.room < BLOCK_BYTES
                or self._spent()
            ):
                return
            if not _utf8(name):
                self.skips.add("its name is not UTF-8")
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and depth < self.MAX_DEPTH:
                    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                    sub = os.open(name, flags, dir_fd=fd)
                    try:
                        self.directory(sub, rel / name, depth + 1)
                    finally:
                        os.close(sub)
                elif stat.S_ISREG(st.st_mode):
                    self.files += 1
                    self.file(fd, name, rel / name)
            except OSError as exc:
                self.skips.add("could not be copied", path=str(rel / name), error=repr(exc))

    def _room(self) -> int:
        """Entries the walk may still look at (one more, to know it was over)."""
        return max(0, self.MAX_ENTRIES - self.entries) + 1

    def _spent(self) -> bool:
        """Past the files or the time one sandbox's export may take (said once)."""
        if self.stopped:
            return True
        if self.files >= MAX_KEPT_FILES or time.monotonic() > self.deadline:
            log.warning("artifacts not kept: the export's file or time cap", sandbox=self.info.id)
            self.stopped = True
        return self.stopped

    def file(self, dir_fd: int, name: str, rel: PurePosixPath) -> None:
        # ``rel`` is below the artifacts directory; _target takes a path below the workspace.
        target = _target(self.dest_root, {"path": str(ARTIFACTS_DIR / rel), "type": "file"})
        if target is None:
            return
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        store, kept = self.artifacts.store, str(target.relative_to(self.dest_root))
        src = os.open(name, flags, dir_fd=dir_fd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                return
            if _host_cost(st.st_size, kept) > self.room or _inodes(kept) > self.inodes:
                # Not read at all (what is left may keep the smaller ones): past what its
                # disk held or the host's disk has room for.
                self.skips.add("more than the host's disk has left to keep", path=kept)
                return
            self.inodes -= _inodes(kept)
            # Reserved against the owner's quota before the copy, which may read no more:
            # the orphan's processes may still be writing to it until the sweep.
            reserved = min(self.budget, st.st_size)
            if not store.reserve_artifact(
                self.info.owner, self.info.id, kept, reserved, self.limit
            ):
                self.skips.add("over the owner's quota", path=kept)
                return
            try:
                _private_dirs(self.artifacts.root, target.parent)
                out, partial = self.artifacts._staged()
            except BaseException:
                store.drop_artifact(self.info.id, kept)
                raise
            try:
                size, digest = _copy_bounded(src, out, reserved)
                partial.replace(target)
            except BaseException:
                partial.unlink(missing_ok=True)
                store.drop_artifact(self.info.id, kept)
                self.budget -= reserved  # what it may have read, as a destroy's export
                self.room -= _host_cost(reserved, kept)
                raise
        finally:
            os.close(src)
        self.budget -= size
        self.room -= _host_cost(size, kept)
        store.add_artifact(
            ArtifactInfo(
                sandbox_id=self.info.id,
                path=kept,
                size_bytes=size,
                sha256=digest,
                created_at=time.time(),
            )
        )


def _copy_bounded(src: int, out: int, budget: int) -> tuple[int, str]:
    """Copy the open file ``src`` into the open file ``out`` (closed here); return its size
    and sha256.

    Raises:
        OSError: it is bigger than ``budget``, or could not be read or written.
    """
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(out, "wb") as sink:
        while chunk := os.read(src, max(1, min(1 << 20, budget + 1 - size))):
            size += len(chunk)
            if size > budget:
                raise OSError(f"over the {budget} bytes the sandbox may keep")
            sink.write(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextlib.contextmanager
def _as_is(budget: int) -> Iterator[int]:
    yield budget
