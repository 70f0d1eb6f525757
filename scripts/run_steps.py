"""`specbatch run ARGS` with the decoder's steps counted: how full the batch was, step by step.

Prints one line to stderr at exit: ``STEPS {"steps": N, "row_steps": R, "by_rows": {rows: steps},
"mean_rows": R/N, "wall_s": ..., "load0": ..., "load1": ...}`` (load: the 1-minute load average at
start and end). The step counts follow from the requests' lengths and the admission and claiming
rules, not the machine's speed, so they compare two trees on a noisy machine where seconds cannot.
Used for docs/bench/report-job-default-pair.md, "Admission order and refill":

    PYTHONPATH=TREE SPECBATCH_DATABASE_URL=sqlite:////tmp/x.sqlite \\
        python scripts/run_steps.py run FILE --batch-size 16 --threads 1 --compile off
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

import specbatch.engine.decoder as decoder
from specbatch.cli.main import main

count: dict[str, Any] = {"steps": 0, "row_steps": 0, "by_rows": {}}
_step = decoder.Decoder._step


def _counted(self: decoder.Decoder) -> None:
    rows = len(self.rows)
    count["steps"] += 1
    count["row_steps"] += rows
    count["by_rows"][rows] = count["by_rows"].get(rows, 0) + 1
    _step(self)


def _report(t0: float, load0: float) -> None:
    count.update(wall_s=round(time.time() - t0, 1), load0=round(load0, 1), load1=round(os.getloadavg()[0], 1),
                 mean_rows=round(count["row_steps"] / max(1, count["steps"]), 2))
    print("STEPS " + json.dumps(count), file=sys.stderr, flush=True)


if __name__ == "__main__":
    decoder.Decoder._step = _counted    # type: ignore[method-assign]
    atexit.register(_report, time.time(), os.getloadavg()[0])
    sys.argv = ["specbatch", *sys.argv[1:]]
    main()
