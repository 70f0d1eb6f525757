"""One engine, several ``generate_many`` calls in a row over the same prompt file: what a
long-lived worker does job after job. Prints one line per call: how full its batch was (steps at
each row count, mean rows a step), tokens/s, and the memory budget's scale after it.

The row counts follow from admission, not the machine's speed, so two trees compare on a noisy
machine. Used for docs/bench/report-job-default-pair.md, "A worker's next job":

    PYTHONPATH=TREE python scripts/engine_calls.py examples/job-mixed-48.jsonl --calls 2 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import time

from step_rows import count_steps, summary

from specbatch.config import get_settings
from specbatch.engine import Engine, EngineRequest
from specbatch.engine.threads import configure_threads
from specbatch.jobs.intake import parse_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--batch-size", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    settings = get_settings()
    configure_threads(args.threads)
    engine = Engine.load(settings.default_target, [settings.default_draft], cache_dir=settings.cache_dir or None,
                         batch_size=args.batch_size, linears=settings.linears)
    lines = parse_file(args.file, None, settings)
    reqs = [EngineRequest(prompt=r.prompt, messages=r.messages, params=r.generation_params(),
                          input_ids=r.prompt_ids) for r in lines]
    steps = count_steps()
    for call in range(args.calls):
        steps.clear()
        t0 = time.perf_counter()
        tokens = sum(len(out.token_ids) for _, out in engine.generate_many(reqs) if hasattr(out, "token_ids"))
        wall = time.perf_counter() - t0
        s = summary(steps)
        print("CALL " + json.dumps({
            "call": call + 1, "steps": s["steps"], "mean_rows": s["mean_rows"], "by_rows": s["by_rows"],
            "tok_s": round(tokens / wall, 1), "wall_s": round(wall, 1),
            "scale": round(engine.memory.scale, 2) if engine.memory else None,
            "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
