"""The default job with a float32 and a bfloat16 target, interleaved A B B A in one process (the
same int8 draft for both): tok/s, and how many outputs equal the float32 target's.

    OMP_NUM_THREADS=2 python scripts/dtype_job.py --threads 2 [--configs auto,B32plain,B8spec,B8plain]
"""

from __future__ import annotations

import argparse
import os

import torch

from specbatch.bench.job import JobConfig, _ours, job_requests
from specbatch.config import Settings
from specbatch.engine.loading import load_model
from specbatch.jobs import intake

CONFIGS = {"auto": ("auto", "auto"), "B32plain": (32, False), "B32spec": (32, True),
           "B8plain": (8, False), "B8spec": (8, True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="auto,B32plain")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    s = Settings()
    parsed = intake.parse_file(a.file, None, s)
    models = {}
    for dtype in ("float32", "bfloat16"):
        target = load_model("smollm2-135m", dtype=dtype, cache_dir=s.cache_dir, linears=s.linears)
        models[dtype] = (target, load_model("smollm2-135m-int8", cache_dir=s.cache_dir, loaded=[target],
                                                     linears=s.linears))
    ids, limits = map(list, zip(*job_requests(parsed, models["float32"][0])))
    for pair in models.values():
        _ours(*pair, JobConfig("warm-up", "ours", 2, True), ids[:2], [4, 4])
    reference: list[list[int]] | None = None
    for rnd, order in enumerate((("float32", "bfloat16"), ("bfloat16", "float32"))):
        for name in a.configs.split(","):
            batch, spec = CONFIGS[name]
            for dtype in order:
                outs, seconds, _, _ = _ours(*models[dtype], JobConfig(name, "ours", batch, spec), ids, limits)
                if dtype == "float32" and reference is None:
                    reference = outs
                same = sum(x == y for x, y in zip(outs, reference)) if reference is not None else "-"
                n = sum(len(o) for o in outs)
                print(f"round {rnd} {name:9s} {dtype:9s} {n / seconds:7.1f} tok/s {seconds:6.1f} s  "
                      f"equal to float32: {same}/{len(outs)}  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
