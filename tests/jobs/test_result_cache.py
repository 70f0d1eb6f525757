"""The results cache on SQLite and PostgreSQL, with real tiny engines through the worker's chunk code."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select, text

from specbatch import db
from specbatch.config import Settings
from specbatch.db.models import RESULTS_VIEW, Request, RequestStatus, Result
from specbatch.engine import Engine
from specbatch.engine.fingerprint import model_fingerprint
from specbatch.engine.loading import load_model
from specbatch.engine.types import GenerationParams
from specbatch.jobs import intake, result_cache, store
from specbatch.jobs.stats import job_stats
from specbatch.worker.chunk import process_chunk

GREEDY = GenerationParams(max_new_tokens=8)
PROMPTS = ["Write a haiku about queues", "The quick brown fox", "def fibonacci(n):", "SELECT id FROM jobs"]


# ---------------------------------------------------------------- the key and the rule


def test_only_greedy_requests_are_cacheable():
    assert result_cache.cacheable(GREEDY)
    assert result_cache.cacheable(GenerationParams(temperature=0.0, seed=3, top_k=5))
    # a seeded sample depends on the drafts (measured: see cacheable's docstring)
    assert not result_cache.cacheable(GenerationParams(temperature=0.7, seed=1))
    assert not result_cache.cacheable(GenerationParams(temperature=0.7))


@pytest.mark.parametrize("change, hits", [
    ({"max_new_tokens": 9}, False),
    ({"stop": ("\n",)}, False),
    ({"stop": ("a",)}, False),
    ({"stop": ("a", "b")}, True),                # the same stop set in another order
    ({"temperature": 0.5}, False),
    # greedy decoding never reads these, so the same greedy result serves them
    ({"seed": 123}, True),
    ({"top_p": 0.5}, True),
    ({"top_k": 7}, True),
    ({"gamma": 2, "adaptive": False}, True),     # lossless: the draft length changes no output
    # the logit processors change greedy text: each is in the key (min_p cannot change the argmax)
    ({"presence_penalty": 0.5}, False),
    ({"frequency_penalty": -0.5}, False),
    ({"repetition_penalty": 1.2}, False),
    ({"logit_bias": ((5, 1.0),)}, False),
    ({"logit_bias": ((5, 2.0),)}, False),
    ({"min_p": 0.3}, True),
    ({"presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": ()}, True),   # the defaults
])
def test_greedy_key_per_parameter(change, hits):
    base = result_cache.cache_key("T", [1, 2, 3], dataclasses.replace(GREEDY, stop=("b", "a")))
    changed = result_cache.cache_key("T", [1, 2, 3],
                                     dataclasses.replace(GREEDY, **{"stop": ("b", "a"), **change}))
    assert (changed == base) is hits


def test_key_covers_target_prompt_and_stop_set():
    key = result_cache.cache_key("T", [1, 2, 3], GREEDY)
    assert result_cache.cache_key("U", [1, 2, 3], GREEDY) != key
    assert result_cache.cache_key("T", [1, 2, 4], GREEDY) != key
    assert result_cache.cache_key("T", [1, 2], GREEDY) != key
    with_stops = dataclasses.replace(GREEDY, stop=("x", "y"))
    assert result_cache.cache_key("T", [1], with_stops) == result_cache.cache_key(
        "T", [1], dataclasses.replace(GREEDY, stop=("y", "x", "x")))


@pytest.mark.parametrize("field, value", [("temperature", 0.8), ("top_p", 0.8), ("top_k", 3), ("seed", 2),
                                          ("min_p", 0.2)])
def test_sampled_key_covers_every_sampling_parameter(field, value):
    """Ready for the day seeded sampling becomes cacheable: each sampling parameter is in the key."""
    sampled = GenerationParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=5, seed=1)
    assert result_cache.cache_key("T", [1], sampled) != result_cache.cache_key(
        "T", [1], dataclasses.replace(sampled, **{field: value}))
    assert result_cache.cache_key("T", [1], sampled) == result_cache.cache_key("T", [1], sampled)


# ---------------------------------------------------------------- through process_chunk


@pytest.fixture(scope="module")
def engines(tiny_models):
    """Engines sharing one tiny Llama target: different drafts, batch sizes."""
    target = load_model(str(tiny_models / "llama"))
    partial = load_model(str(tiny_models / "llama-partial"))
    rand = load_model(str(tiny_models / "llama-random"))
    return {"partial-b1": Engine(target, [partial], batch_size=1),
            "random-b4": Engine(target, [rand], batch_size=4),
            "none-b3": Engine(target, [], batch_size=3)}


def _settings(url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=url, cache_dir=str(tmp_path / "cache"), chunk_size=16)


def make_job(settings: Settings, lines: list[dict], target: str = "llama", cache: bool = True,
             name: str = "p.jsonl") -> tuple[str, list[int]]:
    path = Path(settings.cache_dir).parent / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    parsed = intake.parse_file(path, {}, settings)
    with db.session_factory(settings.database_url).begin() as s:
        job = store.create_job(s, target=target, drafts=["d"], params={}, requests=parsed,
                               queue="q", cache=cache)
        return job.id, list(store.resumable_request_ids(s, job.id))


def results(url: str, job_id: str) -> list[Result]:
    with db.session_factory(url).begin() as s:
        return list(s.scalars(select(Result).join(Request, Request.id == Result.request_id)
                              .where(Result.job_id == job_id).order_by(Request.line_no)))


def stats_of(url: str, job_id: str) -> dict:
    with db.session_factory(url, readonly=True).begin() as s:
        return job_stats(s, job_id)


def assert_copied_at_one_moment(url: str, job_id: str, hits: list[Result]) -> None:
    """A hit starts and ends when it is written (docs/FORMATS.md): no NULL start in the view."""
    assert hits and all(h.started_at is not None and h.started_at == h.finished_at for h in hits)
    assert all(h.latency_seconds == 0 for h in hits)
    with db.session_factory(url, readonly=True).begin() as s:
        holes = s.scalar(text(f"SELECT count(*) FROM {RESULTS_VIEW} WHERE job_id = :j AND status = 'completed' "
                              "AND started_at IS NULL"), {"j": job_id})
    assert holes == 0


def lines(prompts: list[str] = PROMPTS, **params) -> list[dict]:
    return [{"custom_id": f"q{i}", "prompt": p, "max_tokens": 8, **params} for i, p in enumerate(prompts)]


def test_hit_across_drafts_and_batch_sizes_is_exact(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    first, ids = make_job(settings, lines())
    report = process_chunk(settings, engines["partial-b1"], ids, "w1")
    assert report.completed == ids and report.cached == []
    generated = results(db_url, first)
    assert all(not r.cached and r.cache_key and r.cache_target for r in generated)

    for name in ("random-b4", "none-b3"):
        job, ids = make_job(settings, lines(), name=f"{name}.jsonl")
        events = []
        report = process_chunk(settings, engines[name], ids, "w2", on_result=events.append)
        assert report.cached == ids and report.new_tokens == 0
        assert all(e.cached and e.output.stats.new_tokens == 0 for e in events)
        hits = results(db_url, job)
        assert [h.token_ids for h in hits] == [g.token_ids for g in generated]
        assert [h.text for h in hits] == [g.text for g in generated]
        assert [h.cached_from for h in hits] == [g.id for g in generated]
        assert all(h.cached and h.verify_steps == 0 and h.drafted_tokens == 0 and h.wall_seconds == 0
                   for h in hits)
        assert_copied_at_one_moment(db_url, job, hits)
        stats = stats_of(db_url, job)
        assert (stats["cache_hits"], stats["tokens_generated"]) == (4, 0)
        assert stats["tokens_from_cache"] == sum(len(g.token_ids) for g in generated)

    # exact: the same engine generating for real (a --no-cache job) gives the cached tokens
    fresh, ids = make_job(settings, lines(), cache=False, name="fresh.jsonl")
    report = process_chunk(settings, engines["random-b4"], ids, "w3")
    assert report.cached == [] and report.new_tokens > 0
    assert [r.token_ids for r in results(db_url, fresh)] == [g.token_ids for g in generated]


def test_a_hit_carries_zeros_for_what_it_did_not_do_and_the_job_leaves_it_out(db_url, tmp_path, engines):
    """docs/statistics.md, results-cache hits: 0 prompt tokens read from the prefix cache (not
    NULL, a row older than the column) and no verify step; the job's means count generated rows."""
    settings = _settings(db_url, tmp_path)
    first, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    generated = results(db_url, first)
    assert all(g.cached_prompt_tokens == 0 and g.mean_acceptance_length >= 1.0 for g in generated)
    job, ids = make_job(settings, lines(PROMPTS[:2]), name="again.jsonl")
    events = []
    process_chunk(settings, engines["none-b3"], ids, "w2", on_result=events.append)
    hits = results(db_url, job)
    assert [h.cached for h in hits] == [True, True]
    for h, e in zip(hits, events, strict=True):     # the row says what the worker's event says
        st = e.output.stats
        assert (h.cached_prompt_tokens, h.prefill_seconds_saved) == (st.cached_prompt_tokens,
                                                                     st.prefill_seconds_saved) == (0, 0.0)
        assert (h.verify_steps, h.mean_acceptance_length, h.acceptance_rate) == (0, 0.0, 0.0)
    with db.session_factory(db_url, readonly=True).begin() as s:
        nulls = s.scalar(text(f"SELECT count(*) FROM {RESULTS_VIEW} WHERE job_id = :j "
                              "AND (cached_prompt_tokens IS NULL OR prefill_seconds_saved IS NULL)"), {"j": job})
    assert nulls == 0
    stats = stats_of(db_url, job)
    assert stats["mean_acceptance_length"] == {"token_weighted": None, "request_mean": None}
    assert stats["acceptance_rate"] == {"token_weighted": None, "request_mean": None}
    assert stats["prefix_cache"]["cached_prompt_tokens"] == 0


@pytest.mark.parametrize("change", [{"max_tokens": 7}, {"stop": ["e"]}, {"temperature": 0.7, "seed": 1}])
def test_a_changed_parameter_misses(db_url, tmp_path, engines, change):
    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    job, ids = make_job(settings, lines(PROMPTS[:2], **change), name="changed.jsonl")
    report = process_chunk(settings, engines["partial-b1"], ids, "w1")
    assert report.cached == [] and report.completed == ids
    assert not any(r.cached for r in results(db_url, job))
    sampled = "temperature" in change
    assert all((r.cache_key is None) is sampled for r in results(db_url, job))  # sampled: never stored


def test_chat_messages_key_on_the_templated_tokens(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    chat = [{"custom_id": "c", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}]
    _, ids = make_job(settings, chat)
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    other = [{"custom_id": "c", "messages": [{"role": "system", "content": "hello"}], "max_tokens": 6}]
    job, ids = make_job(settings, chat + [{**other[0], "custom_id": "d"}], name="chat2.jsonl")
    report = process_chunk(settings, engines["random-b4"], ids, "w1")
    assert report.cached == ids[:1]        # another role is another templated prompt


@pytest.mark.parametrize("engine", ["partial-b1", "random-b4"])
def test_duplicates_within_one_file_are_generated_once(db_url, tmp_path, engines, engine):
    settings = _settings(db_url, tmp_path)
    rows = lines(["The quick brown fox"] * 3 + ["SELECT id FROM jobs"] * 2 + ["def fibonacci(n):"])
    job, ids = make_job(settings, rows)
    report = process_chunk(settings, engines[engine], ids, "w1")
    assert sorted(report.completed) == ids and len(report.cached) == 3
    got = results(db_url, job)
    assert [r.cached for r in got] == [False, True, True, False, True, False]
    assert got[1].token_ids == got[2].token_ids == got[0].token_ids
    assert got[1].cached_from == got[2].cached_from == got[0].id and got[4].cached_from == got[3].id
    assert_copied_at_one_moment(db_url, job, [r for r in got if r.cached])
    assert stats_of(db_url, job)["tokens_generated"] == sum(
        len(got[i].token_ids) for i in (0, 3, 5))
    with db.session_factory(db_url).begin() as s:
        assert {r.status for r in s.scalars(select(Request).where(Request.job_id == job))} == {
            RequestStatus.completed}
        assert store.job_summary(s, job)["status"] == "completed"


def test_duplicates_claimed_by_a_refilling_batch_wait_for_their_leader(db_url, tmp_path, engines):
    """A batch of 2 claims more of its job as rows finish (worker/chunk.py): a duplicate of a
    request still decoding, claimed later, waits for it (not generated twice), and those waiting
    from the first claim are still resolved (a later claim once replaced them: left running)."""
    settings = _settings(db_url, tmp_path)
    a, b, c, d = PROMPTS
    job, ids = make_job(settings, lines([a, a, b, c, a, b, c, d]))
    report = process_chunk(settings, Engine(engines["none-b3"].target, [], batch_size=2), ids[:2], "w1")
    assert sorted(report.completed) == ids and sorted(report.cached) == [ids[i] for i in (1, 4, 5, 6)]
    got = results(db_url, job)
    assert [r.cached for r in got] == [False, True, False, False, True, True, True, False]
    with db.session_factory(db_url).begin() as s:
        assert store.job_summary(s, job)["status"] == "completed"


class _Claimed:
    """A claimed request that counts how often its id is read (the work of ``serve``'s dedupe)."""

    reads = 0

    def __init__(self, rid: int, job_id: str) -> None:
        self.rid, self.job_id = rid, job_id

    @property
    def id(self) -> int:
        type(self).reads += 1
        return self.rid


def test_many_duplicates_of_one_leader_wait_once_each_in_linear_work(db_url, tmp_path):
    """Thousands of copies of one prompt in a chunk: each waits for the leader once, in the order
    claimed, and a later claim of some of them again adds only the new ones; the dedupe reads each
    id a few times (it compared every duplicate with every one before it: quadratic)."""
    settings = _settings(db_url, tmp_path)
    job, _ = make_job(settings, lines(PROMPTS[:1]))
    cache = result_cache.ResultCache(engine=None, target="T")
    n = 400
    claimed = [_Claimed(i, job) for i in range(1, n + 1)]
    cache.keys.update({c.rid: "same" for c in claimed})
    _Claimed.reads = 0
    hits, todo = cache.serve(db.session_factory(db_url), claimed, "w1")
    assert _Claimed.reads < 20 * n, _Claimed.reads
    assert hits == [] and todo == [claimed[0]]
    assert [c.rid for c in cache.waiting[1]] == list(range(2, n + 1))
    later = _Claimed(n + 1, job)
    cache.keys[later.rid] = "same"
    cache.serve(db.session_factory(db_url), claimed[n // 2:] + [later, later], "w1")
    assert [c.rid for c in cache.waiting[1]] == list(range(2, n + 2))


def test_a_failing_request_fails_its_duplicates_alike(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    too_long = lines(["The quick brown fox"] * 2, max_tokens=600)   # the tiny model's context is 512
    job, ids = make_job(settings, too_long + [{"custom_id": "ok", "prompt": "def fibonacci(n):", "max_tokens": 8}])
    report = process_chunk(settings, engines["random-b4"], ids, "w1")
    assert sorted(report.failed) == ids[:2] and report.completed == ids[2:]
    with db.session_factory(db_url).begin() as s:
        reqs = list(s.scalars(select(Request).where(Request.job_id == job).order_by(Request.line_no)))
        assert reqs[0].error == reqs[1].error and "exceeds the context" in reqs[0].error


def test_no_cache_job_generates_everything_and_still_fills_the_cache(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    job, ids = make_job(settings, lines(PROMPTS[:2] * 2), cache=False, name="nocache.jsonl")
    report = process_chunk(settings, engines["random-b4"], ids, "w1")
    assert report.cached == [] and sorted(report.completed) == ids
    assert all(r.cache_key for r in results(db_url, job))
    with db.session_factory(db_url).begin() as s:
        assert result_cache.stats(s)["entries"] == 2


def test_stats_and_clear_by_target_name_and_alias(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:3]), target="llama")
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    _, ids = make_job(settings, lines(PROMPTS[:2]), target="alias-of-llama", name="alias.jsonl")
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    sf = db.session_factory(db_url)
    with sf.begin() as s:
        st = result_cache.stats(s)
    assert (st["entries"], st["hits"]) == (3, 2) and len(st["targets"]) == 1
    assert st["targets"][0]["names"] == ["alias-of-llama", "llama"]
    assert st["tokens_saved"] > 0
    with sf.begin() as s:
        assert result_cache.clear(s, "no-such-model") == 0
        assert result_cache.clear(s, "alias-of-llama") == 3     # the same weights: all its entries
    with sf.begin() as s:
        assert result_cache.stats(s)["entries"] == 0
    job, ids = make_job(settings, lines(PROMPTS[:1]), name="after.jsonl")
    assert process_chunk(settings, engines["partial-b1"], ids, "w1").cached == []


def test_clear_everything_keeps_the_results(db_url, tmp_path, engines):
    settings = _settings(db_url, tmp_path)
    job, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    with db.session_factory(db_url).begin() as s:
        assert result_cache.clear(s) == 2
    assert [r.cache_key for r in results(db_url, job)] == [None, None]
    assert all(r.text is not None for r in results(db_url, job))


# ---------------------------------------------------------------- the target's identity


def _perturb_one_weight(model_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})


def test_same_weights_under_another_name_hit_and_a_rewritten_weight_misses(db_url, tmp_path, tiny_models):
    settings = _settings(db_url, tmp_path)
    a, b = tmp_path / "models" / "a", tmp_path / "models" / "b"
    shutil.copytree(tiny_models / "llama", a)
    shutil.copytree(tiny_models / "llama", b)
    draft = load_model(str(tiny_models / "llama-partial"))
    _, ids = make_job(settings, lines(PROMPTS[:2]), target=str(a))
    process_chunk(settings, Engine(load_model(str(a)), [draft]), ids, "w1")

    _, ids = make_job(settings, lines(PROMPTS[:2]), target=str(b), name="b.jsonl")
    assert process_chunk(settings, Engine(load_model(str(b)), [draft]), ids, "w1").cached == ids

    _perturb_one_weight(a)
    job, ids = make_job(settings, lines(PROMPTS[:2]), target=str(a), name="a2.jsonl")
    report = process_chunk(settings, Engine(load_model(str(a)), [draft]), ids, "w1")
    assert report.cached == [] and report.new_tokens > 0


def test_fingerprint_is_memoized_on_disk_and_follows_the_numerics(tmp_path, tiny_models):
    model = load_model(str(tiny_models / "llama"))
    cache = tmp_path / "cache"
    fp = model_fingerprint(model, cache)
    memo = sorted((cache / "fingerprints").iterdir())
    assert fp and memo                                     # one memo per file, written once
    assert model_fingerprint(model, cache) == fp and sorted((cache / "fingerprints").iterdir()) == memo
    assert model_fingerprint(model, None) == fp            # the memo is only a shortcut
    bf16 = load_model(str(tiny_models / "llama"), dtype="bfloat16")
    assert model_fingerprint(bf16, cache) != fp            # other numbers, other results
    assert model_fingerprint(load_model(str(tiny_models / "llama-partial")), cache) != fp


def test_packed_linears_are_numerics_of_their_own(tmp_path, tiny_models, monkeypatch):
    """Packed products round unlike F.linear, and oneDNN's unlike MKL's: results of a model with
    plain Linears (written before packing, or by a torch without MKL) or another kernel's are not
    served for a packed one."""
    from specbatch.engine import packed

    passing = [k for k in packed.KERNELS if packed.kernel_check(k) is None]
    if not passing:
        pytest.skip("no packed kernel passes its check here")
    fps = set()
    for k in passing:
        monkeypatch.setattr(packed, "kernel", lambda linears="auto", k=k: k)
        fps.add(model_fingerprint(load_model(str(tiny_models / "llama")), tmp_path))
    monkeypatch.setattr(packed, "kernel", lambda linears="auto": None)
    plain = load_model(str(tiny_models / "llama"))
    assert not any(isinstance(m, packed.PackedLinear) for m in plain.model.modules())
    fps.add(model_fingerprint(plain, tmp_path))
    assert len(fps) == len(passing) + 1


def test_a_token_id_prompt_hits_the_text_that_tokenizes_to_it(db_url, tmp_path, engines):
    """The key is the prompt's token ids, so an OpenAI /v1/completions line with ids for a prompt
    shares the entry of the same prompt sent as text."""
    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:1]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    token_ids = engines["partial-b1"].encode(PROMPTS[0])
    batch_line = {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": token_ids, "max_tokens": 8}}
    other = {**batch_line, "custom_id": "other", "body": {"prompt": token_ids[:-1], "max_tokens": 8}}
    job, ids = make_job(settings, [batch_line, other], name="ids.jsonl")
    report = process_chunk(settings, engines["random-b4"], ids, "w1")
    assert report.cached == ids[:1] and report.completed == ids
    got = results(db_url, job)
    assert got[0].cached and not got[1].cached and got[1].cache_key
    # a copy was decoded where its source was: it carries the source's record of how (results.numerics)
    assert got[0].numerics is not None and got[0].numerics == got[1].numerics, (got[0].numerics, got[1].numerics)


def test_a_lossy_fallback_engine_neither_serves_nor_stores(db_url, tmp_path, engines):
    """--fallback-draft answers with the draft alone in the target's place: never a cache entry."""
    from specbatch.worker.guard import draft_only

    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:1]))
    process_chunk(settings, engines["partial-b1"], ids, "w1")
    fallback = draft_only(engines["partial-b1"])
    assert fallback.lossy
    job, ids = make_job(settings, lines(PROMPTS[:1] * 2), name="lossy.jsonl")
    report = process_chunk(settings, fallback, ids, "w1")
    assert report.cached == [] and report.completed == ids
    assert all(r.lossy and r.cache_key is None and not r.cached for r in results(db_url, job))


# ---------------------------------------------------------------- keys follow how a result was decoded


def _compiled_forward(model):
    """A real compiled forward installed on ``model`` that never runs a graph (every shape class
    eager): nothing compiles, yet the model decodes "compiled" as far as any record can tell."""
    from specbatch.engine.compile.forward import install

    compiled = install(model)
    assert compiled is not None
    compiled.eager_classes = {(rows, tokens) for rows in (False, True) for tokens in (False, True)}
    return compiled


class _Finished:
    """A background compile that has finished (engine/background.py): adopting it installs a
    compiled forward on the target, or hands the engine static graphs, as BackgroundCompile.adopt."""

    done = True

    def __init__(self, model, static: bool = False) -> None:
        from types import SimpleNamespace

        from specbatch.engine.compile.decision import CompilePlan

        self.model, self.plan = model, CompilePlan("on", True, "warmed up in a test")
        self.graphs = SimpleNamespace(failed=None) if static else None

    def adopt(self):
        if self.graphs is None:
            _compiled_forward(self.model)
        return self.plan


def test_an_eager_target_keeps_the_fingerprint_it_had(tmp_path, tiny_models):
    """Reading the compiled state at each call changed no eager key, so the results cached before
    stay valid: the fingerprint is still the one FINGERPRINT_VERSION 1 made (spelled out here)."""
    import hashlib

    from specbatch.engine import packed
    from specbatch.engine.fingerprint import directory_digest

    model = load_model(str(tiny_models / "llama"))
    kernel = packed.packed_kernel(model.model)
    blob = {"v": 1, "files": directory_digest(tiny_models / "llama", None), "dtype": "torch.float32",
            "device": "cpu", "int8": False, "compiled": False,
            **({"linears": f"{kernel}-packed"} if kernel is not None else {})}
    before = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
    assert model_fingerprint(model, tmp_path) == before
    engine = Engine(model)
    assert result_cache.target_identity(engine, str(tmp_path)) == before
    assert result_cache.ResultCache.for_engine(engine, str(tmp_path)).target == before


@pytest.mark.parametrize("static", [False, True], ids=["compiled-forward", "static-graphs"])
def test_a_compile_adopted_while_the_worker_runs_keys_what_it_decodes_next_as_compiled(
        db_url, tmp_path, tiny_models, engines, static):
    """A worker compiles in the background and adopts the graphs between batches: what it decodes
    from then on is compiled and keyed so (the engine's fingerprint was computed once and stayed
    eager), it is served no eager entry, and no eager engine is served its entries."""
    settings = _settings(db_url, tmp_path)
    engine = Engine(load_model(str(tiny_models / "llama")), [], batch_size=3)
    first, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engine, ids, "w1")
    eager = {r.cache_target for r in results(db_url, first)}
    assert len(eager) == 1 and None not in eager

    engine.background = _Finished(engine.target, static)   # adopted at the chunk's first batch
    job, ids = make_job(settings, lines(PROMPTS[:3]), name="compiled.jsonl")
    report = process_chunk(settings, engine, ids, "w1")
    assert report.cached == [] and sorted(report.completed) == ids
    assert engine.background is None and (engine.static_graphs is not None) is static
    got = results(db_url, job)
    assert all(r.numerics["compiled"] is True and r.cache_key for r in got), [r.numerics for r in got]
    compiled = {r.cache_target for r in got}
    assert len(compiled) == 1 and compiled != eager

    # an eager engine is served the eager entries only; the compiled one, its own
    job, ids = make_job(settings, lines(PROMPTS[:3]), name="eager-again.jsonl")
    report = process_chunk(settings, engines["none-b3"], ids, "w2")
    assert report.cached == ids[:2]
    job, ids = make_job(settings, lines(PROMPTS[:3]), name="compiled-again.jsonl")
    assert process_chunk(settings, engine, ids, "w1").cached == ids


def test_static_graphs_are_keyed_apart_from_eager(db_url, tmp_path, engines):
    """--compile static decodes through the engine's graphs, the target's compiled forward unset:
    its results were keyed (and served) as eager ones."""
    from types import SimpleNamespace

    settings = _settings(db_url, tmp_path)
    _, ids = make_job(settings, lines(PROMPTS[:2]))
    process_chunk(settings, engines["none-b3"], ids, "w1")
    static = Engine(engines["none-b3"].target, [], batch_size=3)
    static.static_graphs = SimpleNamespace(failed=None)   # (without the static backend it decodes eagerly)
    job, ids = make_job(settings, lines(PROMPTS[:2]), name="static.jsonl")
    report = process_chunk(settings, static, ids, "w2")
    assert report.cached == [] and sorted(report.completed) == ids
    assert all(r.numerics["compiled"] is True and r.cache_key for r in results(db_url, job))


def test_a_decode_straddling_a_compile_failure_is_not_cached_and_later_ones_are_eager(
        db_url, tmp_path, tiny_models, engines, monkeypatch):
    """The compiled forward fails while rows decode (CompiledForward.fail: eager for good): those
    rows decoded partly compiled, partly eager, so they are stored with no key and a record that
    says so; what decodes after the failure is eager and keyed as eager results are."""
    from specbatch.engine.fingerprint import PARTLY

    settings = _settings(db_url, tmp_path)
    engine = Engine(load_model(str(tiny_models / "llama")), [], batch_size=3)
    compiled = _compiled_forward(engine.target)
    real = engine.generate_many

    def failing_as_they_start(requests, *args, on_start=None, **kwargs):
        def start(indices):
            on_start(indices)
            compiled.fail(RuntimeError("inductor fell over"))   # after they began, before their steps
        return real(requests, *args, on_start=start, **kwargs)

    monkeypatch.setattr(engine, "generate_many", failing_as_they_start)
    job, ids = make_job(settings, lines(PROMPTS[:2]))
    assert sorted(process_chunk(settings, engine, ids, "w1").completed) == ids
    got = results(db_url, job)
    assert all(r.cache_key is None and r.cache_target is None and r.numerics["compiled"] == PARTLY
               for r in got), [(r.cache_key, r.numerics) for r in got]

    monkeypatch.undo()
    job, ids = make_job(settings, lines(PROMPTS[:2]), name="after.jsonl")
    report = process_chunk(settings, engine, ids, "w1")
    assert report.cached == [] and sorted(report.completed) == ids      # the straddled rows were not stored as entries
    got = results(db_url, job)
    assert all(r.numerics["compiled"] is False for r in got)
    assert {r.cache_target for r in got} == {result_cache.target_identity(engines["none-b3"], settings.cache_dir)}
    job, ids = make_job(settings, lines(PROMPTS[:2]), name="eager.jsonl")
    assert process_chunk(settings, engines["none-b3"], ids, "w2").cached == ids
