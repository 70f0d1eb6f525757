"""The default job decoded two ways in one process, interleaved round by round, token for token
compared:

    PYTHONPATH=. python scripts/job_variants.py lanes --rounds 3            # one loop vs decode lanes
    PYTHONPATH=. python scripts/job_variants.py lanes --rounds 2 --busy     # a busy process beside it
    PYTHONPATH=. python scripts/job_variants.py shared-products --threads 1 # q/k/v, gate/up shared or not

``lanes``: one loop of every core's torch thread (the default) against decode lanes
(engine/lanes.py: two loops, the cores divided). ``shared-products``: the target's sibling
Linears multiplied as one packed product each (engine/packed.py ``_Group``, the default) against
one product per Linear.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("compare", choices=["lanes", "shared-products"])
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="shared-products: torch threads (default: the cores)")
    ap.add_argument("--busy", action="store_true", help="a busy process beside it the whole time")
    a = ap.parse_args()

    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine.loading import load_model
    from specbatch.engine.packed import PackedLinear
    from specbatch.engine.threads import default_threads, plan
    from specbatch.jobs import intake

    settings = Settings.from_env()
    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "cache_dir": settings.cache_dir or None,
          "linears": settings.linears}
    target = load_model(settings.default_target, **kw)
    draft = load_model(settings.default_draft, **kw, loaded=[target])
    jobs = job_requests(intake.parse_file(a.file, None, settings), target)
    members = [m for m in target.model.modules() if isinstance(m, PackedLinear) and m._group is not None]
    groups = {id(m): m._group for m in members}

    def shared(on: bool) -> Callable[[], Engine]:
        def make() -> Engine:
            torch.set_num_threads(a.threads or default_threads())
            for m in members:
                m._group = groups[id(m)] if on else None
            return Engine(target, [draft])
        return make

    def lanes(threads: int, n: int) -> Callable[[], Engine]:
        def make() -> Engine:
            torch.set_num_threads(threads)
            return Engine(target, [draft], lanes=n)
        return make

    variants = {"one loop": lanes(default_threads(), 1), "lanes": lanes(*plan(None, 2))} if a.compare == "lanes" \
        else {"shared": shared(True), "one each": shared(False)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    try:
        for r in range(a.rounds):
            for name, make in variants.items():
                engine = make()
                reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in jobs]
                dict(engine.generate_many(reqs[:2]))     # warm-up (one each: packs each weight once)
                load0 = os.getloadavg()[0]
                t0 = time.perf_counter()
                outs = dict(engine.generate_many(reqs))
                seconds = time.perf_counter() - t0
                ids = [list(outs[i].token_ids) for i in range(len(reqs))]
                tokens = sum(map(len, ids))
                print("RESULT " + json.dumps({
                    "round": r, "variant": name, "threads": torch.get_num_threads(), "lanes": engine.lanes_used,
                    "tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1),
                    "load0": round(load0, 2), "busy": a.busy,
                    "outputs": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}), flush=True)
    finally:
        if busy is not None:
            busy.kill()


if __name__ == "__main__":
    main()
