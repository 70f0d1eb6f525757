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
from collections import Counter

from step_rows import count_steps, summary

from specbatch.cli.main import main


def _report(steps: Counter[int], t0: float, load0: float) -> None:
    count = summary(steps) | {"wall_s": round(time.time() - t0, 1), "load0": round(load0, 1),
                              "load1": round(os.getloadavg()[0], 1)}
    print("STEPS " + json.dumps(count), file=sys.stderr, flush=True)


if __name__ == "__main__":
    steps = count_steps()
    atexit.register(_report, steps, time.time(), os.getloadavg()[0])
    sys.argv = ["specbatch", *sys.argv[1:]]
    main()
