"""The decoder's policy seam: how many rows may decode together, and how much to speculate.

The decoder asks the policy before admitting rows (``max_rows``) and before each step
(``gamma_cap``, ``costs``), and reports every step back (``observe``). The default policy keeps a
fixed row limit and measures step costs per batch-size bucket; each request's GammaController
chooses its draft length from the costs of the bucket it is decoded at. A throughput autopilot
is another implementation of ``Policy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specbatch.engine.gamma import CostModel


@dataclass(frozen=True)
class StepReport:
    """One decode step of the whole batch, as measured."""

    rows: int                 # rows in the batch
    depth: int                # longest draft of any row (0: a plain target step)
    drafted: int              # draft tokens verified, all rows
    emitted: int              # tokens emitted, all rows (before stop-string cuts)
    draft_seconds: float
    verify_seconds: float
    prefill: bool             # the step also cached prompts (rows that joined a fresh batch)


class Policy(Protocol):
    def max_rows(self, waiting: int = 0) -> int:
        """Rows that may be active at once; asked before admitting ``waiting`` requests (fewer
        than are active: the newest rows pause until there is room again)."""
        ...

    def gamma_cap(self, n_rows: int) -> int | None:
        """Before each step: the most an adaptive row may draft (0: a plain step), None: no cap.
        Requests with a fixed gamma (``adaptive=False``) draft it regardless, as asked."""
        ...

    def costs(self, n_rows: int) -> CostModel:
        """The step costs the rows' GammaControllers steer by at this batch size."""
        ...

    def observe(self, report: StepReport) -> None:
        ...


def bucket(n_rows: int) -> int:
    """Batch sizes share cost measurements by power-of-two bucket: 1, 2, 4, 8, ..."""
    return 1 << max(0, (n_rows - 1).bit_length())


@dataclass
class MeasuredPolicy:
    """A fixed row limit; costs measured per batch-size bucket (``buckets`` outlives one call).

    After ``warmup_steps`` speculative steps at a bucket whose plain step was never measured, one
    plain step measures it: switching speculation off compares against a measured plain step.
    """

    limit: int
    buckets: dict[int, CostModel] = field(default_factory=dict)
    warmup_steps: int = 3
    spec_steps: dict[int, int] = field(default_factory=dict)   # speculative steps seen per bucket

    def max_rows(self, waiting: int = 0) -> int:
        return max(1, self.limit)

    def gamma_cap(self, n_rows: int) -> int | None:
        b = bucket(n_rows)
        if self.spec_steps.get(b, 0) >= self.warmup_steps and 1 not in self.costs(n_rows).verify:
            return 0
        return None

    def costs(self, n_rows: int) -> CostModel:
        return self.buckets.setdefault(bucket(n_rows), CostModel())

    def observe(self, report: StepReport) -> None:
        if report.prefill:
            return        # a prompt's prefill says nothing about the cost of a decode step
        b = bucket(report.rows)
        costs = self.costs(report.rows)
        costs.observe_draft(report.draft_seconds, report.depth)
        costs.observe_verify(report.depth + 1, report.verify_seconds)
        if report.depth:
            self.spec_steps[b] = self.spec_steps.get(b, 0) + 1
