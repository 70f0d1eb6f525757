"""Attention over grouped key/value heads without copying the cache to every query head.

transformers' SDPA integration (``integrations/sdpa_attention.py``) folds a one-token query's heads
onto the key/value heads (``pack_gqa``), but for several query tokens under a mask (on CPU: a
speculative verify, a draft's catch-up, a padded prefill) and for every call under dynamo it
expands each layer's keys and values to all query heads (``repeat_kv``) first. For the default
target (9 query heads on 3 key/value heads) at 32 rows, 200 cached tokens and 5 tokens a row that
copy is most of the attention: 12 ms a layer against 1.2 ms folded (docs/DESIGN.md, "Attention
folds the query heads").

Folding generalizes ``pack_gqa``: query head h reads key/value head h // groups, so the queries
of one group become ``groups * T`` rows over that group's keys, and the mask is repeated per
group (``groups * T * L`` entries, small beside the keys and values). Each query row is the
same arithmetic over the same keys as under ``repeat_kv``: bitwise-equal outputs at one token
and at three or more (at two, ``repeat_kv``'s 2-row products take another CPU kernel than the
folded 2 x groups rows: equal to the last bit or so), and a row's output equals the same query
sent alone over the same columns, which ``repeat_kv`` does not always give
(tests/engine/test_attention.py).

On some CPUs (a 2-core AMD EPYC, stop 44; not stop 43's Xeon) SDPA's own products round a query row
differently in a block of 1-3 rows than in a block of 4 or more: CPU flash attention multiplies
the queries in blocks of 32 rows (64 from 192 rows, 256 from 768) and MKL's ``sgemm`` takes
another kernel for 1-3 rows there. A verify's token then got other numbers than the same token
decoded alone, and a one-token step other numbers than any wider one. Where ``rows_move`` finds
that, the queries are padded with rows of zeros (seeing every column, so no row is empty) until
no block has 1-3 rows, and the padding is dropped from the output: a row's numbers then no
longer depend on how many rows share its call. Unmasked calls (a causal prefill) are
transformers' own, unpadded.

The same kernels round a score by where its key column sits, too: ``sgemm``'s last few output
columns (key lengths 1-3 mod 4 below 16, 13-15 mod 16 above) take another kernel, and the sum
over keys of 193-383 columns (CPU flash attention's blocks hold 512) is split at a point that
moves with the length. A decode step over n columns then rounded unlike the same token in a
verify over n + 4 columns (the later ones masked). Where ``columns_move`` finds that, keys and
values are widened to ``_aligned`` columns, masked: a length whose kernels and split points are
the same as every other such length's (scripts/kv_tail_probe.py: a step row equal to its verify
row bitwise at 1099 of 1099 prompt lengths, 504 without). On the decode path the wider keys are a
view over the cache buffer's spare columns (``hf_cache.GrowingLayer`` keeps them finite), so
nothing is copied there; a tensor whose storage ends sooner gets zero columns copied on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "specbatch_sdpa"


def folded_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, T, D), key and value (B, Hk, L, D),
    ``attention_mask`` (B or 1, 1, T, L) additive or boolean; returns ((B, T, Hq, D), None).

    Folds the query heads where there are several per key/value head and a mask says what each
    token sees; anything else (no mask: a causal prefill that SDPA's ``is_causal`` serves; a
    per-head mask, a position bias, dropout) is transformers' own SDPA path."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    pad_rows = query.device.type == "cpu" and rows_move()
    pad_cols = query.device.type == "cpu" and columns_move()
    one_token = attention_mask is None and query.shape[2] == 1 and (pad_rows or pad_cols)
    if ((groups == 1 and not (pad_rows or pad_cols)) or (attention_mask is None and not one_token)
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))
            or dropout or any(kwargs.get(k) for k in ("position_bias", "softcap", "output_attentions"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    b, heads, t, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.reshape(b, kv_heads, groups * t, query.shape[-1])             # head h -> group h // groups
    pad = _pad_rows(groups * t) if pad_rows else 0
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    # not under dynamo: the widening's length arithmetic made inductor's lowering fail there ("Exponent
    # must be non-negative"), so the compiled forward fell back to eager wherever ``columns_move``;
    # and a compiled step and verify run different graphs (their own fusions and GEMM blocking), so
    # the bits it keeps alike in eager are not alike compiled anyway (docs/COMPILE.md, exactness)
    cols = _aligned(length) - length if pad_cols and not torch.compiler.is_compiling() else 0
    if cols:
        key, value = _wider(key, cols), _wider(value, cols)
    mask = _folded_mask(attention_mask, b, groups, t, length, pad, cols, q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    if pad:
        out = out[:, :, : groups * t]
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2).contiguous(), None


# the last folded mask made on this thread, with what it was made from: every layer of a forward
# gets the same mask (transformers' and the flat forward alike) and would fold it again, ~50 us a
# layer at 16 rows (decode lanes, engine/lanes.py, call one model on several threads at once)
_held = threading.local()


def _no_mask() -> None:
    """What a one-token step's held mask was made from (None: it sees every column)."""
    return None


def _folded_mask(attention_mask: torch.Tensor | None, b: int, groups: int, t: int, length: int, pad: int,
                 cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (rows, 1, groups * t + pad, length + cols) of ``attention_mask`` (rows or 1,
    1, t, length; None: a one-token step that sees every column) for the folded queries: repeated
    per group, ``pad`` query rows added and ``cols`` hidden key columns. A boolean mask is made
    additive in ``dtype`` here (0 or -inf: SDPA's own conversion), once, not in every layer's SDPA call. Held
    for the next call with the same mask while that mask lives: a weak reference, whose referent
    cannot be freed and its identity reused unseen, and which lets the folded mask go with it (a
    long padded prefill's stayed held until the thread's next forward)."""
    key = (b, groups, t, length, pad, cols, dtype)
    held = None if torch.compiler.is_compiling() else getattr(_held, "last", None)
    # (a mask is alive here, so where the reference is to it, it has not emptied the pair)
    if held is not None and (held[0] is _no_mask if attention_mask is None else held[0]() is attention_mask) \
            and held[1][0] == key:
        return held[1][1]
    # a one-token step sees every column: spelled as a mask, so that it is padded like the verify
    # block the same token would otherwise be scored in
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool) if attention_mask is None else attention_mask   # (CPU only)
    rows = mask.shape[0]
    mask = mask[:, :, None].expand(rows, 1, groups, t, length).reshape(rows, 1, groups * t, length)
    if pad:
        mask = torch.nn.functional.pad(mask, (0, 0, 0, pad), value=False if mask.dtype == torch.bool else 0.0)
    if cols:
        mask = torch.nn.functional.pad(mask, (0, cols), value=False if mask.dtype == torch.bool else float("-inf"))
    if mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))   # SDPA's own conversion
    if not torch.compiler.is_compiling():
        pair = [key, mask]      # emptied when the mask it came from is freed (no cycle: it holds no reference)
        _held.last = (_no_mask if attention_mask is None else weakref.ref(attention_mask, lambda _: pair.clear()), pair)
    return mask


def _pad_rows(rows: int) -> int:
    """Rows of zeros to add so that no block of CPU flash attention's query blocks (32 rows, or 64
    or 256 for long queries: multiples of 32) has 1-3 rows."""
    tail = rows % 32
    return 4 - tail if tail in (1, 2, 3) else 0


def _aligned(n: int) -> int:
    """Key columns to give SDPA for ``n`` real ones: the next multiple of 16, and a last block of
    512 columns (CPU flash attention's) of at most 192 or at least ``long_tail()``: past 192
    columns sgemm splits the sum over keys at points that move with the length below that floor,
    and sit still from it on, as below 193 where it does not split. The real columns' numbers are
    then the same whatever the length (scripts/kv_tail_probe.py)."""
    base, tail = n // 512 * 512, -(-(n % 512) // 16) * 16
    return base + (tail if tail <= 192 else max(tail, long_tail()))


_long_tail: int | None = None   # long_tail's answer, once known (a plain global, as _columns_move)


def long_tail() -> int:
    """The shortest last block past 192 columns from which this CPU's SDPA sums the keys at fixed
    points: 384 where lengths of 384 and more round a row alike (the AMD EPYC hosts of
    docs/DESIGN.md), else a whole block, 512 (an Intel Xeon with AMX: there the split moves up to
    496 columns, so 384 and 400 columns give a row over 381 real keys other numbers). A check,
    once per process, as ``columns_move``."""
    global _long_tail
    if _long_tail is None:
        sdpa = _keys_probe(15, 1024)
        _long_tail = 384 if all(torch.equal(sdpa(real, 384), sdpa(real, length))
                                for real in (200, 300, 381) for length in (400, 448, 496, 512, 1024)) else 512
    return _long_tail


def _keys_probe(rows: int, keys: int) -> Callable[[int, int], torch.Tensor]:
    """SDPA of ``rows`` seeded random query rows over the first ``length`` of ``keys`` random key
    columns, the first ``real`` of them seen: what the start-up checks ask of a key length."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 64, generator=gen) for n in (rows, keys, keys))

    def sdpa(real: int, length: int) -> torch.Tensor:
        seen = (torch.arange(length) < real).expand(1, 1, rows, length)
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k[:, :, :length], v[:, :, :length], attn_mask=seen)
    return sdpa


def _wider(t: torch.Tensor, cols: int) -> torch.Tensor:
    size = (t.shape[0], t.shape[1], t.shape[2] + cols, t.shape[3])
    if t.stride(3) == 1 and t.stride(2) == t.shape[3]:
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(size, t.stride()))
        if last < t.untyped_storage().nbytes() // t.element_size():
            return t.as_strided(size, t.stride(), t.storage_offset())
    return torch.nn.functional.pad(t, (0, 0, 0, cols))


_columns_move: bool | None = None   # columns_move's answer, once known (a plain global, as _rows_move)


def columns_move() -> bool:
    """Whether this CPU's SDPA gives a query row other numbers over the same real key columns when
    masked columns follow them (the key length alone changed: ``sgemm``'s column tails, the split
    of the sum over keys past 192 columns). A check at model load, as ``rows_move``."""
    global _columns_move
    if _columns_move is None:
        sdpa = _keys_probe(8, 420)
        _columns_move = any(not torch.equal(sdpa(real, real), sdpa(real, length))
                            for real, length in ((5, 16), (14, 16), (29, 32), (150, 208), (150, 240), (300, 400)))
    return _columns_move


_rows_move: bool | None = None     # rows_move's answer, once known (a plain global: dynamo reads it as a constant)


def rows_move() -> bool:
    """Whether this CPU's SDPA gives a query row other numbers in a block of 1-3 rows than in a
    wider one (fixed by a check, not by timing, so that every process on the machine agrees).
    Answered when a model is routed here (``use_folded_attention``), before any graph is traced."""
    global _rows_move
    if _rows_move is None:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, 64, generator=gen) for n in (40, 200, 200))
        mask = torch.zeros(1, 1, 40, 200)
        with torch.inference_mode():
            whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            _rows_move = any(not torch.equal(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, :n], k, v, attn_mask=mask[:, :, :n]), whole[:, :, :n]) for n in (1, 2, 3, 33, 35))
    return _rows_move


def use_folded_attention(model: Any) -> None:
    """Route a transformers model's SDPA attention through ``folded_sdpa`` (masks built as for SDPA).
    Models on another attention implementation (eager, flash) are left as they are."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    rows_move()
    if columns_move():
        long_tail()
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, folded_sdpa)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
