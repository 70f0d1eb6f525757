"""The default job under folded attention (engine/attention.py) and transformers' SDPA path, both
in one process, A B B A per configuration: tok/s, and whether every output equals the first run's.

    OMP_NUM_THREADS=1 python scripts/fold_job.py --configs B32spec,B8spec --threads 1
"""

from __future__ import annotations

import argparse
import os

import torch

from specbatch.bench.job import JobConfig, _ours, job_requests
from specbatch.config import Settings
from specbatch.engine.attention import NAME
from specbatch.engine.loading import load_model
from specbatch.jobs import intake

CONFIGS = {"auto": ("auto", "auto"), "B32plain": (32, False), "B32spec": (32, True),
           "B8plain": (8, False), "B8spec": (8, True), "B4spec": (4, True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="B32spec,B8spec")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    s = Settings()
    parsed = intake.parse_file(a.file, None, s)
    target = load_model("smollm2-135m", cache_dir=s.cache_dir)
    draft = load_model("smollm2-135m-int8", loaded=[target], cache_dir=s.cache_dir)
    ids, limits = map(list, zip(*job_requests(parsed, target)))
    _ours(target, draft, JobConfig("warm-up", "ours", 2, True), ids[:2], [4, 4])
    first: list[list[int]] | None = None
    rates: dict[tuple[str, str], list[float]] = {}
    for rnd, order in enumerate((("sdpa", NAME), (NAME, "sdpa"))):
        for name in a.configs.split(","):
            batch, spec = CONFIGS[name]
            for mode in order:
                for lm in (target, draft):
                    lm.model.set_attn_implementation(mode)
                outs, seconds, _, _ = _ours(target, draft, JobConfig(name, "ours", batch, spec), ids, limits)
                first = first or outs
                n = sum(len(o) for o in outs)
                rates.setdefault((name, mode), []).append(n / seconds)
                print(f"round {rnd} {name:9s} {mode:14s} {n / seconds:7.1f} tok/s {seconds:6.1f} s  equal to the "
                      f"first run: {sum(x == y for x, y in zip(outs, first))}/{len(outs)}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    for name in a.configs.split(","):
        theirs, ours = (sum(rates[(name, m)]) / 2 for m in ("sdpa", NAME))
        print(f"{name:9s} transformers' SDPA {theirs:7.1f}  folded {ours:7.1f}  folded / SDPA {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
