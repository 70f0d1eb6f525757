"""``n`` samples per request: n rows forked from one prefill (parameter n, docs/FORMATS.md).

Greedy samples are n copies of the target's own greedy text; seeded samples are the same at any
batch size and on a re-run, and differ from one another; samples drawn from one prefill follow
the target's law (chi-square, with a negative control); the prompt is fed to each model once
for the n rows (counted on the caches' forwards).
"""

from __future__ import annotations

import collections

import pytest

import specbatch.engine.engine as engine_mod
from specbatch.engine import Engine, GenerationParams
from specbatch.engine.cache import BatchCache
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.engine import EngineRequest
from specbatch.engine.policy import MeasuredPolicy
from specbatch.engine.sampling import sample_seed
from tests.engine.test_greedy_exact import target_greedy
from tests.engine.test_sampling_distribution import PROMPT, WARP, chi2_pvalue, exact_joint

PROMPTS = ["Write a haiku about", "def fibonacci(n):"]


@pytest.mark.parametrize(("drafts", "ngram", "batch"), [([], False, 8), (["llama-partial"], False, 8),
                                                        (["llama-partial"], True, 3), (["llama-partial"], False, 1)])
def test_greedy_samples_are_copies_of_the_target_alone(load, drafts, ngram, batch):
    target = load("llama")
    engine = Engine(target, [load(d) for d in drafts] + [NGRAM] * ngram)
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=24, n=4)) for p in PROMPTS]
    got = dict(engine.generate_many(reqs, batch_size=batch))
    for i, prompt in enumerate(PROMPTS):
        ref = target_greedy(target, prompt, 24)
        assert [o.sample_index for o in got[i].samples] == [0, 1, 2, 3]
        assert [o.token_ids[:len(ref)] for o in got[i].samples] == [ref] * 4
        assert all(o.stats.verify_steps > 0 for o in got[i].samples)     # each its own row


SAMPLED = dict(max_new_tokens=16, temperature=1.0, top_k=20, gamma=3, adaptive=False)


def _sampled(engine, batch: int, seed: int = 11, n: int = 5) -> list[list[int]]:
    reqs = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(seed=seed, n=n, **SAMPLED)),
            EngineRequest(prompt=PROMPTS[1], params=GenerationParams(seed=3, **SAMPLED))]
    got = dict(engine.generate_many(reqs, batch_size=batch))
    return [o.token_ids for o in got[0].samples]


def test_seeded_samples_are_the_same_at_any_batch_size_and_differ(load):
    engine = Engine(load("llama"), [load("llama-partial")])
    at8 = _sampled(engine, 8)
    assert _sampled(engine, 1) == at8
    assert _sampled(engine, 3) == at8
    assert _sampled(engine, 8) == at8                       # a re-run
    assert len({tuple(t) for t in at8}) == len(at8)          # the samples differ
    # sample 0 is the request's n = 1 output: n changes nothing for existing seeded lines
    alone = engine.generate(prompt=PROMPTS[0], params=GenerationParams(seed=11, **SAMPLED))
    assert alone.token_ids == at8[0]
    # sample i is a function of (seed, i): another n keeps the first samples
    assert _sampled(engine, 8, n=3) == at8[:3]


def _first_two(engine, requests: int, n: int) -> collections.Counter:
    params = dict(max_new_tokens=2, temperature=WARP.temperature, top_k=WARP.top_k, gamma=3, adaptive=False)
    reqs = [EngineRequest(prompt=PROMPT, params=GenerationParams(seed=100 + r, n=n, **params))
            for r in range(requests)]
    counts: collections.Counter = collections.Counter()
    for _, out in engine.generate_many(reqs, batch_size=n):
        counts.update(tuple(o.token_ids) for o in out.samples)
    return counts


def test_samples_of_one_prefill_follow_the_target(load):
    target = load("llama")
    engine = Engine(target, [load("llama-partial")])
    counts = _first_two(engine, 6, 128)
    assert chi2_pvalue(counts, exact_joint(target)) > 1e-3


def test_samples_sharing_their_draws_are_detected(load, monkeypatch):
    """Negative control: samples seeded alike (one noise for all n rows) are not n
    draws from the target; the same test rejects them."""
    monkeypatch.setattr(engine_mod, "sample_seed", lambda seed, i: seed)
    target = load("llama")
    engine = Engine(target, [load("llama-partial")])
    counts = _first_two(engine, 6, 128)
    assert chi2_pvalue(counts, exact_joint(target)) < 1e-3


def test_sample_seeds():
    assert sample_seed(7, 0) == 7
    seeds = {sample_seed(7, i) for i in range(1, 200)} | {sample_seed(8, i) for i in range(1, 200)}
    assert len(seeds) == 398 and all(0 <= s < 2**63 for s in seeds)


@pytest.fixture
def fed(monkeypatch):
    """Tokens fed to each model's caches: {model name: [feed lengths of each forward]}."""
    log: dict[str, list[list[int]]] = collections.defaultdict(list)
    forward = BatchCache.forward

    def counting(self, feeds, logits_to_keep, parents=None, *, hidden=False):
        log[self.model.name].append([len(f) for f in feeds])
        return forward(self, feeds, logits_to_keep, parents, hidden=hidden)

    monkeypatch.setattr(BatchCache, "forward", counting)
    return log


class OneThenNine(MeasuredPolicy):
    """One row first (it starts decoding alone), then room for nine: the n rows join it."""

    def __init__(self) -> None:
        super().__init__(9, {})
        self.asked = 0

    def max_rows(self, waiting: int = 0) -> int:
        self.asked += 1
        return 1 if self.asked == 1 else 9


@pytest.mark.parametrize("running", [False, True], ids=["fresh-batch", "joining-a-running-batch"])
def test_the_prompt_is_prefilled_once_for_n_rows(load, fed, running):
    target, draft = load("llama"), load("llama-partial")
    engine = Engine(target, [draft])
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    length = len(engine.encode(prompt))
    reqs = [EngineRequest(prompt=prompt, params=GenerationParams(max_new_tokens=6, n=8, gamma=2, adaptive=False))]
    if running:   # a one-token request decodes first; the n rows join it
        reqs.insert(0, EngineRequest(input_ids=[5], params=GenerationParams(max_new_tokens=12, gamma=2,
                                                                             adaptive=False)))
    got = dict(engine.generate_many(reqs, policy=OneThenNine() if running else MeasuredPolicy(9, {})))
    assert len(got[len(reqs) - 1].samples) == 8
    for name in (target.name, draft.name):
        # forwards with a feed longer than a step's (1 pending token + gamma 2): prompt prefills
        prefills = [f for f in fed[name] if max(f) > 3]
        assert sum(sum(f) for f in prefills) == length - 1, name   # the prompt but its last token, once


LONG = ("You are a careful assistant. Answer briefly and plainly, in one line, and never repeat the "
        "question. Here is the question: ")


@pytest.mark.parametrize("batch", [2, 8])
def test_samples_of_requests_sharing_a_stored_prefix(load, batch):
    """n samples and the prefix cache together: the requests share a long prompt prefix (computed
    once, stored), each request's samples load it, prefill the rest once and fork; greedy and
    seeded samples are the same with the prefix cache off."""
    target, draft = load("llama"), load("llama-partial")
    prompts = [LONG + "what is a queue?", LONG + "what is a worker?", "def fibonacci(n):"]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(n=3, **kw)) for p in prompts
            for kw in (dict(max_new_tokens=12), dict(SAMPLED, seed=5))]
    runs = {}
    for on in (True, False):
        engine = Engine(target, [draft, NGRAM], prefix_cache=on)
        got = dict(engine.generate_many(reqs, batch_size=batch))
        runs[on] = [[o.token_ids for o in got[i].samples] for i in range(len(reqs))]
        cached = [o.stats.cached_prompt_tokens for i in range(len(reqs)) for o in got[i].samples]
        assert any(cached) == on
    assert runs[True] == runs[False]
    for i, prompt in enumerate(prompts):
        ref = target_greedy(target, prompt, 12)
        assert [t[:len(ref)] for t in runs[True][2 * i]] == [ref] * 3
