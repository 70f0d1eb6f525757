"""Verification functions on hand-built logits (vLLM test_rejection_sampler style)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specbatch.engine.drafters import NgramIndex, Proposal
from specbatch.engine.sampling import Warp, residual
from specbatch.engine.tree import build_tree, verify_greedy, verify_sampling

V = 8


def one_hot_logits(ids: list[int]) -> torch.Tensor:
    x = torch.full((len(ids), V), -10.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return x


def chain(tokens: list[int], q: torch.Tensor | None = None):
    """One drafter's proposal: the degenerate tree."""
    return build_tree([Proposal(tokens, q)])


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


def test_sampling_accepts_when_q_equals_p():
    p = torch.softmax(torch.randn(4, V), -1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampling(chain([1, 2, 3], p[:3].clone()), p, g)
        assert v.n_accepted == 3


def test_sampling_rejects_token_target_never_emits():
    p = torch.full((3, V), 1.0 / (V - 1))
    p[0, 5] = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampling(chain([5, 1]), p, g)  # point-mass draft at 5
        assert v.n_accepted == 0 and v.tokens[0] != 5 and len(v.tokens) == 1


def test_residual():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))


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


def test_tree_sampling_tries_next_member_after_rejection():
    tree = build_tree([Proposal([3]), Proposal([4])])
    p = torch.zeros(3, V)
    p[0, 4] = 1.0          # target always emits 4 at the root
    p[1:, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    v = verify_sampling(tree, p, g)
    assert v.tokens == [4, 0] and v.winner == 1 and v.path == [2]


def test_tree_order_keeps_pool_indices():
    """Sampling may try members out of pool order; the winner is still named by pool index."""
    tree = build_tree([Proposal([3]), Proposal([4]), None], order=[1, 0, 2])
    assert tree.members == [1, 0] and tree.tokens == [4, 3]
    p = torch.zeros(3, V)
    p[0, 3] = 1.0
    p[1:, 0] = 1.0
    v = verify_sampling(tree, p, torch.Generator().manual_seed(0))
    assert v.tokens == [3, 0] and v.winner == 0 and v.path == [2]


def test_ngram_index_copies_latest_earlier_continuation():
    ids = [9, 1, 2, 3, 4, 1, 2, 7, 8, 1, 2]
    assert NgramIndex(max_n=2).lookup(ids, 3) == [7, 8, 1]
    assert NgramIndex().lookup([1, 2, 3], 4) == []
