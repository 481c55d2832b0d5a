"""Named volumes in the SDK: a tenant's files that outlive its sandboxes.

>>> from sandlot import Sandbox, Volume
>>> Volume.create("data", size_mb=256)
>>> with Sandbox.create(volumes={"data": "/workspace/data"}) as sb:
...     sb.commands.run("echo kept > /workspace/data/note")
>>> with Sandbox.create(volumes={"data": "/workspace/data"}) as sb:
...     sb.commands.run("cat /workspace/data/note").stdout
'kept\\n'

A volume is attached to one live sandbox at a time; embedded, or on a server with
``api_url`` as :class:`~sandlot.sandbox.AsyncSandbox` does.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator

from sandlot._runner import Runner
from sandlot._sync import blocking_classmethod
from sandlot.core import SandboxManager
from sandlot.models import VolumeInfo
from sandlot.requests import CreateVolume, build
from sandlot.sandbox import runner_for


class AsyncVolume:
    """A tenant's named volumes: made, looked up, listed and deleted (each a classmethod)."""

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        size_mb: int = 256,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> VolumeInfo:
        """Make an empty volume of ``size_mb`` (its cap: a write past it fails, ENOSPC).

        Raises:
            VolumeExists: one of that name is yours already.
            QuotaExceeded: past your volumes' quota (TENANT_MAX_VOLUMES, _VOLUME_MB).
            ConfigError: a bad name, or a size over SANDBOX_MAX_VOLUME_MB.
        """
        request = build(CreateVolume, name=name, size_mb=size_mb)
        async with _runner(manager, api_url, api_key) as runner:
            return await runner(runner.volumes().create_volume(request))

    @classmethod
    async def get(
        cls,
        name: str,
        *,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> VolumeInfo:
        """Raises: VolumeNotFound."""
        async with _runner(manager, api_url, api_key) as runner:
            return await runner(runner.volumes().get_volume(name))

    @classmethod
    async def list(
        cls,
        *,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> builtins.list[VolumeInfo]:
        async with _runner(manager, api_url, api_key) as runner:
            return await runner(runner.volumes().list_volumes())

    @classmethod
    async def delete(
        cls,
        name: str,
        *,
        manager: SandboxManager | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        """Delete the volume and every file on it.

        Raises:
            VolumeNotFound: no such volume.
            VolumeInUse: a live sandbox has it attached.
        """
        async with _runner(manager, api_url, api_key) as runner:
            await runner(runner.volumes().delete_volume(name))


@contextlib.asynccontextmanager
async def _runner(
    manager: SandboxManager | None, api_url: str | None, api_key: str | None
) -> AsyncIterator[Runner]:
    runner = await runner_for(manager, api_url, api_key)
    try:
        yield runner
    finally:
        await runner.aclose()


class Volume:
    """Blocking twin of :class:`AsyncVolume` (same arguments, same results)."""

    create = blocking_classmethod(AsyncVolume.create)
    get = blocking_classmethod(AsyncVolume.get)
    list = blocking_classmethod(AsyncVolume.list)
    delete = blocking_classmethod(AsyncVolume.delete)
