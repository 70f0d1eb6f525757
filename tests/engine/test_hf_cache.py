"""GrowingLayer (engine/hf_cache.py) holds what transformers' concatenating DynamicLayer holds."""

import torch
from transformers.cache_utils import DynamicLayer

from specbatch.engine import hf_cache
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


def _buffer(layer: GrowingLayer) -> int:
    assert layer.keys is not None
    return layer.keys.untyped_storage().data_ptr()


def test_rows_leaving_move_only_the_rows_that_fill_their_places_within_the_buffer() -> None:
    plain, grow = DynamicLayer(), GrowingLayer()
    for layer in (plain, grow):
        layer.update(*_kv(8, 5, 0))
    before = _buffer(grow)
    for order in ([0, 1, 7, 3, 4, 5, 6], [0, 1, 2, 6, 4, 5]):    # decoder._refill's order, then kept in order
        idx = torch.tensor(order)
        plain.batch_select_indices(idx)
        grow.batch_select_indices(idx)
        _same(plain, grow)
        assert _buffer(grow) == before, "rows leaving copy nothing out of the buffer"
    k, v = _kv(6, 1, 7)
    plain.update(k, v)
    grow.update(k, v)
    _same(plain, grow)
    assert _buffer(grow) == before
    idx = torch.tensor([0, 3, 5])                # under SHRINK of the buffer's rows: its memory goes back
    plain.batch_select_indices(idx)
    grow.batch_select_indices(idx)
    _same(plain, grow)
    assert _buffer(grow) != before and grow._k is not None and grow._k.shape[0] == 3


def test_a_repeated_or_swapped_row_gathers_into_a_new_buffer() -> None:
    plain, grow = DynamicLayer(), GrowingLayer()
    for layer in (plain, grow):
        layer.update(*_kv(3, 4, 0))
    for order in ([1, 0, 2], [2, 2, 0, 1, 1]):
        idx = torch.tensor(order)
        plain.batch_select_indices(idx)
        grow.batch_select_indices(idx)
        _same(plain, grow)


def _joined(a: torch.Tensor, b: torch.Tensor | None, n_b: int) -> torch.Tensor:
    width = max(a.shape[2], 0 if b is None else b.shape[2])
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))   # noqa: E731
    return torch.cat([pad(a), pad(b) if b is not None else a.new_zeros(n_b, a.shape[1], width, a.shape[3])])


def test_rows_joining_go_into_the_rows_that_left_left_padded_either_side() -> None:
    grow = GrowingLayer()
    grow.update(*_kv(4, 6, 0))
    grow.batch_select_indices(torch.tensor([0, 3, 2]))    # 3 rows in use, 4 in the buffer
    before = _buffer(grow)
    assert grow.keys is not None and grow.values is not None
    k, v = grow.keys.clone(), grow.values.clone()
    nk, nv = _kv(1, 3, 1)                                  # narrower: written in place
    hf_cache.append_rows(grow, _Layer(nk, nv), 1)
    want_k, want_v = _joined(k, nk, 1), _joined(v, nv, 1)
    assert torch.equal(grow.keys, want_k) and torch.equal(grow.values, want_v)
    assert _buffer(grow) == before
    wk, wv = _kv(1, 9, 2)                                  # wider: a new buffer, this side padded
    hf_cache.append_rows(grow, _Layer(wk, wv), 1)
    assert torch.equal(grow.keys, _joined(want_k, wk, 1)) and torch.equal(grow.values, _joined(want_v, wv, 1))
    k, v = grow.keys.clone(), grow.values.clone()
    hf_cache.append_rows(grow, None, 2)                    # nothing cached yet: rows of zeros
    assert torch.equal(grow.keys, _joined(k, None, 2)) and torch.equal(grow.values, _joined(v, None, 2))
    plain = DynamicLayer()                                 # a concatenating layer joins the same
    plain.update(k, v)
    hf_cache.append_rows(plain, None, 2)
    _same(plain, grow)


def test_compaction_gathers_columns_into_a_buffer_with_spare_columns() -> None:
    plain, grow = DynamicLayer(), GrowingLayer()
    for layer in (plain, grow):
        layer.update(*_kv(2, 7, 0))
    index = torch.tensor([[0, 2, 3, 6], [1, 4, 5, 6]])
    hf_cache.gather_columns(plain, index)
    hf_cache.gather_columns(grow, index)
    _same(plain, grow)
    after = _buffer(grow)
    k, v = _kv(2, 1, 3)
    plain.update(k, v)
    grow.update(k, v)
    _same(plain, grow)
    assert _buffer(grow) == after, "the next write needs no new buffer"


class _Layer:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
