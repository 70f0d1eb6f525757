"""One row per request for CSV (flat, nested data as JSON text) and Parquet (typed, nested);
a request with ``n`` > 1 samples has one row per sample (``sample_index`` 0..n-1).

Log-probabilities are Parquet list columns (and in the JSONL export); CSV, like the
specbatch_results view it mirrors, leaves them out.

To add a column: add it to FLAT_COLUMNS / flat_record for CSV, and to parquet_schema /
parquet_record for Parquet (docs/FORMATS.md lists both).

Parquet maps (``stats.pool_wins``, ``metadata``) are written as ``list<struct<key, value>>``, the
physical layout of an Arrow map: ``datasets`` cannot load an Arrow ``map`` column at all, and
DuckDB turns the entries into a MAP with ``map_from_entries``.
"""

from __future__ import annotations

import json
from typing import Any

from specbatch.db.models import STATS_COLUMNS, Job, Request, RequestStatus, Result
from specbatch.jobs.logprobs import unpack as unpack_logprobs
from specbatch.jobs.openai_output import produced_by, request_models

FLAT_COLUMNS = (
    "job_id", "request_id", "sample_index", "custom_id", "line_no", "kind", "status", "model", "target", "drafts",
    "prompt", "prompt_ids", "messages", "params", "metadata", "attempts", "error", "error_type", "text",
    "finish_reason", "prompt_tokens", "completion_tokens", "token_ids", *STATS_COLUMNS, "worker",
    "started_at", "finished_at", "latency_seconds", "lossy", "cached",
)
# Parquet's stats struct: every statistics field stored with a result (the CSV's columns, plus the
# ones the SQL view adds: null draft_steps / accepted_at_position on rows written before 0004)
PARQUET_STATS = (*STATS_COLUMNS, "draft_steps", "accepted_at_position", "batch_size_seconds")
_JSON_TEXT = ("drafts", "prompt_ids", "messages", "params", "metadata", "token_ids", "accepted_per_position",
              "pool_wins")


def _logprobs(res: Result | None) -> dict[str, Any]:
    """``logprobs``: each generated token's log-probability; ``top_logprobs``: per token, its top
    alternatives as {token_id, token, logprob}. Both null unless the request asked for them."""
    if res is None or res.logprobs is None:
        return {"logprobs": None, "top_logprobs": None}
    lps = unpack_logprobs(res.logprobs)
    return {"logprobs": [t.logprob for t in lps],
            "top_logprobs": [[{"token_id": i, "token": b.decode("utf-8", errors="replace"), "logprob": v}
                              for (i, v), b in zip(t.top, t.top_raw)] for t in lps]}


def _base(job: Job, req: Request) -> dict[str, Any]:
    target, drafts = request_models(job, req)
    return {"job_id": job.id, "request_id": req.id, "custom_id": req.custom_id, "line_no": req.line_no,
            "kind": req.kind, "status": RequestStatus(req.status).value, "model": req.model,
            "target": target, "drafts": drafts, "prompt": req.prompt, "prompt_ids": req.prompt_ids,
            "attempts": req.attempts, "error": req.error, "error_type": req.error_type,
            "sample_index": 0}


def _produced(job: Job, req: Request, res: Result) -> dict[str, Any]:
    """target / drafts as the result recorded them, ``lossy`` (--fallback-draft output) and
    ``cached`` (a results-cache hit: a copy of an earlier generated result)."""
    target, drafts = produced_by(job, req, res)
    return {"target": target, "drafts": drafts, "lossy": bool(res.lossy), "cached": bool(res.cached)}


def flat_record(job: Job, req: Request, res: Result | None) -> dict[str, Any]:
    """One CSV row: nested values as JSON text, times as ISO 8601."""
    row: dict[str, Any] = dict.fromkeys(FLAT_COLUMNS)
    row.update(_base(job, req), messages=req.messages, params=req.params, metadata=req.meta)
    if res is not None:
        row["sample_index"] = res.sample_index
        row.update({c: getattr(res, c) for c in STATS_COLUMNS})
        row.update(text=res.text, finish_reason=res.finish_reason, prompt_tokens=res.prompt_tokens,
                   completion_tokens=res.completion_tokens, token_ids=list(res.token_ids), worker=res.worker,
                   started_at=res.started_at.isoformat() if res.started_at else None,
                   finished_at=res.finished_at.isoformat(), latency_seconds=res.latency_seconds)
        row.update(_produced(job, req, res))
    for key in _JSON_TEXT:
        if row[key] is not None:
            row[key] = json.dumps(row[key], ensure_ascii=False)
    return row


# ---------------------------------------------------------------- Parquet


def _entries(d: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    return None if d is None else [{"key": str(k), "value": v} for k, v in d.items()]


def _messages(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if messages is None:
        return None
    return [{"role": m.get("role"), "content": m.get("content"), "name": m.get("name")} for m in messages]


def conversation(req: Request, res: Result | None) -> list[dict[str, Any]] | None:
    """A chat request's messages plus the assistant's reply (for SFT trainers); None without a
    result or for a completion request (its ``prompt`` and ``text`` are the pair)."""
    if res is None or req.messages is None:
        return None
    return [*(_messages(req.messages) or []), {"role": "assistant", "content": res.text, "name": None}]


def parquet_record(job: Job, req: Request, res: Result | None) -> dict[str, Any]:
    params = dict(req.params or {})
    row = _base(job, req)
    row.update(messages=_messages(req.messages), metadata=_entries(req.meta),
               params={"max_new_tokens": params.get("max_new_tokens"), "temperature": params.get("temperature"),
                       "top_p": params.get("top_p"), "top_k": params.get("top_k"), "seed": params.get("seed"),
                       "stop": list(params.get("stop") or []),
                       # the logit processors, stored only when a line gave them: their defaults else
                       "presence_penalty": params.get("presence_penalty", 0.0),
                       "frequency_penalty": params.get("frequency_penalty", 0.0),
                       "repetition_penalty": params.get("repetition_penalty", 1.0),
                       "min_p": params.get("min_p", 0.0), "n": params.get("n", 1),
                       "logit_bias": _entries(params.get("logit_bias") or {}),
                       # the output's grammar (GrammarSpec.to_dict), None for free text
                       "structured": params.get("structured")},
               text=None, finish_reason=None, prompt_tokens=None, completion_tokens=None, token_ids=None,
               conversation=conversation(req, res), stats=None, worker=None, started_at=None,
               finished_at=None, latency_seconds=None, **_logprobs(res))
    if res is not None:
        stats = {c: getattr(res, c) for c in PARQUET_STATS}
        stats["pool_wins"] = _entries(res.pool_wins or {})
        stats["batch_size_seconds"] = _entries(res.batch_size_seconds or {})
        row.update(sample_index=res.sample_index, text=res.text, finish_reason=res.finish_reason,
                   prompt_tokens=res.prompt_tokens,
                   completion_tokens=res.completion_tokens, token_ids=list(res.token_ids), stats=stats,
                   worker=res.worker, started_at=res.started_at, finished_at=res.finished_at,
                   latency_seconds=res.latency_seconds)
        row.update(_produced(job, req, res))
    return row


def parquet_schema() -> Any:
    import pyarrow as pa

    s, i64, f64 = pa.string(), pa.int64(), pa.float64()
    ts = pa.timestamp("us", tz="UTC")
    message = pa.list_(pa.struct([("role", s), ("content", s), ("name", s)]))

    def entries(value: Any) -> Any:
        return pa.list_(pa.struct([("key", s), ("value", value)]))

    stats = pa.struct([
        ("verify_steps", i64), ("drafted_tokens", i64), ("accepted_tokens", i64), ("acceptance_rate", f64), ("mean_acceptance_length", f64), ("accepted_per_position", pa.list_(f64)),
        ("target_forwards", i64), ("draft_forwards", i64), ("draft_seconds", f64), ("verify_seconds", f64),
        ("wall_seconds", f64), ("tokens_per_second", f64), ("pool_wins", entries(i64)), ("final_gamma", i64),
        ("speculation_disabled", pa.bool_()), ("grammar_drafted_tokens", i64),
        ("grammar_accepted_tokens", i64), ("cached_prompt_tokens", i64),
        ("prefill_seconds_saved", f64), ("draft_steps", i64), ("accepted_at_position", pa.list_(i64)),
        ("batch_size_seconds", entries(f64))])
    params = pa.struct([("max_new_tokens", i64), ("temperature", f64), ("top_p", f64), ("top_k", i64),
                        ("seed", i64), ("stop", pa.list_(s)), ("presence_penalty", f64),
                        ("frequency_penalty", f64), ("repetition_penalty", f64), ("min_p", f64), ("n", i64),
                        ("logit_bias", entries(f64)),
                        ("structured", pa.struct([("kind", s), ("source", s), ("strict", pa.bool_())]))])
    return pa.schema([
        ("job_id", s), ("request_id", i64), ("sample_index", i64), ("custom_id", s), ("line_no", i64), ("kind", s), ("status", s),
        ("model", s), ("target", s), ("drafts", pa.list_(s)), ("prompt", s), ("prompt_ids", pa.list_(i64)),
        ("messages", message), ("params", params), ("metadata", entries(s)), ("attempts", i64), ("error", s),
        ("error_type", s), ("text", s), ("finish_reason", s), ("prompt_tokens", i64),
        ("completion_tokens", i64), ("token_ids", pa.list_(i64)), ("conversation", message), ("stats", stats),
        ("worker", s), ("started_at", ts), ("finished_at", ts), ("latency_seconds", f64),
        ("lossy", pa.bool_()), ("cached", pa.bool_()), ("logprobs", pa.list_(f64)),
        ("top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", i64), ("token", s), ("logprob", f64)])))),
    ])
