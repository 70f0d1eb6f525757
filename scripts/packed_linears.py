"""Per Linear of the default target's shapes: ``F.linear`` against the same product over MKL's packed
weight (engine/packed.py), interleaved call by call in one process; and whether each row's output
stays bitwise the same at every row count (batch invariance), for both.

    python scripts/packed_linears.py --rows 1,2,4,8,16,32,64 --threads 1

Prints one line per (shape, rows): us for each, the ratio, whether packed equals ``F.linear`` bit for
bit, then per shape the row counts (of 1..--max-rows) at which a row's output differs from its
output in the largest batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from specbatch.engine.packed import PACK_ROWS

# the default target's (SmolLM2-135M) Linears: K -> N
SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192), "gate/up 576->1536": (576, 1536),
          "down 1536->576": (1536, 576), "head 576->49152": (576, 49152)}


def shape(name: str, w: torch.Tensor, rows_list: list[int], reps: int, max_rows: int,
          g: torch.Generator) -> None:
    """One Linear's weight (N, K): timings per row count, then batch invariance of both products."""
    k = w.shape[1]
    p = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def packed(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0])

    ways = (("F.linear", plain), ("packed", packed))
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g)
        t: dict[str, list[float]] = {"F.linear": [], "packed": []}
        for rep in range(reps + 3):
            for label, f in ways if rep % 2 == 0 else ways[::-1]:
                t0 = time.perf_counter()
                f(x)
                if rep >= 3:          # (warm-up)
                    t[label].append(time.perf_counter() - t0)
        us = {label: statistics.median(v) * 1e6 for label, v in t.items()}
        print(f"{name:18s} rows {rows:3d}: F.linear {us['F.linear']:8.0f} us  packed {us['packed']:8.0f} us  "
              f"ratio {us['F.linear'] / us['packed']:.2f}x  bitwise equal: {torch.equal(plain(x), packed(x))}  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
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
