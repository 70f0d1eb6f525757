"""Files of the HTTP API (OpenAI Files): bytes under ``settings.files_dir``, one ``api_files`` row each.

A file is written beside its final place (``files_dir/.incoming``), fsynced, then renamed to
``files_dir/<id>``; the row is written after the bytes, so a row always has its bytes. Ids are
``file-`` + 24 hex digits; nothing a client sends becomes part of a path.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Row, and_, bindparam, or_, select
from sqlalchemy.orm import Session

from specbatch.config import Settings
from specbatch.db.models import ApiFile, row_columns, utcnow
from specbatch.errors import InputError, SpecBatchError
from specbatch.jobs.intake import LOOKS_UTF16, UTF16_BOMS

ID_RE = re.compile(r"^file-[0-9a-f]{24}$")
PURPOSES = ("batch", "batch_output")
Reader = Connection | Session     # reads run Core statements on either (the API's: a Connection)
MAX_ID = 64        # the id columns' width; every id we issue (file-..., batch_...) is shorter


def shown_id(value: str) -> str:
    """``value`` as an error message may echo it: not when it is longer than any id we issue or
    holds unprintable characters (a 150 MB "id" must not come back in a 404)."""
    return value if len(value) <= MAX_ID and value.isprintable() else f"(an id of {len(value)} characters)"


class FileNotFound(SpecBatchError):
    """No file with that id."""


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def files_root(settings: Settings) -> Path:
    root = Path(settings.files_dir).expanduser()
    (root / ".incoming").mkdir(parents=True, exist_ok=True)
    return root


def file_path(settings: Settings, file_id: str) -> Path:
    if not ID_RE.match(file_id):
        raise FileNotFound(f"No such File object: {shown_id(file_id)}")
    return files_root(settings) / file_id


@dataclass
class Tally:
    """Size, non-blank line count and sha256 of bytes fed in chunks (lines split across chunks too),
    and ``not_text``: why the bytes are not JSON Lines text, naming the first line at fault (invalid
    UTF-8, or a NUL byte, which no JSON text holds raw), else None."""

    size: int = 0
    lines: int = 0
    longest_line: int = 0
    not_text: str | None = None
    _line_no: int = 1
    _line_len: int = 0
    _line_blank: bool = True
    _head: bytes = b""          # the file's first two bytes
    _sha: Any = field(default_factory=hashlib.sha256)
    _utf8: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")())

    def feed(self, chunk: bytes) -> None:
        if len(self._head) < 2:     # a byte-order mark (never UTF-8) names the encoding, as intake's does
            self._head += chunk[:2 - len(self._head)]
            if self._head.startswith(UTF16_BOMS):
                self.not_text = f"line 1 is not UTF-8 text: {LOOKS_UTF16}"
        self.size += len(chunk)
        self._sha.update(chunk)
        parts = chunk.split(b"\n")
        for i, part in enumerate(parts):
            self._line_len += len(part)
            if self._line_blank and part.strip():
                self._line_blank = False
            if self.not_text is None:
                self._check_text(part, final=i < len(parts) - 1)
            if i < len(parts) - 1:      # a newline ends this line
                self._end_line()

    def _check_text(self, part: bytes, final: bool) -> None:
        """(a sequence split across chunks is held by the incremental decoder until it completes)"""
        try:
            self._utf8.decode(part, final=final)
        except UnicodeDecodeError as e:
            self.not_text = f"line {self._line_no} is not UTF-8 text (byte 0x{e.object[e.start]:02x})"
            return
        if b"\0" in part:
            self.not_text = f"line {self._line_no} holds a NUL byte: binary data, not JSON text"

    def _end_line(self) -> None:
        self.longest_line = max(self.longest_line, self._line_len)
        if not self._line_blank:
            self.lines += 1
        self._line_no += 1
        self._line_len, self._line_blank = 0, True

    def close(self) -> Tally:
        if self.not_text is None:
            self._check_text(b"", final=True)     # a sequence cut short by the end of the file
        self._end_line()
        return self

    @property
    def sha256(self) -> str:
        return str(self._sha.hexdigest())


@contextmanager
def incoming(settings: Settings) -> Iterator[Path]:
    """A fresh path in ``files_dir/.incoming``; removed on exit unless ``place`` moved it away."""
    tmp = files_root(settings) / ".incoming" / secrets.token_hex(12)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def sweep_incoming(settings: Settings, older_than: float = 24 * 3600) -> int:
    """Remove uploads a killed process left half-written (old ones only: another API process may
    be writing into the same directory right now); returns how many."""
    import time

    cutoff, n = time.time() - older_than, 0
    for p in (files_root(settings) / ".incoming").iterdir():
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
                n += 1
        except FileNotFoundError:
            continue
    return n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def place(settings: Settings, tmp: Path, file_id: str) -> Path:
    """Durably move a finished incoming file to its place (fsync the bytes, rename, fsync the dir)."""
    with tmp.open("rb+") as fh:
        os.fsync(fh.fileno())
    final = file_path(settings, file_id)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def add_file(s: Session, *, file_id: str, purpose: str, filename: str, tally: Tally,
             batch_id: str | None = None, kind: str | None = None, owner: str | None = None) -> ApiFile:
    row = ApiFile(id=file_id, purpose=purpose, filename=filename[:512], bytes=tally.size, lines=tally.lines,
                  sha256=tally.sha256, batch_id=batch_id, kind=kind, created_at=utcnow(), owner=owner)
    s.add(row)
    s.flush()
    return row


def visible(row: Any, owner: str | None) -> bool:
    """Whether a file or batch row is the tenant ``owner``'s (None: every tenant's, see api/auth.py);
    another tenant's object is answered as if it did not exist."""
    return row is not None and (owner is None or row.owner == owner)


def get_file(s: Session, file_id: str, owner: str | None = None) -> ApiFile:
    """The file's row as an object, for a write (``delete_file``); reads use ``read_file``."""
    row = s.get(ApiFile, file_id) if ID_RE.match(file_id) else None
    if row is None or not visible(row, owner):
        raise FileNotFound(f"No such File object: {shown_id(file_id)}")
    return row


FILE_COLUMNS = row_columns(ApiFile)
_FILE = select(*FILE_COLUMNS).where(ApiFile.__table__.c.id == bindparam("file_id"))


def read_file(c: Reader, file_id: str, owner: str | None = None) -> Row[Any]:
    """The file as a plain row (``file_object`` takes it as it takes an ``ApiFile``); FileNotFound
    if it is not the tenant's."""
    row = c.execute(_FILE, {"file_id": file_id}).first() if ID_RE.match(file_id) else None
    if row is None or not visible(row, owner):
        raise FileNotFound(f"No such File object: {shown_id(file_id)}")
    return row


# the statements behind a page, one per shape, built on first use: building a select with its
# WHERE, ORDER BY and LIMIT (and SQLAlchemy's cache key of it) on every request cost more CPU than
# SQLite's run of it (issue 32). Keyed by the caller's base statement itself: built once, at module level
_PAGES: dict[tuple[Any, bool, bool, bool], Any] = {}
_CURSORS: dict[Any, Any] = {}


def _page_query(table: Any, stmt: Any, descending: bool, owned: bool, after: bool) -> Any:
    key = (stmt, descending, owned, after)
    query = _PAGES.get(key)
    if query is None:
        c = table.c
        if owned:
            stmt = stmt.where(c.owner == bindparam("owner"))
        if after:
            t, i = bindparam("after_t", type_=c.created_at.type), bindparam("after_i", type_=c.id.type)
            if descending:
                stmt = stmt.where(or_(c.created_at < t, and_(c.created_at == t, c.id < i)))
            else:
                stmt = stmt.where(or_(c.created_at > t, and_(c.created_at == t, c.id > i)))
        order = (c.created_at.desc(), c.id.desc()) if descending else (c.created_at, c.id)
        query = _PAGES[key] = stmt.order_by(*order).limit(bindparam("limit"))
    return query


def _cursor(table: Any) -> Any:
    query = _CURSORS.get(table)
    if query is None:
        c = table.c
        query = _CURSORS[table] = select(c.created_at, c.id, c.owner).where(c.id == bindparam("cursor"))
    return query


def page_after(c: Reader, model: Any, stmt: Any, limit: int, after: str | None, descending: bool,
               owner: str | None = None, params: dict[str, Any] | None = None) -> tuple[list[Row[Any]], bool]:
    """``owner``'s rows of ``model`` after the cursor ``after`` (an id) by (created_at, id);
    (rows, has_more). ``stmt``: a Core select of ``model``'s table (its columns first, say
    ``row_columns(model)``) built once, at module level (the page's statements are cached per
    ``stmt``), with ``params`` for its bind parameters. Rows are plain rows."""
    table = model.__table__
    values: dict[str, Any] = {**(params or {}), "limit": limit + 1}
    if owner is not None:
        values["owner"] = owner
    if after:
        cursor = c.execute(_cursor(table), {"cursor": after}).first() if len(after) <= MAX_ID else None
        if cursor is None or not visible(cursor, owner):
            raise InputError(f"no object with id {shown_id(after)!r} to list after", field="after")
        values["after_t"], values["after_i"] = cursor.created_at, cursor.id
    rows = list(c.execute(_page_query(table, stmt, descending, owner is not None, bool(after)), values))
    return rows[:limit], len(rows) > limit


FILES = select(*FILE_COLUMNS)
FILES_OF_PURPOSE = FILES.where(ApiFile.__table__.c.purpose == bindparam("purpose"))


def list_files(c: Reader, *, limit: int, after: str | None = None, purpose: str | None = None,
               order: str = "desc", owner: str | None = None) -> tuple[list[Row[Any]], bool]:
    """A page of the tenant's files, as plain rows (``file_object`` takes them)."""
    if purpose:
        return page_after(c, ApiFile, FILES_OF_PURPOSE, limit, after, order != "asc", owner=owner,
                          params={"purpose": purpose})
    return page_after(c, ApiFile, FILES, limit, after, order != "asc", owner=owner)


def delete_file(s: Session, file_id: str, owner: str | None = None) -> None:
    """The row, in the caller's transaction; unlink ``file_path`` after it commits (bytes without a
    row are harmless, a row without bytes is not)."""
    s.delete(get_file(s, file_id, owner))
    s.flush()


def _ts(t: datetime) -> int:
    return int(t.timestamp())


def file_object(f: ApiFile | Row[Any]) -> dict[str, Any]:
    """OpenAI's FileObject, from the file's object or its plain row (``read_file``)."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": _ts(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "expires_at": None,
            "status_details": None}
