"""Shared prompt prefixes (engine/prefix.py): computed once, copied into each row, outputs unchanged.

Greedy outputs with the prefix cache on equal those with it off (and the target's own greedy
decoding) for rows that share a prefix and rows that do not, mixed, at 1 and 8 rows, with a draft
model, n-gram and a pool; the target's prefill tokens show the prefix computed once; the store
keeps its byte budget, least recently used out.
"""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.backend import PrefixKV
from specbatch.engine.cache import BatchCache
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.drafters import ModelDrafter
from specbatch.engine.memory import MemoryBudget
from specbatch.engine.policy import MeasuredPolicy
from specbatch.engine.prefix import PrefixEntry, PrefixStore, shared_prefixes
from tests.tiny import CORPUS


def corpus_ids(target, n: int, skip: int = 0) -> list[int]:
    """n token ids of the tiny corpus (real text: the tiny models' drafts agree on some of it)."""
    ids = target.tokenizer("".join(CORPUS)).input_ids[skip:]
    assert len(ids) >= n
    return ids[:n]


def mixed_prompts(target) -> list[list[int]]:
    """Two groups sharing a 40- and a 60-token prefix, one prompt sharing only 20 tokens with the
    first group, two sharing nothing, one that is the first group's prefix plus a single token."""
    a, b = corpus_ids(target, 40), corpus_ids(target, 60, skip=200)
    # (each question starts with its own token: the groups share exactly 40 and 60 tokens)
    q = [[50 + i] + corpus_ids(target, n, skip=400 + 17 * i) for i, n in enumerate([3, 7, 5, 9, 4, 6, 8])]
    return [a + q[0], b + q[1], a + q[2], corpus_ids(target, 30, skip=600), a + q[3], b + q[4],
            a[:20] + q[5], corpus_ids(target, 12, skip=700), a + q[6][:1]]


LENGTHS = [8, 20, 5, 12, 16, 3, 10, 7, 9]
SETUPS = {"draft": (["llama-partial"], False), "ngram": ([], True), "pool": (["llama-partial"], True)}


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_outputs_are_identical_with_the_prefix_cache_on_and_off(load, setup, batch):
    target = load("llama")
    names, ngram = SETUPS[setup]
    prompts = mixed_prompts(target)
    reqs = [EngineRequest(input_ids=p, params=GenerationParams(max_new_tokens=n, gamma=3, adaptive=False))
            for p, n in zip(prompts, LENGTHS)]
    out = {}
    for on in (True, False):
        engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram, prefix_cache=on)
        out[on] = dict(engine.generate_many(reqs, batch_size=batch))
    for i, (p, n) in enumerate(zip(prompts, LENGTHS)):
        assert out[True][i].token_ids == out[False][i].token_ids, (setup, batch, i)
        with torch.inference_mode():
            ref = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                        max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out[True][i].token_ids == ref[0, len(p):].tolist()[: len(out[True][i].token_ids)]
    cached = [out[True][i].stats.cached_prompt_tokens for i in range(len(prompts))]
    # the first row of each shared prefix computes it; the others read it (B=1: one admission
    # per row, so every later row of a group hits the store; B=8: the same admission)
    # five rows start with a (one computes it), two with b; the rest share nothing worth it
    assert sorted(cached) == [0] * 5 + [40] * 3 + [60]
    assert cached[3] == cached[6] == cached[7] == 0
    assert all(out[False][i].stats.cached_prompt_tokens == 0 for i in range(len(prompts)))
    assert all(out[True][i].stats.prefill_seconds_saved > 0 for i, c in enumerate(cached) if c)


class CountingCache(BatchCache):
    """The target's cache, recording every feed it scores."""

    feeds: list[list[int]] = []

    def forward(self, feeds, logits_to_keep, parents=None, *, hidden=False):
        CountingCache.feeds += [list(f) for f in feeds]
        return super().forward(feeds, logits_to_keep, parents, hidden=hidden)


@pytest.mark.parametrize("batch", [4, 16])
def test_a_prefix_shared_by_16_requests_is_prefilled_once(load, batch):
    target = load("llama")
    prefix = corpus_ids(target, 300)
    prompts = [prefix + [50 + i] + corpus_ids(target, 4, skip=320 + 9 * i) for i in range(16)]
    params = GenerationParams(max_new_tokens=4, adaptive=False)
    fed: dict[bool, list[list[int]]] = {}
    outs = {}
    for on in (True, False):
        CountingCache.feeds = []
        decoder = Decoder(target, [], MeasuredPolicy(batch, {}), backend=lambda n: CountingCache(target, n),
                          prefixes=PrefixStore(10**9) if on else None)
        with torch.inference_mode():
            outs[on] = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)]))
        fed[on] = CountingCache.feeds
    assert {i: o.token_ids for i, o in outs[True].items()} == {i: o.token_ids for i, o in outs[False].items()}
    starts = {on: sum(f[:300] == prefix for f in feeds) for on, feeds in fed.items()}
    assert starts == {True: 1, False: 16}
    tokens = {on: sum(len(f) for f in feeds) for on, feeds in fed.items()}
    assert tokens[False] - tokens[True] == 15 * 300
    assert sorted(o.stats.cached_prompt_tokens for o in outs[True].values()) == [0] + [300] * 15


def test_shared_prefixes_come_from_the_token_trie():
    p = list(range(100))
    prompts = [p + [1000], p + [1001, 5], p[:50] + [7] * 30, p[:50] + [8] * 30, list(range(200, 260)),
               p[:10] + [9] * 40, p[:10] + [6] * 40, p[:30] + [4] * 9, p + [1000]]
    # (10 shared: under the minimum; p[:30] + ...: its 30 would serve it alone, the others go
    # deeper, so it uses the 10 where that counts)
    assert shared_prefixes(prompts) == [100, 100, 50, 50, 0, 0, 0, 0, 100]
    assert shared_prefixes(prompts, min_tokens=5) == [100, 100, 50, 50, 0, 10, 10, 10, 100]
    # a prompt that is another's prefix: its last token stays to be fed; one prompt: nothing shared
    assert shared_prefixes([p[:40], p]) == [39, 39]
    assert shared_prefixes([p]) == [0]
    # 48 questions after one system prompt: one prefix for all, though some questions also share
    # their first words (each pair's longer prefix would be one more forward, for one reader)
    system = list(range(600))
    questions = [[1000 + i % 3, 2000 + i] for i in range(48)]
    assert shared_prefixes([system + q for q in questions]) == [600] * 48


def entry(tokens: tuple[int, ...], nbytes: int) -> PrefixEntry:
    return PrefixEntry(tokens, (PrefixKV(len(tokens), nbytes, None),), ("t",), 0.1)


def test_the_prefix_store_keeps_its_byte_budget_least_recently_used_out():
    store = PrefixStore(budget=250)
    a, b, c = (1,) * 20, (2,) * 20, (3,) * 30
    assert store.put(entry(a, 100)) and store.put(entry(b, 100))
    assert store.longest(list(a) + [5], ("t",), limit=21) is not None   # a: used, now the newest
    assert store.longest(list(a) + [5], ("other",), limit=21) is None   # another pool's: not it
    assert store.longest(list(a), ("t",), limit=19) is None             # the last token stays to feed
    assert store.put(entry(c, 100))
    assert set(store.entries) == {a, c} and store.nbytes == 200 and store.evictions == 1
    assert not store.put(entry((4,) * 20, 300))                          # alone over the budget
    assert set(store.entries) == {a, c}
    assert store.put(entry(a[:16], 250)) and set(store.entries) == {a[:16]} and store.nbytes == 250


def test_an_engine_keeps_prefixes_within_its_store_budget_across_calls(load):
    target = load("llama")
    engine = Engine(target, [NGRAM])
    groups = [corpus_ids(target, 64, skip=64 * g) for g in range(3)]
    per_entry = 64 * 2 * 2 * 16 * 2 * 4              # layers x kv heads x head dim x (K, V) x fp32
    engine.prefixes = PrefixStore(budget=2 * per_entry)   # room for two of the three prefixes
    params = GenerationParams(max_new_tokens=3, adaptive=False)
    for g in groups:
        reqs = [EngineRequest(input_ids=g + corpus_ids(target, 4, skip=300 + 5 * i), params=params)
                for i in range(3)]
        list(engine.generate_many(reqs, batch_size=3))
        assert engine.prefixes.nbytes <= engine.prefixes.budget
        assert engine.memory is not None and engine.memory.reserved == engine.prefixes.nbytes
    assert set(engine.prefixes.entries) == {tuple(groups[1]), tuple(groups[2])}
    assert engine.prefixes.evictions == 1
    # a later call reads a stored prefix even for a request no other request of it shares
    out = dict(engine.generate_many([EngineRequest(input_ids=groups[2] + [5, 6], params=params)]))
    assert out[0].stats.cached_prompt_tokens == 64


class Shrinking(MeasuredPolicy):
    """4 rows for the first steps, then 2: the newest rows pause and resume later."""

    def __init__(self) -> None:
        super().__init__(4)
        self.steps = 0

    def max_rows(self, waiting: int = 0) -> int:
        return 4 if self.steps < 3 else 2

    def observe(self, report) -> None:
        self.steps += 1
        super().observe(report)


def test_paused_rows_resume_from_the_stored_prefix(load):
    target, draft = load("llama"), load("llama-partial")
    prefix = corpus_ids(target, 50)
    prompts = [prefix + [60 + i] + corpus_ids(target, 3, skip=300 + 7 * i) for i in range(6)]
    params = GenerationParams(max_new_tokens=10, gamma=2, adaptive=False)
    outs = {}
    for on in (True, False):
        CountingCache.feeds = []
        decoder = Decoder(target, [ModelDrafter(draft, target.vocab_size)], Shrinking(),
                          backend=lambda n: CountingCache(target, n), prefixes=PrefixStore(10**9) if on else None)
        with torch.inference_mode():
            outs[on] = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)]))
        if on:   # resumed rows read the prefix again rather than feed it
            assert sum(f[:50] == prefix for f in CountingCache.feeds) == 1
    assert {i: o.token_ids for i, o in outs[True].items()} == {i: o.token_ids for i, o in outs[False].items()}
    assert sorted(o.stats.cached_prompt_tokens for o in outs[True].values()) == [0] + [50] * 5


@pytest.mark.parametrize("batch", [4, 8])
def test_a_requests_samples_count_once_in_the_trie(load, batch):
    """n samples of one request are one prompt, prefilled once and forked: not a prefix shared by
    n requests (nothing stored for it). Two requests sharing a prefix, 3 samples each: the prefix
    is computed once, stored once, and every sample of both reads it."""
    target = load("llama")
    prefix = corpus_ids(target, 40)
    alone = corpus_ids(target, 30, skip=500)
    prompts = [alone] * 4 + [prefix + [60] + corpus_ids(target, 3, skip=300)] * 3 \
        + [prefix + [61] + corpus_ids(target, 5, skip=320)] * 3
    forks = {0: 0, 1: 0, 2: 0, 3: 0, 4: 4, 5: 4, 6: 4, 7: 7, 8: 7, 9: 7}
    params = GenerationParams(max_new_tokens=4, adaptive=False)
    CountingCache.feeds = []
    store = PrefixStore(10**9)
    decoder = Decoder(target, [], MeasuredPolicy(batch, {}), backend=lambda n: CountingCache(target, n),
                      prefixes=store)
    with torch.inference_mode():
        out = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)], forks=forks))
    assert list(store.entries) == [tuple(prefix)]
    assert [out[i].stats.cached_prompt_tokens for i in range(10)] == [0] * 5 + [40] * 5   # 4 computes it
    assert sum(f[:29] == alone[:29] for f in CountingCache.feeds) == 1     # one prefill, forked
    assert sum(f[:40] == prefix for f in CountingCache.feeds) == 1
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ref = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                        max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert out[i].token_ids == ref[0, len(p):].tolist()[: len(out[i].token_ids)]


@pytest.mark.parametrize("batch", [2, 8])
def test_a_job_with_more_distinct_prefixes_than_the_store_holds_keeps_its_budget(load, monkeypatch, batch):
    """Six prompt prefixes, three requests each, one run under a memory cap whose prefix share
    holds two: at every insertion the store is within its budget, the least recently used prefix
    goes, the budget's rows get what the store does not hold, and outputs are those without it."""
    target = load("llama")
    per_entry = 128 * 2 * 2 * 16 * 2 * 4             # 128 tokens x layers x kv heads x head dim x (K, V) x fp32
    cap = 780_000       # a quarter: room for two prefixes; the rest: two rows (256,000 B each, estimated)
    puts: list[tuple[int, int, int]] = []
    put = PrefixStore.put

    def recording(self, entry):
        kept = put(self, entry)
        puts.append((self.nbytes, self.budget, self.evictions))
        return kept

    steps: list[tuple[int, float]] = []            # (rows, their estimated bytes + the store's)
    check = MemoryBudget.check

    def checking(self, measured, rows, columns, gamma):
        steps.append((rows, rows * self.row_bytes(columns, gamma) + self.reserved))
        return check(self, measured, rows, columns, gamma)

    monkeypatch.setattr(PrefixStore, "put", recording)
    monkeypatch.setattr(MemoryBudget, "check", checking)
    groups = [corpus_ids(target, 128, skip=128 * g) for g in range(6)]
    params = GenerationParams(max_new_tokens=3, adaptive=False)
    reqs = [EngineRequest(input_ids=g + [50 + i] + corpus_ids(target, 3, skip=400 + 5 * i), params=params)
            for g in groups for i in range(3)]
    engine = Engine(target, [NGRAM], max_memory=cap)
    on = dict(engine.generate_many(reqs, batch_size=batch))
    off = dict(Engine(target, [NGRAM], max_memory=cap, prefix_cache=False).generate_many(reqs, batch_size=batch))
    assert engine.prefixes is not None and engine.prefixes.budget == cap // 4
    assert len(puts) == 6                                          # each prefix computed once
    assert all(nbytes <= budget for nbytes, budget, _ in puts)
    assert [e for _, _, e in puts] == [0, 0, 1, 2, 3, 4]            # from the third on, one out each
    assert list(engine.prefixes.entries) == [tuple(groups[4]), tuple(groups[5])]   # the newest two
    assert engine.memory is not None and engine.memory.reserved == engine.prefixes.nbytes == 2 * per_entry
    assert engine.memory.rows_budget == cap - 2 * per_entry
    # the run's peak as the budget counts it: every step's rows and the store within the cap
    # (the process's resident set cannot tell: these prefixes are 64 KiB)
    assert max(r for r, _ in steps) > 1 and all(r <= 1 or used <= cap for r, used in steps)
    assert {i: o.token_ids for i, o in on.items()} == {i: o.token_ids for i, o in off.items()}
    assert sorted(o.stats.cached_prompt_tokens for o in on.values()) == [0] * 6 + [128] * 12


class Plain(MeasuredPolicy):
    """Decodes plainly at every size (a large CPU batch): drafts are never asked for."""

    def gamma_cap(self, n_rows: int) -> int | None:
        return 0


def test_a_draft_neither_computes_nor_loads_prefixes_while_the_batch_decodes_plainly(load, monkeypatch):
    target, draft = load("llama"), load("llama-partial")
    prefix = corpus_ids(target, 60)
    prompts = [prefix + [70 + i] + corpus_ids(target, 3, skip=330 + 5 * i) for i in range(10)]
    params = GenerationParams(max_new_tokens=6)
    calls = []
    real = type(draft).forward
    monkeypatch.setattr(type(draft), "forward", lambda self, *a, **k: (calls.append(self.name) if self is draft else None,
                                                                        real(self, *a, **k))[1])
    outs = {}
    for on in (True, False):
        drafter = ModelDrafter(draft, target.vocab_size)
        decoder = Decoder(target, [drafter], Plain(4), prefixes=PrefixStore(10**9) if on else None)
        with torch.inference_mode():
            outs[on] = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)]))
    assert calls == []
    assert {i: o.token_ids for i, o in outs[True].items()} == {i: o.token_ids for i, o in outs[False].items()}
    ref = dict(Engine(target).generate_many([EngineRequest(input_ids=p, params=params) for p in prompts], batch_size=1))
    assert {i: o.token_ids for i, o in outs[True].items()} == {i: o.token_ids for i, o in ref.items()}


def test_a_cold_first_prefix_does_not_count_as_saved_by_every_later_hit(load, monkeypatch):
    """A worker's first forward can be slow (just started, a compile beside it): the prefix it
    computed then must not count those seconds again for each request that reads it. A hit saves
    its tokens' prefill at the fastest rate the worker measured."""
    target = load("llama")
    prefix = corpus_ids(target, 40)
    prompts = [prefix + [50 + i] + corpus_ids(target, 3, skip=400 + 7 * i) for i in range(6)]
    compute = Decoder._compute_prefix
    cold = 2.0

    def slow_first(self, tokens, drafts):
        entry = compute(self, tokens, drafts)
        return PrefixEntry(entry.tokens, entry.kv, entry.models, entry.seconds + cold)   # as if it were cold

    monkeypatch.setattr(Decoder, "_compute_prefix", slow_first)
    engine = Engine(target, [])
    reqs = [EngineRequest(input_ids=p, params=GenerationParams(max_new_tokens=4)) for p in prompts]
    out = dict(engine.generate_many(reqs, batch_size=2))
    hits = [o.stats for o in out.values() if o.stats.cached_prompt_tokens]
    assert len(hits) == 5 and all(s.cached_prompt_tokens == 40 for s in hits)
    assert all(0 < s.prefill_seconds_saved < cold for s in hits)


def test_the_prefix_store_counts_a_hit_at_its_fastest_measured_rate():
    store = PrefixStore(10**6)
    assert store.saved(40) == 0.0                  # nothing measured yet
    store.observe(20.0, 40)                        # a cold first prefix: 0.5 s a token
    store.observe(0.3, 100)                        # rows joining later: 3 ms a token
    store.observe(0.0, 0)                          # (nothing fed: no measure)
    assert store.saved(40) == pytest.approx(0.12)
