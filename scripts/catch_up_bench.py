"""Time a draft's catch-up on ragged backlogs: one forward padded to the longest (main's) against
runs of similar length (ModelDrafter._catch_up), interleaved A B B A in one process.

    OMP_NUM_THREADS=1 python scripts/catch_up_bench.py [rows] [longest] [repeats] [draft]

The backlogs are what speculation turning on over plainly decoded rows feeds the draft: each
row's whole context (23 rows up to 144 tokens on the default job). It also counts the rows whose
first draft token differs: none for a float draft; 17-21 for the int8 one while it took one
activation scale over every row and pad of the forward (torch.ao dynamic quantization), 3 since
it scales each row (engine/int8.py; the fp32 attention's last bits can still flip a rounding).
"""

from __future__ import annotations

import random
import sys
import time

import torch

from specbatch.config import get_settings
from specbatch.engine.drafters import ModelDrafter
from specbatch.engine.loading import load_model


def main() -> None:
    args = sys.argv[1:] + ["23", "144", "3", "smollm2-135m-int8"][len(sys.argv) - 1:]
    rows, longest, repeats = (int(a) for a in args[:3])
    torch.set_num_threads(1)
    draft = load_model(args[3], cache_dir=get_settings().cache_dir, linears=get_settings().linears)
    rng = random.Random(0)
    feeds = [[rng.randrange(1000, 20000) for _ in range(rng.randint(8, longest))] for _ in range(rows)]
    feeds[0] = feeds[0][:1] + [rng.randrange(1000, 20000) for _ in range(longest - 1)]   # (the longest)

    def run(padded: bool) -> tuple[float, list[int]]:
        d = ModelDrafter(draft, draft.vocab_size)
        d.admit([], prefill=False)
        d.cache.extend(type(d.cache)(draft, rows))
        t0 = time.perf_counter()
        last = d.cache.forward(feeds, logits_to_keep=1)[:, -1] if padded else d._catch_up(feeds)
        return time.perf_counter() - t0, last.argmax(-1).tolist()

    lengths = sorted(len(f) for f in feeds)
    print(f"{args[3]}: {rows} rows, backlogs {lengths[0]}-{lengths[-1]} (sum {sum(lengths)}, padded {rows * lengths[-1]})")
    times: dict[bool, list[float]] = {True: [], False: []}
    firsts: dict[bool, list[int]] = {}
    with torch.inference_mode():
        run(True)   # (warm-up)
        for _ in range(repeats):
            for padded in (True, False, False, True):
                s, firsts[padded] = run(padded)
                times[padded].append(s)
    differ = sum(x != y for x, y in zip(firsts[True], firsts[False]))
    a, b = sum(times[True]) / len(times[True]), sum(times[False]) / len(times[False])
    print("padded (main):", " ".join(f"{s:.3f}" for s in times[True]))
    print("runs (branch):", " ".join(f"{s:.3f}" for s in times[False]))
    print(f"mean {a:.3f} s vs {b:.3f} s: {a / b:.2f}x; first draft token differs on {differ} rows")


if __name__ == "__main__":
    main()
