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


def kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's attention layers (each with ``keys`` / ``values`` of shape (B, H, L, D))."""
    return list(cache.layers)


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def _in_use(buf: str, used: str) -> Any:
    """A layer's ``keys`` or ``values``: a view of the buffer's columns in use. Assigning a whole
    tensor (transformers' own code, BatchCache's joins and compaction) makes it the buffer, with no
    spare room."""
    def get(layer: Any) -> torch.Tensor | None:
        return _used(getattr(layer, buf), getattr(layer, used))

    def put(layer: Any, value: torch.Tensor | None) -> None:
        setattr(layer, buf, value)
        setattr(layer, used, _width(value))
    return property(get, put)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that writes new columns in place into a buffer with spare columns.

    ``DynamicLayer.update`` concatenates: every step copies the whole cache of every layer, which
    for 32 rows of 300 tokens is a large share of what a decode step moves through memory. Here a step
    writes its own columns only and the buffer grows by a quarter when full (each column is copied
    a few times in all, not once per step). Readers see ``keys`` / ``values`` as views of the
    first ``n`` columns: the same values in the same order, so attention computes the same sums.
    """

    # columns in use, kept apart for keys and values: callers replace the two one after the other
    _nk = _nv = 0
    _k: torch.Tensor | None
    _v: torch.Tensor | None
    keys = _in_use("_k", "_nk")       # type: ignore[assignment]
    values = _in_use("_v", "_nv")     # type: ignore[assignment]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._nk, key_states.shape[-2]
        assert self._k is not None and self._v is not None and self._nv == n, "initialized above"
        if self._k.dim() < 4 or n + new > self._k.shape[-2]:
            self._k, self._v = _regrow(self._k, key_states, n, new), _regrow(self._v, value_states, n, new)
        self._k[:, :, n: n + new] = key_states
        self._v[:, :, n: n + new] = value_states
        self._nk = self._nv = n + new
        return self._k[:, :, : n + new], self._v[:, :, : n + new]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            self._nk = self._nv = max(0, self._nk + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            assert self._k is not None and self._v is not None
            self._k, self._v = self._k[indices], self._v[indices]


def _width(t: torch.Tensor | None) -> int:
    return t.shape[-2] if t is not None and t.dim() == 4 else 0


def _used(buf: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return buf if buf is None or buf.dim() < 4 else buf[:, :, :n]


def _regrow(buf: torch.Tensor, like: torch.Tensor, n: int, new: int) -> torch.Tensor:
    """A buffer for n + new columns and a quarter more (at least 32), holding buf's first n."""
    cols = n + new + max(32, (n + new) // 4)
    out = like.new_empty(like.shape[0], like.shape[1], cols, like.shape[3])
    if n:
        out[:, :, :n] = buf[:, :, :n]
    return out


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
