"""Structured outputs in the decode loop: the grammar's part of a step, for rows that have one.

The law a constrained row follows is the constrained target: at each position the target's
logits masked by the grammar state after the tokens before it (then warped as usual). The loop
keeps it exact under speculation with four calls (docs/STRUCTURED.md, "In the decode loop"):

1. ``trim``: each proposal stops before the first token its row's grammar refuses (an n-gram
   copy, say); a model draft is masked while drafted (``ModelDrafter.propose``), so it passes whole.
2. ``forced``: the run of tokens the grammar admits next, proposed as one more chain of the
   row's tree (a point mass, like an n-gram draft), tried first when sampling.
3. ``tree_masks`` + ``mask_logits``: the target's logits at the root and at every node of the
   row's tree are masked with the state after that node's path (``Matcher.tree_masks``, computed
   on a helper thread while the target's forward runs), before either verifier
   reads them: a verifier then sees the constrained target's p, so its guarantee (greedy
   identity, or the sampling law) holds for the constrained target.
4. The row's matcher advances over the accepted tokens only (``Row`` in decoder.py): a rejected
   draft never entered it, so nothing is rolled back there; every draft-time advance
   (``tree_masks``, ``ModelDrafter.propose``) is rolled back before it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from specbatch.engine.drafters import Proposal, common_prefix
from specbatch.engine.grammar import Matcher, refuse
from specbatch.engine.tree import TokenTree

GRAMMAR = "grammar"     # the pool name of the grammar's forced-token chain (stats: pool_wins)
FORCED_MARGIN = 1.05    # a forced run longer than the drafts must promise this many times the rate


class GrammarRow(Protocol):
    @property
    def grammar(self) -> Matcher | None: ...


def trim(rows: Sequence[GrammarRow], proposals: list[list[Proposal | None]]) -> list[list[Proposal | None]]:
    """proposals[i][b]: member i's proposal for row b, cut before the first token row b's grammar
    refuses (None where nothing is left)."""
    out = []
    for props in proposals:
        cut: list[Proposal | None] = []
        for r, p in zip(rows, props):
            if p is None or r.grammar is None:
                cut.append(p)
                continue
            n = r.grammar.allows(p.tokens)
            if n == len(p.tokens):
                cut.append(p)
            else:
                cut.append(Proposal(p.tokens[:n], p.forwards) if n else None)
        out.append(cut)
    return out


def forced(row: GrammarRow, limit: int) -> Proposal | None:
    """Up to ``limit`` tokens the grammar forces next, as a proposal; None if none is forced."""
    if row.grammar is None or limit <= 0:
        return None
    tokens = row.grammar.forced()[:limit]
    return Proposal(tokens) if tokens else None


def forced_cap(runs: Sequence[int], depth: int, step_cost: Callable[[int], float | None]) -> int:
    """How many of its forced tokens each row proposes this step: the cap L with the most tokens
    per second, ``(rows + sum(min(f, L))) / step_cost(1 + max(depth, L))``.

    ``runs``: each row's forced run (0: none); ``depth``: the deepest draft the drafters proposed
    (forced tokens up to it ride along for free); ``step_cost(n)``: the measured seconds of a step
    verifying n positions per row at this batch size (None: not measured, and then no cap, which
    measures it). A batch pads every row to its deepest tree, so one row's long forced run costs
    every row its positions: at B=1 it is nearly free, at B=8 on a CPU it may cost more than it
    brings. Which tokens are emitted does not depend on L, only how many steps it takes."""
    longest = max(runs, default=0)
    if longest <= depth:
        return longest
    rates = {}
    for cap in sorted({depth, *(f for f in runs if f > depth)}):
        cost = step_cost(1 + cap)
        if cost is None or cost <= 0:
            return longest
        rates[cap] = (len(runs) + sum(min(f, cap) for f in runs)) / cost
    best = max(rates, key=rates.__getitem__)
    # (past the drafts' depth only for a clear gain: the costs are measured, and noisy)
    return best if rates[best] >= FORCED_MARGIN * rates[depth] else depth


def drafters_part(proposals: Sequence[Proposal | None], forced: Proposal | None,
                  accepted: Sequence[int]) -> tuple[int, int]:
    """(drafted, accepted) of a row's drafters past the grammar's forced run: what its gamma
    controller learns from. A forced token is accepted by construction, and a masked draft model
    proposes it too, so counting it would credit the drafter with the grammar's certainty."""
    skip = 0 if forced is None else len(forced.tokens)
    props = [p for p in proposals if p is not None]
    drafted = max((len(p.tokens) for p in props), default=0)
    agreed = max((common_prefix(p.tokens, accepted) for p in props), default=0)
    return max(0, drafted - skip), max(0, agreed - skip)


def tree_masks(rows: Sequence[GrammarRow], trees: Sequence[TokenTree]) -> list[torch.Tensor | None]:
    """Per row, the (1 + n_nodes, V) bool masks at its tree's root and nodes (None: free text).
    Needs only the trees, not the logits: the decoder computes them while the target runs."""
    return [None if r.grammar is None else r.grammar.tree_masks(t.tokens, t.parents) for r, t in zip(rows, trees)]


def mask_logits(masks: Sequence[torch.Tensor | None], trees: Sequence[TokenTree], logits: torch.Tensor) -> None:
    """logits: (B, keep, V), row b's root at column keep - 1 - n_nodes(b) (as ``Decoder._verify``
    reads them). Masks constrained rows in place: -inf where the grammar refuses the token."""
    keep = logits.shape[1]
    for b, (allowed, t) in enumerate(zip(masks, trees)):
        if allowed is not None:
            refuse(logits[b, keep - 1 - t.n_nodes:], allowed)
