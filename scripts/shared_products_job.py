"""The default job with the target's sibling Linears (q/k/v, gate/up) multiplied as one packed
product each (engine/packed.py ``_Group``, the default) and as one product per Linear, interleaved
in one process, token for token compared.

    PYTHONPATH=. OMP_NUM_THREADS=2 python scripts/shared_products_job.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine.loading import load_model
    from specbatch.engine.packed import PackedLinear
    from specbatch.jobs import intake

    settings = Settings.from_env()
    kw = {"device": "cpu", "dtype": "float32", "cache_dir": settings.cache_dir or None}
    target = load_model(settings.default_target, **kw)
    draft = load_model(settings.default_draft, **kw, loaded=[target])
    jobs = job_requests(intake.parse_file(a.file, None, settings), target)
    members = [m for m in target.model.modules() if isinstance(m, PackedLinear) and m._group is not None]
    groups = {id(m): m._group for m in members}
    size = a.batch if a.batch == "auto" else int(a.batch)
    print(f"{len(members)} Linears in shared products", flush=True)

    def use(shared: bool) -> None:
        for m in members:
            m._group = groups[id(m)] if shared else None

    for r in range(a.rounds):
        for name, shared in (("shared", True), ("one each", False)):
            use(shared)
            engine = Engine(target, [draft], batch_size=size)
            reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in jobs]
            dict(engine.generate_many(reqs[:2]))      # warm-up (one each: packs each weight once)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            outs = dict(engine.generate_many(reqs))
            seconds = time.perf_counter() - t0
            ids = [list(outs[i].token_ids) for i in range(len(reqs))]
            tokens = sum(map(len, ids))
            print("RESULT " + json.dumps({
                "round": r, "config": name, "tokens": tokens, "seconds": round(seconds, 2),
                "tok_s": round(tokens / seconds, 1), "load0": round(load0, 2),
                "outputs": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}), flush=True)


if __name__ == "__main__":
    main()
