"""Which models a worker holds, and whether a task's job may run on them.

Every task is checked before its requests are claimed: the job must be in this worker's
database, the ids must be that job's, and the job's target and drafters must be the ones this
worker loaded (compared as queue names, which canonicalise local paths). A task that fails the
check is refused, loudly, and goes back to the queue for a worker that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.engine.drafter_specs import names, parse_drafters
from specbatch.redact import mask
from specbatch.worker.queues import queue_name, route_drafters


def engine_models(engine: Any, began_compiled: bool | None = None) -> dict[str, Any]:
    """What a result records about the engine that produced it: its models, and how its target
    computes (``numerics``: what ``specbatch audit`` re-decodes with, docs/CONTRACTS.md).
    ``began_compiled``: ``fingerprint.decodes_compiled`` when the result's decode began; where it
    differs from now (a compile failed mid-batch) the record says ``"compiled": "partly"``.
    Called for every stored result: the record is made once per compiled forward (``decoded_with``)."""
    from specbatch.engine.fingerprint import decode_ran, decoded_by, decodes_compiled
    from specbatch.engine.loading import LoadedModel

    target = getattr(engine, "target", None)
    numerics = decoded_by(engine, decode_ran(began_compiled, decodes_compiled(engine))) \
        if isinstance(target, LoadedModel) else None
    return {"target": getattr(engine, "target_name", None),
            "drafts": list(getattr(engine, "drafter_names", []) or []),
            "lossy": bool(getattr(engine, "lossy", False)),
            "numerics": numerics}


def draft_only(engine: Any) -> Any:
    """The engine's first draft model as a plain (non-speculative) engine, flagged lossy: its output
    is the draft's, not the target's. Only for jobs submitted with --fallback-draft."""
    from specbatch.engine import Engine

    drafts = list(getattr(engine, "drafts", []) or [])
    if not drafts:
        return None
    fallback = Engine(drafts[0], batch_size=getattr(engine, "batch_size", 1))
    fallback.lossy = True  # type: ignore[attr-defined]
    return fallback


def allows_fallback(s: Session, job_id: str) -> bool:
    from specbatch.db.models import Job

    job = s.get(Job, job_id)
    return bool(job is not None and (job.meta or {}).get("fallback_draft"))


def spec_label(target: str, drafters: Sequence[str]) -> str:
    return f"{target} + {', '.join(names(parse_drafters(drafters))) or 'no draft'}"


def refusal(s: Session, job_id: str, request_ids: Sequence[int], spec: dict[str, Any],
            database_url: str) -> str | None:
    """Why this worker (holding ``spec``) must not run these requests; None when it may."""
    from specbatch.db.models import Job, Request

    job = s.get(Job, job_id)
    if job is None:
        return (f"job {job_id} is not in this worker's database {mask(database_url)}: the submitter "
                "and this worker use different SPECBATCH_DATABASE_URL values")
    ids = sorted({int(i) for i in request_ids})
    rows = s.execute(select(Request.id, Request.target, Request.drafts)
                     .where(Request.id.in_(ids), Request.job_id == job_id)).all()
    if len(rows) != len(ids):
        return (f"requests {ids} are not all job {job_id}'s in this worker's database "
                f"{mask(database_url)} (another database?)")
    held = queue_name(spec["target"], spec.get("drafts") or [])
    job_drafters = list(job.drafts or [])
    for _, target, drafts in rows:   # a --model-map line runs on its own pair, else the job's
        want_target, want = (target, route_drafters(drafts or [], job_drafters)) if target is not None \
            else (job.target, job_drafters)
        if queue_name(want_target, want) != held:
            return (f"job {job_id} runs on {spec_label(want_target, want)}; this worker "
                    f"holds {spec_label(spec['target'], spec.get('drafts') or [])}")
    return None
