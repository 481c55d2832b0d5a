"""Artifacts: what a sandbox leaves in /workspace/artifacts, kept on the host after it ends.

They are copied out through the guest, which only sees the sandbox's own view, so paths and
sizes come from inside the sandbox and are treated as hostile.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from sandlot.core.files import read_through
from sandlot.core.live import Live
from sandlot.core.store import Store
from sandlot.errors import SandboxError, SandboxFileNotFound
from sandlot.guest.ops import Op
from sandlot.models import ArtifactInfo

log = structlog.get_logger(__name__)

ARTIFACTS_DIR = "artifacts"
MIB = 1 << 20
# Artifacts are read through the guest, which sandboxed code can slow down: bound the wait.
EXPORT_TIMEOUT_S = 60.0


class Artifacts:
    """Kept artifacts under ``<data dir>/artifacts/<sandbox id>/``, indexed in the store."""

    def __init__(self, data_dir: Path, store: Store) -> None:
        self.root = data_dir / ARTIFACTS_DIR
        self.store = store

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def export(self, live: Live) -> None:
        """Copy /workspace/artifacts out of a sandbox about to be destroyed.

        Each path must be a plain relative path that stays below the artifact directory on
        the host. All files together stay within the sandbox's disk size and what is left of
        its owner's artifact quota. One file that cannot be copied (unreadable, vanished, over
        the budget) is skipped and never leaves a partial copy; the others are still kept.
        """
        if live.conn is None or not live.conn.alive:
            return
        try:
            listing = await live.conn.request(Op.FILE_LIST, {"path": ARTIFACTS_DIR, "depth": 32})
        except (SandboxError, OSError):
            return  # no artifacts directory
        for problem in listing.get("errors", []):
            log.warning("artifact not kept", sandbox=live.id, problem=problem)
        dest_root = self._dir(live.id).resolve()
        budget = self._budget(live)
        for entry in listing.get("entries", []):
            target = _target(dest_root, entry)
            if target is None or budget <= 0:
                continue
            rel = str(entry["path"])
            try:
                size, digest = await self._copy(live, rel, target, budget)
            except (SandboxError, OSError) as exc:
                log.warning("artifact not kept", sandbox=live.id, path=rel, error=repr(exc))
                continue
            budget -= size
            self.store.add_artifact(
                ArtifactInfo(
                    sandbox_id=live.id,
                    path=str(target.relative_to(dest_root)),
                    size_bytes=size,
                    sha256=digest,
                    created_at=time.time(),
                )
            )

    def _budget(self, live: Live) -> int:
        """Bytes this sandbox may still keep: its disk size, and its owner's quota."""
        budget = live.disk_bytes
        quota = live.quota
        if quota is not None and quota.max_artifact_mb is not None:
            left = quota.max_artifact_mb * MIB - self.store.artifact_bytes(live.info.owner)
            budget = min(budget, left)
        return budget

    async def _copy(self, live: Live, rel: str, target: Path, budget: int) -> tuple[int, str]:
        """Copy one file through the guest into ``target`` (readable by this user alone),
        via a partial file that is removed unless the copy completes.

        Raises:
            GuestError: the file is bigger than ``budget`` (or grew while read).
            SandboxError, OSError: it could not be read or written.
        """
        assert live.conn is not None
        _private_dirs(self.root, target.parent)
        partial = target.with_name(f".{target.name}.partial")
        digest = hashlib.sha256()
        size = 0
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                async for data in read_through(live.conn, rel, budget):
                    out.write(data)
                    digest.update(data)
                    size += len(data)
            partial.replace(target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def list(self, sandbox_id: str) -> list[ArtifactInfo]:
        return self.store.artifacts(sandbox_id)

    def path(self, sandbox_id: str, path: str) -> Path:
        """Host path of a kept artifact.

        Raises:
            SandboxFileNotFound: the sandbox kept no such artifact.
        """
        if path not in {a.path for a in self.list(sandbox_id)}:
            raise SandboxFileNotFound(f"sandbox {sandbox_id} kept no artifact {path!r}")
        return self._dir(sandbox_id) / path

    async def delete(self, sandbox_id: str) -> int:
        count = self.store.delete_artifacts(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, self._dir(sandbox_id), True)
        return count

    async def delete_older_than(self, cutoff: float) -> None:
        for sandbox_id in self.store.sandboxes_with_artifacts_before(cutoff):
            await self.delete(sandbox_id)


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


def _private_dirs(root: Path, leaf: Path) -> None:
    """Make ``leaf`` and its parents up to ``root`` as directories only this user can enter."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    leaf.mkdir(mode=0o700, parents=True, exist_ok=True)
