"""Recovery: what a manager does at start for the sandboxes a crashed run left behind.

Their artifacts are kept first, as a destroy would have kept them (read from the host side:
their guests are gone), then every backend this store ever used is swept, so no process,
cgroup, mount, loop device or directory of theirs survives.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from sandlot.backends import KNOWN_BACKENDS, Backend
from sandlot.core.artifacts import Artifacts
from sandlot.core.store import Store
from sandlot.errors import SandboxError
from sandlot.models import SandboxInfo

log = structlog.get_logger(__name__)


async def recover(
    store: Store,
    artifacts: Artifacts,
    backend_of: Callable[[str], Backend],
    default_backend: str,
    extra_backends: set[str],
) -> list[SandboxInfo]:
    """Keep the orphans' artifacts, then sweep; return the orphans' records (to be ended).

    Every backend this store ever used is swept (pooled sandboxes are never stored, and a
    backend may have been left running with none live), plus ``extra_backends`` (those the
    pools will use) and the default one.
    """
    orphans = store.list(live_only=True)
    for info in orphans:
        await _rescue_artifacts(info, artifacts, backend_of)
    names = (store.backends_used() | extra_backends | {default_backend}) & set(KNOWN_BACKENDS)
    for name in sorted(names):
        try:
            removed = await backend_of(name).sweep(keep=())
        except SandboxError as exc:
            log.warning("recovery sweep skipped", backend=name, error=str(exc))
            continue
        if removed:
            log.warning("removed orphaned sandboxes", backend=name, ids=removed)
    return orphans


async def _rescue_artifacts(
    info: SandboxInfo, artifacts: Artifacts, backend_of: Callable[[str], Backend]
) -> None:
    if info.backend not in KNOWN_BACKENDS:
        return
    try:
        workspace = backend_of(info.backend).workspace_on_host(info.id)
        if workspace is not None:
            await artifacts.export_from_host(info, workspace)
    except (SandboxError, OSError) as exc:
        log.warning("artifacts of an orphan not kept", sandbox=info.id, error=repr(exc))
