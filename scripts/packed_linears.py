"""Per Linear of the default target's shapes: ``F.linear`` against the products over each kernel's
packed weight (engine/packed.py: oneDNN, MKL), interleaved call by call in one process; and whether
each row's output stays bitwise the same at every row count (batch invariance), for each.

    python scripts/packed_linears.py --rows 1,2,4,8,16,32,64 --threads 1

Prints one line per (shape, rows): us for each way and its speed-up over ``F.linear``, then per shape
and way the row counts (of 1..--max-rows) at which a row's output differs from its output in the
largest batch. Each shape's one weight is multiplied again and again, so it is read from the
caches.

    python scripts/packed_linears.py --layers 30 --rows 4,16,32 --threads 2

``--layers N``: instead, N layers' distinct weights (q, k, v, o, gate, up, down each) multiplied in a
forward's order, as a decode step reads them: from memory, once each (the default target's 30 layers
are 425 MB of float32). The weights are Q4_1 values, as the default target's (engine/blocks.py), so
more ways multiply by their blocks where this CPU builds that product, at each vector width it has
(``blocks512``, ``blocks256``). Prints ms for the N
layers per way and the float32 weight bytes a second that makes: the products' distance from the
machine's read bandwidth (scripts/forward_floor.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specbatch.engine import blocks
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


def layers(n_layers: int, rows_list: list[int], reps: int, g: torch.Generator) -> None:
    """A forward's Linears over ``n_layers`` layers' distinct weights, each way interleaved rep by rep."""
    order = ("q/o 576->576", "k/v 576->192", "k/v 576->192", "q/o 576->576", "gate/up 576->1536",
             "gate/up 576->1536", "down 1536->576")
    weights = [[blocks.q4_1(torch.randn(SHAPES[s][1], SHAPES[s][0], generator=g) * 0.02) for s in order]
               for _ in range(n_layers)]
    nbytes = 4 * sum(w.numel() for layer in weights for w in layer)
    ways: dict[str, Callable[[torch.Tensor, int, int], torch.Tensor]] = {
        "F.linear": lambda x, i, j: F.linear(x, weights[i][j])}
    for kern in KERNELS:
        if kern.available():
            packed = [[kern.pack(w) for w in layer] for layer in weights]
            ways[kern.name] = lambda x, i, j, kern=kern, packed=packed: kern.product(x, packed[i][j], weights[i][j], None)
    if blocks.unavailable() is None:
        split = [[blocks.split(w) for w in layer] for layer in weights]
        for isa in blocks.isas():      # the widest first; AVX2's too on an AVX-512 CPU (an AVX2-only CPU's way)
            ways[f"blocks{isa}"] = lambda x, i, j, isa=isa: blocks.product(x, split[i][j], isa=isa)  # type: ignore[arg-type]
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
        t: dict[str, list[float]] = {label: [] for label in ways}
        for rep in range(reps + 2):
            for label, f in ways.items() if rep % 2 == 0 else reversed(ways.items()):
                t0 = time.perf_counter()
                for i, layer in enumerate(weights):
                    for j, w in enumerate(layer):
                        f(xs[w.shape[1]], i, j)
                if rep >= 2:
                    t[label].append(time.perf_counter() - t0)
        ms = {label: statistics.median(v) * 1e3 for label, v in t.items()}
        cols = "  ".join(f"{label} {ms[label]:6.1f} ms ({nbytes / ms[label] / 1e6:4.1f} GB/s)" for label in ways)
        print(f"{n_layers} layers ({nbytes / 1e6:.0f} MB) rows {rows:3d}: {cols}  load {os.getloadavg()[0]:.1f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=0, help="N layers' distinct weights in a forward's order")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    if a.layers:
        layers(a.layers, [int(r) for r in a.rows.split(",")], max(3, a.reps // 5), g)
        return
    for name, (k, n) in SHAPES.items():
        reps = max(3, a.reps // 10) if n > 10000 else a.reps
        shape(name, torch.randn(n, k, generator=g), [int(r) for r in a.rows.split(",")], reps, a.max_rows, g)


if __name__ == "__main__":
    main()
