"""Job-level statistics from the result rows (the ``stats`` object of ``specbatch status --json``).

Rates come twice: token-weighted (sums over the job, then divided) and the request mean (each
request's rate, averaged over the requests that drafted at all). Undefined figures are None.
Results-cache hits count as results (``cache_hits``, ``tokens_from_cache``) but generated nothing:
``tokens_generated``, the rates and the request latencies leave them out.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.db.models import Result


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _prefix_cache(rows: list[Any]) -> dict[str, Any]:
    """Prompt tokens of generated results read from the prefix cache, their share and the
    prefill seconds that saved (engine/prefix.py)."""
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_prompt_tokens or 0 for r in rows)
    return {"cached_prompt_tokens": cached, "share": _ratio(cached, prompt),
            "requests": sum(1 for r in rows if r.cached_prompt_tokens),
            "prefill_seconds_saved_sum": sum(r.prefill_seconds_saved or 0.0 for r in rows)}


def _speculation(rows: list[Any]) -> dict[str, Any]:
    """What speculation measured over generated results: the steps that drafted, the tokens such a
    step emitted, and its cost in plain steps (1 + draft seconds per drafted step / verify seconds
    per step: a lower bound, a drafted step's verify being the wider one). Speculation pays where
    ``tokens_per_drafted_step`` exceeds ``drafted_step_cost``; ``switched_off_requests``: requests
    whose gamma controller found it did not (``speculation_disabled``)."""
    steps = sum(r.verify_steps for r in rows)
    drafted = sum(r.draft_steps or 0 for r in rows)
    draft_per_step = _ratio(sum(r.draft_seconds for r in rows), drafted)
    verify_per_step = _ratio(sum(r.verify_seconds for r in rows), steps)
    return {
        "steps": steps, "drafted_steps": drafted,
        "tokens_per_drafted_step": _ratio(sum(r.accepted_tokens for r in rows) + drafted, drafted),
        "drafted_step_cost": None if draft_per_step is None or not verify_per_step
                             else 1 + draft_per_step / verify_per_step,
        "switched_off_requests": sum(1 for r in rows if r.speculation_disabled),
    }


def job_stats(s: Session, job_id: str) -> dict[str, Any]:
    """Aggregate statistics over the job's results (see the module docstring)."""
    cols = (Result.worker, Result.prompt_tokens, Result.cached_prompt_tokens, Result.prefill_seconds_saved,
            Result.completion_tokens, Result.verify_steps,
            Result.drafted_tokens, Result.accepted_tokens, Result.acceptance_rate,
            Result.mean_acceptance_length, Result.target_forwards, Result.draft_forwards,
            Result.draft_seconds, Result.verify_seconds, Result.wall_seconds, Result.tokens_per_second,
            Result.started_at, Result.finished_at, Result.latency_seconds, Result.pool_wins,
            Result.accepted_per_position, Result.speculation_disabled, Result.cached,
            Result.batch_size_seconds, Result.draft_steps, Result.sample_index, Result.grammar_drafted_tokens,
            Result.grammar_accepted_tokens)
    rows = s.execute(select(*cols).where(Result.job_id == job_id).order_by(Result.id)).all()
    generated = [r for r in rows if not r.cached]        # results-cache hits generated nothing

    tokens = sum(r.completion_tokens for r in generated)
    drafted = sum(r.drafted_tokens for r in rows)
    accepted = sum(r.accepted_tokens for r in rows)
    steps = sum(r.verify_steps for r in rows)
    spec = [r for r in rows if r.drafted_tokens > 0]
    starts = [r.started_at for r in rows if r.started_at is not None]
    ends = [r.finished_at for r in rows]
    span = (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0
    # a hit is answered from the results cache at once (0 s): counted beside, not as a latency
    latencies = [r.latency_seconds for r in generated]

    pool_wins: dict[str, int] = defaultdict(int)
    by_size: dict[int, float] = defaultdict(float)
    for r in rows:
        for size, seconds in (r.batch_size_seconds or {}).items():
            by_size[int(size)] += float(seconds)
    size_total = sum(by_size.values())
    per_position: dict[int, list[float]] = defaultdict(list)
    by_worker: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        for name, n in (r.pool_wins or {}).items():
            pool_wins[name] += int(n)
        for j, rate in enumerate(r.accepted_per_position or []):
            per_position[j].append(float(rate))
        by_worker[r.worker].append(r)

    workers = []
    for name in sorted(by_worker):
        rs = by_worker[name]
        w_tokens = sum(r.completion_tokens for r in rs if not r.cached)
        w_starts = [r.started_at for r in rs if r.started_at is not None]
        w_span = (max(r.finished_at for r in rs) - min(w_starts)).total_seconds() if w_starts else 0.0
        # rows decoded together overlap: busy is the time covered by at least one decode
        busy = _covered_seconds([(r.finished_at.timestamp() - r.wall_seconds, r.finished_at.timestamp())
                                 for r in rs if not r.cached])
        workers.append({
            "worker": name, "requests": len(rs), "tokens_generated": w_tokens,
            "busy_seconds": busy, "wall_clock_seconds": w_span,
            "tokens_per_second": _ratio(w_tokens, w_span),          # wall-clock throughput
            "busy_tokens_per_second": _ratio(w_tokens, busy),       # while generating
        })

    return {
        "results": len(rows),
        # a request's samples share its prompt (parameter n): counted once, as OpenAI's usage does
        "prompt_tokens": sum(r.prompt_tokens for r in rows if r.sample_index == 0),
        "prefix_cache": _prefix_cache([r for r in generated if r.sample_index == 0]),   # a prompt once
        "tokens_generated": tokens,
        "cache_hits": len(rows) - len(generated),
        "tokens_from_cache": sum(r.completion_tokens for r in rows if r.cached),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": {
            "token_weighted": _ratio(accepted, drafted),
            "request_mean": _mean([r.acceptance_rate for r in spec]),
        },
        "mean_acceptance_length": {
            "token_weighted": _ratio(accepted + steps, steps),
            "request_mean": _mean([r.mean_acceptance_length for r in rows if r.verify_steps > 0]),
        },
        "accepted_per_position": [sum(v) / len(v) for _, v in sorted(per_position.items())],
        "target_forwards": sum(r.target_forwards for r in rows),
        "draft_forwards": sum(r.draft_forwards for r in rows),
        # sums over requests: rows decoded together each count a shared step, so under batching
        # these exceed the job's wall clock (about batch size times); the names say so
        "draft_seconds_sum": sum(r.draft_seconds for r in rows),
        "verify_seconds_sum": sum(r.verify_seconds for r in rows),
        "generation_seconds_sum": sum(r.wall_seconds for r in rows),
        "wall_clock_seconds": span,
        "tokens_per_second": _ratio(tokens, span),                 # wall-clock throughput of the job
        "request_tokens_per_second_mean": _mean([r.tokens_per_second for r in generated]),
        "latency_seconds": {
            "p50": percentile(latencies, 0.50),
            "p95": percentile(latencies, 0.95),
            "mean": _mean(latencies),
            "max": max(latencies) if latencies else None,
            "cache_hits": len(rows) - len(generated),
        },
        "speculation_disabled": sum(1 for r in rows if r.speculation_disabled),
        # structured outputs: forced tokens the grammar drafted, and the share of the text they make
        "grammar_drafted_tokens": sum(r.grammar_drafted_tokens or 0 for r in rows),
        "grammar_accepted_tokens": (grammar := sum(r.grammar_accepted_tokens or 0 for r in generated)),
        "grammar_token_share": _ratio(grammar, tokens),
        "batching": {
            # decode time by rows active in the step (each request's share summed): what was chosen
            "batch_size_share": {str(k): v / size_total for k, v in sorted(by_size.items())}
                                if size_total else {},
            "batch_size_seconds": {str(k): v for k, v in sorted(by_size.items())},
            "speculative_step_share": _ratio(sum(r.draft_steps or 0 for r in rows), steps),
            "decode_tokens_per_second": _ratio(tokens, size_total),
        },
        "speculation": _speculation(generated),
        "pool_wins": dict(sorted(pool_wins.items())),
        "workers": workers,
    }
