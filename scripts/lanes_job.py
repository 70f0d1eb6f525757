"""The default job decoded by one loop of N torch threads (the old default) and by decode lanes
(engine/lanes.py: two loops of N/2 threads each, the default now), interleaved in one process,
token for token compared. ``--busy``: with a busy process beside it (another tenant's work).

    PYTHONPATH=. python scripts/lanes_job.py --rounds 3
    PYTHONPATH=. python scripts/lanes_job.py --rounds 3 --busy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="a busy process beside it the whole time")
    a = ap.parse_args()

    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine.loading import load_model
    from specbatch.engine.threads import default_threads, plan
    from specbatch.jobs import intake

    settings = Settings.from_env()
    kw = {"device": "cpu", "dtype": "float32", "cache_dir": settings.cache_dir or None}
    target = load_model(settings.default_target, **kw)
    draft = load_model(settings.default_draft, **kw, loaded=[target])
    jobs = job_requests(intake.parse_file(a.file, None, settings), target)
    cores = default_threads()
    configs = {"one loop": (cores, 1), "lanes": plan(None)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    try:
        for r in range(a.rounds):
            for name, (threads, lanes) in configs.items():
                torch.set_num_threads(threads)
                engine = Engine(target, [draft], lanes=lanes)
                reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in jobs]
                list(engine.generate_many(reqs[:2]))     # warm-up
                load0 = os.getloadavg()[0]
                t0 = time.perf_counter()
                outs = dict(engine.generate_many(reqs))
                seconds = time.perf_counter() - t0
                ids = [list(outs[i].token_ids) for i in range(len(reqs))]
                tokens = sum(map(len, ids))
                print("RESULT " + json.dumps({
                    "round": r, "config": name, "threads": threads, "lanes": engine.lanes_used,
                    "tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1),
                    "load0": round(load0, 2), "busy": a.busy,
                    "outputs": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}), flush=True)
    finally:
        if busy is not None:
            busy.kill()


if __name__ == "__main__":
    main()
