"""The one adapter over transformers' KV-cache API: the forward's cache keyword (renamed within
transformers 5.x) and the cache's layers. Everything else reaches a ``DynamicCache`` through here."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import DynamicCache


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
