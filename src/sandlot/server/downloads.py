"""A file the server opened once, sent from its descriptor: a download that a delete racing
it can neither cut nor turn into a 500 (kept artifacts, ``routes.download_artifact``)."""

from __future__ import annotations

import email.utils
import io
import os
import re
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

# What one read takes off the event loop and holds until it is sent.
CHUNK_BYTES = 256 * 1024
# At most 19 digits (an int64), ASCII ones: Python refuses to convert more than 4,300 digits,
# and a header of 5,000 was a 500 with two tracebacks (red team, 2026-12-06).
_ONE_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")


def opened_file_response(
    file: io.FileIO, info: os.stat_result, request: Request, disposition: str
) -> Response:
    """``file`` (open, a regular file whose ``fstat`` is ``info``) as the answer, with one
    ``Range: bytes=`` range honoured (206, 416), ETag and Last-Modified; closes it."""
    size = info.st_size
    etag = f'"{info.st_ino:x}-{info.st_mtime_ns:x}-{size:x}"'
    headers = {
        "content-disposition": disposition,
        "accept-ranges": "bytes",
        "etag": etag,
        "last-modified": email.utils.formatdate(info.st_mtime, usegmt=True),
    }
    # If-Range naming another version (an ETag or a date not this file's): all of it.
    if_range = request.headers.get("if-range")
    wanted = request.headers.get("range")
    span = None
    if wanted is not None and if_range in (None, etag, headers["last-modified"]):
        span = byte_range(wanted, size)
    if span == "unsatisfiable":
        file.close()
        headers["content-range"] = f"bytes */{size}"
        return Response(status_code=416, headers=headers)
    start, end, status = 0, size, 200
    if isinstance(span, tuple):
        (start, end), status = span, 206
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
    headers["content-length"] = str(end - start)
    return StreamingResponse(
        _read_chunks(file, start, end),
        status_code=status,
        media_type="application/octet-stream",
        headers=headers,
    )


def byte_range(header: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """``[start, end)`` of a ``Range`` header of one byte range, ``"unsatisfiable"``, or
    None to send it all: a header of several ranges, or one not understood, is ignored (as
    RFC 9110 allows)."""
    match = _ONE_RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # the last N bytes
        count = int(last)
        return (max(size - count, 0), size) if count > 0 and size > 0 else "unsatisfiable"
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if last != "" and int(last) < start:
        return None  # invalid: ignored
    return (start, end) if start < size else "unsatisfiable"


async def _read_chunks(file: io.FileIO, start: int, end: int) -> AsyncIterator[bytes]:
    """``file``'s bytes ``[start, end)``, read beside the event loop; closes it. A read
    cancelled (the client gone) is waited for before the close (``run_in_threadpool`` does
    not abandon its thread), so no read ever meets a closed or reused descriptor."""
    try:
        while start < end:
            chunk = await run_in_threadpool(
                os.pread, file.fileno(), min(CHUNK_BYTES, end - start), start
            )
            if not chunk:
                return  # shorter than its fstat said: kept files are not written to
            start += len(chunk)
            yield chunk
    finally:
        file.close()
