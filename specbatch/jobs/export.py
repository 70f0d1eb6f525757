"""Results out, for datasets: JSONL (the OpenAI batch output shape + a ``stats`` object), CSV, Parquet.

    with session_factory(url, readonly=True).begin() as s:
        n = export_job(s, job_id, "parquet", "out.parquet", statuses=["completed"])

Rows come in prompt-file order (line number). Every request is a row; one without a result has
an ``error`` (its status, or the failure reason) and empty result columns.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.db.models import REQUEST_STATUSES, STATS_COLUMNS, Job, Request, RequestStatus, Result
from specbatch.jobs.store import get_job

FORMATS = ("jsonl", "csv", "parquet")
BATCH_ROWS = 1000

FLAT_COLUMNS = (
    "job_id", "request_id", "custom_id", "line_no", "kind", "status", "prompt", "messages", "params",
    "attempts", "error", "text", "finish_reason", "prompt_tokens", "completion_tokens", "token_ids",
    *STATS_COLUMNS, "worker", "started_at", "finished_at", "latency_seconds",
    "model_target", "model_drafts", "lossy",   # the models that produced the row (lossy: --fallback-draft)
)
_JSON_TEXT = ("messages", "params", "pool_wins")       # nested data kept as JSON text in CSV/Parquet


def iter_rows(s: Session, job_id: str, statuses: Sequence[str] | None = None
              ) -> Iterator[tuple[Job, Request, Result | None]]:
    """(job, request, result or None) in line order, streamed in batches. Raises JobNotFound now,
    not on the first ``next``."""
    job = get_job(s, job_id)
    stmt = (select(Request, Result).outerjoin(Result, Result.request_id == Request.id)
            .where(Request.job_id == job.id).order_by(Request.line_no)
            .execution_options(yield_per=BATCH_ROWS))
    if statuses:
        bad = sorted(set(statuses) - set(REQUEST_STATUSES))
        if bad:
            raise ValueError(f"unknown status {bad}; known: {REQUEST_STATUSES}")
        stmt = stmt.where(Request.status.in_([RequestStatus(x) for x in statuses]))
    return ((job, req, res) for req, res in s.execute(stmt))


def _stats(res: Result) -> dict[str, Any]:
    out = {c: getattr(res, c) for c in STATS_COLUMNS}
    out.update(worker=res.worker, latency_seconds=res.latency_seconds, lossy=bool(res.lossy),
               model_target=res.target, model_drafts=res.drafts,
               started_at=res.started_at.isoformat() if res.started_at else None,
               finished_at=res.finished_at.isoformat())
    return out


def openai_record(job: Job, req: Request, res: Result | None) -> dict[str, Any]:
    """One line of the OpenAI Batch API output file, plus ``status`` and ``stats``."""
    rid = f"{job.id}-{req.id}"
    if res is None:
        status = RequestStatus(req.status).value
        return {"id": rid, "custom_id": req.custom_id, "status": status, "response": None,
                "error": {"code": status, "message": req.error or f"the request is {status}"},
                "stats": None}
    usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
             "total_tokens": res.prompt_tokens + res.completion_tokens}
    if req.kind == "chat":
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                             "finish_reason": res.finish_reason}]}
    else:
        body = {"id": f"cmpl-{rid}", "object": "text_completion",
                "choices": [{"index": 0, "text": res.text, "finish_reason": res.finish_reason,
                             "logprobs": None}]}
    body.update(created=int(res.finished_at.timestamp()), model=res.target or job.target, usage=usage)
    return {"id": rid, "custom_id": req.custom_id, "status": RequestStatus(req.status).value,
            "lossy": bool(res.lossy),
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None,
            "stats": _stats(res)}


def flat_record(job: Job, req: Request, res: Result | None) -> dict[str, Any]:
    """One row of the CSV / Parquet table (nested data as JSON text, see _JSON_TEXT)."""
    row: dict[str, Any] = dict.fromkeys(FLAT_COLUMNS)
    row.update(job_id=job.id, request_id=req.id, custom_id=req.custom_id, line_no=req.line_no,
               kind=req.kind, status=RequestStatus(req.status).value, prompt=req.prompt,
               messages=json.dumps(req.messages) if req.messages is not None else None,
               params=json.dumps(req.params), attempts=req.attempts, error=req.error)
    if res is not None:
        row.update({c: getattr(res, c) for c in STATS_COLUMNS})
        row.update(text=res.text, finish_reason=res.finish_reason, prompt_tokens=res.prompt_tokens,
                   completion_tokens=res.completion_tokens, token_ids=list(res.token_ids),
                   pool_wins=json.dumps(res.pool_wins), worker=res.worker, started_at=res.started_at,
                   finished_at=res.finished_at, latency_seconds=res.latency_seconds,
                   model_target=res.target, lossy=bool(res.lossy),
                   model_drafts=json.dumps(res.drafts) if res.drafts is not None else None)
    return row


def _parquet_schema() -> Any:
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    types = {
        "request_id": pa.int64(), "line_no": pa.int64(), "attempts": pa.int64(),
        "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(), "token_ids": pa.list_(pa.int64()),
        "verify_steps": pa.int64(), "drafted_tokens": pa.int64(), "accepted_tokens": pa.int64(),
        "acceptance_rate": pa.float64(), "mean_acceptance_length": pa.float64(),
        "accepted_per_position": pa.list_(pa.float64()), "target_forwards": pa.int64(),
        "draft_forwards": pa.int64(), "draft_seconds": pa.float64(), "verify_seconds": pa.float64(),
        "wall_seconds": pa.float64(), "tokens_per_second": pa.float64(), "final_gamma": pa.int64(),
        "speculation_disabled": pa.bool_(), "started_at": ts, "finished_at": ts,
        "latency_seconds": pa.float64(), "lossy": pa.bool_(),
    }
    return pa.schema([(c, types.get(c, pa.string())) for c in FLAT_COLUMNS])


def _write_parquet(rows: Iterator[tuple[Job, Request, Result | None]], path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    n = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(flat_record(*row))
            if len(batch) >= BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n, batch = n + len(batch), []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def _write_text(rows: Iterator[tuple[Job, Request, Result | None]], fmt: str, fp: TextIO) -> int:
    n = 0
    if fmt == "jsonl":
        for row in rows:
            fp.write(json.dumps(openai_record(*row), ensure_ascii=False) + "\n")
            n += 1
        return n
    writer = csv.DictWriter(fp, fieldnames=FLAT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        rec = flat_record(*row)
        for key in ("token_ids", "accepted_per_position"):
            if rec[key] is not None:
                rec[key] = json.dumps(rec[key])
        for key in ("started_at", "finished_at"):
            if rec[key] is not None:
                rec[key] = rec[key].isoformat()
        writer.writerow(rec)
        n += 1
    return n


def export_job(s: Session, job_id: str, fmt: str, out: str | Path | TextIO,
               statuses: Sequence[str] | None = None) -> int:
    """Write the job's rows to ``out`` (a path, or a text stream for jsonl/csv); returns the count.

    A path is written atomically (a temporary file beside it, then renamed).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    rows = iter_rows(s, job_id, statuses)
    if not isinstance(out, (str, Path)):
        if fmt == "parquet":
            raise ValueError("parquet is written to a file, not a stream")
        return _write_text(rows, fmt, out)
    path = Path(out)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if fmt == "parquet":
            n = _write_parquet(rows, tmp)
        else:
            with tmp.open("w", encoding="utf-8", newline="") as fp:
                n = _write_text(rows, fmt, fp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n
