"""The manager's verbs on named volumes (:mod:`~sandlot.core.volumes`), and the leases that
keep each attached volume to its one sandbox until its destroy has halted it (or its create
failed): none of its processes runs then, and a next attach waits for the kernel to drop
the volume's last mount (``backends/volumes.py``)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sandlot.backends.base import Backend, require_volumes
from sandlot.config import Settings
from sandlot.core.volumes import Lease, VolumeStore
from sandlot.models import Quota, SandboxInfo, VolumeInfo, VolumeMount
from sandlot.requests import CreateVolume


class VolumeVerbs:
    """Named volumes, by owner and name."""

    settings: Settings
    _volumes: VolumeStore
    # The volumes each live sandbox holds, by sandbox id.
    _leases: dict[str, Lease]

    if TYPE_CHECKING:

        def _volume_room(
            self, size_mb: int, live_ids: set[str] | None = None
        ) -> contextlib.AbstractContextManager[None]: ...

        def _live_infos(
            self, elsewhere: builtins.list[SandboxInfo] | None = None
        ) -> builtins.list[SandboxInfo]: ...

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
            ConfigError: a bad name, or a size under 8 MB or over SANDBOX_MAX_VOLUME_MB.
            VolumeExists: ``owner`` has a volume of that name.
            QuotaExceeded: past the owner's max_volumes or max_volume_mb.
            CapacityExhausted: the data directory's disk has no room for it beside the
                sandboxes' disks and the other volumes.
            BackendUnavailable: this host could not make it (mkfs.ext4 failed).
        """
        # The data directory's live sandboxes, from the store (read here, on the loop).
        live_ids = {info.id for info in self._live_infos()}
        room = functools.partial(self._volume_room, live_ids=live_ids)
        return await asyncio.to_thread(
            self._volumes.create, owner, request.name, request.size_mb, quota, room
        )

    async def list_volumes(self, *, owner: str = "local") -> builtins.list[VolumeInfo]:
        return await asyncio.to_thread(self._volumes.list, owner)

    async def get_volume(self, name: str, *, owner: str = "local") -> VolumeInfo:
        """Raises: ConfigError (a bad name), VolumeNotFound."""
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
        require_volumes(backend, runtime)
        # The lease is taken in a thread, which a cancelled create cannot stop: shielded,
        # and released when the thread ends if its create is gone by then. Unshielded, a
        # create cancelled while the tenant's lock was held (or during the wait for a
        # previous sandbox to let go) left a lease nobody held: the volume "in use" until
        # the process ended (red team, 2026-12-07).
        taking = asyncio.ensure_future(asyncio.to_thread(self._volumes.lease, owner, mounts))
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:
            taking.add_done_callback(_release_orphan)
            raise

    def _release_lease(self, sandbox_id: str) -> None:
        """The sandbox is gone (its teardown ended, or it never started): its volumes may
        be attached again."""
        lease = self._leases.pop(sandbox_id, None)
        if lease is not None:
            lease.release()


def _release_orphan(taking: asyncio.Future[Lease]) -> None:
    """A lease whose create was cancelled while it was being taken: given back."""
    if not taking.cancelled() and taking.exception() is None:
        taking.result().release()
