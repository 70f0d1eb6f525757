"""The results cache with two real workers on one queue (real Redis, real celery workers, SQLite)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from specbatch.cli.main import cli
from specbatch.db import session_factory
from specbatch.db.models import Job, Request, Result

pytestmark = pytest.mark.integration

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "SELECT id FROM jobs", "Write a haiku about"]


def _rows(prompt_set: list[str]) -> list[dict]:
    return [{"custom_id": f"q{i}", "prompt": p, "max_tokens": 6} for i, p in enumerate(prompt_set)]


def _results(cluster, job_ids: list[str]) -> list[tuple[str, Result]]:
    with session_factory(cluster.settings.database_url).begin() as s:
        return [(prompt, res) for prompt, res in s.execute(
            select(Request.prompt, Result).join(Result, Result.request_id == Request.id)
            .where(Request.job_id.in_(job_ids)).order_by(Result.id))]


def test_two_workers_racing_on_the_same_keys(cluster):
    cluster.worker("a", wait=False)
    cluster.worker("b")
    cluster.wait_consuming(cluster.procs[0])
    # every prompt four times in one file and again in a second job, submitted at once:
    # chunks of 2 land on both workers, so the same keys are claimed concurrently
    first, _ = cluster.submit(_rows(PROMPTS * 4))
    second, _ = cluster.submit(_rows(PROMPTS * 2))
    for job in (first, second):
        assert cluster.wait_finished(job)["status"] == "completed"
        assert all(r["results"] == 1 and r["status"] == "completed" for r in cluster.rows(job))

    by_prompt: dict[str, list[Result]] = defaultdict(list)
    for prompt, res in _results(cluster, [first, second]):
        by_prompt[prompt].append(res)
    assert set(by_prompt) == set(PROMPTS)
    for prompt, rows in by_prompt.items():
        generated = [r for r in rows if not r.cached]
        # each worker generates a key at most once: its own row is committed before its next claim
        assert 1 <= len(generated) <= 2, (prompt, [(r.worker, r.cached) for r in rows])
        assert len({tuple(r.token_ids) for r in rows}) == 1 and len({r.text for r in rows}) == 1
        assert len({r.cache_key for r in rows}) == 1
        assert all(r.cached_from in {g.id for g in generated} for r in rows if r.cached)
    hits = sum(r.cached for rows in by_prompt.values() for r in rows)
    assert hits >= 24 - 2 * len(PROMPTS)
    stats = [cluster.summary(j)["stats"] for j in (first, second)]
    assert sum(s["cache_hits"] for s in stats) == hits


def test_submit_no_cache_generates_again(cluster):
    cluster.worker("a")
    first, _ = cluster.submit(_rows(PROMPTS[:2]))
    cluster.wait_finished(first)
    path = cluster.prompts(_rows(PROMPTS[:2]))
    result = CliRunner().invoke(cli, ["submit", str(path), "--target", str(cluster.models / "llama"),
                                      "--draft", str(cluster.models / "llama-partial"), "--no-cache",
                                      "--json"], obj={})
    assert result.exit_code == 0, result.output
    second = json.loads(result.stdout[result.stdout.index("{"):])["job_id"]
    summary = cluster.wait_finished(second)
    assert summary["stats"]["cache_hits"] == 0 and summary["stats"]["tokens_generated"] > 0
    with session_factory(cluster.settings.database_url).begin() as s:
        assert s.scalar(select(Job.cache).where(Job.id == second)) is False
    third, _ = cluster.submit(_rows(PROMPTS[:2]))
    assert cluster.wait_finished(third)["stats"]["cache_hits"] == 2
