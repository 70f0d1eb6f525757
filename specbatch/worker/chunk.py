"""The task body: work through one chunk of request ids. Shared by Celery tasks and ``specbatch run``.

Per request (or per batch of ``batch_size`` requests):
  claim (short transaction: pending or lease-expired only; finished ones are skipped, requests of
  a cancelled job become cancelled: this is the cancellation check between prompts)
  -> serve what the results cache holds (specbatch.jobs.result_cache), before any model work
  -> generate with no transaction open, a thread renewing the lease meanwhile
  -> write the result (or the request's own error) at once, in its own short transaction.
Claiming one request at a time means a request that kills its worker only burns its own
attempts; a request already attempted before (``attempts > 0``, a suspect) runs alone on its
last attempt (``suspects``), batched with the others before that.
An attempt is charged when a request starts decoding (``store.start_requests``), not at its
claim: requests claimed ahead of the batch and still queued in it are not blamed for a crash.
A batch claims more of its job as its rows finish (``_claim_more``), so it stays full across
chunks instead of draining at the end of each (docs/DESIGN.md, "Admission order").
Transient database errors are retried here with backoff; what still fails propagates to the
caller (the Celery task retries the whole chunk, finished requests are skipped then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from specbatch.config import Settings
from specbatch.engine.types import GenerationOutput
from specbatch.errors import InputError, SpecBatchError
from specbatch.observability import tracing
from specbatch.worker.guard import engine_models
from specbatch.worker.transaction import PERMANENT_DB_ERRORS, transact, with_db_retry

if TYPE_CHECKING:   # the engine imports torch: only when a worker decodes
    from specbatch.engine.engine import Engine, EngineRequest

logger = logging.getLogger(__name__)

# a batch's claim for more work that found none is not repeated for this long: once a job's
# pending requests run out, every finishing row would ask again (one transaction a step)
REFILL_QUIET_SECONDS = 5.0


@dataclass
class ResultEvent:
    """One request finished in this chunk: ``output`` (a GenerationOutput) or ``error``."""

    request_id: int
    job_id: str
    output: Any = None
    error: str | None = None
    claimed_ns: int = 0       # time.time_ns() at its claim, and when the engine returned it
    generated_ns: int = 0
    cached: bool = False      # served from the results cache: nothing was generated


@dataclass
class ChunkReport:
    """What happened to each id of a chunk."""

    completed: list[int] = field(default_factory=list)    # a result row written by this call
    cached: list[int] = field(default_factory=list)       # ... of those, results-cache hits
    failed: list[int] = field(default_factory=list)       # the request's own error, recorded
    finished: list[int] = field(default_factory=list)     # already done / failed / cancelled: skipped
    held: list[int] = field(default_factory=list)         # running under another worker's live lease
    unstarted: list[int] = field(default_factory=list)    # left pending because stop was requested
    retry_after: float = 0.0                               # seconds until the earliest held lease ends
    new_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"completed": self.completed, "cached": self.cached, "failed": self.failed,
                "finished": self.finished,
                "held": self.held, "unstarted": self.unstarted, "retry_after": self.retry_after,
                "new_tokens": self.new_tokens}


class LeaseKeeper:
    """Renews the lease of ``request_ids`` every ``lease_seconds / 3`` while the block runs."""

    def __init__(self, session_factory: Any, request_ids: Sequence[int], worker: str, lease_seconds: int):
        self._sf, self._ids, self._worker, self._lease = session_factory, list(request_ids), worker, lease_seconds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specbatch-lease", daemon=True)

    def _run(self) -> None:
        from specbatch.jobs import store

        interval = max(self._lease / 3.0, 0.2)
        while not self._stop.wait(interval):
            with self._lock:        # (``add`` extends the list from the decoding thread)
                ids = list(self._ids)
            try:
                with self._sf.begin() as s:
                    store.renew_leases(s, ids, self._worker, self._lease)
            except Exception as e:  # a missed renewal only risks a duplicate attempt, never a row
                logger.warning("lease renewal failed for %s: %s", ids, e)

    def add(self, request_ids: Sequence[int]) -> None:
        """Renew these too (requests claimed while the block runs)."""
        with self._lock:
            self._ids.extend(request_ids)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _engine_request(claimed: Any) -> EngineRequest:
    from specbatch.engine import EngineRequest

    return EngineRequest(prompt=claimed.prompt, messages=claimed.messages, params=claimed.params,
                         input_ids=claimed.input_ids)


def _own_fault(out: Any) -> tuple[str | None, str | None]:
    """(message, field) of a request's own error (None, None: no error), in its line's terms: the
    engine names a token-id prompt ``input_ids`` (its argument), the line wrote it as ``prompt``."""
    if not isinstance(out, SpecBatchError):
        return None, None
    field_ = getattr(out, "field", None)
    if isinstance(out, InputError) and field_ == "input_ids":
        return str(InputError(out.reason, field="prompt")), "prompt"
    return str(out), field_


def _classify(session_factory: Any, ids: Sequence[int], report: ChunkReport) -> set[str]:
    """Sort ids that were not claimed into finished / held; returns the job ids of ``ids``."""
    from specbatch.db.models import Request, RequestStatus

    now = datetime.now(timezone.utc)
    jobs: set[str] = set()
    with session_factory.begin() as s:
        rows = s.execute(select(Request.id, Request.job_id, Request.status, Request.lease_expires_at)
                         .where(Request.id.in_(list(ids)))).all()
    for rid, job_id, status, lease in rows:
        jobs.add(job_id)
        if status in (RequestStatus.pending, RequestStatus.running):
            if lease is not None and lease.tzinfo is None:
                lease = lease.replace(tzinfo=timezone.utc)
            remaining = (lease - now).total_seconds() if lease is not None else 0.0
            report.held.append(rid)
            report.retry_after = max(report.retry_after, remaining, 0.0)
        else:
            report.finished.append(rid)
    return jobs


def process_chunk(settings: Settings, engine: Engine, request_ids: Sequence[int], worker_name: str, *,
                  batch_size: int | str | None = None, on_result: Callable[[ResultEvent], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> ChunkReport:
    """Generate every claimable request of ``request_ids``; see the module docstring.

    ``engine``: a loaded ``specbatch.engine.Engine``. ``should_stop`` is checked between prompts;
    when it returns true the remaining ids are left untouched (reported as ``unstarted``).
    """
    from specbatch.db import session_factory
    from specbatch.jobs import store
    from specbatch.jobs.result_cache import ResultCache

    sf = session_factory(settings.database_url)
    cache = ResultCache.for_engine(engine, settings.cache_dir or None)
    report = ChunkReport()
    todo = list(dict.fromkeys(int(i) for i in request_ids))
    batch = claim_rows(engine, batch_size)
    touched_jobs: set[str] = set()
    not_claimed: list[int] = []

    while todo:
        if should_stop is not None and should_stop():
            report.unstarted.extend(todo)
            break
        # batch 1 claims one request at a time (the claim doubles as the cancellation check);
        # a batch claims the whole chunk so rows that finish are replaced from it at once
        # (continuous batching inside the chunk; make chunk_size > batch_size to benefit)
        group, todo = (todo[:1], todo[1:]) if batch == 1 else (todo, [])
        with tracing.span("claim", {"specbatch.request_ids": group}):
            claimed: list[Any] = transact(sf, store.claim_requests, group, worker_name, settings.lease_seconds,
                                          settings.max_attempts)
        claimed_ns = time.time_ns()
        got = {c.id for c in claimed}
        not_claimed.extend(i for i in group if i not in got)
        if not claimed:
            continue
        if batch > 1 and not any(c.attempts > 0 for c in claimed):
            claimed += transact(sf, _claim_ahead, settings, claimed, worker_name, batch)
        touched_jobs.update(c.job_id for c in claimed)
        # a background compile that finished is adopted before the lookup, not at the decode a
        # moment later: this claim is looked up under the numerics it will be decoded with
        if (adopt := getattr(engine, "adopt_compiled", None)) is not None:
            adopt()
        hits, claimed = with_db_retry(cache.serve, sf, claimed, worker_name)
        for c, out in hits:
            _report_cached(report, on_result, c, out, claimed_ns)
        together, alone = suspects(claimed, settings.max_attempts)
        rows: int | str = "auto" if batch_size == "auto" or engine.batch_size == "auto" else batch
        # every claimed row keeps its lease while it waits for its run (not only the run decoding)
        with LeaseKeeper(sf, [c.id for c in claimed] + cache.waiting_ids(), worker_name, settings.lease_seconds):
            for run in ([together] if together else []) + [[c] for c in alone]:
                fresh = run is together and not any(c.attempts > 0 for c in run)
                _generate_run(settings, engine, sf, run, worker_name, report, on_result, rows, claimed_ns,
                              cache, refill=fresh and batch > 1, should_stop=should_stop)

    if not_claimed:
        touched_jobs |= with_db_retry(_classify, sf, not_claimed, report)
    for job_id in sorted(touched_jobs):
        transact(sf, store.refresh_job, job_id)
    return report


def suspects(claimed: list[Any], max_attempts: int) -> tuple[list[Any], list[Any]]:
    """``claimed`` split into (decoded together, each alone). A suspect (a worker died holding it
    before) runs alone on its last attempt only: one that crashes its worker every time then fails
    alone, with no neighbour charged its last attempt, after as many worker deaths as before. Its
    earlier retries decode batched: a worker killed by an operator or the OOM killer makes every
    row it held a suspect, and alone they decoded one at a time (a job of 8 rows: 1.3 against 10
    tokens/s, 35 minutes to recover)."""
    alone = [c for c in claimed if c.attempts > 0 and c.attempts >= max_attempts - 1] if len(claimed) > 1 else []
    return [c for c in claimed if all(c is not a for a in alone)], alone


def _report_cached(report: ChunkReport, on_result: Callable[[ResultEvent], None] | None, c: Any,
                   out: Any, claimed_ns: int) -> None:
    report.completed.append(c.id)
    report.cached.append(c.id)
    if on_result is not None:
        on_result(ResultEvent(c.id, c.job_id, output=out, claimed_ns=claimed_ns, generated_ns=time.time_ns(),
                              cached=True))


def claim_rows(engine: Any, batch_size: int | str | None = None) -> int:
    """Rows a chunk claims requests for (and how it sizes chunks): a fixed size, or with the
    autopilot at least 8, its kept size once larger (its start, before it measured anything,
    is too small a guess to claim by)."""
    b = batch_size or getattr(engine, "batch_size", 1) or 1
    if b != "auto":
        return max(1, int(b))
    return max(8, engine.rows_now() or 0)


def _claim_ahead(s: Any, settings: Settings, claimed: list[Any], worker: str, batch: int) -> list[Any]:
    """More pending requests of the same job, so a batch larger than the chunk keeps full (the
    chunk size follows the batch size): up to 2 x batch rows in all. The tasks that carry those
    ids find them finished (or held) and skip them."""
    from specbatch.jobs import store

    want = 2 * batch - len(claimed)
    if want <= 0:
        return []
    mine = {c.id for c in claimed}
    pending = [i for i in store.resumable_request_ids(s, claimed[0].job_id) if i not in mine]
    return _claim_beside(s, settings, claimed, pending, worker, want)


def _claim_beside(s: Any, settings: Settings, held: list[Any], pending: list[int], worker: str,
                  want: int) -> list[Any]:
    """Claim up to ``want`` of ``pending`` (ids of ``held``'s job) to decode beside ``held``."""
    from specbatch.jobs import store
    from specbatch.jobs.prefix_order import ahead_ordered

    if not pending:
        return []
    job_id, first = held[0].job_id, held[0].id
    # only requests routed to the same pair (--model-map): another pair's worker owns the rest
    routes = store.request_routes(s, job_id, [first, *pending])
    same = next(ids for ids in routes.values() if first in ids)
    # requests whose prompt shares the batch's prefix first (engine/prefix.py computes it once
    # per decode): in id order a job's prefixes interleave
    ids = ahead_ordered(s, [c.id for c in held], [i for i in same if i != first])[:want]
    return list(store.claim_requests(s, ids, worker, settings.lease_seconds, settings.max_attempts)) \
        if ids else []


def _generate_run(settings: Settings, engine: Engine, sf: Any, run: list[Any], worker: str,
                  report: ChunkReport, on_result: Callable[[ResultEvent], None] | None,
                  batch: int | str = 1, claimed_ns: int = 0, cache: Any = None, *, refill: bool = False,
                  should_stop: Callable[[], bool] | None = None) -> None:
    """Generate the claimed requests of ``run`` together, writing each result as it arrives.

    ``refill``: as rows finish and nothing waits, claim more of the job's pending requests into
    the running batch (``Engine.generate_many``'s ``more``), so the batch stays full until the
    job's work runs out rather than draining at the end of every chunk; ``run`` grows with them.
    After a claim that found none, none is asked for ``REFILL_QUIET_SECONDS``; none after a
    quarter of the broker's visibility timeout.

    If anything else escapes (an engine bug, the database down for good), the unfinished claims
    are left as they are: their lease stops being renewed and expires, then a later claim takes
    them with one more attempt, so a request that keeps crashing ends failed after max_attempts.
    (Undoing the attempt instead could loop forever.)
    """
    from specbatch.engine.fingerprint import decodes_compiled
    from specbatch.jobs import store

    with LeaseKeeper(sf, [c.id for c in run], worker, settings.lease_seconds) as keeper:
        requests = [_engine_request(c) for c in run]
        # rows, not requests: a request's n samples are n rows (decoded together, one prefill)
        rows = sum(getattr(c.params, "n", 1) for c in run)
        size = batch if batch == "auto" or refill else min(int(batch), rows)
        quiet_until = 0.0
        # a task that claims on and on stays unacknowledged: past the visibility timeout Redis
        # would hand it to another worker (harmless, its ids are held or done, but wasted)
        claim_until = time.monotonic() + settings.visibility_timeout / 4

        # request id -> whether its decode began compiled: a compiler failure mid-batch turns the
        # engine eager for good, and a result decoded partly each way is keyed as neither
        began: dict[int, bool] = {}

        def start(indices: list[int]) -> None:
            compiled = decodes_compiled(engine)
            began.update((run[i].id, compiled) for i in indices)
            transact(sf, store.start_requests, [run[i].id for i in indices], worker)

        def more(room: int) -> list[EngineRequest]:
            nonlocal quiet_until
            while True:     # until a claim has something to decode (a claim served whole from the cache: again)
                now = time.monotonic()
                if now < quiet_until or now > claim_until or (should_stop is not None and should_stop()):
                    return []
                claimed = transact(sf, _claim_more, settings, run, worker, room)
                if not claimed:
                    quiet_until = now + REFILL_QUIET_SECONDS
                    return []
                keeper.add([c.id for c in claimed])
                if cache is not None:
                    hits, claimed = with_db_retry(cache.serve, sf, claimed, worker)
                    for c, out in hits:
                        _report_cached(report, on_result, c, out, time.time_ns())
                if claimed:
                    run.extend(claimed)
                    return [_engine_request(c) for c in claimed]

        # a claim served whole from the cache leaves no request to claim more of the job for
        for idx, out in engine.generate_many(requests, batch_size=size, on_start=start,
                                             more=more if refill and run else None):
            c, generated_ns = run[idx], time.time_ns()
            msg, param = _own_fault(out)
            error_type = store.INVALID_REQUEST
            if msg is None:
                compiled = began.pop(c.id, None)
                try:
                    transact(sf, _store_result, c, out, worker, engine_models(engine, compiled),
                             cache.columns(c.id, compiled) if cache else {})
                except PERMANENT_DB_ERRORS as e:  # this result can never be stored: fail it, go on
                    msg = f"the result could not be stored: {getattr(e, 'orig', e)}"
                    error_type, param = store.SERVER_ERROR, None
            if msg is not None:
                transact(sf, _store_failure, c, msg, worker, error_type, param)
                report.failed.append(c.id)
                event = ResultEvent(c.id, c.job_id, error=msg, claimed_ns=claimed_ns, generated_ns=generated_ns)
            elif isinstance(out, GenerationOutput):      # (always, when there is no message)
                report.completed.append(c.id)
                report.new_tokens += sum(len(o.token_ids) for o in out.samples)
                event = ResultEvent(c.id, c.job_id, output=out, claimed_ns=claimed_ns,
                                    generated_ns=generated_ns)
            if on_result is not None:
                on_result(event)
            if cache is not None:  # duplicates of this request claimed in the same chunk
                for dup, dup_out in with_db_retry(cache.resolve, sf, c.id, worker, msg, error_type=error_type,
                                                  param=param):
                    if dup_out is None:
                        report.failed.append(dup.id)
                        if on_result is not None:
                            on_result(ResultEvent(dup.id, dup.job_id, error=msg, claimed_ns=claimed_ns))
                    else:
                        _report_cached(report, on_result, dup, dup_out, claimed_ns)


def _claim_more(s: Any, settings: Settings, run: list[Any], worker: str, want: int) -> list[Any]:
    """Up to ``want`` more of the job's pending requests for a running batch with free places:
    never attempted (a suspect runs alone), as ``_claim_ahead`` picks them."""
    from specbatch.db.models import Request, RequestStatus

    pending = list(s.scalars(select(Request.id).where(
        Request.job_id == run[0].job_id, Request.status == RequestStatus.pending, Request.attempts == 0)
        .order_by(Request.id).limit(4 * want)))
    return _claim_beside(s, settings, run, pending, worker, want)


def _store_result(s: Any, c: Any, out: Any, worker: str, models: Any, columns: dict[str, Any]) -> None:
    from specbatch.jobs import store

    store.record_result(s, c.id, out, worker, models=models, **columns)
    store.refresh_job(s, c.job_id)


def _store_failure(s: Any, c: Any, msg: str, worker: str, error_type: str, param: Any) -> None:
    from specbatch.jobs import store

    store.record_failure(s, c.id, msg, worker, error_type=error_type, param=param)
    store.refresh_job(s, c.job_id)
