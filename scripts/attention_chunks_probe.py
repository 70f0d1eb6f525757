"""What widening the keys costs a decode step's attention, and a lead for avoiding it.

Where ``attention.columns_move()`` holds, ``attention._aligned`` widens a call's keys past 192
columns to ``long_tail()`` (masked), so that a row's numbers do not move with the key length. On a
host whose ``long_tail()`` is 512, a cache of 200 columns is attended as 512. This probe times, at
the default target's decode shape (B rows, 3 key/value heads, 3 folded query heads padded to 4,
head dim 64, 1 torch thread): SDPA over the widened keys (today), over the real ones (not
invariant), and over fixed 192-column chunks of the keys (each no wider than SDPA's unsplit range,
its tail aligned to 16), merged by their log-sum-exps; and whether the chunked numbers of a row's
real columns stay bitwise the same when masked columns follow them (the property widening buys).

    OMP_NUM_THREADS=1 python scripts/attention_chunks_probe.py [rows]
"""

from __future__ import annotations

import sys
import time

import torch

from specbatch.engine import attention

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CHUNK = 192


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, real: int) -> torch.Tensor:
    outs, lses = [], []
    for s in range(0, real, CHUNK):
        w = -(-(min(s + CHUNK, real) - s) // 16) * 16
        o, lse = OP(q, k[:, :, s:s + w], v[:, :, s:s + w], attn_mask=mask[..., s:s + w])
        # a chunk none of whose columns a row may see (a verify's later columns) must add nothing:
        # SDPA gives such a row a finite log-sum-exp, not -inf, so the mask says which rows
        seen = (mask[..., s:s + w] > float("-inf")).any(-1)          # (B, 1, T)
        outs.append(torch.where(seen.unsqueeze(-1), o, 0.0))
        lses.append(torch.where(seen, lse, float("-inf")))
    stacked = torch.stack(lses)
    weights = (stacked - stacked.amax(0)).exp()     # exp(-inf) = 0 for such a chunk
    out = outs[0] * weights[0].unsqueeze(-1)
    for o, w_ in zip(outs[1:], weights[1:]):
        out = out + o * w_.unsqueeze(-1)
    return out / weights.sum(0).unsqueeze(-1)


def timed(f, repeats: int = 100) -> float:
    with torch.inference_mode():
        for _ in range(10):
            f()
        t = time.perf_counter()
        for _ in range(repeats):
            f()
    return (time.perf_counter() - t) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(1)
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    print(f"columns_move {attention.columns_move()}, long_tail {attention.long_tail()}, rows {rows}, 1 thread")
    gen = torch.Generator().manual_seed(0)
    width = 1024
    q = torch.randn(rows, 3, 4, 64, generator=gen)
    k, v = (torch.randn(rows, 3, width, 64, generator=gen) for _ in range(2))
    print("| real columns | widened to | widened, us/layer | real only | chunked | widened / chunked | widened invariant | chunked invariant |")
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for real in (160, 200, 250, 300, 400, 600):
        wide = attention._aligned(real)
        mask = torch.zeros(rows, 1, 4, width)
        mask[..., real:] = float("-inf")
        # (timed at once, this iteration's values: default arguments bind them for ruff's B023)
        t_wide = timed(lambda m=mask, w=wide: OP(q, k[:, :, :w], v[:, :, :w], attn_mask=m[..., :w]))
        t_real = timed(lambda m=mask, r=real: OP(q, k[:, :, :r], v[:, :, :r], attn_mask=m[..., :r]))
        t_chunk = timed(lambda m=mask, r=real: chunked(q, k, v, m, r))
        with torch.inference_mode():   # the same real columns, then 4 and 40 masked ones after them
            base = chunked(q, k, v, mask, real)
            same = all(torch.equal(base, chunked(q, k, v, mask, real + extra)) for extra in (4, 40))
            now = OP(q, k[:, :, :wide], v[:, :, :wide], attn_mask=mask[..., :wide])[0]
            held = all(torch.equal(now, OP(q, k[:, :, :w], v[:, :, :w], attn_mask=mask[..., :w])[0])
                       for w in (attention._aligned(real + extra) for extra in (4, 40)))
        print(f"| {real} | {wide} | {t_wide:.0f} | {t_real:.0f} | {t_chunk:.0f} | {t_wide / t_chunk:.2f} | {held} | {same} |")


if __name__ == "__main__":
    main()
