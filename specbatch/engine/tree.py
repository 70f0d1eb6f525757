"""A row's draft candidates as one token tree, and the two lossless verifiers over it.

Node 0 is the root: the last accepted token. Node j >= 1 holds ``tokens[j - 1]``. Chains that
share a prefix share nodes, so the target scores each distinct prefix once. One drafter's
proposal is a chain, the degenerate tree: the same verifiers serve a single drafter and a pool.
The target scores every node in one forward, each node seeing the cached prefix and its own
ancestors only (``BatchCache.forward`` with ``parents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specbatch.engine.drafters import Proposal
from specbatch.engine.sampling import Verdict, accept, residual, sample


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)       # token of node j at index j - 1
    parents: list[int] = field(default_factory=list)      # parent node of node j at index j - 1
    chains: list[list[int]] = field(default_factory=list) # per chain: its nodes, root excluded
    members: list[int] = field(default_factory=list)      # per chain: the pool index that drafted it
    qs: list[torch.Tensor | None] = field(default_factory=list)  # per chain: (len, V) q, or None
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(self.n_nodes))

    @property
    def depth(self) -> int:
        """The step's draft length: the longest chain."""
        return max((len(c) for c in self.chains), default=0)

    def add(self, member: int, proposal: Proposal) -> None:
        node, chain = 0, list[int]()
        for x in proposal.tokens:
            child = self.children[node].get(x)
            if child is None:
                self.tokens.append(x)
                self.parents.append(node)
                self.children.append({})
                child = self.children[node][x] = len(self.tokens)
            chain.append(child)
            node = child
        self.chains.append(chain)
        self.members.append(member)
        self.qs.append(proposal.q)

    def branches(self) -> list[list[int]]:
        """Per node (0: the root), the drafted tokens on its path, itself included: the history
        the target's logits at that node were conditioned on, beyond the accepted sequence."""
        out: list[list[int]] = [[]]
        for tok, parent in zip(self.tokens, self.parents):
            out.append(out[parent] + [tok])      # a parent's index precedes its children's
        return out

    def feed_parents(self, n_prefix: int) -> list[int]:
        """Parents within a feed of n_prefix accepted tokens (root last) followed by the nodes."""
        return [i - 1 for i in range(n_prefix)] + [n_prefix - 1 + a for a in self.parents]


def build_tree(proposals: Sequence[Proposal | None], order: Sequence[int] | None = None) -> TokenTree:
    """proposals[i]: pool member i's candidates. ``order``: the members in the order sampling
    verification tries them (default: pool order)."""
    tree = TokenTree()
    for i in order if order is not None else range(len(proposals)):
        prop = proposals[i]
        if prop is not None and prop.tokens:
            tree.add(i, prop)
    return tree


def verify_greedy(tree: TokenTree, target_ids: list[int]) -> Verdict:
    """Lossless at temperature 0. target_ids[j]: the target's argmax after node j (0: the root).

    Follows the target's own choice down the tree: the longest accepted run wins.
    """
    node, path = 0, []
    while (child := tree.children[node].get(target_ids[node])) is not None:
        path.append(child)
        node = child
    tokens = [tree.tokens[j - 1] for j in path] + [target_ids[node]]
    winner = next((m for m, c in zip(tree.members, tree.chains) if path and len(c) >= len(path)
                   and c[len(path) - 1] == path[-1]), -1)
    return Verdict(tokens, len(path), path, winner)


def verify_sampling(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Speculative sampling over a tree (Leviathan et al. 2023 for a chain; SpecInfer, Miao et
    al. 2024, for several), lossless.

    p: (1 + n_nodes, V) warped target probabilities at the root and at each node. At each node,
    the chains that reached it offer their next token in tree order; each is accepted with
    min(1, r(x) / q_i(x)), else r <- norm(max(0, r - q_i)); if all are rejected the token is
    sampled from the final r. Each chain's token is an independent draw from its q given the
    accepted path, so the emitted tokens are distributed exactly as the target's. A chain of
    one drafter is plain speculative sampling.
    """
    node, path, depth, winner = 0, list[int](), 0, -1
    active = list(range(len(tree.chains)))
    while True:
        r = p[node]
        taken = None
        for i in active:
            if len(tree.chains[i]) <= depth:
                continue
            child = tree.chains[i][depth]
            x = tree.tokens[child - 1]
            q = tree.qs[i]
            qi = None if q is None else q[depth]
            if accept(r, qi, x, generator):
                taken = (tree.members[i], child)
                break
            r = residual(r, qi, x)
        if taken is None:
            tokens = [tree.tokens[j - 1] for j in path] + [sample(r, generator)]
            return Verdict(tokens, len(path), path, winner)
        winner, node = taken
        path.append(node)
        depth += 1
        active = [i for i in active if len(tree.chains[i]) >= depth and tree.chains[i][depth - 1] == node]
