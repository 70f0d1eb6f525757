"""The decoder's steps counted by the rows in each: how full the batch was, step by step.

Shared by scripts/engine_calls.py and scripts/run_steps.py (run as ``python scripts/X.py``, so this
directory is on the path). The counts follow from the requests' lengths and the admission rules,
not the machine's speed, so they compare two trees on a noisy machine where seconds cannot. The
engine reports time by batch size per request (``batch_size_seconds``), not steps: hence a wrapper
around ``Decoder._step``, installed once per process.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import specbatch.engine.decoder as decoder

steps: Counter[int] = Counter()     # rows in a step -> steps with that many rows


def count_steps() -> Counter[int]:
    """From now on every decoder step counts its rows in ``steps`` (returned); clear it to restart."""
    real = decoder.Decoder._step
    if getattr(real, "counts_rows", False):
        return steps

    def counted(self: decoder.Decoder) -> None:
        steps[len(self.rows)] += 1
        real(self)

    counted.counts_rows = True    # type: ignore[attr-defined]
    decoder.Decoder._step = counted    # type: ignore[method-assign]
    return steps


def summary(counts: Counter[int]) -> dict[str, Any]:
    """Steps, row-steps, steps by rows and mean rows a step."""
    n = sum(counts.values())
    row_steps = sum(k * v for k, v in counts.items())
    return {"steps": n, "row_steps": row_steps, "by_rows": dict(sorted(counts.items())),
            "mean_rows": round(row_steps / max(n, 1), 2)}
