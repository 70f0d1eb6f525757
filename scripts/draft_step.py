"""The int8 draft's one-token step over a cache of about L tokens, its shared-input products fused
(engine/int8.py ``quantize_linears``, the default) against one product per Linear, with the fp32
target's step beside them: interleaved rep by rep (the order rotating), 1 torch thread; prints ms,
the draft/target ratios, the int8 LM head's share of a fused step, and whether the fused and
unfused drafts' logits are bitwise equal.

    python scripts/draft_step.py 1x200,4x200,8x200,32x200     # rows x cached
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from specbatch.config import Settings
from specbatch.engine.cache import BatchCache
from specbatch.engine.int8 import quantize_linears
from specbatch.engine.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", help="comma list of ROWSxCACHED")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    settings = Settings()
    target = load_model("smollm2-135m", cache_dir=settings.cache_dir, linears=settings.linears)
    models = {"target": target}
    for name, fuse in (("unfused", False), ("fused", True)):
        lm = copy.copy(target)
        lm.model = quantize_linears(copy.deepcopy(target.model), fuse=fuse)
        models[name] = lm
    head = models["fused"].model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    for shape in a.shapes.split(","):
        rows, length = (int(x) for x in shape.split("x"))
        prompt = [torch.randint(100, 40000, (length - b % 7,), generator=g).tolist() for b in range(rows)]
        times: dict[str, list[float]] = {k: [] for k in (*models, "head")}
        same = True
        with torch.inference_mode():
            caches = {k: BatchCache(lm, rows) for k, lm in models.items()}
            for c in caches.values():
                c.forward(prompt, logits_to_keep=1)        # ragged: left pads, as a batch's rows
            names = list(models)
            for rep in range(a.reps):
                step = [torch.randint(100, 40000, (1,), generator=g).tolist() for _ in range(rows)]
                logits = {}
                for k in names[rep % 3:] + names[:rep % 3]:
                    t0 = time.perf_counter()
                    logits[k] = caches[k].forward(step, logits_to_keep=1)
                    times[k].append(time.perf_counter() - t0)
                    caches[k].drop_tail([1] * rows)
                same = same and torch.equal(logits["fused"], logits["unfused"])
                h = torch.randn(rows, 1, head.in_features, generator=g)
                t0 = time.perf_counter()
                head(h)
                times["head"].append(time.perf_counter() - t0)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"B={rows} L~{length}: target {ms['target']:.1f} ms, draft unfused {ms['unfused']:.1f} ms "
              f"({ms['unfused'] / ms['target']:.2f} of target), fused {ms['fused']:.1f} ms "
              f"({ms['fused'] / ms['target']:.2f}), fused/unfused {ms['fused'] / ms['unfused']:.2f}, "
              f"int8 head {ms['head']:.1f} ms ({ms['head'] / ms['fused']:.0%} of fused), "
              f"logits bitwise equal: {same}, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
