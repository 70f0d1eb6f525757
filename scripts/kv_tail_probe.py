"""Does giving CPU SDPA keys/values padded to a multiple of 16 columns (the padding masked out)
make a token's attention independent of the key length, as a speculative verify needs?

    OMP_NUM_THREADS=1 python scripts/kv_tail_probe.py

The default target's attention shapes through ``folded_sdpa`` (9 query heads folded on 3 key/value
heads, head dim 64, fp32, query rows padded where ``rows_move``). For prompt lengths L0 (as
scripts/block_vs_steps.py: 2-77 in steps of 3, and 2-200 in steps of 1 for a wider count), 5 tokens:

- block: the 5 tokens as one query over L0 + 5 columns, causal mask (a verify);
- steps: token i alone over its own L0 + i + 1 columns (a decode step).

Printed per variant, at how many prompt lengths all 5 step rows equal their block rows bitwise:
``plain`` (no key padding, today's code), ``pad16`` (each call's keys padded with zero columns to
its own next multiple of 16, masked). And (a): whether the block's real rows are bitwise the same
when its keys are padded to the next multiple of 16, +16 and +32 columns.
docs/DESIGN.md ("Query blocks of 1-3 rows") has what it printed.
"""

from __future__ import annotations

import torch

from specbatch.engine.attention import folded_sdpa, rows_move


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def pad_keys(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, to: int):
    """Keys/values with zero columns up to ``to``, masked out (boolean mask)."""
    extra = to - key.shape[2]
    if extra <= 0:
        return key, value, mask
    key = torch.nn.functional.pad(key, (0, 0, 0, extra))
    value = torch.nn.functional.pad(value, (0, 0, 0, extra))
    return key, value, torch.nn.functional.pad(mask, (0, extra), value=False)


def up16(n: int) -> int:
    return -(-n // 16) * 16


def aligned(n: int) -> int:
    """``up16``, and a last block of CPU flash attention's 512 key columns that is not 193-383
    columns long (there sgemm splits the sum over keys at a point that moves with the length)."""
    base, tail = n // 512 * 512, up16(n % 512)
    return base + (tail if tail <= 192 else max(tail, 384))


def run(l0: int, tokens: int, gen: torch.Generator, align) -> tuple[bool, bool]:
    """(every step row == its block row, block real rows equal at +0/+16/+32 padding)."""
    m = _Attn()
    length = l0 + tokens
    q = torch.randn(1, 9, tokens, 64, generator=gen)
    k = torch.randn(1, 3, length, 64, generator=gen)
    v = torch.randn(1, 3, length, 64, generator=gen)
    causal = torch.ones(tokens, length, dtype=torch.bool).tril(l0)[None, None]

    def call(qq, kk, vv, mm, extra=0):
        if align is not None:
            kk, vv, mm = pad_keys(kk, vv, mm, align(kk.shape[2] + extra))
        return folded_sdpa(m, qq, kk, vv, mm, scaling=0.125)[0]

    block = call(q, k, v, causal)
    steps_equal = True
    for i in range(tokens):
        n = l0 + i + 1
        step = call(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], torch.ones(1, 1, 1, n, dtype=torch.bool))
        steps_equal &= torch.equal(step, block[:, i:i + 1])
    same_pad = align is None or all(torch.equal(call(q, k, v, causal, extra), block) for extra in (16, 32, 200))
    return steps_equal, same_pad


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads 1, rows_move() = {rows_move()}")
    with torch.inference_mode():
        for name, lengths in (("2-77 step 3", range(2, 80, 3)), ("2-1100 step 1", range(2, 1101))):
            for variant, align in (("plain", None), ("pad16", up16), ("aligned", aligned)):
                gen = torch.Generator().manual_seed(0)
                eq, differ, pad_bad = 0, [], []
                for l0 in lengths:
                    same, padded_same = run(l0, 5, gen, align)
                    eq += same
                    if not same:
                        differ.append(l0)
                    if not padded_same:
                        pad_bad.append(l0)
                line = f"{name:>12} {variant}: steps == block at {eq} of {len(lengths)}"
                if differ:
                    line += f"; differ at {differ[:20]}{' ...' if len(differ) > 20 else ''}"
                if align is not None:
                    line += f"; (a) padding for +16/+32/+200 columns changes real rows at {len(pad_bad)} lengths {pad_bad[:10]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
