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

from specbatch.engine.drafters import NgramDrafter, Proposal
from specbatch.engine.sampling import Warp, residual, verify_greedy, verify_sampling
from specbatch.engine.tree import build_tree, tree_mask, verify_tree_greedy, verify_tree_sampling

V = 8


def one_hot_logits(ids: list[int]) -> torch.Tensor:
    x = torch.full((len(ids), V), -10.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return x


def test_greedy_perfect_match():
    v = verify_greedy(torch.tensor([1, 2, 3]), one_hot_logits([1, 2, 3, 4]))
    assert v.tokens == [1, 2, 3, 4] and v.n_accepted == 3 and v.path == [1, 2, 3]


def test_greedy_early_mismatch():
    v = verify_greedy(torch.tensor([1, 5, 3]), one_hot_logits([1, 2, 3, 4]))
    assert v.tokens == [1, 2] and v.n_accepted == 1


def test_greedy_first_mismatch_and_empty_draft():
    assert verify_greedy(torch.tensor([7]), one_hot_logits([1, 2])).tokens == [1]
    assert verify_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([6])).tokens == [6]


def test_sampling_accepts_when_q_equals_p():
    p = torch.softmax(torch.randn(4, V), -1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampling(torch.tensor([1, 2, 3]), p[:3].clone(), p, g)
        assert v.n_accepted == 3


def test_sampling_rejects_token_target_never_emits():
    p = torch.full((3, V), 1.0 / (V - 1))
    p[0, 5] = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampling(torch.tensor([5, 1]), None, p, g)  # point-mass draft at 5
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


def test_tree_merges_shared_prefixes_and_masks_siblings():
    tree = build_tree([Proposal([1, 2, 3]), Proposal([1, 2, 4]), Proposal([5]), None])
    assert tree.tokens == [1, 2, 3, 4, 5]
    assert tree.parents == [0, 1, 2, 2, 0]
    assert tree.chains == [[1, 2, 3], [1, 2, 4], [5], []]
    assert not tree.is_chain
    mask = tree_mask(tree, n_cached=2, n_fed=1, dtype=torch.float32, device=torch.device("cpu"))[0, 0]
    seen = mask == 0
    assert mask.shape == (6, 8)
    # node 4 (token 4) sees the cache, the root, nodes 1 and 2 and itself, not its sibling node 3
    assert seen[4].tolist() == [True, True, True, True, True, False, True, False]
    # node 5 (token 5) sees the cache, the root and itself only
    assert seen[5].tolist() == [True, True, True, False, False, False, False, True]


def test_tree_greedy_takes_longest_accepted_branch():
    tree = build_tree([Proposal([1, 2, 3]), Proposal([1, 2, 4]), Proposal([5])])
    # rows: root, node1..node5; the target's argmax after each
    target_ids = [1, 2, 4, 0, 6, 0]
    v = verify_tree_greedy(tree, target_ids)
    assert v.tokens == [1, 2, 4, 6] and v.n_accepted == 3 and v.path == [1, 2, 4] and v.winner == 1


def test_tree_sampling_tries_next_member_after_rejection():
    tree = build_tree([Proposal([3]), Proposal([4])])
    p = torch.zeros(3, V)
    p[0, 4] = 1.0          # target always emits 4 at the root
    p[1:, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    v = verify_tree_sampling(tree, [Proposal([3]), Proposal([4])], p, g)
    assert v.tokens == [4, 0] and v.winner == 1 and v.path == [2]


def test_ngram_drafter_copies_latest_earlier_continuation():
    d = NgramDrafter(max_n=2)
    ids = [9, 1, 2, 3, 4, 1, 2, 7, 8, 1, 2]
    assert d.propose(ids, 3, None, None).tokens == [7, 8, 1]
    assert NgramDrafter().propose([1, 2, 3], 4, None, None) is None
