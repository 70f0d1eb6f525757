"""``multipart/form-data`` uploads streamed straight into ``files_dir/.incoming``, within the limits.

Starlette's own form parser spools a large file to the system temp directory and reads the whole
body before a handler can refuse it; this parser writes the ``file`` part where it will live and
stops reading at the first byte over ``max_upload_bytes`` or the first line over ``max_requests``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from specbatch.api.errors import ApiError
from specbatch.config import Settings
from specbatch.jobs.files import Tally

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 64 * 1024            # any form field other than the file
FORM_OVERHEAD = 64 * 1024              # boundaries and part headers around the file


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None         # None: no "file" part
    tally: Tally = field(default_factory=Tally)


def not_text(why: str) -> ApiError:
    """A batch input file that is not UTF-8 JSON Lines text (a binary, a spreadsheet, UTF-16):
    refused at upload, as OpenAI refuses one that is not UTF-8 ("Invalid file for Batch API. Must
    be utf-8 encoded"); lines that are text but not JSON fail the batch instead, line by line."""
    return ApiError(400, f"{why}; a batch input file is JSON Lines saved as UTF-8: one JSON request "
                         "per line", param="file")


class _Parts:
    """Callbacks of python-multipart's streaming parser: headers per part, data to file or field."""

    def __init__(self, out: BinaryIO, settings: Settings) -> None:
        self.out, self.settings, self.upload = out, settings, Upload()
        self._header, self._value = b"", b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._buf = bytearray()
        self.error: ApiError | None = None

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_part_data": self.part_data,
                "on_part_end": self.part_end}

    def part_begin(self) -> None:
        self._headers, self._name, self._buf = {}, None, bytearray()

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def headers_finished(self) -> None:
        _, opts = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = opts.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.upload.filename is not None and self.error is None:
                # a second part would be appended to the first's bytes: its first line could run
                # into the first part's last one, a line the client never wrote
                self.error = ApiError(400, "the form has more than one 'file' part; upload one file per request",
                                      param="file")
            self.upload.filename = opts.get(b"filename", b"upload.jsonl").decode("utf-8", "replace") or "upload.jsonl"
            if "\x00" in self.upload.filename and self.error is None:    # PostgreSQL text cannot hold it
                self.error = ApiError(400, "the file's name contains a NUL character", param="file")

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        chunk = data[start:end]
        if self._name != "file":
            self._buf += chunk
            if len(self._buf) > MAX_FIELD_BYTES:
                self.error = ApiError(400, f"form field {self._name!r} is over {MAX_FIELD_BYTES} bytes",
                                      param=self._name)
            return
        tally = self.upload.tally
        tally.feed(chunk)
        if tally.size > self.settings.max_upload_bytes:
            self.error = ApiError(413, f"the file is over {self.settings.max_upload_bytes} bytes "
                                       "(SPECBATCH_MAX_UPLOAD_BYTES); split it into several batches",
                                  param="file", code="file_too_large")
        elif tally.not_text is not None:
            self.error = not_text(tally.not_text)
        elif tally.lines > self.settings.max_requests:
            self.error = ApiError(413, f"the file has over {self.settings.max_requests} lines "
                                       "(SPECBATCH_MAX_REQUESTS); split it into several batches",
                                  param="file", code="too_many_lines")
        else:
            self.out.write(chunk)

    def part_end(self) -> None:
        if self._name and self._name != "file":
            self.upload.fields[self._name] = bytes(self._buf).decode("utf-8", "replace")
        elif self._name == "file":
            self.upload.tally.close()
            if self.upload.tally.not_text is not None and self.error is None:
                self.error = not_text(self.upload.tally.not_text)
            if self.upload.tally.lines > self.settings.max_requests and self.error is None:
                self.error = ApiError(413, f"the file has over {self.settings.max_requests} lines "
                                           "(SPECBATCH_MAX_REQUESTS); split it into several batches",
                                      param="file", code="too_many_lines")


async def receive(request: Request, dest: Path, settings: Settings) -> Upload:
    """Parse the request body, writing the ``file`` part to ``dest``; ApiError on a bad form or
    one over the limits (the body is not read further)."""
    ctype, opts = parse_options_header(request.headers.get("content-type"))
    boundary = opts.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise ApiError(400, "expected a multipart/form-data body with 'purpose' and 'file'")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + FORM_OVERHEAD:
        raise ApiError(413, f"the upload is {int(length)} bytes; files are at most {settings.max_upload_bytes} "
                            "bytes (SPECBATCH_MAX_UPLOAD_BYTES)", param="file", code="file_too_large")
    with dest.open("wb") as out:
        parts = _Parts(out, settings)
        parser = MultipartParser(boundary, cast("MultipartCallbacks", parts.callbacks()))
        try:
            async for chunk in request.stream():
                parser.write(chunk)
                if parts.error is not None:
                    raise parts.error
            parser.finalize()
        except MultipartParseError as e:     # its message names the offset, never the client's bytes
            raise ApiError(400, f"malformed multipart/form-data body: {e}") from None
    if parts.error is not None:
        raise parts.error
    if parser.state != MultipartState.END:     # a body cut short would be stored as a complete file
        raise ApiError(400, "the multipart/form-data body ends before its closing boundary; nothing was stored",
                       param="file")
    return parts.upload
