"""specbatch audit: passes on a finished speculative job, fails when a stored token is altered."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from specbatch import db
from specbatch.cli.main import cli
from specbatch.config import Settings, get_settings
from specbatch.db.models import Request, Result
from specbatch.engine import Engine
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model
from specbatch.jobs import intake, logprobs, store
from specbatch.jobs.audit import LOGPROB_TOL, Item, audit
from specbatch.worker.guard import engine_models

LINES = [
    {"custom_id": "greedy", "prompt": "def fibonacci(n):", "max_tokens": 12},
    {"custom_id": "penalised", "prompt": "Write a haiku about", "max_tokens": 12, "frequency_penalty": 1.5,
     "logit_bias": {"7": 3}},
    {"custom_id": "sampled-lp", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 1.2,
              "seed": 4, "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "sampled", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0.9,
     "top_k": 8, "seed": 2, "presence_penalty": 1.0},
    # no seed: nothing to re-decode, so the stored logprobs (or the support) are what is checked
    {"custom_id": "unseeded-lp", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 1.2,
              "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "unseeded", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0.9,
     "top_k": 8},
]


def _database(tmp_path, monkeypatch, lines):
    """A fresh SQLite database the CLI uses, and ``lines`` parsed as a submitted file."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    get_settings.cache_clear()
    db.upgrade(url)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return url, intake.read_file(path, {}, Settings(database_url=url))


@pytest.fixture
def job(tmp_path, monkeypatch, tiny_models):
    url, parsed = _database(tmp_path, monkeypatch, LINES)
    target = str(tiny_models / "llama")
    engine = Engine(load_model(target), [load_model(str(tiny_models / "llama-partial")), NGRAM])
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target=target, drafts=["llama-partial", "ngram"], params={},
                                  requests=parsed.requests, queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w", 60, 3)
        for rid, req in zip(ids, parsed.requests):
            out = engine.generate(prompt=req.prompt, messages=req.messages, params=req.generation_params())
            store.record_result(s, rid, out, "w")
        store.refresh_job(s, job_id)
    yield url, job_id, engine
    db.forget_engines()


def run(*args: str):
    return CliRunner().invoke(cli, list(args), obj={})


def _alter(url: str, job_id: str, custom_id: str, engine: Engine | None = None) -> None:
    """Replace the stored token 2 with another. Where logprobs are stored, with one whose own
    log-probability under the target is not the stored one's: a tiny model's logits are nearly flat,
    so the next token id lies within LOGPROB_TOL of it now and then, and the check would then
    (rightly) first fail at token 3. CI met that once in about a thousand runs."""
    with db.session_factory(url).begin() as s:
        req, res = s.execute(select(Request, Result).join(Result, Request.id == Result.request_id)
                             .where(Request.job_id == job_id, Request.custom_id == custom_id)).one()
        tokens = list(res.token_ids)
        for step in range(1, 384):
            new = (tokens[2] + step) % 384
            if res.logprobs is None:
                break
            assert engine is not None
            stored = logprobs.unpack(res.logprobs)[2].logprob
            params = intake.params_from_dict(dict(req.params or {}))
            scored = engine.score(tokens[:2] + [new], prompt=req.prompt, messages=req.messages, params=params)
            if abs(scored.logprobs[2] - stored) > 10 * LOGPROB_TOL:
                break
        tokens[2] = new
        res.token_ids = tokens


def test_audit_passes_on_a_speculative_job(job):
    url, job_id, _ = job
    result = run("audit", job_id, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["audited"], report["failed"]) == (6, 0)
    checks = {r["custom_id"]: r["check"] for r in report["requests"]}
    # a seeded sample is a function of the target, the prompt, the parameters and the seed: the
    # target alone re-decodes it token for token, as a greedy request
    assert checks == {"greedy": "identical", "penalised": "identical", "sampled-lp": "identical",
                      "sampled": "identical", "unseeded-lp": "logprobs", "unseeded": "support"}
    details = {r["custom_id"]: r["detail"] for r in report["requests"]}
    assert details["sampled"] == "10 tokens identical to the target alone's sample with seed 2", details


@pytest.mark.parametrize("custom_id", ["greedy", "penalised", "sampled-lp", "sampled", "unseeded-lp"])
def test_audit_fails_when_a_stored_token_is_altered(job, custom_id):
    url, job_id, engine = job
    _alter(url, job_id, custom_id, engine)
    result = run("audit", job_id)
    assert result.exit_code == 1
    assert f"FAIL {custom_id}: " in result.stdout and "token 2" in result.stdout
    # the unseeded sampled line without stored logprobs passed the weaker support check only
    assert ("4 match the target alone, 1 sampled without a seed or stored logprobs only possible under it"
            in result.stderr and result.stderr.rstrip().endswith("1 do not")), result.stderr


def test_a_seeded_sample_with_another_possible_token_fails(tmp_path, monkeypatch, tiny_models):
    """A token the target could have drawn, but did not with this seed: the support check passes
    it; the re-decode does not (a seeded sample is certified like a greedy one)."""
    line = {"custom_id": "wide", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 1.0,
            "seed": 3}
    url, parsed = _database(tmp_path, monkeypatch, [line])
    target = str(tiny_models / "llama")
    engine = Engine(load_model(target), [load_model(str(tiny_models / "llama-partial"))])
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target=target, drafts=["llama-partial"], params={},
                                  requests=parsed.requests, queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w", 60, 3)
        req = parsed.requests[0]
        store.record_result(s, ids[0], engine.generate(prompt=req.prompt, params=req.generation_params()), "w")
        store.refresh_job(s, job_id)
    try:
        assert run("audit", job_id).exit_code == 0
        _alter(url, job_id, "wide")     # temperature 1, no top-k: every token stays possible
        result = run("audit", job_id, "--json")
        assert result.exit_code == 1, result.output
        (verdict,) = json.loads(result.stdout)["requests"]
        assert (verdict["check"], verdict["ok"]) == ("identical", False), verdict
        assert verdict["detail"].startswith("token 2 differs"), verdict
    finally:
        db.forget_engines()


def test_sample_picks_a_subset_and_bad_sample_is_one_line(job):
    url, job_id, _ = job
    result = run("audit", job_id, "--sample", "50%", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["audited"] == 3
    bad = run("audit", job_id, "--sample", "0")
    assert bad.exit_code == 2 and "--sample: '0': give a count >= 1" in bad.output   # bad usage
    assert "Traceback" not in bad.output


def test_audit_of_a_job_with_nothing_completed_is_not_a_pass(tmp_path, monkeypatch, tiny_models):
    url, parsed = _database(tmp_path, monkeypatch, LINES[:2])
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target=str(tiny_models / "llama"), drafts=[], params={},
                                  requests=parsed.requests, queue="q").id
    try:
        result = run("audit", job_id)
        assert result.exit_code == 1, result.output
        assert f"nothing to audit: job {job_id} has no completed request" in result.stderr
        result = run("audit", job_id, "--json")
        assert result.exit_code == 1 and json.loads(result.stdout)["audited"] == 0
    finally:
        db.forget_engines()


def test_a_job_decoded_in_bfloat16_is_audited_in_bfloat16(tmp_path, monkeypatch, tiny_models):
    """With no --dtype the audit re-decodes with the dtype the results recorded (results.numerics):
    it audited in float32 before, and a bfloat16 job failed there wherever a near-tie rounded the
    other way (here: the second line, at token 0), with no draft involved."""
    prompts = ["def fibonacci(n):", "Write a haiku about", "The quick brown fox"]
    url, parsed = _database(tmp_path, monkeypatch, [{"custom_id": str(i), "prompt": p, "max_tokens": 12}
                                                    for i, p in enumerate(prompts)])
    target = str(tiny_models / "llama")
    engine = Engine(load_model(target, dtype="bfloat16"))    # plain: in 16 bits batching moves near-ties
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target=target, drafts=[], params={}, requests=parsed.requests, queue="q").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w", 60, 3)
        for rid, req in zip(ids, parsed.requests):
            out = engine.generate(prompt=req.prompt, params=req.generation_params())
            store.record_result(s, rid, out, "w", engine_models(engine))
        store.refresh_job(s, job_id)
    try:
        result = run("audit", job_id, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["passed"] == 3
        # told otherwise, it audits in float32, and a mismatch says the numerics differ
        forced = run("audit", job_id, "--dtype", "float32", "--json")
        for v in json.loads(forced.stdout)["requests"]:
            assert v["ok"] or "dtype bfloat16, here float32" in v["detail"], v
    finally:
        db.forget_engines()


def test_a_mismatch_names_the_numerics_that_differ_from_the_recorded_ones(tiny_models):
    """A result decoded on another device, dtype or processor may differ at a near-tie with no
    draft involved: a failing verdict says what differs, so it is not read as speculation lossy;
    a result with no record (written before results.numerics) or alike numerics reads as before."""
    from specbatch.engine.fingerprint import decoded_with

    engine = Engine(load_model(str(tiny_models / "llama")))
    here = decoded_with(engine.target)
    assert (here["device"], here["dtype"]) == ("cpu", "float32") and here["processor"]
    good = engine.generate(prompt="def fibonacci(n):", params=intake.params_from_dict({"max_new_tokens": 6}))
    bad = [*good.token_ids[:2], (good.token_ids[2] + 1) % engine.target.vocab_size, *good.token_ids[3:]]

    def item(numerics):
        return Item(1, "x", "t", "def fibonacci(n):", None, None, {"max_new_tokens": 6}, bad, None, False,
                    numerics=numerics)

    elsewhere = {**here, "dtype": "bfloat16", "processor": "NVIDIA H200", "device": "cuda"}
    (v,) = audit([item(elsewhere)], lambda target: engine)
    assert not v.ok and v.detail.startswith("token 2 differs"), v
    assert "device cuda, here cpu; dtype bfloat16, here float32; processor NVIDIA H200, here " in v.detail, v
    for same in (None, here):
        (v,) = audit([item(same)], lambda target: engine)
        assert not v.ok and "numerics" not in v.detail, v

def test_the_audit_compares_with_how_its_engine_decodes_now(tiny_models):
    """The audit's own numerics follow the rule the records follow (fingerprint.decodes_compiled):
    its engine's static graphs are compiled (it read the target's forward only), failed ones eager."""
    from types import SimpleNamespace

    from specbatch.engine.fingerprint import decoded_with

    engine = Engine(load_model(str(tiny_models / "llama")))
    here = decoded_with(engine.target)
    good = engine.generate(prompt="def fibonacci(n):", params=intake.params_from_dict({"max_new_tokens": 6}))
    bad = [*good.token_ids[:2], (good.token_ids[2] + 1) % engine.target.vocab_size, *good.token_ids[3:]]
    item = Item(1, "x", "t", "def fibonacci(n):", None, None, {"max_new_tokens": 6}, bad, None, False,
                numerics={**here, "compiled": True})
    engine.static_graphs = SimpleNamespace(failed=None)     # (no static backend: it decodes eagerly here)
    (v,) = audit([item], lambda target: engine)
    assert not v.ok and "numerics" not in v.detail, v
    engine.static_graphs.failed = "BackendCompilerFailed: boom"
    (v,) = audit([item], lambda target: engine)
    assert "compiled True, here False" in v.detail, v


def test_a_one_token_result_is_worded_in_the_singular() -> None:
    """`ok  chat-09: identical: 1 tokens identical to the target alone` (an answer that is one end
    token; qa53): counts go through plural(), as every other line's."""
    from types import SimpleNamespace

    from specbatch.jobs.audit import Item, audit_item

    class Alone:
        def generate(self, **_):  # noqa: ANN003, ANN202
            return SimpleNamespace(token_ids=[2])

        def score(self, token_ids, **_):  # noqa: ANN001, ANN003, ANN202
            return SimpleNamespace(probs=[0.5] * len(token_ids))

    greedy = Item(1, "q1", "t", "hi", None, None, {"temperature": 0}, [2], None, False)
    assert audit_item(Alone(), greedy).detail == "1 token identical to the target alone"
    sampled = Item(2, "q2", "t", "hi", None, None, {"temperature": 0.7}, [2], None, False)
    assert audit_item(Alone(), sampled).detail == \
        "1 token possible under the target (no logprobs stored to compare)"


@pytest.mark.parametrize("recorded", [{"device": "cuda", "dtype": "bfloat16"}, {"device": "cpu", "dtype": "float32"}])
def test_a_bad_configured_device_is_one_line_whatever_the_results_recorded(tmp_path, monkeypatch, tiny_models,
                                                                           recorded):
    """SPECBATCH_DEVICE=gpu is a setting's mistake, told in one line; with results that recorded a
    device, the audit's choice of device read it first and said "unexpected error (RuntimeError:
    Expected one of cpu, cuda, ...) ... please report it" (review53). Since qa55 the settings
    refuse it before any command runs (exit 2, naming the variable)."""
    from tests.jobs.test_store import output

    url, parsed = _database(tmp_path, monkeypatch, LINES[:1])
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target=str(tiny_models / "llama"), drafts=[], params={},
                                  requests=parsed.requests, queue="q").id
        (rid,) = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, [rid], "w", 60, 3)
        store.record_result(s, rid, output(), "w", {"numerics": recorded})
        store.refresh_job(s, job_id)
    monkeypatch.setenv("SPECBATCH_DEVICE", "gpu")
    get_settings.cache_clear()
    try:
        result = run("audit", job_id)
    finally:
        db.forget_engines()
    assert result.exit_code == 2, result.output
    assert "SPECBATCH_DEVICE='gpu': use cpu, cuda, cuda:N or mps" in result.stderr, result.stderr
    assert "unexpected error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
