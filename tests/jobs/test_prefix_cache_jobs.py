"""The prefix cache seen from a job: chunking order, the stored counts, the OpenAI usage field."""

from __future__ import annotations

import io
import json

from specbatch import db
from specbatch.jobs import export, store
from specbatch.jobs.batches import tallies
from specbatch.jobs.intake import ParsedRequest
from specbatch.jobs.prefix_order import group_by_prefix, mates_first
from specbatch.jobs.stats import job_stats
from tests.jobs.test_store import PARAMS, output

SYSTEM = "You are a careful assistant. Answer in one short sentence, citing the manual where you can. "


def test_requests_sharing_a_prompt_prefix_are_grouped_where_the_first_one_was():
    texts = [SYSTEM + "Q1", "unrelated one", SYSTEM[:30] + "other", SYSTEM + "Q2", "unrelated two", SYSTEM + "Q3"]
    assert group_by_prefix([10, 11, 12, 13, 14, 15], texts) == [10, 13, 15, 11, 12, 14]
    # nothing shared: the order is kept as it was
    assert group_by_prefix([3, 1, 2], ["a" * 80, "b" * 80, "c" * 80]) == [3, 1, 2]


def test_claiming_ahead_takes_the_batchs_prefix_mates_first_then_the_others_grouped():
    other = "Z" * 70
    texts = ["short", other + "1", SYSTEM + "Q2", "x" * 70, other + "2", SYSTEM + "Q3"]
    assert mates_first([SYSTEM + "Q1"], [1, 2, 3, 4, 5, 6], texts) == [3, 6, 1, 2, 5, 4]
    assert mates_first(["hi"], [1, 2, 3], ["hi", "hi", "hi"]) == [1, 2, 3]     # nothing long: as they came


def _job(url: str, prompts: list[str]) -> tuple[str, list[int]]:
    reqs = [ParsedRequest(line_no=i + 1, custom_id=f"c{i}", kind="completion", prompt=p, messages=None,
                          params=PARAMS) for i, p in enumerate(prompts)]
    with db.session_factory(url).begin() as s:
        job = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                               queue="q")
        return job.id, store.resumable_request_ids(s, job.id)


def test_a_jobs_routes_come_in_prefix_order_for_chunking(db_url):
    job_id, ids = _job(db_url, [SYSTEM + "Q1", "alone", SYSTEM + "Q2", "also alone", SYSTEM + "Q3"])
    with db.session_factory(db_url).begin() as s:
        assert store.request_routes(s, job_id) == {None: ids}
        assert store.request_routes(s, job_id, by_prefix=True) == {None: [ids[0], ids[2], ids[4], ids[1], ids[3]]}


def test_cached_prompt_tokens_reach_the_output_line_the_stats_and_the_batch_usage(db_url):
    job_id, ids = _job(db_url, [SYSTEM + "Q1", SYSTEM + "Q2"])
    first, second = output(), output()
    second.stats.cached_prompt_tokens, second.stats.prefill_seconds_saved = 4, 0.25
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids, "w1", 60, 3)
        store.record_result(s, ids[0], first, "w1")
        store.record_result(s, ids[1], second, "w1")
        store.refresh_job(s, job_id)
    buf = io.StringIO()
    with db.session_factory(db_url, readonly=True).begin() as s:
        export.write_openai(s, job_id, buf)
        st = job_stats(s, job_id)
        usage = tallies(s, [job_id])[1][job_id].as_openai()
    from openai.types import Completion

    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    cached = [Completion.model_validate(x["response"]["body"]).usage.prompt_tokens_details.cached_tokens
              for x in lines]
    assert cached == [0, 4]
    assert st["prefix_cache"] == {"cached_prompt_tokens": 4, "share": 0.4, "requests": 1,
                                  "prefill_seconds_saved_sum": 0.25}
    assert usage["input_tokens_details"] == {"cached_tokens": 4}
