"""Prompts cached in forwards of rows of similar length, not one forward padded to the longest.

A batched forward left-pads every row to the longest feed: rows of 10 and of 117 prompt tokens in
one forward cost 2 x 117 positions of GEMMs, element-wise work and attention. The default job's
first batch (32 prompts of 8-117 tokens after their shared prefix) spent 60% of its prefill, a
quarter of the whole job, on pad positions (docs/bench/report-job-default-pair.md, "Where a
step's time goes"). Here the joining rows are cut into runs of similar length, each prefilled in
a forward of its own, and the runs' caches are joined: a row's KV does not depend on the rows
beside it or on pads (masked), so the cache holds what one padded forward would have cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specbatch.engine.backend import BackendFactory, PrefixKV, TargetBackend, joining

# what one more forward costs, in fed positions (a row's position through every layer): the
# model's Python per layer, smaller GEMMs, and each row's head at its last position
RUN_OVERHEAD = 32


def length_runs(lengths: Sequence[int], overhead: int = RUN_OVERHEAD) -> list[int]:
    """Sizes of the consecutive runs that ``lengths`` (in this order) is cut into, so that the
    padded positions plus ``overhead`` per run, sum of (rows x longest + overhead), is least.
    Sorted lengths give the best cut; a run of one row or of equal lengths is never padded."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n       # best[i]: least cost of the first i rows
    cut = [0] * (n + 1)                     # cut[i]: where the last run of that best starts
    for i in range(1, n + 1):
        longest = 0
        for j in range(i - 1, -1, -1):      # the last run is rows j .. i - 1
            longest = max(longest, lengths[j])
            cost = best[j] + (i - j) * longest + overhead
            if cost < best[i]:
                best[i], cut[i] = cost, j
    sizes: list[int] = []
    i = n
    while i:
        sizes.append(i - cut[i])
        i = cut[i]
    return sizes[::-1]


def feed_lengths(ids: Sequence[Sequence[int]], prefixes: Sequence[PrefixKV | None]) -> list[int]:
    """Per joining row, the tokens its prefill feeds: its ids less the prefix loaded first
    (``prefixes[b]``; None: none) and less its last token (fed by the step that scores it)."""
    return [len(x) - 1 - (0 if p is None else p.n_tokens) for x, p in zip(ids, prefixes, strict=True)]


def prefilled(factory: BackendFactory, prefixes: Sequence[PrefixKV | None], ids: Sequence[Sequence[int]],
              runs: Sequence[int], observe: Callable[[float, float], None] | None = None
              ) -> tuple[TargetBackend, int]:
    """A backend for rows about to join, in the order given: row b starts with ``prefixes[b]``
    (None: nothing) and then caches ``ids[b]`` but its last token (fed by the step that scores
    it), one forward per run of ``runs`` consecutive rows. Returns it and the forwards made.
    ``observe(wall, cpu)``: told each forward's seconds (``forward_in_runs``)."""
    out = factory(0)
    feeds = [list(x[0 if p is None else p.n_tokens: -1]) for x, p in zip(ids, prefixes, strict=True)]
    return out, len(forward_in_runs(out, runs, lambda s: joining(factory, prefixes[s]), feeds, observe))


def forward_in_runs(out: TargetBackend, runs: Sequence[int], part: Callable[[slice], TargetBackend],
                    feeds: Sequence[Sequence[int]], observe: Callable[[float, float], None] | None = None
                    ) -> list[torch.Tensor]:
    """Rows cut into ``runs`` consecutive runs, each a backend of its own (``part(s)``: rows
    ``s``), fed ``feeds[s]`` in one forward (none where nothing is to be fed: one-token prompts)
    and appended to ``out`` in order. Returns each forward's last fed position's logits (n, V).

    ``observe(wall, cpu)``: each forward's wall and process CPU seconds, for the threads' governor
    (engine/contention.py, CPU only): a fresh batch's prefill is a few forwards of seconds each,
    and read as one they gave it no window to see another process take a core in."""
    logits: list[torch.Tensor] = []
    start = 0
    for n in runs:
        s = slice(start, start + n)
        rows = part(s)
        if any(feeds[s]):
            # (the clocks are read only for a governor)
            w0, c0 = (time.perf_counter(), time.process_time()) if observe is not None else (0.0, 0.0)
            logits.append(rows.forward(feeds[s], logits_to_keep=1)[:, -1])
            if observe is not None:
                observe(time.perf_counter() - w0, time.process_time() - c0)
        out.extend(rows)
        start += n
    return logits
