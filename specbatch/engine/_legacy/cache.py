"""The one place KV caches are rolled back (target and draft models alike)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache


def kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's attention layers (each with ``keys`` / ``values`` of shape (B, H, L, D))."""
    return list(cache.layers)


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
    for layer in kv_layers(cache):
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


class BatchCache:
    """One model's KV cache for a batch of rows that advance by different amounts.

    Columns are shared by all rows; ``valid[b, j]`` says whether column j holds a token of row b.
    Rejected draft tokens and left padding are invalid columns ("holes") that attention never
    sees; each row's position ids count only its valid tokens, so holes do not shift positions.
    Tail columns invalid for every row are cropped, and ``compact`` squeezes the holes out when
    they grow. Pad queries attend only to themselves so no attention row is empty.
    """

    def __init__(self, model, n_rows: int = 0) -> None:  # model: LoadedModel
        self.model = model
        self.cache = DynamicCache()
        self.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=model.device)
        self.n_valid = torch.zeros(n_rows, dtype=torch.long, device=model.device)

    @property
    def n_rows(self) -> int:
        return int(self.valid.shape[0])

    def forward(self, feeds: list[list[int]], logits_to_keep: int) -> torch.Tensor:
        """Append each row's tokens (left-padded to a common width); returns logits (B, keep, V)."""
        dev = self.model.device
        width = max(len(f) for f in feeds)
        n_cols = self.valid.shape[1]
        pad = torch.tensor([width - len(f) for f in feeds], device=dev)
        inp = torch.tensor([[0] * (width - len(f)) + f for f in feeds], dtype=torch.long, device=dev)
        cols = torch.arange(width, device=dev)
        new_valid = cols[None, :] >= pad[:, None]                                   # (B, W)
        pos = (self.n_valid[:, None] + cols[None, :] - pad[:, None]).clamp(min=0)   # (B, W)
        keys_valid = torch.cat([self.valid, new_valid], dim=1)                      # (B, L + W)
        causal = torch.arange(n_cols + width, device=dev)[None, :] <= (n_cols + cols)[:, None]
        allowed = keys_valid[:, None, :] & causal[None]                             # (B, W, L + W)
        allowed[:, cols, n_cols + cols] = True                                      # pads see themselves
        dtype = self.model.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        out = self.model.forward(inp, self.cache, attention_mask=mask[:, None], position_ids=pos,
                                 logits_to_keep=logits_to_keep)
        self.valid = keys_valid
        self.n_valid = self.n_valid + new_valid.sum(dim=1)
        return out.logits

    def drop_tail(self, n_drop: list[int]) -> None:
        """Row b's last n_drop[b] valid tokens were rejected: make them holes, crop common tail."""
        for b, n in enumerate(n_drop):
            if n:
                idx = torch.nonzero(self.valid[b]).flatten()[-n:]
                self.valid[b, idx] = False
        self.n_valid = self.valid.sum(dim=1)
        any_valid = torch.nonzero(self.valid.any(dim=0)).flatten()
        keep = int(any_valid[-1]) + 1 if any_valid.numel() else 0
        if keep < self.valid.shape[1]:
            rollback(self.cache, keep)
            self.valid = self.valid[:, :keep]

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        if cache_length(self.cache):
            self.cache.batch_select_indices(idx)
        self.valid, self.n_valid = self.valid[idx], self.n_valid[idx]

    def extend(self, other: BatchCache) -> None:
        """Append other's rows (new requests joining), left-padding the shorter cache."""
        if self.n_rows == 0:
            self.cache, self.valid, self.n_valid = other.cache, other.valid, other.n_valid
            return
        la, lb = self.valid.shape[1], other.valid.shape[1]
        width = max(la, lb)
        for mine, theirs in zip(kv_layers(self.cache), kv_layers(other.cache)):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.valid = torch.cat([_left_pad_mask(self.valid, width), _left_pad_mask(other.valid, width)])
        self.n_valid = torch.cat([self.n_valid, other.n_valid])

    def holes(self) -> float:
        total = self.valid.numel()
        return 1.0 - float(self.valid.sum()) / total if total else 0.0

    def compact(self) -> None:
        """Squeeze holes out: each row's valid columns, left-padded to the longest row."""
        width = int(self.n_valid.max()) if self.n_rows else 0
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:] if width else None
        if order is None:
            return
        for layer in kv_layers(self.cache):
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx.to(layer.keys.device))
            layer.values = layer.values.gather(2, idx.to(layer.values.device))
        self.valid = self.valid.gather(1, order)


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, width, D) with zeros on the left."""
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))


def _left_pad_mask(valid: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(valid, (width - valid.shape[1], 0), value=False)
