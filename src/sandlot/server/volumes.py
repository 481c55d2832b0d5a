"""``/v1/volumes``: a tenant's named volumes (core/volumes.py), made, listed and deleted;
attached to a sandbox by its create (``volumes`` in the body). Audited like a sandbox's
create and destroy: a volume holds a tenant's disk."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as FastPath

from sandlot.models import VOLUME_NAME_PATTERN, VolumeInfo
from sandlot.requests import CreateVolume
from sandlot.server.auth import Principal
from sandlot.server.deps import caller, state_of
from sandlot.server.routes import ERRORS

router = APIRouter(prefix="/v1/volumes", tags=["volumes"], responses=ERRORS)
Caller = Annotated[Principal, Depends(caller)]
VolumeName = Annotated[str, FastPath(pattern=VOLUME_NAME_PATTERN, description="A volume's name.")]


@router.post("", response_model=VolumeInfo, status_code=201)
async def create_volume(body: CreateVolume, request: Request, who: Caller) -> VolumeInfo:
    """An empty volume of the caller's tenant, capped at ``size_mb`` (409 if the name is
    taken, 429 past the tenant's volume quota, 503 without room on the host's disk)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "volume.create", volume=body.name):
        return await state.manager.create_volume(body, owner=who.tenant, quota=state.quota_for(who))


@router.get("", response_model=list[VolumeInfo])
async def list_volumes(request: Request, who: Caller) -> list[VolumeInfo]:
    return await state_of(request).manager.list_volumes(owner=who.tenant)


@router.get("/{name}", response_model=VolumeInfo)
async def get_volume(name: VolumeName, request: Request, who: Caller) -> VolumeInfo:
    return await state_of(request).manager.get_volume(name, owner=who.tenant)


@router.delete("/{name}", status_code=204)
async def delete_volume(name: VolumeName, request: Request, who: Caller) -> Response:
    """Delete the volume and its files (409 while a sandbox has it attached)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "volume.delete", volume=name):
        await state.manager.delete_volume(name, owner=who.tenant)
    return Response(status_code=204)
