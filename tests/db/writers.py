"""Body of the concurrent-writer test's child processes (a module of its own: spawn imports it)."""

from __future__ import annotations

from typing import Any


def write_results(url: str, job_id: str, ids: list[int], worker: str, start: Any, out: Any) -> None:
    """Claim and record each request in its own short transactions; report (worker, written, errors)."""
    from specbatch.db import session_factory
    from specbatch.engine.types import GenerationOutput, GenerationStats
    from specbatch.jobs import store

    factory = session_factory(url)
    written, errors = [], []
    start.wait(60)
    for rid in ids:
        output = GenerationOutput(f"{worker}:{rid}", [rid, rid + 1], "length",
                                  GenerationStats(prompt_tokens=3, new_tokens=2, verify_steps=1,
                                                  drafted_tokens=4, accepted_tokens=2, wall_seconds=0.01))
        try:
            with factory.begin() as s:
                store.claim_requests(s, [rid], worker, 60, 10)
            with factory.begin() as s:
                if store.record_result(s, rid, output, worker):
                    written.append(rid)
                store.refresh_job(s, job_id)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
            errors.append(f"{type(e).__name__}: {e}")
    out.put((worker, written, errors))
