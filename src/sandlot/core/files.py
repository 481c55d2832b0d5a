"""Files in a live sandbox's /workspace, moved through its guest in chunks.

The guest shares a uid with sandboxed code, so nothing it says is trusted to end: reads are
bounded by the sandbox's disk size, and what a listing names is validated by the caller.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from sandlot.core.guest_link import GuestConnection
from sandlot.core.live import Live, guest_broken
from sandlot.errors import GuestError, InvalidRequest, PidsExhausted, RequestTooLarge, SandboxError
from sandlot.guest.ops import Op
from sandlot.models import LISTING_TRUNCATED, FileInfo, Listing
from sandlot.requests import FilePath, ListFiles, ReadFile, ReadRange, RemoveFile, WriteFile

FILE_CHUNK_BYTES = 1 << 20
# Called with a listing's entry count; the host's check of them runs inside what it returns.
EntriesCheck = Callable[[int], AbstractAsyncContextManager[None]]


async def file_op(live: Live, op: Op, payload: dict[str, Any]) -> dict[str, Any]:
    """One file request to the guest, restarting a guest that cannot serve any: one a
    background fork bomb starves, or one whose own limits sandboxed code lowered."""
    live.touch()
    conn, _ = await live.connection()
    try:
        return await conn.ask(op, payload)
    except SandboxError as exc:
        if not (isinstance(exc, PidsExhausted) or guest_broken(exc)):
            raise
        # A fresh guest (the processes of the old one killed, its limits new) can serve.
        await live.drop_guest()
        conn, _ = await live.connection()
        return await conn.ask(op, payload)


async def write_chunks(
    live: Live,
    request: WriteFile,
    chunks: AsyncIterable[bytes],
    *,
    max_bytes: int | None = None,
) -> int:
    """Stream chunks into a file; past ``max_bytes`` the partial file is removed.

    Raises:
        RequestTooLarge: more than ``max_bytes`` arrived.
    """
    written = 0
    size = 0
    first = True
    async for chunk in rechunk(chunks, FILE_CHUNK_BYTES):
        written += len(chunk)
        if max_bytes is not None and written > max_bytes:
            with contextlib.suppress(SandboxError):
                await remove(live, RemoveFile(path=request.path))
            raise RequestTooLarge(
                f"upload is over {max_bytes} bytes; raise API_MAX_UPLOAD_MB to allow more"
            )
        reply = await file_op(
            live,
            Op.FILE_WRITE,
            {"path": request.path, "append": not first, "mode": request.mode, "data": _b64(chunk)},
        )
        size = int(reply["size_bytes"])
        first = False
    return size


async def read_chunks(live: Live, request: FilePath) -> AsyncIterator[bytes]:
    """Stream a file out of the sandbox in chunks of at most 1 MiB."""
    live.touch()
    conn, _ = await live.connection()
    most = request.max_bytes if isinstance(request, ReadFile) else None
    async for chunk in read_through(conn, request.path, live.disk_bytes, most):
        yield chunk


async def read_range(live: Live, request: ReadRange) -> bytes:
    """At most ``request.length`` bytes of a file from ``request.offset`` (none past its end).

    Raises:
        GuestError: the guest sent more than asked, or bytes past the sandbox's disk size
            (it shares a uid with sandboxed code: a reply may lie).
    """
    live.touch()
    conn, _ = await live.connection()
    reply = await conn.ask(
        Op.FILE_READ, {"path": request.path, "offset": request.offset, "length": request.length}
    )
    data = base64.b64decode(reply["data"])
    if len(data) > request.length or request.offset + len(data) > live.disk_bytes:
        raise GuestError(f"{request.path}: the guest sent more than the read could hold")
    return data


async def list_dir(live: Live, request: ListFiles, checking: EntriesCheck | None = None) -> Listing:
    """The guest's listing, its entries checked here; ``checking``, called with their count
    once the guest has answered, is entered around that check (the server's turns: a
    tenant's listings checked a few at a time, never held while a guest works)."""
    reply = await file_op(live, Op.FILE_LIST, request.model_dump())
    # The guest says where it stopped; the words the client gets are the host's own.
    cut = any(error.get("code") == "too_many_entries" for error in reply.get("errors", ()))
    raw = reply["entries"]
    count = len(raw) if isinstance(raw, list) else 0
    async with checking(count) if checking is not None else contextlib.nullcontext():
        entries = await asyncio.to_thread(_checked, raw)
    return Listing(entries, LISTING_TRUNCATED if cut else None)


# The guest's entries checked a slice at a time, each slice stopping at its first bad entry
# (the sandbox writes them: 100,000 bad ones would be 800,000 errors, ~160 ms to make and
# megabytes to say).
_ENTRIES = TypeAdapter(Annotated[list[FileInfo], Field(fail_fast=True)])
_SLICE = 1024


def _checked(entries: list[Any]) -> list[FileInfo]:
    """A listing's entries as models, on a worker thread: 25,900 of them take ~60 ms, which
    on the event loop held every other tenant's call as long (red team, 2026-12-06), and in
    one call would hold the GIL as long; between slices the loop gets its turn."""
    checked: list[FileInfo] = []
    for start in range(0, len(entries), _SLICE):
        checked += _ENTRIES.validate_python(entries[start : start + _SLICE])
    return checked


async def stat(live: Live, request: FilePath) -> FileInfo:
    return FileInfo.model_validate(await file_op(live, Op.FILE_STAT, request.model_dump()))


async def remove(live: Live, request: RemoveFile) -> None:
    await file_op(live, Op.FILE_REMOVE, request.model_dump())


async def make_dir(live: Live, request: FilePath) -> None:
    await file_op(live, Op.FILE_MKDIR, request.model_dump())


async def read_through(
    conn: GuestConnection, path: str, limit_bytes: int, max_bytes: int | None = None
) -> AsyncIterator[bytes]:
    """Read a file through the guest, never trusting it to say when to stop.

    The guest shares a uid with sandboxed code, so a reply may lie: a "file" that never reaches
    eof would otherwise stream until the host's disk or memory is full.

    Raises:
        InvalidRequest: the file holds more than the caller's ``max_bytes`` (checked on the
            bytes read, not on a size looked up before).
        GuestError: the guest sent more bytes than the sandbox's disk can hold.
    """
    offset = 0
    while True:
        length = FILE_CHUNK_BYTES
        if max_bytes is not None:  # one byte past the bound is enough to know
            length = max(1, min(length, max_bytes + 1 - offset))
        reply = await conn.ask(Op.FILE_READ, {"path": path, "offset": offset, "length": length})
        data = base64.b64decode(reply["data"])
        offset += len(data)
        if max_bytes is not None and offset > max_bytes:
            raise InvalidRequest(
                f"{path} holds more than {max_bytes} bytes, the most this read returns: "
                "read a part of it (head, tail, grep) or download it"
            )
        if offset > limit_bytes:
            raise GuestError(
                f"{path} grew past the sandbox's disk size ({limit_bytes} bytes) while read"
            )
        if data:
            yield data
        if reply["eof"] or not data:
            return


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def rechunk(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Regroup a byte stream into pieces of at most ``size`` (at least one, maybe empty)."""
    buffer = bytearray()
    sent = False
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
            sent = True
    if buffer or not sent:
        yield bytes(buffer)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
