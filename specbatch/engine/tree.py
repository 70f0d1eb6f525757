"""A row's draft candidates as one token tree, and the lossless verifiers over it.

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
from specbatch.engine.sampling import RowNoise, Verdict, race


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)       # token of node j at index j - 1
    parents: list[int] = field(default_factory=list)      # parent node of node j at index j - 1
    chains: list[list[int]] = field(default_factory=list) # per chain: its nodes, root excluded
    members: list[int] = field(default_factory=list)      # per chain: the pool index that drafted it
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

    def depths(self) -> list[int]:
        """Per node (0: the root), its drafted ancestors: node j's token is the row's output
        position next + depths[parent(j)], the position its logits choose is next + depths[j]."""
        out = [0]
        for parent in self.parents:
            out.append(out[parent] + 1)
        return out

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
    """proposals[i]: pool member i's candidates. ``order``: the members in tree order (default:
    pool order); the first member whose chain holds the accepted path is the winner."""
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


def verify_race(tree: TokenTree, p: torch.Tensor, noise: RowNoise) -> Verdict:
    """Sampled rows: p (1 + n_nodes, V), warped target probabilities at the root and each node.

    The target's token after node j is race(p[j], E_{t + depth(j)}), t = ``noise.next`` the
    position of the root's next token: what the target alone draws at that position given that
    node's path. ``verify_greedy`` follows those tokens down the tree, so the emitted tokens are
    the target-alone sample with this noise, token for token, whatever was drafted (lossless by
    identity; each race is an exact draw from its p, positions independent)."""
    e = torch.stack([noise.at(noise.next + d, p.shape[-1]) for d in tree.depths()])
    return verify_greedy(tree, race(p, e).tolist())
