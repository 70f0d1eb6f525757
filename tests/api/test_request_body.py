"""JSON request bodies the reader itself cannot take, in process (no server, no broker): each a 400
in OpenAI's error shape that says why, never FastAPI's "There was an error parsing the body"."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from specbatch.jobs.structured import TOO_DEEP

FIELDS = {"input_file_id": "file-0123456789abcdef01234567", "endpoint": "/v1/chat/completions",
          "completion_window": "24h"}
JSON = {"Content-Type": "application/json"}


def _with(field: str, raw: str) -> bytes:
    """The batch body with ``field`` set to ``raw`` JSON text, as written (json.dumps cannot write
    it: it recurses as deep as the reader)."""
    return (json.dumps(FIELDS)[:-1] + f', "{field}": {raw}}}').encode()


def _nested(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("body", [_with("metadata", '{"note": ' + _nested(10_000) + "}"), _nested(10_000).encode(),
                                  ('{"a": ' * 100_000 + "1" + "}" * 100_000).encode()],
                         ids=["metadata", "whole body", "objects"])
def test_a_body_nested_too_deeply_is_a_400_that_says_so(client: Any, body: bytes,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Python's JSON reader raises RecursionError near 1000 levels: FastAPI answered "There was an
    error parsing the body" (code null), which names nothing a client can fix (tidy54)."""
    with caplog.at_level(logging.DEBUG):
        got = client.post("/v1/batches", content=body, headers=JSON)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error == {"message": f"the request body is not valid JSON: {TOO_DEEP}",
                     "type": "invalid_request_error", "param": None, "code": "invalid_json"}, error
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text, caplog.text


def test_a_body_at_the_json_readers_depth_limit_is_a_400_either_way(client: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Near 1000 levels whether Python's reader gives up depends on how deep the stack already is
    where it runs (CI's run parsed 1000 levels where a lone run did not): either answer is a 400
    that says what is wrong, the depth or the field, with no traceback."""
    with caplog.at_level(logging.DEBUG):
        got = client.post("/v1/batches", content=_with("output_expires_after", _nested(1_000)), headers=JSON)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["code"] == "invalid_json" or error["param"] == "output_expires_after", error
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text, caplog.text


@pytest.mark.parametrize("body, why", [
    (b'{"input_file_id": "\xff\xfe"}', "it is not UTF-8 text (byte 0xff at byte 19)"),
    (b'{"input_file_id": ' + b"1" * 5000 + b"}", "a number has more than 4300 digits"),
])
def test_a_body_the_json_reader_refuses_otherwise_says_why(client: Any, body: bytes, why: str) -> None:
    """The same generic answer for bytes that are not UTF-8 and an integer past Python's digit
    limit: each says what is wrong with the body."""
    got = client.post("/v1/batches", content=body, headers=JSON)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["message"], error["code"]) == (f"the request body is not valid JSON: {why}", "invalid_json"), error
