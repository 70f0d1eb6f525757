"""Verification functions on hand-built logits (vLLM test_rejection_sampler style)."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specbatch.engine.tree as tree_mod
from specbatch.engine.drafters import NgramIndex, Proposal
from specbatch.engine.sampling import RowNoise, Warp, race
from specbatch.engine.tree import build_tree, verify_greedy, verify_race

V = 8


def one_hot_logits(ids: list[int]) -> torch.Tensor:
    x = torch.full((len(ids), V), -10.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return x


def chain(tokens: list[int]):
    """One drafter's proposal: the degenerate tree."""
    return build_tree([Proposal(tokens)])


def greedy(tokens: list[int], target_ids: list[int]):
    return verify_greedy(chain(tokens), one_hot_logits(target_ids).argmax(-1).tolist())


def test_greedy_perfect_match():
    v = greedy([1, 2, 3], [1, 2, 3, 4])
    assert v.tokens == [1, 2, 3, 4] and v.n_accepted == 3 and v.path == [1, 2, 3] and v.winner == 0


def test_greedy_early_mismatch():
    v = greedy([1, 5, 3], [1, 2, 3, 4])
    assert v.tokens == [1, 2] and v.n_accepted == 1


def test_greedy_first_mismatch_and_empty_draft():
    v = greedy([7], [1, 2])
    assert v.tokens == [1] and v.winner == -1
    assert verify_greedy(build_tree([None]), [6]).tokens == [6]


def test_race_accepts_a_draft_raced_with_the_same_noise_from_p():
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(0)), -1)
    for seed in range(50):
        noise = RowNoise(seed, "cpu")
        drafted = [int(race(p[j], noise.at(j, V))) for j in range(3)]      # q = p
        v = verify_race(chain(drafted), p, noise)
        assert v.n_accepted == 3 and v.tokens[:3] == drafted


def test_race_rejects_token_target_never_emits():
    p = torch.full((3, V), 1.0 / (V - 1))
    p[0, 5] = 0.0
    for seed in range(50):
        v = verify_race(chain([5, 1]), p, RowNoise(seed, "cpu"))
        assert v.n_accepted == 0 and v.tokens[0] != 5 and len(v.tokens) == 1


L1, L2 = [1, 2, 3, 4, 0, 0, 0, 0], [4, 3, 2, 1, 0, 0, 0, 0]      # tenths
P1, P2 = torch.tensor(L1) / 10, torch.tensor(L2) / 10


def _first_two(n: int) -> collections.Counter:
    """Two tokens from a chain drafted by the target itself (its first token always accepted):
    the second is raced at the node. Rows 1..n, each its own seed."""
    counts: collections.Counter = collections.Counter()
    p = torch.stack([P1, P2, P2])
    for seed in range(n):
        noise = RowNoise(seed, "cpu")
        x1 = int(race(P1, noise.at(0, V)))
        counts[tuple(verify_race(chain([x1, 0]), p, noise).tokens[:2])] += 1
    return counts


def _pvalue(counts: collections.Counter, n: int) -> float:
    keys = [(a, b) for a in range(4) for b in range(4)]
    return float(chisquare([counts[k] for k in keys], [n * L1[a] * L2[b] / 100 for a, b in keys]).pvalue)


def test_race_over_a_chain_follows_the_joint_law():
    assert _pvalue(_first_two(3000), 3000) > 1e-3


def test_noise_of_the_wrong_position_is_detected(monkeypatch):
    """Negative control: a verifier racing every node with the root's noise (the draft's noise
    of another position) makes the second token depend on the first; the same test rejects it."""
    monkeypatch.setattr(tree_mod.TokenTree, "depths", lambda self: [0] * (self.n_nodes + 1))
    assert _pvalue(_first_two(3000), 3000) < 1e-3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    expected = procs(None, logits.clone()).softmax(-1)
    assert torch.allclose(Warp(temperature, top_k, top_p).probs(logits), expected, atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6])
def test_a_tiny_temperature_is_its_limit_not_nan(temperature):
    """temperature in (0, 2] is accepted at intake; logits / 1e-40 overflowed float32 to inf and the
    softmax gave NaN, so every race picked token 0 (walk8: 'The capital of France is' came out
    empty, greedy says ' Paris'). The limit as T -> 0 is uniform over the top logits."""
    logits = torch.tensor([[3.0, 5.0, 5.0, 1.0, float("-inf")], [30.0, -2.0, 29.5, 0.0, 1.0]])
    p = Warp(temperature, top_p=0.9, min_p=0.05).probs(logits)
    assert torch.equal(p, torch.tensor([[0, 0.5, 0.5, 0, 0], [1.0, 0, 0, 0, 0]]))
    assert race(p, torch.ones_like(p)).tolist() == [1, 0]


def test_tree_merges_shared_prefixes():
    tree = build_tree([Proposal([1, 2, 3]), Proposal([1, 2, 4]), Proposal([5]), None])
    assert tree.tokens == [1, 2, 3, 4, 5]
    assert tree.parents == [0, 1, 2, 2, 0]
    assert tree.chains == [[1, 2, 3], [1, 2, 4], [5]] and tree.members == [0, 1, 2]
    assert not tree.is_chain and tree.depth == 3
    assert chain([4, 5]).is_chain
    # fed after two pending tokens (root last): node j's parent is at feed index 1 + parent(j)
    assert tree.feed_parents(2) == [-1, 0, 1, 2, 3, 3, 1]


def test_tree_greedy_takes_longest_accepted_branch():
    tree = build_tree([Proposal([1, 2, 3]), Proposal([1, 2, 4]), Proposal([5])])
    # rows: root, node1..node5; the target's argmax after each
    target_ids = [1, 2, 4, 0, 6, 0]
    v = verify_greedy(tree, target_ids)
    assert v.tokens == [1, 2, 4, 6] and v.n_accepted == 3 and v.path == [1, 2, 4] and v.winner == 1


def test_tree_race_takes_the_branch_the_target_draws():
    tree = build_tree([Proposal([3]), Proposal([4])])
    p = torch.zeros(3, V)
    p[0, 4] = 1.0          # target always emits 4 at the root
    p[1:, 0] = 1.0
    v = verify_race(tree, p, RowNoise(0, "cpu"))
    assert v.tokens == [4, 0] and v.winner == 1 and v.path == [2]


def test_tree_order_keeps_pool_indices():
    """A tree may hold members out of pool order (the grammar's chain first); the winner is
    still named by pool index."""
    tree = build_tree([Proposal([3]), Proposal([4]), None], order=[1, 0, 2])
    assert tree.members == [1, 0] and tree.tokens == [4, 3]
    p = torch.zeros(3, V)
    p[0, 3] = 1.0
    p[1:, 0] = 1.0
    v = verify_race(tree, p, RowNoise(0, "cpu"))
    assert v.tokens == [3, 0] and v.winner == 0 and v.path == [2]


def test_ngram_index_copies_latest_earlier_continuation():
    ids = [9, 1, 2, 3, 4, 1, 2, 7, 8, 1, 2]
    assert NgramIndex(max_n=2).lookup(ids, 3) == [7, 8, 1]
    assert NgramIndex().lookup([1, 2, 3], 4) == []
