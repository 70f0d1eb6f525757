"""A row's logits for 5 tokens fed one step at a time against the same 5 fed as one block (a
speculative verify) over the same cached columns: bitwise equal or not, per prompt length.

    OMP_NUM_THREADS=1 python scripts/block_vs_steps.py                 # the default target
    OMP_NUM_THREADS=1 python scripts/block_vs_steps.py --model PATH     # any model load_model takes
    OMP_NUM_THREADS=1 python scripts/block_vs_steps.py --lengths 180:1100:23   # past 192 cached columns

docs/DESIGN.md ("Query blocks of 1-3 rows") has what it printed and why some lengths differ.
"""

from __future__ import annotations

import argparse

import torch

from specbatch.config import Settings
from specbatch.engine.cache import BatchCache
from specbatch.engine.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--lengths", default="2:80:3", help="prompt lengths START:STOP:STEP (a Python range)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    settings = Settings()
    lm = load_model(a.model, cache_dir=settings.cache_dir, linears=settings.linears)
    g = torch.Generator().manual_seed(0)
    equal, differ = [], []
    with torch.inference_mode():
        for length in range(*(int(x) for x in a.lengths.split(":"))):
            prompt = torch.randint(3, lm.vocab_size, (length,), generator=g).tolist()
            toks = torch.randint(3, lm.vocab_size, (a.tokens,), generator=g).tolist()
            steps = BatchCache(lm, 1)
            steps.forward([prompt], 1)
            one = torch.cat([steps.forward([[x]], 1) for x in toks], dim=1)
            block = BatchCache(lm, 1)
            block.forward([prompt], 1)
            (equal if torch.equal(one, block.forward([toks], a.tokens)) else differ).append(length)
    print(f"bitwise equal at {len(equal)} of {len(equal) + len(differ)} prompt lengths; differ at {differ}")


if __name__ == "__main__":
    main()
