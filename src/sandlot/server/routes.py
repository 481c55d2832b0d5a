"""``/v1/sandboxes``: lifecycle, code, commands, files and artifacts."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as FastPath
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, TypeAdapter
from starlette.convertors import Convertor, register_url_convertor

from sandlot.core import SandboxManager
from sandlot.errors import CommandStillRunning, RequestTooLarge
from sandlot.models import (
    TRUNCATED_HEADER,
    ArtifactInfo,
    CommandInfo,
    ExecResult,
    FileInfo,
    Listing,
    PtyOutput,
    ResourceUsage,
    SandboxInfo,
)
from sandlot.requests import (
    CommandInput,
    FilePath,
    ListFiles,
    OpenPty,
    PtyInput,
    PtySize,
    RemoveFile,
    RunCode,
    RunCommand,
    SandboxSpec,
    SetTimeout,
    WriteFile,
)
from sandlot.server import multipart
from sandlot.server.auth import Principal
from sandlot.server.deps import SandboxId, caller, state_of, unless_gone
from sandlot.server.downloads import opened_file_response
from sandlot.server.metering import charge_entries
from sandlot.server.schemas import ErrorBody, WrittenFile


class AnyPathConvertor(Convertor[str]):
    r"""``{name:anypath}``: the rest of the URL path, whatever its characters. Starlette's
    ``path`` is ``.*``, compiled without DOTALL: a name with a newline never matched (a kept
    artifact ``a\nb`` was listed and charged but 404 to download), and ``$``, which matches
    before a final newline, made ``x\n`` serve the artifact ``x`` (red team, 2026-12-06).
    ``[\s\S]*`` takes every character, so the route's ``$`` is the end of the path."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


# Registered before the routes below are made: their paths are compiled as they are declared.
register_url_convertor("anypath", AnyPathConvertor())

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}
router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], responses=ERRORS)
Caller = Annotated[Principal, Depends(caller)]
# The file verbs' requests arrive as query parameters (the body, where there is one, is bytes).
PathQuery = Annotated[FilePath, Query()]
UPLOAD_CHUNK_BYTES = 1 << 20
MAX_LISTED = 1000  # sandboxes one list call returns; the client pages with offset


@router.post("", status_code=201, response_model=SandboxInfo)
async def create_sandbox(body: SandboxSpec, request: Request, who: Caller) -> SandboxInfo:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.create", backend=body.backend) as audit:
        info = await state.manager.create(body, owner=who.tenant, quota=state.quota_for(who))
        audit["sandbox_id"] = info.id
    return info


@router.get("", response_model=list[SandboxInfo])
async def list_sandboxes(
    request: Request,
    who: Caller,
    include_ended: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED)] = MAX_LISTED,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[SandboxInfo]:
    """Oldest first, at most ``limit`` from the ``offset``-th: a tenant may keep thousands
    of ended records for the retention period, and one response of them all took 129 MB and
    a second of the server's (red team, 2026-12-06). Page on while a page comes back full."""
    manager = state_of(request).manager
    return await manager.list(
        owner=who.owner_filter, include_ended=include_ended, limit=limit, offset=offset
    )


@router.get("/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: SandboxId, request: Request, who: Caller) -> SandboxInfo:
    return await state_of(request).manager.get(sandbox_id, owner=who.owner_filter)


@router.delete("/{sandbox_id}", response_model=SandboxInfo)
async def delete_sandbox(sandbox_id: SandboxId, request: Request, who: Caller) -> SandboxInfo:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.delete", sandbox_id):
        return await state.manager.destroy(sandbox_id, owner=who.owner_filter)


@router.post("/{sandbox_id}/timeout", response_model=SandboxInfo)
async def set_timeout(
    sandbox_id: SandboxId, body: SetTimeout, request: Request, who: Caller
) -> SandboxInfo:
    who.require_write()
    return await state_of(request).manager.extend(sandbox_id, body, owner=who.owner_filter)


@router.get("/{sandbox_id}/usage", response_model=ResourceUsage)
async def usage(sandbox_id: SandboxId, request: Request, who: Caller) -> ResourceUsage:
    return await state_of(request).manager.usage(sandbox_id, owner=who.owner_filter)


@router.post("/{sandbox_id}/code", response_model=ExecResult)
async def run_code(sandbox_id: SandboxId, body: RunCode, request: Request, who: Caller) -> Response:
    """Run Python in the sandbox's persistent interpreter. A failing program is a 200."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.run_code", sandbox_id) as audit:
        # A client that hangs up interrupts its run, as cancelling the SDK's call does.
        result = await unless_gone(
            request, state.manager.run_code(sandbox_id, body, owner=who.owner_filter)
        )
        return answer_run(audit, result)


@router.post(
    "/{sandbox_id}/commands",
    response_model=ExecResult,
    responses={202: {"model": CommandInfo, "description": "Started in the background."}},
)
async def run_command(
    sandbox_id: SandboxId, body: RunCommand, request: Request, who: Caller
) -> Response:
    """Run a bash command; ``cd`` and ``export`` persist within ``session``. With
    ``"background": true``, answer 202 with its pid at once (see ``/commands/{pid}``)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.command", sandbox_id) as audit:
        if body.background:
            info = await state.manager.start_command(sandbox_id, body, owner=who.owner_filter)
            audit["pid"] = info.pid
            return Response(info.model_dump_json(), 202, media_type="application/json")
        result = await unless_gone(
            request, state.manager.run_command(sandbox_id, body, owner=who.owner_filter)
        )
        return answer_run(audit, result)


def answer_run(audit: dict[str, Any], result: ExecResult | None) -> Response:
    """A foreground run's answer, its outcome in the audit row: 499 if its client left."""
    if result is None:
        audit["client_gone"] = True
        return _nobody_there()
    audit.update(exit_code=result.exit_code, kill_reason=result.kill_reason)
    return _json(result)


def _nobody_there() -> Response:
    """The answer to a request whose client left before it was made: nobody reads it
    (nginx's "client closed request")."""
    return Response(status_code=499)


def _json(model: BaseModel) -> Response:
    """Our own model, already valid: serialize once instead of FastAPI validating it again
    (``response_model`` still documents it in the OpenAPI document)."""
    return Response(model.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------- background commands

Pid = Annotated[int, FastPath(gt=0, description="A background command's pid.")]
# A pid names the newest command with it: pids are reused once the sandbox's guest restarts,
# so a client that kept a command's id acts on that command only (404 once it is gone, even
# if its pid now runs another). Left out (E2B's clients), the pid alone decides.
CommandId = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=64,
        pattern="^[A-Za-z0-9_-]+$",
        description="The command's ``command_id``: act on it only, never on a later command "
        "with its pid.",
    ),
]
MAX_WAIT_S = 3600.0  # one HTTP request waits at most this long; the client asks again


class KilledCommand(BaseModel):
    pid: int
    killed: bool


@router.get("/{sandbox_id}/commands", response_model=list[CommandInfo])
async def list_commands(sandbox_id: SandboxId, request: Request, who: Caller) -> list[CommandInfo]:
    """The background commands still running."""
    return await state_of(request).manager.list_commands(sandbox_id, owner=who.owner_filter)


@router.get("/{sandbox_id}/commands/{pid}", response_model=CommandInfo)
async def get_command(
    sandbox_id: SandboxId, pid: Pid, request: Request, who: Caller, command_id: CommandId = None
) -> CommandInfo:
    manager = state_of(request).manager
    return await manager.command_info(
        sandbox_id, pid, command_id=command_id, owner=who.owner_filter
    )


@router.get(
    "/{sandbox_id}/commands/{pid}/wait",
    response_model=ExecResult,
    responses={202: {"model": CommandInfo, "description": "Still running after timeout_s."}},
)
async def wait_command(
    sandbox_id: SandboxId,
    pid: Pid,
    request: Request,
    who: Caller,
    timeout_s: Annotated[float, Query(gt=0, le=MAX_WAIT_S)] = 30.0,
    command_id: CommandId = None,
) -> Response:
    """Its result once it ends; 202 with its info if it still runs after ``timeout_s``.

    A client that goes away ends the wait (the command runs on): a wait holds one of its
    tenant's open requests (``API_MAX_OPEN_PER_TENANT``), and 100 waits abandoned after a
    second held a tenant's for their whole timeout (red team, 2026-12-06)."""
    manager = state_of(request).manager
    owner = who.owner_filter
    try:
        # Cancelling the wait leaves the command be: it is shielded from its waiters.
        result = await unless_gone(
            request,
            manager.wait_command(sandbox_id, pid, timeout_s, command_id=command_id, owner=owner),
        )
    except CommandStillRunning:
        info = await manager.command_info(sandbox_id, pid, command_id=command_id, owner=owner)
        return Response(info.model_dump_json(), 202, media_type="application/json")
    return _json(result) if result is not None else _nobody_there()


@router.post("/{sandbox_id}/commands/{pid}/stdin", status_code=204)
async def command_stdin(
    sandbox_id: SandboxId,
    pid: Pid,
    body: CommandInput,
    request: Request,
    who: Caller,
    command_id: CommandId = None,
) -> Response:
    """Write ``data`` to its stdin; ``eof`` closes it after."""
    who.require_write()
    await state_of(request).manager.send_command_stdin(
        sandbox_id,
        pid,
        body.data.encode(),
        eof=body.eof,
        command_id=command_id,
        owner=who.owner_filter,
    )
    return Response(status_code=204)


@router.delete("/{sandbox_id}/commands/{pid}", response_model=KilledCommand)
async def kill_command(
    sandbox_id: SandboxId, pid: Pid, request: Request, who: Caller, command_id: CommandId = None
) -> KilledCommand:
    """Kill it and what it started; ``killed`` is false if it had already ended."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.command_kill", sandbox_id, pid=pid):
        killed = await state.manager.kill_command(
            sandbox_id, pid, command_id=command_id, owner=who.owner_filter
        )
    return KilledCommand(pid=pid, killed=killed)


# ---------------------------------------------------------------- terminals
# A terminal's pid takes the background verbs too: GET .../commands/{pid}/wait for its
# result, DELETE .../commands/{pid} to end it. Its output streams over the WebSocket.


@router.post("/{sandbox_id}/pty", response_model=CommandInfo, status_code=201)
async def open_pty(sandbox_id: SandboxId, body: OpenPty, request: Request, who: Caller) -> Response:
    """Open a terminal (an interactive shell unless ``command`` says otherwise); counts
    against the sandbox's background commands (429 ``background_limit`` past the cap)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "sandbox.pty", sandbox_id) as audit:
        info = await state.manager.start_pty(sandbox_id, body, owner=who.owner_filter)
        audit["pid"] = info.pid
    return Response(info.model_dump_json(), 201, media_type="application/json")


@router.post("/{sandbox_id}/pty/{pid}/input", status_code=204)
async def pty_input(
    sandbox_id: SandboxId,
    pid: Pid,
    body: PtyInput,
    request: Request,
    who: Caller,
    command_id: CommandId = None,
) -> Response:
    """Type raw bytes (base64) into it."""
    who.require_write()
    manager = state_of(request).manager
    await manager.send_pty_input(
        sandbox_id, pid, body.data(), command_id=command_id, owner=who.owner_filter
    )
    return Response(status_code=204)


@router.post("/{sandbox_id}/pty/{pid}/resize", status_code=204)
async def pty_resize(
    sandbox_id: SandboxId,
    pid: Pid,
    body: PtySize,
    request: Request,
    who: Caller,
    command_id: CommandId = None,
) -> Response:
    """Give it a new size; its foreground programs get SIGWINCH."""
    who.require_write()
    await state_of(request).manager.resize_pty(
        sandbox_id, pid, body, command_id=command_id, owner=who.owner_filter
    )
    return Response(status_code=204)


@router.get("/{sandbox_id}/pty/{pid}/output", response_model=PtyOutput)
async def pty_output(
    sandbox_id: SandboxId,
    pid: Pid,
    request: Request,
    who: Caller,
    offset: Annotated[int, Query(ge=0)] = 0,
    command_id: CommandId = None,
) -> Response:
    """Its output from ``offset`` on, as far as the server still keeps it (256 KiB)."""
    manager = state_of(request).manager
    output = await manager.pty_output(
        sandbox_id, pid, offset, command_id=command_id, owner=who.owner_filter
    )
    return _json(output)


# ---------------------------------------------------------------- files


@router.get("/{sandbox_id}/files", response_model=list[FileInfo])
async def list_files(
    sandbox_id: SandboxId,
    request: Request,
    who: Caller,
    query: Annotated[ListFiles, Query()],
) -> Response:
    """Entries below the path; a listing cut at its bound (100,000 entries or 4 MiB of names
    and paths) has the ``X-Listing-Truncated`` header, saying why."""
    state = state_of(request)
    checking = state.listings.checking(request.scope, who.tenant)
    found = await state.manager.list_files(
        sandbox_id, query, owner=who.owner_filter, checking=checking
    )
    return listing_response(found, request)


_FILE_INFOS = TypeAdapter(list[FileInfo])
_ARTIFACT_INFOS = TypeAdapter(list[ArtifactInfo])


def listing_response(found: Listing, request: Request) -> Response:
    """``found`` as JSON, written once (FastAPI dumped, checked and wrote each entry again:
    ~100 ms of the event loop for 25,900 entries, red team 2026-12-06), with the
    ``X-Listing-Truncated`` header if it was cut (its entries are charged in its turn)."""
    answer = Response(_FILE_INFOS.dump_json(found), media_type="application/json")
    if found.truncated:
        answer.headers[TRUNCATED_HEADER] = found.truncated
    return answer


@router.get("/{sandbox_id}/files/stat", response_model=FileInfo)
async def stat_file(
    sandbox_id: SandboxId, query: PathQuery, request: Request, who: Caller
) -> FileInfo:
    return await state_of(request).manager.stat_file(sandbox_id, query, owner=who.owner_filter)


@router.get(
    "/{sandbox_id}/files/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download_file(
    sandbox_id: SandboxId, query: PathQuery, request: Request, who: Caller
) -> StreamingResponse:
    """Stream a file out of the sandbox."""
    chunks = state_of(request).manager.read_file_chunks(sandbox_id, query, owner=who.owner_filter)
    # Pull the first chunk now, so a missing file is a 404 rather than a broken stream.
    first = await anext(chunks, b"")
    return StreamingResponse(
        _prepend(first, chunks),
        media_type="application/octet-stream",
        headers={"Content-Disposition": _attachment(query.path.rsplit("/", 1)[-1])},
    )


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


def _attachment(name: str) -> str:
    """RFC 6266 header for any file name: an ASCII fallback plus the exact UTF-8 name."""
    fallback = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name
    )
    return (
        f"attachment; filename=\"{fallback}\"; filename*=utf-8''{urllib.parse.quote(name, safe='')}"
    )


@router.put("/{sandbox_id}/files/content", response_model=WrittenFile)
async def upload_raw(
    sandbox_id: SandboxId, query: Annotated[WriteFile, Query()], request: Request, who: Caller
) -> WrittenFile:
    """Upload the raw request body to ``path``, streamed (never held whole in memory)."""
    who.require_write()
    state = state_of(request)
    limit = _upload_limit(request)
    async with state.audited(request, who, "file.write", sandbox_id, path=query.path) as audit:
        size = await state.manager.write_file_chunks(
            sandbox_id, query, request.stream(), max_bytes=limit, owner=who.owner_filter
        )
        audit["size_bytes"] = size
    return WrittenFile(path=query.path, size_bytes=size)


MULTIPART_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}},
                    "required": ["file"],
                }
            }
        },
    }
}


@router.post(
    "/{sandbox_id}/files",
    response_model=WrittenFile,
    status_code=201,
    openapi_extra=MULTIPART_BODY,
)
async def upload_multipart(
    sandbox_id: SandboxId, query: Annotated[WriteFile, Query()], request: Request, who: Caller
) -> WrittenFile:
    """Upload a multipart form's ``file`` field to ``path``, streamed into the sandbox as
    it arrives (never spooled on the host)."""
    who.require_write()
    state = state_of(request)
    limit = _upload_limit(request, required=True)
    chunks = multipart.file_stream(request.headers, request.stream())
    async with state.audited(request, who, "file.write", sandbox_id, path=query.path) as audit:
        size = await state.manager.write_file_chunks(
            sandbox_id, query, chunks, max_bytes=limit, owner=who.owner_filter
        )
        audit["size_bytes"] = size
    return WrittenFile(path=query.path, size_bytes=size)


def _upload_limit(request: Request, required: bool = False) -> int:
    limit = state_of(request).settings.max_upload_mb * 1024 * 1024
    declared = request.headers.get("content-length")
    if required and (declared is None or not declared.isdigit()):
        raise RequestTooLarge("a multipart upload needs a Content-Length; or PUT the raw bytes")
    if declared is not None and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise RequestTooLarge(
            f"upload of {declared} bytes is over {limit} bytes; raise API_MAX_UPLOAD_MB"
        )
    return limit


@router.post("/{sandbox_id}/directories", response_model=FileInfo, status_code=201)
async def make_dir(
    sandbox_id: SandboxId, query: PathQuery, request: Request, who: Caller
) -> FileInfo:
    """Create a directory (and its parents)."""
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "file.mkdir", sandbox_id, path=query.path):
        await state.manager.make_dir(sandbox_id, query, owner=who.owner_filter)
    return await state.manager.stat_file(sandbox_id, query, owner=who.owner_filter)


@router.delete("/{sandbox_id}/files", status_code=204)
async def delete_file(
    sandbox_id: SandboxId, query: Annotated[RemoveFile, Query()], request: Request, who: Caller
) -> Response:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "file.delete", sandbox_id, path=query.path):
        await state.manager.remove_file(sandbox_id, query, owner=who.owner_filter)
    return Response(status_code=204)


# ---------------------------------------------------------------- artifacts


@router.get("/{sandbox_id}/artifacts", response_model=list[ArtifactInfo])
async def list_artifacts(sandbox_id: SandboxId, request: Request, who: Caller) -> Response:
    """Files the sandbox left in /workspace/artifacts, kept after it was destroyed."""
    state = state_of(request)
    async with state.listings.turn(request.scope, who.tenant):
        kept = await state.manager.list_artifacts(sandbox_id, owner=who.owner_filter)
        charge_entries(request.scope, len(kept))
    return Response(_ARTIFACT_INFOS.dump_json(kept), media_type="application/json")


@router.get(
    "/{sandbox_id}/artifacts/{path:anypath}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {}, 416: {}},
)
async def download_artifact(
    sandbox_id: SandboxId, path: str, request: Request, who: Caller
) -> Response:
    """A kept artifact; one ``Range: bytes=`` range is honoured (206), as it was before."""
    manager = state_of(request).manager
    name = path.rsplit("/", 1)[-1]
    if not isinstance(manager, SandboxManager):
        # On a Ray cluster the artifact lives on its node and comes over in ranged reads:
        # streamed on, never copied to this host's disk (which holds the key store) nor held
        # here whole (a tenant's artifact quota is 1 GiB by default).
        chunks = manager.read_artifact_chunks(sandbox_id, path, owner=who.owner_filter)
        first = await anext(chunks, b"")  # a missing artifact is a 404, not a broken stream
        return StreamingResponse(
            _prepend(first, chunks),
            media_type="application/octet-stream",
            headers={"content-disposition": _attachment(name)},
        )
    # Opened once, here: a 404 if it is gone, and what is sent comes from this descriptor,
    # never from the path again. A FileResponse stats and opens its path when it is sent, so
    # a DELETE in between was a 500, or a body cut after its headers, with a traceback in
    # the log (red team, 2026-12-06). A file deleted once opened still streams whole.
    file, info = await manager.open_artifact(sandbox_id, path, owner=who.owner_filter)
    return opened_file_response(file, info, request, _attachment(name))


@router.delete("/{sandbox_id}/artifacts", status_code=204)
async def delete_artifacts(sandbox_id: SandboxId, request: Request, who: Caller) -> Response:
    who.require_write()
    state = state_of(request)
    async with state.audited(request, who, "artifacts.delete", sandbox_id):
        await state.manager.delete_artifacts(sandbox_id, owner=who.owner_filter)
    return Response(status_code=204)
