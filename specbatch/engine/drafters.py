"""Batched drafters: propose candidates for every row of a batch; see what each row accepted.

A drafter serves the whole batch and keeps its state per row, aligned with the decoder's rows
(``admit`` appends rows, ``retire`` keeps some): a draft model its batched KV cache, the n-gram
drafter its per-row index. A drafter that finds nothing for a row returns None there and that row
falls back to one target step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specbatch.engine.backend import PrefixKV, joining
from specbatch.engine.cache import BatchCache
from specbatch.engine.grammar import Matcher, refuse
from specbatch.engine.loading import LoadedModel
from specbatch.engine.prefill import feed_lengths, forward_in_runs, length_runs, prefilled
from specbatch.engine.processors import RowProcessors
from specbatch.engine.sampling import RowNoise, Warp, race


class DraftRow(Protocol):
    """What a drafter reads of a decoder row."""

    @property
    def ids(self) -> list[int]: ...          # the accepted sequence (prompt + generated)
    @property
    def warp(self) -> Warp | None: ...       # None: greedy
    @property
    def noise(self) -> RowNoise | None: ...  # sampled rows: the noise the verifier races with
    @property
    def procs(self) -> RowProcessors | None: ...  # logit processors; q is drawn after them
    @property
    def grammar(self) -> Matcher | None: ...  # structured output: the state after ids; None: free text


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]                 # k candidate tokens
    forwards: int = 0                 # draft-model forwards this row took part in to make it


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits (..., V_draft) on the target's support (..., V_target): q must live where p does."""
    v = logits.shape[-1]
    if v > vocab_size:
        return logits[..., :vocab_size]
    if v < vocab_size:
        return torch.nn.functional.pad(logits, (0, vocab_size - v), value=float("-inf"))
    return logits


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Drafter:
    """Base of every drafter: the last proposals, per row.

    Call ``propose`` and ``observe`` under ``torch.inference_mode()``.
    """

    keeps_cache = False     # a KV cache that lags the rows while they decode without drafting
    # reads the target's final hidden states (EAGLE, Medusa, MTP heads; HF's requires_model_outputs):
    # the decoder then asks the backend for them and passes them to ``observe``
    needs_target_hidden = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.last: list[Proposal | None] = []

    def prefix(self, tokens: Sequence[int]) -> PrefixKV | None:
        """This drafter's state for a prompt prefix shared by rows (engine/prefix.py), computed
        alone; None: it keeps none (its rows need nothing loaded)."""
        return None

    def admit(self, rows: Sequence[DraftRow], prefill: bool,
              prefixes: Sequence[PrefixKV | None] | None = None) -> int:
        """Rows join the batch. ``prefill``: cache all of each row's ids but its last token now
        (rows joining a running batch); else the first proposal feeds them (a fresh batch).
        ``prefixes[b]``: what this drafter's ``prefix`` gave for a prefix of row b's ids, loaded
        first (rows sharing one are adjacent). Returns the model forwards made."""
        self.last += [None] * len(rows)
        return 0

    def retire(self, keep: list[int]) -> None:
        """Only rows ``keep`` (indices into the current rows) stay."""
        self.last = [self.last[i] for i in keep]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> list[Proposal | None]:
        """Up to k[b] candidate tokens following rows[b].ids (no proposal where k[b] == 0)."""
        raise NotImplementedError

    def observe(self, rows: Sequence[DraftRow], accepted: Sequence[list[int]],
                hidden: Sequence[torch.Tensor] | None = None) -> None:
        """accepted[b]: the tokens row b emitted this step (accepted drafts + one target token).
        hidden[b] (only for ``needs_target_hidden``): (len(accepted[b]), H), the target's final
        hidden state at each position whose logits chose accepted[b][i]. The base keeps nothing."""


class ModelDrafter(Drafter):
    """A small causal LM with one batched KV cache (the classic draft model).

    The cache holds a prefix of each row's ids; ``propose`` first feeds whatever it lacks, so a
    row admitted without ``prefill`` or decoded for a while without drafting catches up there.
    """

    keeps_cache = True

    def __init__(self, draft: LoadedModel, vocab_size: int) -> None:
        super().__init__(draft.name)
        self.draft = draft
        self.vocab_size = vocab_size          # the target's logits width: q must live on p's support
        self.cache = BatchCache(draft)
        self.fed: list[int] = []              # per row: own draft tokens fed in the last proposal

    def prefix(self, tokens: Sequence[int]) -> PrefixKV:
        alone = BatchCache(self.draft, 1)
        alone.forward([list(tokens)], logits_to_keep=1)
        return alone.export_prefix()

    def admit(self, rows: Sequence[DraftRow], prefill: bool,
              prefixes: Sequence[PrefixKV | None] | None = None) -> int:
        super().admit(rows, prefill)
        self.fed += [0] * len(rows)
        prefixes = list(prefixes or [None] * len(rows))
        if not prefill and all(p is None for p in prefixes):
            self.cache.extend(BatchCache(self.draft, len(rows)))
            return 0
        # rows with the same ids and prefix (the samples of one request) cache them once and fork
        first: dict[tuple[tuple[int, ...], int], int] = {}
        src = [first.setdefault((tuple(r.ids), id(p)), len(first)) for r, p in zip(rows, prefixes)]
        reps = [src.index(u) for u in range(len(first))]
        def factory(n: int) -> BatchCache:
            return BatchCache(self.draft, n)

        forwards = 0
        if prefill:   # (runs of similar length, engine/prefill.py: the decoder sorted the rows so)
            firsts, ids = [prefixes[b] for b in reps], [rows[b].ids for b in reps]
            cache, forwards = prefilled(factory, firsts, ids, length_runs(feed_lengths(ids, firsts)))
        else:
            cache = joining(factory, [prefixes[b] for b in reps])
        assert isinstance(cache, BatchCache)
        if len(reps) < len(rows):
            cache.fork(src)
        self.cache.extend(cache)
        return forwards

    def retire(self, keep: list[int]) -> None:
        super().retire(keep)
        self.fed = [self.fed[i] for i in keep]
        self.cache.select(keep)

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> list[Proposal | None]:
        n = len(rows)
        tokens: list[list[int]] = [[] for _ in rows]
        # 1. the cache holds a prefix of each row's ids (observe() dropped rejected drafts):
        #    feed the rest; then each step feeds the token just drafted, for rows that want more
        feeds = [r.ids[int(m):] for r, m in zip(rows, self.cache.n_valid.tolist())]
        # structured rows: the grammar follows the draft while it allows it (advanced[b] tokens)
        advanced = [0] * n
        for j in range(max(k)):
            last = self._catch_up(feeds) if j == 0 else self.cache.forward(feeds, logits_to_keep=1)[:, -1]
            logits = fit_vocab(last, self.vocab_size)
            # a structured row drafts from q masked by its grammar after the tokens drafted so far
            # (the verifier reads this masked q: the draws come from it)
            for b, r in enumerate(rows):
                if r.grammar is not None and advanced[b] == j < k[b]:
                    refuse(logits[b], r.grammar.mask())
            greedy = logits.argmax(dim=-1).tolist()
            # 2. the next draft token: argmax when greedy, else race(q, E) with the noise the
            #    verifier races p with at this position (so it is accepted where q is close to
            #    p); a row's logit processors first, with the tokens drafted so far as this
            #    position's history (the target's logits get the same at this node)
            for b, r in enumerate(rows):
                if j >= k[b]:
                    continue
                x = logits[b]
                if r.procs is not None:
                    x = r.procs(x[None], r.ids, [tokens[b]])[0]
                if r.warp is None:
                    tokens[b].append(greedy[b] if r.procs is None else int(x.argmax()))
                else:
                    assert r.noise is not None, "a sampled row has its noise"
                    q = r.warp.probs(x)
                    tokens[b].append(int(race(q, r.noise.at(r.noise.next + j, q.shape[-1]))))
            for b, r in enumerate(rows):   # (not past an EOS: the rest is cut before verifying)
                if r.grammar is not None and advanced[b] == j < k[b] and r.grammar.allows(tokens[b][-1:]):
                    r.grammar.advance(tokens[b][-1:])
                    advanced[b] += 1
            # 3. feed it unless it is the row's last (the target scores it; no need for its logits)
            feeds = [[t[-1]] if j + 1 < k[b] else [] for b, t in enumerate(tokens)]
            if not any(feeds):
                break
        for r, a in zip(rows, advanced):   # the drafted tokens leave the grammar's state
            if r.grammar is not None:
                r.grammar.rollback(a)
        self.fed = [max(0, kb - 1) for kb in k]
        self.last = [Proposal(t, forwards=len(t)) if t else None for t in tokens]
        assert len(self.last) == n
        return list(self.last)

    def _catch_up(self, feeds: list[list[int]]) -> torch.Tensor:
        """Feed each row's backlog; the last fed position's logits (B, V), in row order.

        Usually a token or a few a row, one forward. Where speculation turns on over rows that
        decoded plainly (or a fresh batch was not prefilled), backlogs run from a few tokens to a
        whole prompt: one forward left-padded to the longest fed mostly pads (23 rows x 144 took
        6.5 s on the default job). Rows of similar backlog go together then, one forward each
        (engine/prefill.py), and the caches are joined back in row order: a row's KV and logits
        do not depend on the rows beside it or on pads (masked), so the draft proposes the same.
        (An int8 draft nearly so: its Linears scale activations per row, engine/int8.py, and
        only the fp32 attention's last bits can flip a rounding: 3 of 23 first draft tokens
        differ in scripts/catch_up_bench.py. torch.ao's dynamic quantization, used before, took
        one scale over the whole forward: 17-21 of 23; issue 31, docs/DESIGN.md "Batch invariance".)
        """
        order = sorted(range(len(feeds)), key=lambda b: len(feeds[b]))
        runs = length_runs([len(feeds[b]) for b in order])
        if len(runs) <= 1:
            return self.cache.forward(feeds, logits_to_keep=1)[:, -1]
        joined = BatchCache(self.draft)
        parts = forward_in_runs(joined, runs, lambda s: self.cache.take(order[s]), [feeds[b] for b in order])
        # every row has a backlog (at least the last emitted token), so each run is one forward: a
        # block or a row missing or extra would hand the rows below another row's logits
        assert [len(p) for p in parts] == runs, \
            f"forward_in_runs gave logits of {[len(p) for p in parts]} rows for runs of {runs} rows"
        back = sorted(range(len(order)), key=order.__getitem__)   # row b sits at back[b] in joined
        joined.select(back)
        self.cache = joined
        return torch.cat(parts)[torch.tensor(back, device=parts[0].device)]

    def observe(self, rows: Sequence[DraftRow], accepted: Sequence[list[int]],
                hidden: Sequence[torch.Tensor] | None = None) -> None:
        super().observe(rows, accepted)
        # keep the own tokens that were accepted, but never the last emitted token: the next
        # proposal starts by feeding it
        drop = []
        for fed, prop, acc in zip(self.fed, self.last, accepted):
            agreed = common_prefix(prop.tokens, acc) if prop is not None else 0
            drop.append(fed - min(fed, agreed, len(acc) - 1))
        self.cache.drop_tail(drop)
        self.fed = [0] * len(self.fed)


@dataclass
class NgramIndex:
    """One row's prompt-lookup index: n-gram -> end position of its latest earlier occurrence.

    Incremental (each accepted token is indexed once), so a lookup is O(1).
    """

    max_n: int = 3
    min_n: int = 1
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0                  # n-grams ending before this position are indexed

    def lookup(self, ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the trailing n-gram."""
        end = len(ids) - 1                # index every n-gram ending before the last token
        for e in range(self.indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if e - n + 1 >= 0:
                    self.index[tuple(ids[e - n + 1: e + 1])] = e
        self.indexed = max(self.indexed, end)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) < n:
                continue
            last = self.index.get(tuple(ids[-n:]))
            if last is not None and last + 1 < len(ids):
                return ids[last + 1: last + 1 + k]
        return []


class NgramDrafter(Drafter):
    """Prompt lookup: copy what followed the latest earlier occurrence of the trailing n-gram.

    Proposals are deterministic (the same for a greedy and a sampled row); only accepted tokens enter a row's index.
    """

    def __init__(self) -> None:
        super().__init__("ngram")
        self.rows: list[NgramIndex] = []

    def admit(self, rows: Sequence[DraftRow], prefill: bool,
              prefixes: Sequence[PrefixKV | None] | None = None) -> int:
        self.rows += [NgramIndex() for _ in rows]
        return super().admit(rows, prefill)

    def retire(self, keep: list[int]) -> None:
        super().retire(keep)
        self.rows = [self.rows[i] for i in keep]

    def propose(self, rows: Sequence[DraftRow], k: Sequence[int]) -> list[Proposal | None]:
        found = [ix.lookup(r.ids, kb) if kb else [] for ix, r, kb in zip(self.rows, rows, k)]
        self.last = [Proposal(t) if t else None for t in found]
        return list(self.last)
