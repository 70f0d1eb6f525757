"""Results as OpenAI Batch API output lines (docs/FORMATS.md, "JSONL export").

    with session_factory(url, readonly=True).begin() as s:
        output, errors = export_openai(s, job_id)          # the output file's and error file's lines

Every line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}``, as OpenAI and vLLM write them:
  - a result: status 200, a ``chat.completion`` or ``text_completion`` body with ``usage`` (plus
    ``specbatch``: the request's speculative-decoding statistics);
  - the request's own failure: status 400, body ``{"error": {message, type: "invalid_request_error",
    param, code}}``; a failure on the worker's side: status 500, type ``server_error``;
  - a request the batch never ran: ``response: null``, error code ``batch_cancelled`` or
    ``batch_expired``.
The output file takes the 200 lines, the error file every other line (OpenAI's split).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.db.models import REQUEST_STATUSES, STATS_COLUMNS, Job, Request, RequestStatus, Result
from specbatch.engine.drafter_specs import model_names, parse_drafters, pool_fields
from specbatch.jobs import logprobs
from specbatch.jobs.store import INVALID_REQUEST, SERVER_ERROR, get_job

BATCH_ROWS = 1000
# finished requests: what a batch's output and error files hold
FINISHED = ("completed", "failed", "cancelled")


def iter_rows(s: Session, job_id: str, statuses: Sequence[str] | None = None
              ) -> Iterator[tuple[Job, Request, Result | None]]:
    """(job, request, result or None) in input-line order, streamed in batches: one row per
    sample of a request with ``n`` > 1, in sample order. Raises JobNotFound now, not on the
    first ``next``."""
    job = get_job(s, job_id)
    stmt = (select(Request, Result).outerjoin(Result, Result.request_id == Request.id)
            .where(Request.job_id == job.id).order_by(Request.line_no, Result.sample_index)
            .execution_options(yield_per=BATCH_ROWS))
    if statuses:
        bad = sorted(set(statuses) - set(REQUEST_STATUSES))
        if bad:
            raise ValueError(f"unknown status {bad}; known: {REQUEST_STATUSES}")
        stmt = stmt.where(Request.status.in_([RequestStatus(x) for x in statuses]))
    return ((job, req, res) for req, res in s.execute(stmt))


def request_models(job: Job, req: Request) -> tuple[str, list[str]]:
    """The (target, draft models) the request ran on: --model-map's route, else the job's pair."""
    if req.target is not None:
        return req.target, list(req.drafts or [])
    return job.target, model_names(parse_drafters(job.drafts or []))


def produced_by(job: Job, req: Request, res: Result) -> tuple[str, list[str]]:
    """The (target, drafts) that produced ``res``, as the result recorded them (a --fallback-draft
    result: the draft alone, ``lossy``); results older than that record: the request's pair."""
    if res.target is not None:
        return res.target, model_names(parse_drafters(res.drafts or []))
    return request_models(job, req)


def stats(job: Job, req: Request, res: Result) -> dict[str, Any]:
    """The ``specbatch`` object of a success body: the request's body.model and metadata, who
    generated it and how speculation went."""
    target, drafts = produced_by(job, req, res)
    out: dict[str, Any] = {"model": req.model, "metadata": req.meta, "target": target, "drafts": drafts,
                           "ngram": pool_fields(job.drafts or [])["ngram"], "lossy": bool(res.lossy),
                           "numerics": res.numerics}
    out.update({c: getattr(res, c) for c in STATS_COLUMNS})
    # cached_from: the generated results row a cache hit copies, as in the specbatch_results view
    out.update(worker=res.worker, latency_seconds=res.latency_seconds, cached=res.cached,
               cached_from=res.cached_from,
               started_at=res.started_at.isoformat() if res.started_at else None,
               finished_at=res.finished_at.isoformat())
    return out


def _ids(job: Job, req: Request) -> tuple[str, str]:
    return f"batch_req_{job.id}_{req.id}", f"req_{job.id}_{req.id}"


def _choice(kind: str, res: Result) -> dict[str, Any]:
    """One sample as a choice (its index: the sample's)."""
    lps = None if res.logprobs is None else logprobs.unpack(res.logprobs)
    if kind == "chat":
        return {"index": res.sample_index,
                "message": {"role": "assistant", "content": res.text, "refusal": None},
                "logprobs": None if lps is None else logprobs.chat_logprobs(lps),
                "finish_reason": res.finish_reason}
    return {"index": res.sample_index, "text": res.text,
            "logprobs": None if lps is None else logprobs.completion_logprobs(lps),
            "finish_reason": res.finish_reason}


def success_body(job: Job, req: Request, results: Sequence[Result]) -> dict[str, Any]:
    """The ``chat.completion`` / ``text_completion`` object (validates as openai's ChatCompletion /
    Completion): one choice per sample (parameter ``n``); usage as OpenAI counts it, the prompt
    once and every sample's completion tokens. ``specbatch``: sample 0's statistics, and with
    n > 1 each sample's in ``samples``."""
    res = results[0]
    key = f"{job.id}-{req.id}"
    completion = sum(r.completion_tokens for r in results)
    usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": completion,
             "total_tokens": res.prompt_tokens + completion,
             # read from the prefix cache, not prefilled (OpenAI's prompt caching field)
             "prompt_tokens_details": {"cached_tokens": res.cached_prompt_tokens or 0}}
    chat = req.kind == "chat"
    body: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
                            "object": "chat.completion" if chat else "text_completion",
                            "choices": [_choice(req.kind, r) for r in results]}
    extra = stats(job, req, res)
    if len(results) > 1:
        extra["samples"] = [stats(job, req, r) for r in results]
    body.update(created=int(max(r.finished_at for r in results).timestamp()), model=produced_by(job, req, res)[0],
                system_fingerprint=None, usage=usage, specbatch=extra)
    return body


def openai_line(job: Job, req: Request, res: Result | Sequence[Result] | None, *,
                expired: bool = False) -> dict[str, Any]:
    """One output or error line for the request (see the module docstring); ``res``: its result,
    or its samples' results in sample order. ``expired``: the batch's window ended, so a
    request that never finished is ``batch_expired``."""
    line_id, request_id = _ids(job, req)
    status = RequestStatus(req.status)
    line: dict[str, Any] = {"id": line_id, "custom_id": req.custom_id, "response": None, "error": None}
    results = [res] if isinstance(res, Result) else list(res or [])
    if results:
        line["response"] = {"status_code": 200, "request_id": request_id,
                            "body": success_body(job, req, results)}
    elif status == RequestStatus.failed:
        server = req.error_type == SERVER_ERROR
        line["response"] = {
            "status_code": 500 if server else 400, "request_id": request_id,
            "body": {"error": {"message": req.error or "the request failed",
                               "type": SERVER_ERROR if server else INVALID_REQUEST,
                               "param": req.error_param, "code": None}}}
    elif status == RequestStatus.cancelled:
        line["error"] = {"code": "batch_cancelled",
                         "message": "the batch was cancelled before this request was completed"}
    elif expired:
        line["error"] = {"code": "batch_expired",
                         "message": "the batch expired before this request was completed"}
    else:       # asked for with --status: still pending or running
        line["error"] = {"code": "request_not_finished",
                         "message": f"the request is {status.value}; export again once the job ends"}
    return line


def is_output_line(line: dict[str, Any]) -> bool:
    """True for the output file (a 200 response), False for the error file."""
    return line["response"] is not None and line["response"]["status_code"] == 200


def openai_lines(s: Session, job_id: str, statuses: Sequence[str] | None = None, *,
                 expired: bool = False) -> Iterator[dict[str, Any]]:
    """The job's lines in input order. Default: finished requests only (every request once the
    batch ``expired``); ``statuses`` picks others."""
    if not statuses:
        statuses = REQUEST_STATUSES if expired else FINISHED
    return (openai_line(job, req, results, expired=expired) for job, req, results in by_request(
        iter_rows(s, job_id, statuses)))


def by_request(rows: Iterator[tuple[Job, Request, Result | None]]
               ) -> Iterator[tuple[Job, Request, list[Result]]]:
    """iter_rows' rows as (job, request, its results in sample order: empty when none)."""
    for _, group in groupby(rows, key=lambda row: row[1].id):
        first = list(group)
        job, req = first[0][0], first[0][1]
        yield job, req, [r for _, _, r in first if r is not None]


def export_openai(s: Session, job_id: str, *, statuses: Sequence[str] | None = None,
                  expired: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(output lines, error lines) of the job, in input order: what OpenAI serves as a batch's
    ``output_file_id`` and ``error_file_id``. For files, use export.write_openai."""
    output: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for line in openai_lines(s, job_id, statuses, expired=expired):
        (output if is_output_line(line) else errors).append(line)
    return output, errors
