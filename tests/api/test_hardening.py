"""What an attacker or a careless client sends a real `specbatch serve`: bodies that never end, keys
that are not theirs, ids and filters that are not text. Raw sockets where the client must not
finish sending; the official `openai` client elsewhere."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.conftest import KEYS, Api, chat_line, start_api

pytestmark = pytest.mark.integration

MiB = 1 << 20


TEAM = ("sk-team-a", "sk-team-b")      # two keys of one project
ADMIN = "sk-admin"


@pytest.fixture(scope="module")
def api(api_redis, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("hardening")
    server = Api(tmp, api_redis, f"sqlite:///{tmp / 'api.db'}", tiny_models)
    server.env["SPECBATCH_API_KEYS"] = ",".join([*KEYS, *(f"team:{k}" for k in TEAM), f"*:{ADMIN}"])
    server.start()
    yield server
    server.close()


def _head(path: str, key: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"{auth}{extra}\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read one response (Content-Length framed) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed mid-response"
        body += chunk
    return int(lines[0].split()[1]), json.loads(body)


def _unfinished_chunked(api: Api, path: str, key: str | None, n_bytes: int) -> tuple[int, dict[str, Any]]:
    """Send ``n_bytes`` of a chunked body and never its last chunk: the answer must come anyway.
    (A server that waits for the end of the body fails this at the socket timeout.)"""
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(_head(path, key, "Transfer-Encoding: chunked\r\n"))
        piece = b'{"pad": "' + b"x" * (64 * 1024) + b'"}'
        sent = 0
        while sent < n_bytes:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
        return _response(sock)


def test_a_chunked_body_without_a_key_is_refused_before_it_is_read(api: Api) -> None:
    for key, code in ((None, "missing_api_key"), ("sk-wrong", "invalid_api_key")):
        status, body = _unfinished_chunked(api, "/v1/batches", key, 1)
        assert (status, body["error"]["code"]) == (401, code)


def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(api: Api) -> None:
    status, body = _unfinished_chunked(api, "/v1/batches", KEYS[0], MiB + 128 * 1024)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    # a route that takes no body answers without reading it
    status, body = _unfinished_chunked(api, "/v1/batches/batch_x/cancel", KEYS[0], MiB + 128 * 1024)
    # a 500 here once (2026-12-03, not reproduced in 20 runs alone): the server's log says why
    assert status == 404, (body, api.procs[0].output()[-4000:])
    # the upload's own limit is the file's (here 60 kB) plus the form around it
    status, body = _unfinished_chunked(api, "/v1/files", KEYS[0], int(api.env["SPECBATCH_MAX_UPLOAD_BYTES"])
                                       + 128 * 1024)
    assert status in (400, 413), body


def test_a_declared_length_over_the_limit_is_refused_before_it_is_read(api: Api) -> None:
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(_head("/v1/batches", KEYS[0], f"Content-Length: {150 * MiB}\r\n") + b"{")
        status, body = _response(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(_head("/v1/batches", None, f"Content-Length: {150 * MiB}\r\n") + b"{")
        assert _response(sock)[0] == 401


def test_small_bodies_and_public_routes_still_pass(api: Api) -> None:
    status, body = api.request("POST", "/v1/batches", body=json.dumps(
        {"input_file_id": "file-0123456789abcdef01234567", "endpoint": "/v1/chat/completions",
         "completion_window": "24h"}).encode(), headers={"Content-Type": "application/json"})
    assert status == 404, body
    assert api.get("/healthz", key=None)[0] == 200


def test_a_body_that_is_not_a_json_object_says_so(api: Api) -> None:
    """A form post, a text/plain body, a JSON array and no body at all: one readable 400
    (`invalid_json`), not pydantic's "valid dictionary or object to extract fields from"."""
    fields = {"input_file_id": "file-0123456789abcdef01234567", "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}
    for body, ctype in ((b"input_file_id=x", "application/x-www-form-urlencoded"),
                        (json.dumps(fields).encode(), "text/plain"), (b"[]", "application/json"),
                        (None, "application/json")):
        status, raw = api.request("POST", "/v1/batches", body=body, headers={"Content-Type": ctype})
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == "invalid_json", (ctype, body, err)
        assert "JSON object" in err["message"] and "dictionary" not in err["message"], err


def _batch(api: Api, key: str) -> tuple[str, str]:
    c = api.client(key)
    f = c.files.create(file=("in.jsonl", (json.dumps(chat_line(0)) + "\n").encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    return f.id, b.id


def test_a_key_sees_only_its_tenants_files_and_batches(api: Api) -> None:
    mine_f, mine_b = _batch(api, KEYS[0])
    team_f, team_b = _batch(api, TEAM[0])
    other = api.client(KEYS[1])
    for call in (lambda: other.files.retrieve(mine_f), lambda: other.files.content(mine_f),
                 lambda: other.files.delete(mine_f), lambda: other.batches.retrieve(mine_b),
                 lambda: other.batches.cancel(mine_b), lambda: other.files.retrieve(team_f),
                 lambda: other.batches.create(input_file_id=mine_f, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert api.get(f"/v1/batches/{mine_b}/stats", key=KEYS[1])[0] == 404
    # a cursor of another tenant is as unknown as a made-up one
    assert api.get(f"/v1/batches?after={mine_b}", key=KEYS[1])[0] == \
        api.get("/v1/batches?after=batch_nope", key=KEYS[1])[0]
    assert {mine_f, team_f}.isdisjoint(f.id for f in other.files.list())
    assert {mine_b, team_b}.isdisjoint(b.id for b in other.batches.list())
    # one project, two keys: the same tenant
    team = api.client(TEAM[1])
    assert team.batches.retrieve(team_b).input_file_id == team_f
    assert [b.id for b in team.batches.list()] == [team_b]
    assert mine_f not in {f.id for f in team.files.list()}
    # the admin key sees every tenant's objects
    admin = api.client(ADMIN)
    assert {mine_b, team_b} <= {b.id for b in admin.batches.list()}
    assert admin.files.retrieve(mine_f).id == mine_f
    # nothing was deleted or cancelled by the other tenant
    mine = api.client(KEYS[0])
    assert mine.files.retrieve(mine_f).id == mine_f
    assert mine.batches.retrieve(mine_b).status not in ("cancelling", "cancelled")
    assert [b.id for b in mine.batches.list()][0] == mine_b


def test_the_input_file_of_a_live_batch_cannot_be_deleted(api: Api) -> None:
    f, b = _batch(api, KEYS[0])
    c = api.client(KEYS[0])
    with pytest.raises(openai.ConflictError) as e:
        c.files.delete(f)
    assert e.value.body["code"] == "file_in_use" and b in e.value.body["message"]
    assert c.files.retrieve(f).id == f
    c.batches.cancel(b)        # no worker: the queued job is cancelled at once
    assert c.files.delete(f).deleted is True


@pytest.fixture(scope="module")
def pg_api(request: pytest.FixtureRequest, api_redis, tiny_models: Path,  # noqa: ANN001
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """PostgreSQL: its text cannot hold a NUL, which is where the 500s came from."""
    server = start_api(request, "postgresql", api_redis, tiny_models, tmp_path_factory.mktemp("hardening-pg"))
    yield server
    server.close()


MULTIPART = "multipart/form-data; boundary=XX"
PART = b'--XX\r\nContent-Disposition: form-data; name="%s"%s\r\n\r\n%s\r\n'


def test_lines_that_broke_the_parser_fail_the_batch_not_the_server(api: Api) -> None:
    """Python's JSON reader raises RecursionError on a line ~1000 levels deep, and a 400-digit
    integer overflowed the range check (math.isfinite): POST /v1/batches was a 500 with a
    traceback in the log (and the client's next call on that connection failed)."""
    from specbatch.jobs.structured import TOO_DEEP

    c = api.client(KEYS[0])
    deep = '{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": ' \
           '[{"role": "user", "content": "x"}], "metadata": ' + "[" * 5000 + "]" * 5000 + "}}"
    huge = json.dumps({**chat_line(1), "body": {**chat_line(1)["body"], "temperature": 10**400}})
    f = c.files.create(file=("deep.jsonl", "\n".join([json.dumps(chat_line(0)), deep, huge, ""]).encode()),
                       purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.errors is not None
    assert [(e.line, e.message) for e in b.errors.data] == [
        (2, f"invalid JSON: {TOO_DEEP}"), (3, "must be in [0, 2] (OpenAI's range), got 1000000000... (401 digits)")]
    assert "Traceback" not in api.procs[0].output()


def _form(purpose: bytes = b"batch", filename: bytes = b"a.jsonl", end: bytes = b"--XX--\r\n") -> bytes:
    return (PART % (b"purpose", b"", purpose) + PART % (b"file", b'; filename="' + filename + b'"',
                                                         b'{"prompt": "hi"}\n') + end)


def _corpus(file_id: str) -> list[tuple[str, str, bytes | None, dict[str, str]]]:
    """(method, path, body, headers): ids, cursors, filters and bodies no client should send."""
    gets = ["/v1/batches/batch_%00", "/v1/batches/batch_%00/stats", "/v1/files/file-%00", "/v1/files/file-%00/content",
            "/v1/batches/batch_" + "a" * 5000, "/v1/files/%ff%fe", "/v1/batches?after=%00", "/v1/batches?after=batch_%00",
            "/v1/files?after=file-%00", "/v1/files?purpose=%00", "/v1/files?purpose=batch%00", "/v1/files?order=%00",
            "/v1/batches?limit=%00", "/v1/batches?limit=1e9", "/v1/batches?limit=-1", "/v1/batches?limit=" + "9" * 40,
            "/v1/batches?after=" + "x" * 10000, "/v1/batches?after=%ff", "/v1/files?%00=1", "/v1/batches?after=%0a"]
    cases: list[tuple[str, str, bytes | None, dict[str, str]]] = [("GET", p, None, {}) for p in gets]
    cases += [("POST", "/v1/batches/batch_%00/cancel", None, {}), ("DELETE", "/v1/files/file-%00", None, {})]
    json_h = {"Content-Type": "application/json"}

    def batch(**change: Any) -> bytes:
        return json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                           **change}).encode()
    for body in (batch(input_file_id="file-\0"), batch(input_file_id="x" * 100_000), batch(metadata={"a": "b\0"}),
                 batch(metadata={"a\0": "b"}), batch(endpoint="\0"), batch(completion_window="\0"),
                 batch(metadata={"specbatch_target": "\0"}), batch(metadata={"specbatch_model_map": "a\0=b"}),
                 batch(metadata={"specbatch_stop": '["\\u0000"]'}), batch(output_expires_after={"\0": "\0"}),
                 b'{"input_file_id": "\xff\xfe"}', b"not json", b"[1,2]", b"\0", b"{}", b'{"input_file_id": 5}'):
        cases.append(("POST", "/v1/batches", body, json_h))
    for body in (_form(filename=b"a\0.jsonl"), _form(purpose=b"batch\0"), _form(end=b""), _form(end=b"--XX"),
                 b"garbage\r\n\r\n--XX--", b"--XX\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\nx\r\n--XX--\r\n",
                 b"--XX\r\nBad Header Line\r\n\r\nx\r\n--XX--\r\n"):
        cases.append(("POST", "/v1/files", body, {"Content-Type": MULTIPART}))
    return cases


def test_malformed_input_is_a_400_never_a_500_nor_a_traceback(pg_api: Api) -> None:
    file_id = pg_api.upload([chat_line(0)]).id
    statuses = {}
    for method, path, body, headers in _corpus(file_id):
        status, raw = pg_api.request(method, path, body=body, headers=headers)
        key = f"{method} {path[:60]} {(body or b'')[:60]!r}"
        statuses[key] = status
        assert status < 500, (key, raw[:300])
        if status >= 400:
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}, (key, error)
            assert len(raw) < 2000, (key, "the request's bytes are echoed back")
    assert statuses["POST /v1/files " + repr(_form(end=b"")[:60])] == 400     # cut short: not stored
    assert len(list(pg_api.client().files.list())) == 1
    c = pg_api.client()
    for call in (lambda: c.batches.retrieve("batch_\0"), lambda: c.files.list(purpose="\0"),
                 lambda: c.batches.list(after="batch_\0"), lambda: c.files.retrieve("file-\0"),
                 lambda: c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h", metadata={"note": "a\0b"})):
        with pytest.raises(openai.BadRequestError):
            call()
    log = pg_api.procs[0].output()
    assert "Traceback" not in log and "\0" not in log, log[-3000:]
