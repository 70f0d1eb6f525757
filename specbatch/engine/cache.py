"""The one place KV caches are rolled back (target and draft models alike)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def rollback(cache: DynamicCache, n_keep: int, extra: Sequence[int] = ()) -> None:
    """Keep cache positions [0, n_keep) followed by the absolute positions ``extra`` (in order).

    ``extra`` selects the accepted path of a token tree; for a chain it is contiguous with
    ``n_keep`` and this is a plain crop. Rows of the batch are rolled back alike.
    """
    length = cache_length(cache)
    if extra and list(extra) == list(range(n_keep, n_keep + len(extra))):
        n_keep, extra = n_keep + len(extra), ()
    if not extra:
        if n_keep < length:
            cache.crop(n_keep - length)
        return
    index = torch.tensor(list(range(n_keep)) + list(extra), dtype=torch.long)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
