"""The one adapter over transformers' KV-cache API: the forward's cache keyword (renamed within
transformers 5.x) and the cache's layers. Everything else reaches a ``DynamicCache`` through here."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` or ``past_key_values``."""
    name = getattr(model, "_specbatch_cache_kwarg", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._specbatch_cache_kwarg = name
    return name


def kv_layers(cache: Cache) -> list[Any]:
    """The cache's attention layers (each with ``keys`` / ``values`` of shape (B, H, L, D))."""
    return list(cache.layers)


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def _in_use(buf: str, used: str) -> Any:
    """A layer's ``keys`` or ``values``: a view of the buffer's rows and columns in use. Assigning a
    whole tensor (transformers' own code, a caller's join) makes it the buffer, with no spare room."""
    def get(layer: Any) -> torch.Tensor | None:
        b = getattr(layer, buf)
        if b is None or b.dim() < 4:
            return b
        rows, cols = getattr(layer, used)
        return b[:rows, :, :cols]

    def put(layer: Any, value: torch.Tensor | None) -> None:
        setattr(layer, buf, value)
        setattr(layer, used, (value.shape[0], value.shape[-2]) if value is not None and value.dim() == 4 else (0, 0))
    return property(get, put)


# rows kept in place while at least this share of the buffer's rows stays in use (a batch shrinking
# for good gives its memory back; one shrinking by a row and refilling copies nothing)
SHRINK = 0.75


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes in place into a buffer with spare rows and columns.

    ``DynamicLayer.update`` concatenates: every step copies the whole cache of every layer, which
    for 32 rows of 300 tokens is a large share of what a decode step moves through memory. Here a step
    writes its own columns only and the buffer grows by a quarter when full (each column is copied
    a few times in all, not once per step). Rows leaving move only the rows that fill their places
    (``batch_select_indices``), and rows joining are written into the rows they left
    (``append_rows``), so a continuous batch copies what changes, not the whole cache. Readers see
    ``keys`` / ``values`` as views of the rows and columns in use: the same values in the same
    order, so attention computes the same sums.
    """

    # (rows, columns) in use, kept apart for keys and values: callers replace the two one after the other
    _uk = _uv = (0, 0)
    _k: torch.Tensor | None
    _v: torch.Tensor | None
    keys = _in_use("_k", "_uk")       # type: ignore[assignment]
    values = _in_use("_v", "_uv")     # type: ignore[assignment]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, new = key_states.shape[0], key_states.shape[-2]
        (r, n) = self._uk
        assert self._k is not None and self._v is not None and self._uv == self._uk, "initialized above"
        if not n:
            r = rows
        assert r == rows, "a forward feeds every row of the cache"
        if self._k.dim() < 4 or rows > self._k.shape[0] or n + new > self._k.shape[-2]:
            self._k, self._v = _regrow(self._k, key_states, rows, n, n + new), _regrow(self._v, value_states, rows, n, n + new)
        self._k[:rows, :, n: n + new] = key_states
        self._v[:rows, :, n: n + new] = value_states
        self._uk = self._uv = (rows, n + new)
        return self._k[:rows, :, : n + new], self._v[:rows, :, : n + new]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            rows, n = self._uk
            self._uk = self._uv = (rows, max(0, n + tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Row i becomes old row ``indices[i]``. Where no row is read after it was overwritten
        (rows leaving: the rows kept in order, or the last rows moved into the places of those
        that left) only the moved rows are copied, within the buffer; else (a row repeated for
        ``n`` samples), or once fewer than ``SHRINK`` of the buffer's rows stay (its memory is
        given back), the rows are gathered into a new buffer."""
        if not self.get_seq_length():
            return
        assert self._k is not None and self._v is not None
        rows, n = self._uk
        order = indices.tolist()
        if moves_in_place(order, rows) and len(order) >= SHRINK * self._k.shape[0]:
            for i, src in enumerate(order):
                if i != src:
                    self._k[i, :, :n] = self._k[src, :, :n]
                    self._v[i, :, :n] = self._v[src, :, :n]
        else:
            used_k, used_v = self._k[:rows, :, :n], self._v[:rows, :, :n]
            self._k = _regrow(None, used_k, len(order), 0, n)
            self._v = _regrow(None, used_v, len(order), 0, n)
            self._k[: len(order), :, :n] = used_k.index_select(0, indices)
            self._v[: len(order), :, :n] = used_v.index_select(0, indices)
        self._uk = self._uv = (len(order), n)

    def append_rows(self, keys: torch.Tensor | None, values: torch.Tensor | None, n_rows: int) -> None:
        """Rows joining after this layer's rows: their keys and values (``n_rows`` rows, or None:
        nothing cached yet), the narrower side left-padded with zero columns. The joining rows go
        into the buffer's spare rows where it has them and is at least as wide."""
        assert self._k is not None and self._v is not None
        rows, n = self._uk
        theirs = 0 if keys is None else keys.shape[-2]
        width = max(n, theirs)
        if n < theirs or rows + n_rows > self._k.shape[0] or width > self._k.shape[-2]:
            like_k = self._k if keys is None else keys
            like_v = self._v if values is None else values
            k, v = _regrow(None, like_k, rows + n_rows, 0, width), _regrow(None, like_v, rows + n_rows, 0, width)
            k[:rows, :, : width - n].zero_()
            v[:rows, :, : width - n].zero_()
            k[:rows, :, width - n: width] = self._k[:rows, :, :n]
            v[:rows, :, width - n: width] = self._v[:rows, :, :n]
            self._k, self._v = k, v
        end = rows + n_rows
        self._k[rows:end, :, : width - theirs].zero_()
        self._v[rows:end, :, : width - theirs].zero_()
        if keys is not None and values is not None and theirs:
            self._k[rows:end, :, width - theirs: width] = keys
            self._v[rows:end, :, width - theirs: width] = values
        self._uk = self._uv = (end, width)

    def gather_columns(self, index: torch.Tensor) -> None:
        """Keep, per row, the columns ``index[b]`` (rows, width): compaction, written into a new
        buffer that keeps spare columns."""
        assert self._k is not None and self._v is not None
        rows, n = self._uk
        width = index.shape[1]
        for name in ("_k", "_v"):
            used = getattr(self, name)[:rows, :, :n]
            idx = index[:, None, :, None].expand(-1, used.shape[1], -1, used.shape[3]).to(used.device)
            out = _regrow(None, used, rows, 0, width)
            out[:rows, :, :width] = used.gather(2, idx)   # (not gather(out=): autograd refuses out=)
            setattr(self, name, out)
        self._uk = self._uv = (rows, width)


def moves_in_place(order: list[int], rows: int) -> bool:
    """Whether row i <- row order[i], for each i in turn, never reads a row already overwritten."""
    if len(order) > rows:
        return False
    written: set[int] = set()
    for i, src in enumerate(order):
        if src in written:
            return False
        if src != i:
            written.add(i)
    return True


def _regrow(buf: torch.Tensor | None, like: torch.Tensor, rows: int, n: int, cols: int) -> torch.Tensor:
    """A buffer shaped like ``like`` for ``rows`` rows (as many as buf holds, if more: its spare
    rows stay) of ``cols`` columns and a quarter more (at least 32), holding buf's first ``rows``
    rows of ``n`` columns."""
    held = buf.shape[0] if buf is not None and buf.dim() == 4 else 0
    # zeros, not empty, and a 512-column block of slack past the last head: attention widens keys
    # as a view over the columns that follow (engine/attention.py, _wider: up to 191 past
    # a head's), and a masked column must hold a finite number (0 x NaN is NaN)
    shape = (max(rows, held), like.shape[1], cols + max(32, cols // 4), like.shape[3])
    size = shape[0] * shape[1] * shape[2] * shape[3]
    out = like.new_zeros(size + 512 * like.shape[3])[:size].view(shape)
    if n and buf is not None:
        out[:rows, :, :n] = buf[:rows, :, :n]
    return out


def append_rows(layer: Any, theirs: Any | None, n_rows: int) -> None:
    """``n_rows`` rows joining after ``layer``'s: ``theirs``, a layer of theirs (None: they cached
    nothing yet); the narrower side left-padded with zero columns. In place for a
    ``GrowingLayer``; a concatenating layer (a compiled forward's) gets new tensors."""
    keys, values = (None, None) if theirs is None else (theirs.keys, theirs.values)
    if isinstance(layer, GrowingLayer):
        layer.append_rows(keys, values, n_rows)
        return
    width = max(layer.keys.shape[-2], 0 if keys is None else keys.shape[-2])
    layer.keys = torch.cat([_left_pad(layer.keys, width), _left_pad(keys, width, layer.keys, n_rows)])
    layer.values = torch.cat([_left_pad(layer.values, width), _left_pad(values, width, layer.values, n_rows)])


def gather_columns(layer: Any, index: torch.Tensor) -> None:
    """Keep, per row b, the columns ``index[b]`` (rows, width), in that order (compaction)."""
    if isinstance(layer, GrowingLayer):
        layer.gather_columns(index)
        return
    idx = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]).to(layer.keys.device)
    layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)


def _left_pad(x: torch.Tensor | None, width: int, like: torch.Tensor | None = None, n_rows: int = 0
              ) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, width, D) with zeros on the left; None: ``n_rows`` rows of zeros
    shaped like ``like``'s."""
    if x is None:
        assert like is not None
        return like.new_zeros(n_rows, like.shape[1], width, like.shape[3])
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))


def new_cache(grow: bool = True) -> DynamicCache:
    """An empty cache whose layers grow in place (``GrowingLayer``); ``grow=False``: transformers'
    concatenating layers, for a compiled forward, whose graphs assume contiguous cache tensors
    (``contiguous_layers``) and would copy a growing layer's views every step."""
    cache = DynamicCache()
    if grow:
        Cache.__init__(cache, layer_class_to_replicate=GrowingLayer)
    return cache


def contiguous_layers(cache: Any) -> None:
    """Make each layer's keys and values contiguous, in place. A crop (rollback) leaves them as
    views whose strides still reflect the longer length; compiled graphs assume contiguous cache
    tensors, and a view would recompile them."""
    for layer in getattr(cache, "layers", ()):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and not keys.is_contiguous():
            layer.keys = keys.contiguous()
        if values is not None and not values.is_contiguous():
            layer.values = values.contiguous()
