"""Seeded statistical test: speculative sampling keeps the target's exact distribution.

The exact joint distribution of the first two generated tokens is computed from the target alone
(top-k 4 keeps the support at 16 outcomes); the empirical distribution of speculative samples
must converge to it. A deliberately lossy verifier (accept every draft token: a drafter always
accepted) is the negative control: the same test must reject it, so the test can fail. (A verifier
racing a node with another position's noise: tests/engine/test_verify.py.)
"""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

import specbatch.engine.decoder as decoder_mod
from specbatch.engine import Engine, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.sampling import RowNoise, Verdict, Warp, race
from specbatch.engine.tree import TokenTree

PROMPT = "The quick brown fox"
WARP = Warp(temperature=1.5, top_k=4, top_p=1.0)


def exact_joint(target) -> dict[tuple[int, int], float]:
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        p1 = WARP.probs(target.model(ids).logits[0, -1])
        joint = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            ext = torch.cat([ids, torch.tensor([[x1]])], dim=1)
            p2 = WARP.probs(target.model(ext).logits[0, -1])
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def empirical(engine, n: int, seed0: int = 0) -> collections.Counter:
    params = dict(max_new_tokens=2, temperature=WARP.temperature, top_k=WARP.top_k, gamma=3, adaptive=False)
    return collections.Counter(
        tuple(engine.generate(prompt=PROMPT, params=GenerationParams(seed=seed0 + i, **params)).token_ids)
        for i in range(n))


def tv(counts: collections.Counter, joint: dict) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(joint)
    return 0.5 * sum(abs(counts.get(k, 0) / n - joint.get(k, 0.0)) for k in keys)


def chi2_pvalue(counts: collections.Counter, joint: dict) -> float:
    assert set(counts) <= set(joint), "sampled an outcome the target cannot produce"
    keys = sorted(joint)
    n = sum(counts.values())
    total = sum(joint.values())
    return float(chisquare([counts.get(k, 0) for k in keys], [joint[k] / total * n for k in keys]).pvalue)


POOLS = {
    "single": (["llama-partial"], False),
    "pool": (["llama-partial", "llama-random"], True),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_distribution_matches_target(load, pool):
    names, ngram = POOLS[pool]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    joint = exact_joint(target)
    small = empirical(engine, 100)
    large = small + empirical(engine, 700, seed0=10_000)
    assert tv(large, joint) < tv(small, joint)
    assert tv(large, joint) < 0.08
    assert chi2_pvalue(large, joint) > 1e-3


def accept_every_draft(tree: TokenTree, p: torch.Tensor, noise: RowNoise) -> Verdict:
    """A lossy verifier: the first chain accepted whole, then the target's race after it."""
    chain = tree.chains[0] if tree.chains else []
    node = chain[-1] if chain else 0
    x = int(race(p[node], noise.at(noise.next + len(chain), p.shape[-1])))
    return Verdict([tree.tokens[j - 1] for j in chain] + [x], len(chain), chain, tree.members[0] if chain else -1)


def test_lossy_verifier_is_detected(load, monkeypatch):
    """Negative control: accepting every draft token skews the distribution toward q."""
    monkeypatch.setattr(decoder_mod, "verify_race", accept_every_draft)
    target = load("llama")
    engine = Engine(target, [load("llama-random")])
    counts = empirical(engine, 300)
    joint = exact_joint(target)
    outside = sum(c for k, c in counts.items() if k not in joint)
    assert outside > 0 or chi2_pvalue(counts, joint) < 1e-3



def test_a_tiny_temperature_decodes_as_its_greedy_limit(load):
    """A temperature of 1e-40 (valid: (0, 2]) samples the T -> 0 limit, the target's greedy tokens,
    speculating or not: the float32 overflow made every race pick token 0."""
    target = load("llama")
    want = Engine(target, []).generate(prompt="The quick brown fox", params=GenerationParams(
        max_new_tokens=12)).token_ids
    for drafts in ([], [load("llama-partial")]):
        got = Engine(target, drafts).generate(prompt="The quick brown fox", params=GenerationParams(
            max_new_tokens=12, temperature=1e-40, seed=1, gamma=3, adaptive=False))
        assert got.token_ids == want, drafts
