"""The manager's verbs on named volumes (:mod:`~sandlot.core.volumes`), and the leases that
keep each attached volume to its one sandbox until that sandbox's teardown has ended."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Sequence

from sandlot.backends.base import Backend
from sandlot.config import Settings
from sandlot.core.volumes import Lease, VolumeStore
from sandlot.errors import BackendUnavailable
from sandlot.models import Quota, VolumeInfo, VolumeMount
from sandlot.requests import CreateVolume


class VolumeVerbs:
    """Named volumes, by owner and name."""

    settings: Settings
    _volumes: VolumeStore
    # The volumes each live (or still ending) sandbox holds, by sandbox id.
    _leases: dict[str, Lease]

    def _init_volumes(self) -> None:
        self._volumes = VolumeStore(
            self.settings.data_dir, max_volume_mb=self.settings.max_volume_mb
        )
        self._leases = {}

    async def create_volume(
        self, request: CreateVolume, *, owner: str = "local", quota: Quota | None = None
    ) -> VolumeInfo:
        """Make an empty volume of ``owner``'s.

        Raises:
            ConfigError: a size over SANDBOX_MAX_VOLUME_MB.
            VolumeExists: ``owner`` has a volume of that name.
            QuotaExceeded: past the owner's max_volumes or max_volume_mb.
            CapacityExhausted: the data directory's disk has no room for it.
        """
        return await asyncio.to_thread(
            self._volumes.create, owner, request.name, request.size_mb, quota
        )

    async def list_volumes(self, *, owner: str = "local") -> builtins.list[VolumeInfo]:
        return await asyncio.to_thread(self._volumes.list, owner)

    async def get_volume(self, name: str, *, owner: str = "local") -> VolumeInfo:
        """Raises: VolumeNotFound."""
        return await asyncio.to_thread(self._volumes.get, owner, name)

    async def delete_volume(self, name: str, *, owner: str = "local") -> None:
        """Delete a volume and every file on it.

        Raises:
            VolumeNotFound: no such volume of ``owner``'s.
            VolumeInUse: a live sandbox has it attached (destroy that first).
        """
        await asyncio.to_thread(self._volumes.delete, owner, name)

    async def _lease_volumes(
        self, backend: Backend, runtime: str | None, owner: str, mounts: Sequence[VolumeMount]
    ) -> Lease:
        """Take ``mounts``' volumes for a new sandbox of ``owner`` on ``backend``.

        Raises:
            BackendUnavailable: the backend cannot attach volumes on this host.
            VolumeNotFound, VolumeInUse: as :meth:`VolumeStore.lease`.
        """
        # An optional verb: a plugin backend without it attaches no volumes.
        available = getattr(backend, "volumes_available", None)
        ok, why = available(runtime) if available is not None else (False, "not supported")
        if not ok:
            raise BackendUnavailable(
                f"named volumes are not available on the {backend.name} backend here: {why}"
            )
        return await asyncio.to_thread(self._volumes.lease, owner, mounts)

    def _release_lease(self, sandbox_id: str) -> None:
        """The sandbox is gone (its teardown ended, or it never started): its volumes may
        be attached again."""
        lease = self._leases.pop(sandbox_id, None)
        if lease is not None:
            lease.release()
