"""Seeded sampling is a function of the target and the seed alone (position-keyed exponential race).

A sampled row's token at output position t is race(p_t, E_t), E_t noise keyed by (row seed, t);
the verifier follows the target's race down the tree. So a seeded request gives the same tokens
plain or speculative, with any drafter, pool, gamma and batch (the tiny models are batch-invariant
on this CPU: docs/DESIGN.md, "Batch invariance"). On main a row drew from one generator whose
draws depended on drafting, and these differed.
"""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.drafters import Proposal
from specbatch.engine.sampling import RowNoise, race
from specbatch.engine.tree import build_tree, verify_race

PROMPTS = ["Write a haiku about", "def fibonacci(n):", "The quick brown fox"]
SEEDED = dict(max_new_tokens=20, temperature=0.8, seed=1234, n=3)


def _samples(engine: Engine, batch_size: int = 1, others: bool = False, **extra) -> list[list[int]]:
    reqs = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(**SEEDED, **extra))]
    if others:   # neighbours of other lengths and parameters (one greedy, one sampled unseeded)
        reqs += [EngineRequest(prompt=PROMPTS[1], params=GenerationParams(max_new_tokens=30)),
                 EngineRequest(prompt=PROMPTS[2], params=GenerationParams(max_new_tokens=12, temperature=1.2,
                                                                         top_k=10))]
    got = dict(engine.generate_many(reqs, batch_size=batch_size))
    return [o.token_ids for o in got[0].samples]


CASES = {
    "draft gamma 1": (["llama-partial"], False, dict(gamma=1, adaptive=False)),
    "draft gamma 3": (["llama-partial"], False, dict(gamma=3, adaptive=False)),
    "draft adaptive": (["llama-partial"], False, {}),
    "random draft gamma 3": (["llama-random"], False, dict(gamma=3, adaptive=False)),
    "ngram gamma 3": ([], True, dict(gamma=3, adaptive=False)),
    "pool gamma 3": (["llama-partial", "llama-random"], True, dict(gamma=3, adaptive=False)),
    "pool adaptive": (["llama-partial", "llama-random"], True, {}),
}


@pytest.mark.parametrize("batch", [(1, False), (4, True)], ids=["alone", "batch of 4"])
@pytest.mark.parametrize("case", list(CASES))
def test_seeded_samples_equal_the_target_alone(load, case, batch):
    target = load("llama")
    ref = _samples(Engine(target, []))                 # plain sampling, the target alone
    assert len({tuple(s) for s in ref}) == len(ref)    # the samples differ
    names, ngram, extra = CASES[case]
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    assert _samples(engine, *batch, **extra) == ref


def test_speculation_with_the_coupling_accepts_drafts(load):
    """A close draft's races mostly agree with the target's: the identity above is not the
    trivial one of a row that never accepted a draft token."""
    target = load("llama")
    engine = Engine(target, [load("llama-same")])
    out = engine.generate(prompt=PROMPTS[0], params=GenerationParams(
        max_new_tokens=30, temperature=0.8, seed=5, gamma=3, adaptive=False))
    assert out.stats.drafted_tokens > 0
    assert out.stats.acceptance_rate > 0.9, out.stats


def test_processed_rows_keep_the_identity(load):
    target = load("llama")
    extra = dict(repetition_penalty=1.3, presence_penalty=0.5, top_p=0.9)
    ref = _samples(Engine(target, []), **extra)
    engine = Engine(target, [load("llama-partial"), load("llama-random")] + [NGRAM])
    assert _samples(engine, 4, True, gamma=3, adaptive=False, **extra) == ref


def test_race_is_an_exact_draw_and_skips_zero_probability():
    probs = [0.0, 0.1, 0.2, 0.3, 0.4, 0.0]
    p = torch.tensor(probs)
    counts = collections.Counter(int(race(p, RowNoise(7, "cpu").at(t, 6))) for t in range(4000))
    assert counts[0] == counts[5] == 0
    assert chisquare([counts[x] for x in range(1, 5)], [400 * x for x in range(1, 5)]).pvalue > 1e-3
    # a negative control: the same noise at every position is one draw, not 4000
    assert len({int(race(p, RowNoise(7, "cpu").at(0, 6))) for _ in range(50)}) == 1


def test_noise_is_keyed_by_seed_and_position_only():
    a, b = RowNoise(3, "cpu"), RowNoise(3, "cpu")
    b.at(5, 16)
    b.advance(2)              # what b generated, kept or emitted, does not move position 4's noise
    assert torch.equal(a.at(4, 16), b.at(4, 16))
    assert not torch.equal(a.at(4, 16), a.at(5, 16))
    assert not torch.equal(a.at(4, 16), RowNoise(4, "cpu").at(4, 16))
    assert sorted(b.kept) == [4, 5]          # emitted positions are dropped, drafted ones kept
    b.advance(4)             # next = 6
    assert not b.kept


def test_verify_race_reads_each_node_at_its_depth():
    """Node j's token is the race at position next + depth(j), whatever its branch."""
    tree = build_tree([Proposal([1, 2]), Proposal([3])])      # nodes: 1 (d1), 2 (d2), 3 (d1)
    noise = RowNoise(11, "cpu")
    noise.advance(4)
    p = torch.softmax(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), -1)
    want = [int(race(p[j], noise.at(4 + d, 8))) for j, d in enumerate([0, 1, 2, 1])]
    v = verify_race(tree, p, noise)
    node, expect = 0, []
    while True:   # follow the target's races down the tree
        child = {0: {1: 1, 3: 3}, 1: {2: 2}}.get(node, {}).get(want[node])
        if child is None:
            expect.append(want[node])
            break
        expect.append(tree.tokens[child - 1])
        node = child
    assert v.tokens == expect


@pytest.mark.parametrize("kind", ["schema", "regex"])
def test_structured_rows_keep_the_identity(load, kind):
    """p and q are masked by the grammar; the race never picks a masked token (p = 0), and the
    grammar's forced chain is one more deterministic chain in the tree."""
    from tests.engine.test_structured import SPECS

    target = load("llama")
    extra = dict(structured=SPECS[kind], max_new_tokens=40)
    params = {**SEEDED, **extra}
    reqs = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(**params))]
    ref = [o.token_ids for o in dict(Engine(target, []).generate_many(reqs))[0].samples]
    engine = Engine(target, [load("llama-partial"), load("llama-random")] + [NGRAM])
    reqs = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(**params, gamma=3, adaptive=False)),
            EngineRequest(prompt=PROMPTS[1], params=GenerationParams(max_new_tokens=30))]
    got = [o.token_ids for o in dict(engine.generate_many(reqs, batch_size=4))[0].samples]
    assert got == ref
