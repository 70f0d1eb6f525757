"""``GET /metrics``: Prometheus text, read from the database (and the broker's queue lengths) at
scrape time by one custom collector, so every API replica reports the same fleet-wide totals.

The spec-decode counters follow vLLM's names with a ``specbatch_`` prefix (the workers' own
metrics use the same names):

    specbatch_generation_tokens_total                        completion tokens of stored results
    specbatch_spec_decode_num_drafts_total                   verify steps that drafted >= 1 token
    specbatch_spec_decode_num_draft_tokens_total             drafted tokens
    specbatch_spec_decode_num_accepted_tokens_total          accepted draft tokens
    specbatch_spec_decode_num_accepted_tokens_per_pos_total  accepted draft tokens at position {position}
    specbatch_prompt_tokens_total                            prompt tokens of stored results
    specbatch_prefix_cache_hit_tokens_total                  ... of those, read from the prefix cache

plus the gauges specbatch_jobs{status}, specbatch_requests{status}, specbatch_queue_depth{queue}
(messages waiting in Redis) and specbatch_broker_up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from specbatch.api.auth import Keyed
from specbatch.config import Settings
from specbatch.db.models import Job, JobStatus, RequestStatus, Result
from specbatch.db.models import Request as RequestRow
from specbatch.jobs.store import ACTIVE_JOB
from specbatch.worker.stranded import queue_keys

logger = logging.getLogger(__name__)

router = APIRouter(tags=["metrics"])
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BROKER_TIMEOUT = 1.0

PER_POSITION_SQL = {
    "sqlite": "SELECT CAST(p.key AS INTEGER), SUM(p.value) FROM results, "
              "json_each(results.accepted_at_position) AS p "
              "WHERE json_type(results.accepted_at_position) = 'array' GROUP BY p.key",
    "postgresql": "SELECT p.ord - 1, SUM(p.v::bigint) FROM results, "
                  "jsonb_array_elements_text(results.accepted_at_position) WITH ORDINALITY AS p(v, ord) "
                  "WHERE jsonb_typeof(results.accepted_at_position) = 'array' GROUP BY p.ord",
}


def accepted_per_position(s: Session) -> dict[int, int]:
    """Accepted draft tokens per position over every result (summed in the database)."""
    sql = PER_POSITION_SQL.get(s.get_bind().dialect.name)
    if sql is not None:
        return {int(pos): int(n or 0) for pos, n in s.execute(text(sql))}
    totals: dict[int, int] = {}
    for counts in s.scalars(select(Result.accepted_at_position)):
        for j, n in enumerate(counts if isinstance(counts, list) else []):
            totals[j] = totals.get(j, 0) + int(n)
    return totals


def queue_depths(settings: Settings, queues: list[str]) -> dict[str, int] | None:
    """Messages waiting per queue (Redis brokers); None when the broker does not answer."""
    if not settings.broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    try:
        client = redis.Redis.from_url(settings.broker_url, socket_timeout=BROKER_TIMEOUT,
                                      socket_connect_timeout=BROKER_TIMEOUT)
        with client.pipeline(transaction=False) as pipe:
            pipe.ping()          # answers even when no job is queued
            for q in queues:
                for key in queue_keys(q):
                    pipe.llen(key)
            lengths = pipe.execute()[1:]
        client.close()
    except Exception as e:
        logger.warning("metrics: broker unreachable (%s)", type(e).__name__)
        return None
    per = len(queue_keys(""))
    return {q: int(sum(lengths[i * per:(i + 1) * per])) for i, q in enumerate(queues)}


class DatabaseCollector(Collector):
    """Reads the totals at every scrape; nothing is kept in this process."""

    def __init__(self, settings: Settings, reader: sessionmaker) -> None:
        self.settings, self.reader = settings, reader

    def collect(self) -> Iterator[Metric]:
        with self.reader.begin() as s:
            jobs = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            requests = dict(s.execute(select(RequestRow.status, func.count()).group_by(RequestRow.status)).all())
            tokens, drafts, drafted, accepted, prompt, prefix_hits = s.execute(select(
                func.coalesce(func.sum(Result.completion_tokens), 0), func.coalesce(func.sum(Result.draft_steps), 0),
                func.coalesce(func.sum(Result.drafted_tokens), 0),
                func.coalesce(func.sum(Result.accepted_tokens), 0),
                func.coalesce(func.sum(Result.prompt_tokens), 0),
                func.coalesce(func.sum(Result.cached_prompt_tokens), 0))).one()
            per_position = accepted_per_position(s)
            queues = sorted(set(s.scalars(select(Job.queue).where(Job.status.in_(
                [*ACTIVE_JOB, JobStatus.cancelling])).distinct())))
        yield _by_status("specbatch_jobs", "Jobs by status.", [x.value for x in JobStatus], jobs)
        yield _by_status("specbatch_requests", "Requests (prompt lines) by status.",
                         [x.value for x in RequestStatus], requests)
        for name, doc, value in (
            ("specbatch_generation_tokens", "Generated (completion) tokens of stored results.", tokens),
            ("specbatch_spec_decode_num_drafts", "Verify steps that drafted at least one token.", drafts),
            ("specbatch_spec_decode_num_draft_tokens", "Drafted tokens.", drafted),
            ("specbatch_spec_decode_num_accepted_tokens", "Accepted draft tokens.", accepted),
            ("specbatch_prompt_tokens", "Prompt tokens of stored results.", prompt),
            ("specbatch_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache, not prefilled.",
             prefix_hits),
        ):
            yield CounterMetricFamily(name, doc, value=int(value))
        per_pos = CounterMetricFamily("specbatch_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens at each draft position (0-based).",
                                      labels=["position"])
        for pos in sorted(per_position):
            per_pos.add_metric([str(pos)], per_position[pos])
        yield per_pos
        depths = queue_depths(self.settings, queues)
        depth = GaugeMetricFamily("specbatch_queue_depth", "Tasks waiting in the broker, per queue of an "
                                  "unfinished job.", labels=["queue"])
        for q, n in (depths or {}).items():
            depth.add_metric([q], n)
        yield depth
        yield GaugeMetricFamily("specbatch_broker_up", "1 if the broker answered this scrape.",
                                value=0 if depths is None else 1)


def _by_status(name: str, doc: str, statuses: list[str], counts: dict[Any, int]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["status"])
    values = {getattr(k, "value", k): n for k, n in counts.items()}
    for st in statuses:
        g.add_metric([st], values.get(st, 0))
    return g


def registry_for(settings: Settings, reader: sessionmaker) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(settings, reader))
    return registry


@router.get("/metrics")
def metrics(request: Request, caller: Keyed) -> Response:
    sb = caller.sb
    registry = getattr(request.app.state, "registry", None)
    if registry is None:
        registry = request.app.state.registry = registry_for(sb.settings, sb.reader)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)
