"""What the manager's verbs share: a caller's sandbox found, live or as its record.

:class:`~sandlot.core.manager.SandboxManager` holds the state named here; its verbs on
background commands and terminals (:mod:`~sandlot.core.job_verbs`) and on files and kept
artifacts (:mod:`~sandlot.core.file_verbs`) are mixins that find sandboxes through it.
"""

from __future__ import annotations

from sandlot.config import Settings
from sandlot.core import instances
from sandlot.core.live import Live
from sandlot.core.store import LIVE, Store
from sandlot.errors import SandboxNotFound, SandboxNotRunning
from sandlot.models import SandboxInfo


class Lookup:
    """Finding a caller's sandbox; an owner given sees its own sandboxes only."""

    settings: Settings
    _started: bool
    _live: dict[str, Live]
    _store: Store

    async def get(self, sandbox_id: str, *, owner: str | None = None) -> SandboxInfo:
        """A live or ended sandbox's record.

        Raises:
            SandboxNotFound: no such sandbox, or it belongs to another owner.
        """
        live = self._live.get(sandbox_id)
        info = live.info if live else self._store.get(sandbox_id)
        if info is None or (owner is not None and info.owner != owner):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return info.model_copy()

    def _require_started(self) -> None:
        if not self._started:
            raise SandboxNotRunning(
                "the SandboxManager is not started; use `async with` or start()"
            )

    def _get_live(self, sandbox_id: str, owner: str | None) -> Live:
        self._require_started()
        live = self._live.get(sandbox_id)
        if live is None:
            info = self._store.get(sandbox_id)
            if info is None or (owner is not None and info.owner != owner):
                raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
            if info.status.value in LIVE:
                raise instances.not_here(self._store, self.settings.data_dir, sandbox_id)
            raise SandboxNotRunning(
                f"sandbox {sandbox_id} is {info.status.value} ({info.end_reason}); create a new one"
            )
        if owner is not None and live.info.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if live.destroying:
            raise SandboxNotRunning(f"sandbox {sandbox_id} is being destroyed")
        return live
