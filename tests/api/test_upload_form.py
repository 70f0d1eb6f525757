"""POST /v1/files at the form's edges, in process (no server, no broker): what a client sends
that OpenAI's form does not have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", ' \
       b'"body": {"messages": [{"role": "user", "content": "hi"}]}}'


@pytest.mark.parametrize("second", [LINE + b"\n", LINE.replace(b'"a"', b'"b"')])
def test_two_file_parts_are_refused_not_joined(client: Any, tmp_path: Path, second: bytes) -> None:
    """Two ``file`` parts were stored as one file, the second's bytes after the first's: a first
    part without a final newline ran its last line and the next part's first into one line, and
    the batch failed on lines the client never wrote. One file per upload, as OpenAI's form."""
    got = client.post("/v1/files", data={"purpose": "batch"},
                      files=[("file", ("a.jsonl", LINE, "application/jsonl")),
                             ("file", ("b.jsonl", second, "application/jsonl"))])
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "file" and "more than one 'file' part" in error["message"], error
    assert client.get("/v1/files").json()["data"] == []
    assert not any(p.is_file() for p in (tmp_path / "files").rglob("*"))


def test_one_file_part_is_stored_whole(client: Any) -> None:
    got = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", LINE + b"\n")})
    assert got.status_code == 200, got.text
    assert client.get(f"/v1/files/{got.json()['id']}/content").content == LINE + b"\n"


def test_an_upload_without_a_purpose_says_it_is_missing(client: Any) -> None:
    """It said "purpose must be 'batch' (got None)": a Python value for a field the form lacked (qa53)."""
    got = client.post("/v1/files", files={"file": ("a.jsonl", LINE + b"\n")})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["param"], error["message"]) == ("purpose", "missing required parameter 'purpose': give 'batch'"), error


@pytest.mark.parametrize("data, param, words", [
    ({"purpose": "batch", "purpsoe": "batch"}, "purpsoe", "unrecognized form field 'purpsoe'"),
    ({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "10"},
     "expires_after", "expires_after.seconds: Input should be greater than or equal to 3600"),
    ({"purpose": "batch", "expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
     "expires_after", "expires_after.anchor"),
    ({"purpose": "batch", "expires_after[seconds]": "3600"}, "expires_after", "expires_after.anchor: Field required"),
])
def test_an_unknown_form_field_or_an_expiry_out_of_bounds_is_refused(client: Any, tmp_path: Path, data: dict,
                                                                       param: str, words: str) -> None:
    """Both were dropped: a misspelt field and ``expires_after`` (qa57), where ``POST /v1/batches``
    refuses an unknown field and checks ``output_expires_after``."""
    got = client.post("/v1/files", data=data, files={"file": ("a.jsonl", LINE + b"\n")})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert client.get("/v1/files").json()["data"] == []
    assert not any(p.is_file() for p in (tmp_path / "files").rglob("*"))


def test_an_expiry_within_bounds_is_taken(client: Any) -> None:
    got = client.post("/v1/files", data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                         "expires_after[seconds]": "3600"}, files={"file": ("a.jsonl", LINE + b"\n")})
    assert got.status_code == 200, got.text
