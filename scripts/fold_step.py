"""One verify forward (T tokens a row over a cache of about L tokens with left pads) under folded
attention (engine/attention.py) against transformers' SDPA path, interleaved rep by rep, 1 torch
thread, the default target; prints ms for each and whether the logits are bitwise equal.

    python scripts/fold_step.py 1x5x200,8x5x200,32x5x200,32x1x200,32x3x400   # rows x tokens x cached
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specbatch.config import Settings
from specbatch.engine.attention import NAME
from specbatch.engine.cache import BatchCache
from specbatch.engine.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", help="comma list of ROWSxTOKENSxCACHED")
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    target = load_model("smollm2-135m", cache_dir=Settings().cache_dir)
    g = torch.Generator().manual_seed(0)
    for shape in a.shapes.split(","):
        rows, t, length = (int(x) for x in shape.split("x"))
        times: dict[str, list[float]] = {"sdpa": [], NAME: []}
        same = True
        with torch.inference_mode():
            cache = BatchCache(target, rows)
            cache.forward([torch.randint(100, 40000, (length - b % 7,), generator=g).tolist() for b in range(rows)],
                          logits_to_keep=1)          # ragged: left pads, a 4-D mask from here on
            for rep in range(a.reps):
                step = [torch.randint(100, 40000, (t,), generator=g).tolist() for _ in range(rows)]
                logits = []
                for mode in ("sdpa", NAME) if rep % 2 == 0 else (NAME, "sdpa"):
                    target.model.set_attn_implementation(mode)
                    t0 = time.perf_counter()
                    logits.append(cache.forward(step, logits_to_keep=t))
                    times[mode].append(time.perf_counter() - t0)
                    cache.drop_tail([t] * rows)
                same = same and torch.equal(*logits)
        ours, theirs = statistics.median(times[NAME]) * 1e3, statistics.median(times["sdpa"]) * 1e3
        print(f"B={rows} T={t} L~{length}: transformers' SDPA {theirs:.1f} ms, folded {ours:.1f} ms, "
              f"ratio {theirs / ours:.2f}x, logits bitwise equal: {same}, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
