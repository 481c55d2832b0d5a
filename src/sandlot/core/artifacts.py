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

from sandlot.core.files import read_through
from sandlot.core.live import Live
from sandlot.core.store import Store
from sandlot.errors import SandboxError, SandboxFileNotFound
from sandlot.guest.ops import Op
from sandlot.models import ArtifactInfo

ARTIFACTS_DIR = "artifacts"
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
        the host; all files together cannot exceed the sandbox's disk size.
        """
        if live.conn is None or not live.conn.alive:
            return
        try:
            entries = await live.conn.request(Op.FILE_LIST, {"path": ARTIFACTS_DIR, "depth": 32})
        except (SandboxError, OSError):
            return  # no artifacts directory
        dest_root = self._dir(live.id).resolve()
        budget = live.disk_bytes
        for entry in entries.get("entries", []):
            rel = PurePosixPath(str(entry.get("path", "")))
            if entry.get("type") != "file" or rel.is_absolute() or ".." in rel.parts:
                continue
            inner = PurePosixPath(*rel.parts[1:]) if rel.parts[:1] == (ARTIFACTS_DIR,) else rel
            target = (dest_root / inner).resolve()
            if not str(target).startswith(str(dest_root) + os.sep):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            size = 0
            with open(target, "wb") as out:
                async for data in read_through(live.conn, str(rel), budget):
                    out.write(data)
                    digest.update(data)
                    size += len(data)
            budget -= size
            self.store.add_artifact(
                ArtifactInfo(
                    sandbox_id=live.id,
                    path=str(inner),
                    size_bytes=size,
                    sha256=digest.hexdigest(),
                    created_at=time.time(),
                )
            )

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
