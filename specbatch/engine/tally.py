"""Tally: every per-request counter of a decode, folded into GenerationStats.

Definitions of the fields: docs/statistics.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specbatch.engine.types import GenerationStats


@dataclass
class Tally:
    """The only writer of a request's GenerationStats while it decodes."""

    stats: GenerationStats
    drafted_at: list[int] = field(default_factory=list)    # steps that drafted position j
    accepted_at: list[int] = field(default_factory=list)   # steps that accepted position j
    t_start: float = field(default_factory=time.perf_counter)

    def prefill(self, seconds: float, draft_forwards: int) -> None:
        """The request's prompt was cached in a forward of its own (it joined a running batch)."""
        s = self.stats
        s.target_forwards += 1
        s.draft_forwards += draft_forwards
        s.verify_seconds += seconds

    def cached(self, tokens: int) -> None:
        """The request's first ``tokens`` prompt tokens came from the prefix cache (engine/prefix.py)."""
        self.stats.cached_prompt_tokens = tokens

    def saved(self, seconds: float) -> None:
        """What reading the cached tokens saved (``PrefixStore.saved``, when the request ends:
        the store's rate by then is its best measure)."""
        self.stats.prefill_seconds_saved = seconds

    def batch_share(self, rows: int, seconds: float) -> None:
        """The request's share of a forward over ``rows`` rows (job statistics: time by batch size)."""
        by_rows = self.stats.batch_size_seconds
        by_rows[str(rows)] = by_rows.get(str(rows), 0.0) + seconds

    def step(self, drafted: int, n_accepted: int, winner: int, winner_name: str, *,
             draft_forwards: int, draft_seconds: float, verify_seconds: float) -> None:
        """One verify step: drafted = the depth of the row's draft tree (its draft length)."""
        s = self.stats
        s.verify_steps += 1
        if s.verify_steps == 1:   # the first step emits the request's first token
            s.first_token_seconds = time.perf_counter() - self.t_start
        s.draft_steps += drafted > 0
        s.target_forwards += 1
        s.draft_forwards += draft_forwards
        s.draft_seconds += draft_seconds
        s.verify_seconds += verify_seconds
        s.drafted_tokens += drafted
        s.accepted_tokens += n_accepted
        _grow_counts(self.drafted_at, drafted)
        _grow_counts(self.accepted_at, n_accepted)
        s.step_winners.append(winner)
        if winner >= 0:
            s.pool_wins[winner_name] = s.pool_wins.get(winner_name, 0) + 1

    def close(self, new_tokens: int, final_gamma: int, speculation_disabled: bool,
              wall_seconds: float) -> GenerationStats:
        s = self.stats
        s.new_tokens = new_tokens
        accepted = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        s.accepted_per_position = [a / d for a, d in zip(accepted, self.drafted_at)]
        s.accepted_at_position = accepted
        s.final_gamma = final_gamma
        s.speculation_disabled = speculation_disabled
        s.wall_seconds = wall_seconds
        return s


def _grow_counts(counts: list[int], n: int) -> None:
    """counts[j] += 1 for j < n."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for j in range(n):
        counts[j] += 1
