"""A multipart upload's one file, streamed: never spooled to the host's disk.

Starlette's form parser writes every file part over 1 MiB to a temporary file in the host's
/tmp, so a slow or stalled upload parked up to ``API_MAX_UPLOAD_MB`` there per connection.
:func:`file_stream` parses the body as it arrives and yields the bytes of the part named
``file`` as they come; the caller writes them straight into the sandbox. Other fields are
allowed (a few, small) and ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from sandlot.errors import InvalidRequest

FILE_FIELD = b"file"
MAX_PARTS = 4
MAX_FIELD_BYTES = 64 * 1024


class _Parts:
    """Parser callbacks: the file part's data is queued, everything else is bounded."""

    def __init__(self) -> None:
        self.header_name = b""
        self.header_value = b""
        self.disposition = b""
        self.parts = 0
        self.in_file = False
        self.file_seen = False
        self.field_bytes = 0
        self.ready: list[bytes] = []

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"a multipart upload takes at most {MAX_PARTS} parts")
        self.disposition = b""
        self.in_file = False

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]
        if len(self.header_value) > MAX_FIELD_BYTES:
            raise InvalidRequest("a multipart part header is too large")

    def on_header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = self.header_value
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        if options.get(b"name") == FILE_FIELD and not self.file_seen:
            self.in_file = self.file_seen = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.in_file:
            self.ready.append(data[start:end])
            return
        self.field_bytes += end - start
        if self.field_bytes > MAX_FIELD_BYTES:
            raise InvalidRequest("multipart fields other than 'file' must be small")

    def on_part_end(self) -> None:
        self.in_file = False


async def file_stream(
    headers: Mapping[str, str], body: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The bytes of the multipart field ``file``, as they arrive.

    Raises:
        InvalidRequest: not multipart, malformed, too many or too large other parts, or no
            ``file`` field.
    """
    content_type, params = parse_options_header(headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise InvalidRequest("send multipart/form-data with a boundary, or PUT the raw bytes")
    parts = _Parts()
    callbacks = {
        name: getattr(parts, name)
        for name in (
            "on_part_begin",
            "on_header_field",
            "on_header_value",
            "on_header_end",
            "on_headers_finished",
            "on_part_data",
            "on_part_end",
        )
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in body:
            parser.write(chunk)
            while parts.ready:
                yield parts.ready.pop(0)
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequest(f"invalid multipart body: {exc}") from None
    while parts.ready:
        yield parts.ready.pop(0)
    if not parts.file_seen:
        raise InvalidRequest("send the file as the multipart field 'file'")
