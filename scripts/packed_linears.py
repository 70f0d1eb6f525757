"""Per Linear of the default target's shapes: ``F.linear`` against the products over each kernel's
packed weight (engine/packed.py: oneDNN, MKL), interleaved call by call in one process; and whether
each row's output stays bitwise the same at every row count (batch invariance), for each.

    python scripts/packed_linears.py --rows 1,2,4,8,16,32,64 --threads 1

Prints one line per (shape, rows): us for each way and its speed-up over ``F.linear``, then per shape
and way the row counts (of 1..--max-rows) at which a row's output differs from its output in the
largest batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specbatch.engine.packed import KERNELS

# the default target's (SmolLM2-135M) Linears: K -> N
SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192), "gate/up 576->1536": (576, 1536),
          "down 1536->576": (1536, 576), "head 576->49152": (576, 49152)}


def shape(name: str, w: torch.Tensor, rows_list: list[int], reps: int, max_rows: int,
          g: torch.Generator) -> None:
    """One Linear's weight (N, K): timings per row count, then batch invariance of each product."""
    k = w.shape[1]
    ways: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [("F.linear", lambda x: F.linear(x, w))]
    for kern in KERNELS:
        if kern.available():
            p = kern.pack(w)
            ways.append((kern.name, lambda x, kern=kern, p=p: kern.product(x, p, w, None)))
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g)
        t: dict[str, list[float]] = {label: [] for label, _ in ways}
        for rep in range(reps + 3):
            for label, f in ways if rep % 2 == 0 else ways[::-1]:
                t0 = time.perf_counter()
                f(x)
                if rep >= 3:          # (warm-up)
                    t[label].append(time.perf_counter() - t0)
        us = {label: statistics.median(v) * 1e6 for label, v in t.items()}
        cols = "  ".join(f"{label} {us[label]:7.0f} us ({us['F.linear'] / us[label]:.2f}x)" for label, _ in ways)
        print(f"{name:18s} rows {rows:3d}: {cols}  load {os.getloadavg()[0]:.1f}", flush=True)
    x = torch.randn(max_rows, k, generator=g)
    for label, f in ways:
        whole = f(x)
        moved = [m for m in range(1, max_rows) if not torch.equal(f(x[:m].contiguous()), whole[:m])]
        print(f"{name:18s} {label}: rows whose output differs from the {max_rows}-row batch's at row counts "
              f"{moved or 'none'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--max-rows", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    for name, (k, n) in SHAPES.items():
        reps = max(3, a.reps // 10) if n > 10000 else a.reps
        shape(name, torch.randn(n, k, generator=g), [int(r) for r in a.rows.split(",")], reps, a.max_rows, g)


if __name__ == "__main__":
    main()
