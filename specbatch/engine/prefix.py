"""Prompt prefixes shared across requests: found with a token trie, their KV kept in an LRU store.

The KV of a prefix does not depend on what follows it (causal attention; a row's position ids
count its valid tokens only, engine/cache.py), so a prefix's KV computed once, alone, is the KV
every row starting with it would compute. ``shared_prefixes`` finds, over the prompts of one
decode (a worker's chunk), each prompt's longest prefix that another prompt shares; the decoder
computes such a prefix once per model (target and each draft model) and copies it into every
row that starts with it, which then prefills only its suffix. ``PrefixStore`` keeps computed
prefixes for later decodes of the same worker, least recently used first out, within a byte
budget that the memory budget counts (engine/memory.py ``MemoryBudget.reserved``). A prefix
only one request uses is never computed apart: it would cost a forward and save nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specbatch.engine.backend import PrefixKV

MIN_PREFIX_TOKENS = 16     # shorter shared prefixes are not worth a forward of their own


@dataclass(frozen=True)
class PrefixEntry:
    """One prefix's KV for every model of a pool: ``kv[0]`` the target's, then one per drafter
    (None for a drafter without a KV cache, e.g. n-gram)."""

    tokens: tuple[int, ...]
    kv: tuple[PrefixKV | None, ...]
    models: tuple[str, ...]       # the pool it was computed with (target, drafters): a key part
    seconds: float                # what computing it took (the computing row's prefill time)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kv if k is not None)


def shared_prefixes(prompts: Sequence[Sequence[int]], min_tokens: int = MIN_PREFIX_TOKENS) -> list[int]:
    """Per prompt, the length of the prefix it should read from the prefix cache: of its prefixes
    that other prompts start with too (a token trie: each node counts the prompts through it), the
    one that saves most, (prompts through it - 1) x its length, the longer on a tie; at least
    ``min_tokens`` and one short of the prompt (its last token is fed by the step that scores it).
    A system prompt shared by 48 questions is then one prefix, not one per pair of questions that
    also share their first word. A prefix no other prompt would read is dropped: the prompt takes
    the longest shorter one others read, or none (never a prefix computed for one request)."""
    root: dict[int, Any] = {}
    counts: dict[int, int] = {}          # id(node) -> prompts that pass through it
    for p in prompts:
        node = root
        for t in p:
            node = node.setdefault(t, {})
            counts[id(node)] = counts.get(id(node), 0) + 1
    depths = []
    for p in prompts:
        node, best, saved = root, 0, 0
        for d, t in enumerate(p[: len(p) - 1], start=1):
            node = node[t]
            c = counts[id(node)]
            if c < 2:
                break
            if d >= min_tokens and (c - 1) * d >= saved:
                best, saved = d, (c - 1) * d
        depths.append(best)
    users: dict[tuple[int, ...], int] = {}
    for p, d in zip(prompts, depths):
        if d:
            users[tuple(p[:d])] = users.get(tuple(p[:d]), 0) + 1
    # a prompt alone at its depth joins the longest prefix of it that others use, deepest first
    # (a prompt that is another's prefix: both then use it less its last token)
    lengths = sorted({len(k) for k in users}, reverse=True)
    for b in sorted(range(len(prompts)), key=lambda b: -depths[b]):
        p, d = prompts[b], depths[b]
        if d and users[tuple(p[:d])] < 2:
            users[tuple(p[:d])] -= 1
            depths[b] = next((n for n in lengths if min_tokens <= n < d and users.get(tuple(p[:n]))), 0)
            if depths[b]:
                users[tuple(p[:depths[b]])] += 1
    return [d if d and users[tuple(p[:d])] >= 2 else 0 for p, d in zip(prompts, depths)]


class PrefixStore:
    """Computed prefixes of one worker, LRU within ``budget`` bytes.

    Rows copy a prefix's KV into their own cache columns when they join (BatchCache's
    ``DynamicCache`` holds one tensor per layer for all rows: a row cannot point at shared
    columns), so an entry is never referenced once admission ends and eviction needs no
    reference counts: the least recently used entry goes first.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.nbytes = 0
        self.lengths: dict[int, int] = {}    # prefix length -> entries of that length
        self.evictions = 0
        # the fastest prefill this worker measured, seconds a token: what a cached token saves.
        # Not the policy's costs (engine/policy.py): MeasuredPolicy learns no prefill at all, the
        # autopilot an average per row (tokens unknown, draft catch-ups in it), and neither sees
        # the prefills of rows joining a running batch or of a prefix computed alone; a per-token
        # minimum over all of them is what keeps ``saved`` a lower bound
        self.seconds_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (a prefix computed, rows joining)."""
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            self.seconds_per_token = rate if self.seconds_per_token is None else min(self.seconds_per_token, rate)

    def saved(self, tokens: int) -> float:
        """What reading ``tokens`` cached tokens saved: their prefill at the fastest rate measured.
        Not the time their prefix took to compute: that may be a cold first forward (a worker that
        just started, a compile beside it), which would count tens of seconds for every later hit."""
        return tokens * (self.seconds_per_token or 0.0)

    def longest(self, ids: Sequence[int], models: tuple[str, ...], limit: int) -> PrefixEntry | None:
        """The longest stored prefix of ``ids`` no longer than ``limit`` tokens, for this pool."""
        for n in sorted(self.lengths, reverse=True):
            if n > limit:
                continue
            e = self.entries.get(tuple(ids[:n]))
            if e is not None and e.models == models:
                self.entries.move_to_end(e.tokens)
                return e
        return None

    def holds(self, tokens: Sequence[int], models: tuple[str, ...]) -> bool:
        """Whether exactly this prefix is stored for this pool (its place in the LRU order kept)."""
        e = self.entries.get(tuple(tokens))
        return e is not None and e.models == models

    def put(self, entry: PrefixEntry) -> bool:
        """Keep ``entry``, evicting the least recently used ones; False when it alone exceeds
        the budget (then nothing is evicted for it)."""
        if entry.nbytes > self.budget:
            return False
        self._drop(entry.tokens)
        while self.entries and self.nbytes + entry.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[entry.tokens] = entry
        self.nbytes += entry.nbytes
        self.lengths[len(entry.tokens)] = self.lengths.get(len(entry.tokens), 0) + 1
        return True

    def _drop(self, tokens: tuple[int, ...]) -> None:
        e = self.entries.pop(tokens, None)
        if e is None:
            return
        self.nbytes -= e.nbytes
        n = len(tokens)
        self.lengths[n] -= 1
        if not self.lengths[n]:
            del self.lengths[n]
