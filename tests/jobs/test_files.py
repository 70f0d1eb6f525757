"""The HTTP API's file tally: size, non-blank lines (as intake counts requests) and sha256, fed in
arbitrary chunks."""

from __future__ import annotations

import hashlib

import pytest

from specbatch.config import Settings
from specbatch.jobs.files import Tally, file_path

TEXT = b'{"a": 1}\r\n\n  \n{"b": 2}\n{"c": 3}'      # CRLF, a blank and a whitespace line, no final newline


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_tally_is_independent_of_chunking(size: int) -> None:
    t = Tally()
    for i in range(0, len(TEXT), size):
        t.feed(TEXT[i:i + size])
    t.close()
    assert (t.size, t.lines, t.longest_line, t.sha256) == (len(TEXT), 3, 9, hashlib.sha256(TEXT).hexdigest())


def _tally(data: bytes, size: int) -> Tally:
    t = Tally()
    for i in range(0, len(data), size):
        t.feed(data[i:i + size])
    return t.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_utf8_split_by_the_chunks_is_text_and_the_first_bad_line_is_named(size: int) -> None:
    good = '\ufeff{"a": "é€𝄞"}\n\n{"b": "ü"}\n'.encode()
    assert _tally(good, size).not_text is None
    assert _tally(good + b'{"c": "\xff"}\n{"d": "\0"}', size).not_text == "line 4 is not UTF-8 text (byte 0xff)"
    assert _tally(good + b'{"d": "\0"}\n', size).not_text == "line 4 holds a NUL byte: binary data, not JSON text"
    assert _tally(good + "€".encode()[:2], size).not_text == "line 4 is not UTF-8 text (byte 0xe2)"   # cut short


def test_ids_never_become_paths(tmp_path) -> None:  # noqa: ANN001
    from specbatch.jobs.files import FileNotFound

    settings = Settings.from_env({"SPECBATCH_FILES_DIR": str(tmp_path)})
    assert file_path(settings, "file-0123456789abcdef01234567") == tmp_path / "file-0123456789abcdef01234567"
    for bad in ("../x", "file-../../etc/passwd", "file-0123456789ABCDEF01234567", "/etc/passwd"):
        with pytest.raises(FileNotFound):
            file_path(settings, bad)


def test_sweep_removes_only_old_leftovers(tmp_path) -> None:  # noqa: ANN001
    import os
    import time

    from specbatch.jobs.files import incoming, sweep_incoming

    settings = Settings.from_env({"SPECBATCH_FILES_DIR": str(tmp_path)})
    old, new = tmp_path / ".incoming" / "old", tmp_path / ".incoming" / "new"
    with incoming(settings):                      # creates the directory
        pass
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    assert sweep_incoming(settings) == 1
    assert not old.exists() and new.exists()


@pytest.mark.parametrize("size", [1, 2, 3, 1000])
def test_a_utf16_upload_is_named_as_utf16(size: int) -> None:
    """An upload saved as UTF-16 (Excel's 'Unicode text', PowerShell's default) is named so, as
    `specbatch submit` names it: the API said only 'line 1 is not UTF-8 text (byte 0xff)'."""
    text = '{"custom_id": "a", "prompt": "hi"}\n'
    want = "line 1 is not UTF-8 text: it looks like UTF-16 (it starts with a UTF-16 byte-order mark)"
    assert _tally(text.encode("utf-16-le"), size).not_text == "line 1 holds a NUL byte: binary data, not JSON text"
    for data in (b"\xff\xfe" + text.encode("utf-16-le"), b"\xfe\xff" + text.encode("utf-16-be")):
        assert _tally(data, size).not_text == want
