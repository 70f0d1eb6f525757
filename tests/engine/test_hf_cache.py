"""GrowingLayer (engine/hf_cache.py) holds what transformers' concatenating DynamicLayer holds."""

import torch
from transformers.cache_utils import DynamicLayer

from specbatch.engine.hf_cache import GrowingLayer, cache_length, kv_layers, new_cache


def _kv(b: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)


def _same(a: DynamicLayer, b: GrowingLayer) -> None:
    assert a.keys is not None and b.keys is not None and a.values is not None and b.values is not None
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_growing_layer_follows_dynamic_layer_through_updates_crops_selects_and_joins() -> None:
    plain, grow = DynamicLayer(), GrowingLayer()
    for layer in (plain, grow):
        layer.update(*_kv(3, 5, 0))
    _same(plain, grow)
    for step in range(40):             # many one-column writes: the buffer regrows several times
        k, v = _kv(3, 1 + step % 3, step + 1)
        out_plain, out_grow = plain.update(k, v), grow.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(out_plain, out_grow))
        if step % 7 == 6:
            plain.crop(-2)
            grow.crop(-2)
        _same(plain, grow)
    idx = torch.tensor([2, 0, 0])
    plain.batch_select_indices(idx)
    grow.batch_select_indices(idx)
    _same(plain, grow)
    joined_k, joined_v = torch.cat([plain.keys, plain.keys]), torch.cat([plain.values, plain.values])
    plain.keys, plain.values = joined_k, joined_v       # BatchCache.extend replaces whole tensors
    grow.keys = joined_k
    assert grow.values is not None and grow.values.shape[0] == 3, "values keep their own width"
    grow.values = joined_v
    _same(plain, grow)
    k, v = _kv(6, 2, 99)
    plain.update(k, v)
    grow.update(k, v)
    _same(plain, grow)


def test_a_view_taken_before_a_crop_is_overwritten_by_later_writes_so_exports_copy() -> None:
    """Why BatchCache.export_prefix clones: a view of the first n columns shares the buffer."""
    layer = GrowingLayer()
    layer.update(*_kv(1, 6, 0))
    view = layer.keys
    assert view is not None
    before = view.clone()
    layer.crop(-3)
    layer.update(*_kv(1, 3, 1))
    assert not torch.equal(view, before)


def test_new_cache_builds_growing_layers_on_first_update() -> None:
    cache = new_cache()
    cache.update(*_kv(2, 4, 0), 0)
    cache.update(*_kv(2, 4, 1), 1)
    assert [type(x) for x in kv_layers(cache)] == [GrowingLayer, GrowingLayer]
    assert cache_length(cache) == 4
