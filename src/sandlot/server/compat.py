"""The seeds' own endpoints, so users of those systems can move over unchanged.

Seed 004 (Flask sandbox server): ``POST /create_session``, ``POST /execute`` (a bash command),
``POST /cleanup``. Seed 001 (stateful sandbox system): ``/api/sessions`` and ``/api/e2b/...``.
A "session" is a sandbox; its id is the sandbox id. ``provider: "docker"`` runs on the docker
backend; a provider this server does not run (``e2b``) is served by the default backend, and
the response says which backend that was. ``environment`` is a YAML registry name or alias
(``Python3``, ``Node``, ``python:latest``).
"""

from __future__ import annotations

import contextlib
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from sandlot.agent.models import AgentResult
from sandlot.backends import KNOWN_BACKENDS
from sandlot.errors import SandboxFileError
from sandlot.models import FileInfo, Listing, SandboxInfo, SessionCodeResponse
from sandlot.requests import (
    SANDBOX_ID_PATTERN,
    ListFiles,
    RunCode,
    RunCommand,
    SandboxSpec,
    WriteFile,
    build,
)
from sandlot.server.agent import AgentTaskRequest, execute_task
from sandlot.server.auth import Principal
from sandlot.server.deps import SandboxId, caller, state_of
from sandlot.server.routes import ERRORS, listing_response
from sandlot.server.schemas import (
    CreateSessionResponse,
    LegacyExecuteRequest,
    LegacyExecuteResponse,
    SessionCodeRequest,
    SessionCreateRequest,
    SessionCreateResponse,
    SessionFileWrite,
    SessionRef,
    WrittenFile,
)

router = APIRouter(tags=["seed compatibility"], responses=ERRORS)
Caller = Annotated[Principal, Depends(caller)]


async def _create(
    request: Request, who: Principal, backend: str | None = None, environment: str | None = None
) -> SandboxInfo:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.create", compat=True) as audit:
        spec = build(SandboxSpec, backend=backend, environment=environment)
        info = await state.manager.create(spec, owner=who.tenant, quota=state.quota_for(who))
        audit["sandbox_id"] = info.id
    return info


async def _destroy(request: Request, who: Principal, session_id: str) -> SandboxInfo:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.delete", session_id):
        return await state.manager.destroy(session_id, owner=who.owner_filter)


# ------------------------------------------------------------------ seed 004


@router.post("/create_session", response_model=CreateSessionResponse)
async def create_session(request: Request, who: Caller) -> CreateSessionResponse:
    return CreateSessionResponse(session_id=(await _create(request, who)).id)


@router.post("/execute", response_model=LegacyExecuteResponse | AgentResult)
async def execute(
    body: LegacyExecuteRequest | AgentTaskRequest, request: Request, who: Caller
) -> LegacyExecuteResponse | AgentResult:
    """Seed 002: ``{"task": ...}`` has the agent write and run code until it works (the
    result records every attempt). Seed 004: ``{"session_id", "command"}`` runs a bash
    command in that session's sandbox."""
    if isinstance(body, AgentTaskRequest):
        return await execute_task(body, request, who)
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.command", body.session_id):
        command = build(RunCommand, command=body.command, timeout_s=body.timeout_s)
        r = await state.manager.run_command(body.session_id, command, owner=who.owner_filter)
    return LegacyExecuteResponse(
        exit_code=r.exit_code,
        output=r.stdout + r.stderr,
        stdout=r.stdout,
        stderr=r.stderr,
        kill_reason=r.kill_reason,
    )


@router.post("/cleanup")
async def cleanup(body: SessionRef, request: Request, who: Caller) -> dict[str, str]:
    await _destroy(request, who, body.session_id)
    return {"status": "cleaned", "session_id": body.session_id}


# ------------------------------------------------------------------ seed 001


@router.post("/api/sessions", response_model=SessionCreateResponse)
async def api_create_session(
    body: SessionCreateRequest, request: Request, who: Caller
) -> SessionCreateResponse:
    backend = body.provider if body.provider in KNOWN_BACKENDS else None
    info = await _create(request, who, backend, body.environment)
    url = str(request.url_for("get_sandbox", sandbox_id=info.id))
    return SessionCreateResponse(
        session_id=info.id, sandbox_id=info.id, provider=info.backend, url=url
    )


@router.get("/api/sessions/{session_id}", response_model=SandboxInfo)
async def api_get_session(session_id: SandboxId, request: Request, who: Caller) -> SandboxInfo:
    return await state_of(request).manager.get(session_id, owner=who.owner_filter)


@router.delete("/api/sessions/{session_id}", response_model=SandboxInfo)
async def api_delete_session(
    session_id: SandboxId,
    request: Request,
    who: Caller,
    sandbox_id: Annotated[str | None, Query(description="Accepted for seed 001; ignored.")] = None,
) -> SandboxInfo:
    return await _destroy(request, who, session_id)


@router.post("/api/e2b/execute", response_model=SessionCodeResponse)
async def api_execute(
    body: SessionCodeRequest, request: Request, who: Caller
) -> SessionCodeResponse:
    """Run Python in the session (seed 001's shape: stdout, stderr, results, artifacts)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.run_code", body.session_id):
        code = build(RunCode, code=body.code, timeout_s=body.timeout_s)
        r = await state.manager.run_code(body.session_id, code, owner=who.owner_filter)
    files = Listing()
    # No artifacts directory yet, or something else at its name (sandboxed code can put a
    # file or a FIFO there): the code has run, and its output must not be lost for that.
    # Before 2026-12-06 a missing one was "not a directory", and every first execute of a
    # session failed after its code ran (a red team's find). Nor for its key's debt: its turn
    # never refuses.
    checking = state.listings.checking(request.scope, who.tenant, refuse=False)
    with contextlib.suppress(SandboxFileError):
        files = await state.manager.list_files(
            body.session_id,
            ListFiles(path="artifacts", depth=8),
            owner=who.owner_filter,
            checking=checking,
        )
    return SessionCodeResponse.of(r, files)


@router.get("/api/e2b/files/{session_id}", response_model=list[FileInfo])
async def api_list_files(
    session_id: SandboxId,
    request: Request,
    who: Caller,
    path: Annotated[str, Query(max_length=4096)] = ".",
) -> Response:
    return await _list_files(request, who, session_id, path)


@router.get("/api/e2b/files", response_model=list[FileInfo])
async def api_list_files_by_query(
    request: Request,
    who: Caller,
    session_id: Annotated[str, Query(pattern=SANDBOX_ID_PATTERN)],
    path: Annotated[str, Query(max_length=4096)] = ".",
) -> Response:
    """Seed 001's API table names ``GET /api/e2b/files``; its flow, the session in the path."""
    return await _list_files(request, who, session_id, path)


async def _list_files(request: Request, who: Principal, session_id: str, path: str) -> Response:
    state = state_of(request)
    found = await state.manager.list_files(
        session_id,
        build(ListFiles, path=path),
        owner=who.owner_filter,
        checking=state.listings.checking(request.scope, who.tenant),
    )
    return listing_response(found, request)


@router.post("/api/e2b/files", response_model=WrittenFile)
async def api_write_file(body: SessionFileWrite, request: Request, who: Caller) -> WrittenFile:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "file.write", body.session_id, path=body.path):
        size = await state.manager.write_file(
            body.session_id,
            build(WriteFile, path=body.path),
            body.content.encode(),
            owner=who.owner_filter,
        )
    return WrittenFile(path=body.path, size_bytes=size)
