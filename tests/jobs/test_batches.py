"""OpenAI batches over jobs, on SQLite and PostgreSQL: the status mapping through a job's whole life,
output/error files written once (even by two finalizers at once), expiry after the window, and
the per-position counters summed in SQL."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import null, update

from specbatch import db
from specbatch.config import Settings
from specbatch.db.models import ApiBatch, Job, Result
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats
from specbatch.jobs import batches, files, store
from specbatch.jobs.intake import ParsedRequest

PARAMS = {k: getattr(GenerationParams(), k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")}
PARAMS["stop"] = []


def _setup(db_url: str, tmp_path: Path, n: int = 3) -> tuple[Settings, str, list[int]]:
    settings = Settings.from_env({"SPECBATCH_DATABASE_URL": db_url, "SPECBATCH_FILES_DIR": str(tmp_path / "files")})
    reqs = [ParsedRequest(line_no=i + 1, custom_id=f"c{i}", kind="chat", prompt=None,
                          messages=[{"role": "user", "content": "hi"}], params=PARAMS) for i in range(n)]
    with db.session_factory(db_url).begin() as s:
        job = store.create_job(s, target="t", drafts=["d"], params={}, requests=reqs, queue="q")
        batch_id = batches.new_batch_id()
        batches.create_batch(s, batch_id=batch_id, input_file_id=files.new_file_id(), endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"k": "v"}, job_id=job.id)
        ids = store.resumable_request_ids(s, job.id)
    return settings, batch_id, ids


def _output(per_pos: list[int], drafts: int) -> GenerationOutput:
    stats = GenerationStats(prompt_tokens=3, new_tokens=4, verify_steps=3, drafted_tokens=2 * drafts,
                            accepted_tokens=sum(per_pos), draft_steps=drafts, accepted_at_position=per_pos)
    return GenerationOutput(text="out", token_ids=[1, 2, 3, 4], finish_reason="length", stats=stats)


def _object(db_url: str, batch_id: str) -> dict:
    with db.session_factory(db_url).begin() as s:
        return batches.batch_objects(s, [batches.get_batch(s, batch_id)])[0]


def _finalize(settings: Settings, db_url: str, batch_id: str) -> bool:
    return batches.finalize(settings, db.session_factory(db_url), db.session_factory(db_url, readonly=True), batch_id)


def _lines(settings: Settings, file_id: str) -> list[dict]:
    return [json.loads(x) for x in files.file_path(settings, file_id).read_text().splitlines()]


def test_status_follows_the_job_and_files_are_written_once(db_url: str, tmp_path: Path) -> None:
    settings, batch_id, ids = _setup(db_url, tmp_path)
    assert _object(db_url, batch_id)["status"] == "in_progress"
    assert not _finalize(settings, db_url, batch_id)            # not finished: nothing to write
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        claimed = store.claim_requests(s, ids, "w", 60, 3)
        assert len(claimed) == 3
        store.record_result(s, ids[0], _output([1, 1], 2), "w")
        store.record_result(s, ids[1], _output([2], 2), "w")
        store.record_failure(s, ids[2], "too long", "w")
        store.refresh_job(s, claimed[0].job_id)
    obj = _object(db_url, batch_id)
    assert obj["status"] == "finalizing" and obj["finalizing_at"] and obj["completed_at"] is None
    assert obj["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert obj["usage"]["output_tokens"] == 8 and obj["usage"]["input_tokens"] == 6
    assert _finalize(settings, db_url, batch_id)
    assert not _finalize(settings, db_url, batch_id)            # once
    obj = _object(db_url, batch_id)
    assert obj["status"] == "completed" and obj["completed_at"] >= obj["finalizing_at"]
    out, err = _lines(settings, obj["output_file_id"]), _lines(settings, obj["error_file_id"])
    assert [x["custom_id"] for x in out] == ["c0", "c1"] and [x["custom_id"] for x in err] == ["c2"]
    assert "too long" in json.dumps(err[0])
    with factory.begin() as s:
        f = files.get_file(s, obj["output_file_id"])
        assert (f.purpose, f.batch_id, f.kind, f.lines) == ("batch_output", batch_id, "output", 2)
        assert f.bytes == files.file_path(settings, f.id).stat().st_size


def test_two_finalizers_at_once_write_one_pair(db_url: str, tmp_path: Path) -> None:
    settings, batch_id, ids = _setup(db_url, tmp_path, n=2)
    with db.session_factory(db_url).begin() as s:
        job_id = batches.get_batch(s, batch_id).job_id
        store.cancel_job(s, job_id)                       # nothing ran: every line is an error line
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(_finalize(settings, db_url, batch_id)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [False, True]
    obj = _object(db_url, batch_id)
    assert obj["status"] == "cancelled" and obj["output_file_id"] is None
    stored = [p.name for p in (tmp_path / "files").iterdir() if p.is_file()]
    assert stored == [obj["error_file_id"]]
    assert not list((tmp_path / "files" / ".incoming").iterdir())
    assert {x["error"]["code"] for x in _lines(settings, obj["error_file_id"])} == {"batch_cancelled"}


def test_an_overdue_batch_expires(db_url: str, tmp_path: Path) -> None:
    settings, batch_id, ids = _setup(db_url, tmp_path, n=2)
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        store.claim_requests(s, ids[:1], "w", 60, 3)
        store.record_result(s, ids[0], _output([1], 1), "w")
        b = batches.get_batch(s, batch_id)
        job = s.get(Job, b.job_id)
        assert not batches.is_overdue(b, job)
        s.execute(update(ApiBatch).where(ApiBatch.id == batch_id).values(expires_at=b.created_at - timedelta(seconds=1)))
    with factory.begin() as s:
        batches.expire(s, batch_id)
    assert _object(db_url, batch_id)["status"] == "finalizing"
    assert _finalize(settings, db_url, batch_id)
    obj = _object(db_url, batch_id)
    assert obj["status"] == "expired" and obj["expired_at"]
    assert obj["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert [x["error"]["code"] for x in _lines(settings, obj["error_file_id"])] == ["batch_expired"]


def test_per_position_counts_are_summed_in_sql(db_url: str, tmp_path: Path) -> None:
    from specbatch.api.metrics import accepted_per_position

    _, batch_id, ids = _setup(db_url, tmp_path, n=4)
    factory = db.session_factory(db_url)
    with factory.begin() as s:
        store.claim_requests(s, ids, "w", 60, 3)
        store.record_result(s, ids[0], _output([3, 1, 0], 3), "w")
        store.record_result(s, ids[1], _output([2], 2), "w")
        store.record_result(s, ids[2], _output([5, 4], 5), "w")
        store.record_result(s, ids[3], _output([7], 7), "w")
        # rows written before migration 0004 have no counts (SQL NULL; or a JSON null)
        s.execute(update(Result).where(Result.request_id == ids[2]).values(accepted_at_position=null()))
        s.execute(update(Result).where(Result.request_id == ids[3]).values(accepted_at_position=None))
    with factory.begin() as s:
        assert accepted_per_position(s) == {0: 5, 1: 1, 2: 0}


def test_listing_after_an_unknown_id_is_an_input_error(db_url: str) -> None:
    from specbatch.errors import InputError

    with db.session_factory(db_url).begin() as s, pytest.raises(InputError) as e:
        batches.list_batches(s, limit=10, after="batch_nope")
    assert e.value.field == "after"


def test_a_batch_is_never_in_progress_before_it_was_created(db_url: str, tmp_path: Path) -> None:
    """The job row is stored just before the batch row; when a second boundary falls between the
    two, in_progress_at must still not precede created_at (the API test once caught 1 s)."""
    _, batch_id, _ = _setup(db_url, tmp_path)
    with db.session_factory(db_url).begin() as s:
        batch = batches.get_batch(s, batch_id)
        s.execute(update(Job).where(Job.id == batch.job_id).values(created_at=batch.created_at - timedelta(seconds=1)))
    got = _object(db_url, batch_id)
    assert got["status"] == "in_progress" and got["in_progress_at"] == got["created_at"]


def test_a_batch_created_without_metadata_shows_null_as_openai_does(db_url: str) -> None:
    """OpenAI's Batch object has "metadata": null where the batch was created with none
    (openai-python's ``Batch.metadata: Optional[Metadata] = None``); ours showed {} (tidy53)."""
    from openai.types import Batch

    with db.session_factory(db_url).begin() as s:
        for batch_id, metadata in (("batch_none", {}), ("batch_some", {"k": "v"})):
            batches.create_batch(s, batch_id=batch_id, input_file_id=files.new_file_id(),
                                 endpoint="/v1/chat/completions", completion_window="24h", metadata=metadata,
                                 errors=[{"code": "x", "message": "y", "line": None, "param": None}])
    none, some = _object(db_url, "batch_none"), _object(db_url, "batch_some")
    assert none["metadata"] is None and some["metadata"] == {"k": "v"}
    assert Batch.model_validate(none).metadata is None


def test_a_line_that_is_not_utf8_is_an_invalid_json_line() -> None:
    """A line that cannot be decoded cannot be JSON: OpenAI's `invalid_json_line`, as a JSON syntax
    error is, not the `invalid_value` of a bad field (a binary upload was coded so)."""
    from specbatch.errors import InputError, IntakeError

    errors = [InputError("the file is not UTF-8 text: byte 0xa3 at byte 3 of this line is not UTF-8; save it as "
                         "UTF-8 (the lines after it were not read)", line_no=1),
              InputError("invalid JSON: Expecting value (column 1)", line_no=2)]
    codes = [e["code"] for e in batches.intake_errors(IntakeError(errors))]
    assert codes == ["invalid_json_line", "invalid_json_line"]


def test_an_unknown_field_is_an_unknown_parameter_that_suggests_the_known_one(tmp_path: Path) -> None:
    """A misspelt body field (`temprature`) is OpenAI's `unknown_parameter`, as a misspelt line key
    (`bodyy`) or message key already was, and says which field was meant: it was `invalid_value`
    with no suggestion, so the two kinds of typo read differently in one batch's errors."""
    from specbatch.errors import IntakeError
    from specbatch.jobs import intake

    def line(cid: str, **body: object) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "Hi"}], **body}})

    path = tmp_path / "batch.jsonl"
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strcit": True}}
    path.write_text(line("a", temprature=0.5) + "\n" + line("b", response_format=rf) + "\n")
    with pytest.raises(IntakeError) as e:
        intake.read_file(path, None, Settings.from_env({}))
    got = [(x["line"], x["code"], x["param"], x["message"]) for x in batches.intake_errors(e.value)]
    assert got == [
        (1, "unknown_parameter", "body.temprature",
         'unknown field (did you mean "temperature"?); not part of the OpenAI request body'),
        (2, "unknown_parameter", "body.response_format.json_schema.strcit",
         "unknown field; expected name, schema, strict, description")]
