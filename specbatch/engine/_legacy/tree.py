"""A draft pool's candidates as one token tree, verified by one target forward pass.

Node 0 is the root: the last accepted token. Node j >= 1 holds ``tokens[j - 1]``. Chains that
share a prefix share nodes, so the target scores each distinct prefix once. A tree with a single
chain is verified with the plain causal mask; a branching tree with a 4-D mask where each node
sees the cached prefix and its own ancestors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbatch.engine._legacy.drafters import Proposal
from specbatch.engine._legacy.sampling import Verdict, accept, residual, sample


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)       # token of node j at index j - 1
    parents: list[int] = field(default_factory=list)      # parent node of node j at index j - 1
    depths: list[int] = field(default_factory=list)       # depth of node j (root = 0) at j - 1
    chains: list[list[int]] = field(default_factory=list) # per pool member: its nodes, root excluded
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def add(self, tokens: list[int]) -> list[int]:
        node, chain = 0, list[int]()
        for x in tokens:
            child = self.children[node].get(x)
            if child is None:
                self.tokens.append(x)
                self.parents.append(node)
                self.depths.append(len(chain) + 1)
                self.children.append({})
                child = self.children[node][x] = len(self.tokens)
            chain.append(child)
            node = child
        self.chains.append(chain)
        return chain


def build_tree(proposals: list[Proposal | None]) -> TokenTree:
    tree = TokenTree()
    for prop in proposals:
        tree.add(prop.tokens if prop is not None else [])
    return tree


def tree_mask(tree: TokenTree, n_cached: int, n_fed: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, Q, n_cached + Q) for Q = n_fed prefix tokens (root last) + the nodes."""
    n = tree.n_nodes
    q = n_fed + n
    allowed = torch.zeros(q, n_cached + q, dtype=torch.bool)
    allowed[:, :n_cached] = True
    allowed[:n_fed, n_cached:n_cached + n_fed] = torch.ones(n_fed, n_fed, dtype=torch.bool).tril()
    allowed[n_fed:, n_cached:n_cached + n_fed] = True
    for j in range(1, n + 1):                  # each node sees itself and its ancestors
        a = j
        while a:
            allowed[n_fed + j - 1, n_cached + n_fed + a - 1] = True
            a = tree.parents[a - 1]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def verify_tree_greedy(tree: TokenTree, target_ids: list[int]) -> Verdict:
    """target_ids[j]: the target's argmax after node j (row 0: the root). Longest accepted run wins."""
    node, path = 0, []
    while (child := tree.children[node].get(target_ids[node])) is not None:
        path.append(child)
        node = child
    tokens = [tree.tokens[j - 1] for j in path] + [target_ids[node]]
    return Verdict(tokens, len(path), path, _winner(tree, path))


def verify_tree_sampling(tree: TokenTree, proposals: list[Proposal | None], p: torch.Tensor,
                         generator: torch.Generator | None) -> Verdict:
    """Multi-draft speculative sampling (SpecInfer, Miao et al. 2024), lossless.

    p: (1 + n_nodes, V) warped target probabilities at the root and at each node. At each node,
    the pool members whose chains reached it offer their next token in pool order; each is
    accepted with min(1, r(x) / q_i(x)), else r <- norm(max(0, r - q_i)); if all are rejected the
    token is sampled from the final r. Each member's token is an independent draw from its q given
    the accepted path, so the emitted tokens are distributed exactly as the target's.
    """
    node, path, depth, winner = 0, list[int](), 0, -1
    active = [i for i, chain in enumerate(tree.chains) if chain]
    while True:
        r = p[node]
        taken = None
        for i in active:
            if len(tree.chains[i]) <= depth:
                continue
            child = tree.chains[i][depth]
            x = tree.tokens[child - 1]
            prop = proposals[i]
            qi = None if prop is None or prop.q is None else prop.q[depth]
            if accept(r, qi, x, generator):
                taken = (i, child)
                break
            r = residual(r, qi, x)
        if taken is None:
            tokens = [tree.tokens[j - 1] for j in path] + [sample(r, generator)]
            return Verdict(tokens, len(path), path, winner)
        winner, node = taken
        path.append(node)
        depth += 1
        active = [i for i in active if len(tree.chains[i]) >= depth and tree.chains[i][depth - 1] == node]


def _winner(tree: TokenTree, path: list[int]) -> int:
    if not path:
        return -1
    for i, chain in enumerate(tree.chains):
        if len(chain) >= len(path) and chain[len(path) - 1] == path[-1]:
            return i
    return -1
