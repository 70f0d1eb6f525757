"""A target backend over preallocated KV buffers: fixed shapes, so one compiled graph serves a class.

``BatchCache`` (engine/cache.py) grows a ``DynamicCache`` and sends the model exactly the rows and
columns in use, so every step has a shape of its own. ``StaticBatchCache`` keeps the same
bookkeeping (shared columns, a per-row ``valid`` mask with holes, crop, compaction: it *is* a
``BatchCache`` for all of that) over buffers of fixed size per layer, (slots S, kv heads, columns C,
head dim), and writes a step's keys and values in place at the step's columns (``index_copy_`` at
a column tensor, as transformers' ``StaticLayer``, which ``SlotLayer`` extends). S and C come from
buckets (``slots_for``: powers of two; ``columns_for``: 64, 128, then steps of 128 widened to what
``attention._aligned`` keeps, so attention never widens them again); a batch outgrowing either
moves into the next bucket (a copy), one shrinking to half moves down.

Two ways a forward runs:

- **a compiled shape class** (``StaticForward``, engine/compile/forward.py: a (slots, new tokens)
  pair chosen to compile): the model sees all S slots and all C columns, padding rows fed token 0
  and attending only to their own new column, with a (S, 1, W, C) additive mask. On CPU the column
  count is the graph's one dynamic size (``mark_dynamic``), so one graph serves every column bucket;
  on CUDA it stays static too (CUDA graphs need fixed shapes), so the buffers keep the one capacity
  the graphs were compiled at (``StaticForward.columns``) and do not move below it.
- **eagerly** (every other class, prefill, hidden states): the model sees views of the rows and
  columns in use (the first n slots, L + W columns), the same shapes and numbers as ``BatchCache``,
  in-place writes instead of concatenation.

Rollback is ``BatchCache``'s: rejected columns become holes, tail columns invalid for every row are
cropped (here: only forgotten, the next write overwrites them), holes are squeezed out when they
are half the cache. Columns past the ones in use and the slots of rows that left hold stale but
finite numbers the mask hides (attention multiplies masked scores' zero weights by them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from specbatch.engine.attention import _aligned
from specbatch.engine.backend import PrefixKV, TargetBackend
from specbatch.engine.cache import BatchCache, additive, block_allowed
from specbatch.engine.hf_cache import cache_kwarg, moves_in_place
from specbatch.engine.loading import LoadedModel, is_compile_error

if TYPE_CHECKING:
    from specbatch.engine.compile.forward import StaticForward

MIN_COLUMNS = 64


def slots_for(rows: int) -> int:
    """Slots for ``rows`` rows: the next power of two (at least 1)."""
    return 1 << max(0, rows - 1).bit_length()


def columns_for(cols: int) -> int:
    """Column capacity for ``cols`` columns: 64, 128, then the next multiple of 128 as
    ``attention._aligned`` widens it (256 -> 384, 768 -> 896: a length whose attention kernels
    round like every other's, so a call over all C columns is not widened again)."""
    if cols <= MIN_COLUMNS:
        return MIN_COLUMNS
    return _aligned(-(-cols // 128) * 128)


def capacity_for(cols: int, graphs: StaticForward | None) -> int:
    """The buffers' column capacity for ``cols`` columns over ``graphs``: ``columns_for``, never
    below the one capacity graphs of fixed shape were compiled at (``StaticForward.columns``, CUDA)."""
    return max(graphs.columns if graphs is not None and graphs.columns else 0, columns_for(cols))


@dataclass
class _Shape:
    """What every layer of one backend shares: the buffers' size, the first column this call
    writes (a tensor: inside a compiled graph an int would be a constant), and what it returns."""

    slots: int
    capacity: int
    start: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    full: bool = False    # return the whole buffers (a compiled class) or the views in use (eager)
    visible: int = 0      # eager: the columns in use after this call's writes
    dynamic_columns: bool = False   # mark the column dimension dynamic (compiled, no fixed capacity: CPU)


class SlotLayer(StaticLayer):
    """transformers' ``StaticLayer`` over buffers its backend sizes and moves: writes the call's
    columns from ``shape.start`` into the first rows (as many as the call has), returns the whole
    buffers (a compiled class: S slots, C columns) or the rows and columns in use (eager)."""

    def __init__(self, shape: _Shape) -> None:
        super().__init__(max_cache_len=shape.capacity)
        self.shape = shape
        self.cumulative_length = shape.start

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = _buffer(key_states, self.shape)
        self.values = _buffer(value_states, self.shape)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        s = self.shape
        cols = torch.arange(key_states.shape[-2], device=key_states.device) + s.start
        if s.full:
            self.keys.index_copy_(2, cols, key_states)
            self.values.index_copy_(2, cols, value_states)
            return self.keys, self.values
        rows = key_states.shape[0]
        keys, values = self.keys[:rows], self.values[:rows]
        keys.index_copy_(2, cols, key_states)
        values.index_copy_(2, cols, value_states)
        return keys[:, :, : s.visible], values[:, :, : s.visible]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The key length a mask built by the model must cover (eager, a 2-D mask: the columns in use)."""
        return (self.shape.capacity if self.shape.full else self.shape.visible), 0


def _buffer(like: torch.Tensor, shape: _Shape) -> torch.Tensor:
    """Zeros (slots, heads, capacity, head dim) of ``like``'s dtype and device: finite, as every
    column the mask hides must be (0 x NaN is NaN)."""
    out = like.new_zeros(shape.slots, like.shape[1], shape.capacity, like.shape[3])
    _mark(out, shape)
    return out


def _mark(buf: torch.Tensor, shape: _Shape) -> None:
    """A compiled class's buffer: its column count dynamic where the graphs have no fixed
    capacity (CPU: one graph for every bucket); else, on CUDA, its address static (CUDA graphs
    replay over it without a copy)."""
    if shape.dynamic_columns:
        torch._dynamo.mark_dynamic(buf, 2)
    elif buf.device.type == "cuda":
        torch._dynamo.mark_static_address(buf)


class StaticBatchCache(BatchCache):
    """The target backend (engine/backend.py) over fixed-size per-layer buffers; ``graphs``: the
    compiled shape classes, None: eager only. See the module docstring."""

    def __init__(self, model: LoadedModel, n_rows: int = 0, graphs: StaticForward | None = None) -> None:
        self.model = model
        self.graphs = graphs
        dev = model.device
        self.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=dev)
        self.n_valid = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self._block: tuple[int, list[int]] = (0, [])
        self.last_hidden: torch.Tensor | None = None
        # graphs of one fixed capacity (CUDA): the buffers never narrower, so calls keep their shape
        self.shape = _Shape(slots_for(n_rows), capacity_for(0, graphs),
                            start=torch.zeros((), dtype=torch.long, device=dev),
                            dynamic_columns=graphs is not None and not graphs.columns)
        n_layers = int(model.model.config.get_text_config().num_hidden_layers)
        self.cache = Cache(layers=[SlotLayer(self.shape) for _ in range(n_layers)])

    @property
    def layers(self) -> list[SlotLayer]:
        return self.cache.layers   # type: ignore[return-value]

    def _buffers(self) -> list[tuple[SlotLayer, str, torch.Tensor]]:
        """Every allocated buffer: (layer, "keys" or "values", the tensor)."""
        return [(layer, name, getattr(layer, name)) for layer in self.layers if layer.is_initialized
                for name in ("keys", "values")]

    def forward(self, feeds: Sequence[Sequence[int]], logits_to_keep: int,
                parents: Sequence[Sequence[int]] | None = None, *, hidden: bool = False) -> torch.Tensor:
        """``BatchCache.forward``'s contract; through a compiled graph where (slots, width) is one
        of ``graphs``' classes and something is cached already (a prefill is eager)."""
        dev = self.model.device
        n, width = len(feeds), max(len(f) for f in feeds)
        n_cols = self.valid.shape[1]
        pads = [width - len(f) for f in feeds]
        self._reserve(n, n_cols + width)
        ids = torch.tensor([[0] * p + list(f) for p, f in zip(pads, feeds)], dtype=torch.long, device=dev)
        new_valid, pos, allowed = block_allowed(self.valid, self.n_valid, pads, parents, width)
        self.shape.start.fill_(n_cols)
        graphs = self.graphs
        out = None
        if graphs is not None and not hidden and n_cols and graphs.eligible(self.shape.slots, width):
            out = self._compiled(graphs, ids, pos, allowed)
        if out is None:
            self.shape.full, self.shape.visible = False, n_cols + width
            if parents is None and not any(pads) and self._dense():
                # BatchCache's dense path: the model's own causal mask is the same and cheaper
                mask = torch.ones(n, n_cols + width, dtype=torch.long, device=dev)
            else:
                mask = additive(allowed, self.model.model.dtype)[:, None]
            extra = {"output_hidden_states": True} if hidden else {}
            out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                   logits_to_keep=logits_to_keep, **{cache_kwarg(self.model.model): self.cache},
                                   **extra)
        self.last_hidden = out.hidden_states[-1][:n, -logits_to_keep:] if hidden else None
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.n_valid = self.n_valid + new_valid.sum(dim=1)
        self._block = (n_cols, pads)
        return out.logits[:n, -logits_to_keep:]

    def _compiled(self, graphs: StaticForward, ids: torch.Tensor, pos: torch.Tensor,
                  allowed: torch.Tensor) -> Any:
        """The call at the class's fixed shape: S slots (padding rows see only their own new
        column), W tokens, C columns, every position's logits. None when compiling failed (one
        warning; eager from then on): nothing was written, the eager call writes the same columns."""
        dev, s = ids.device, self.shape
        n, width = ids.shape
        n_cols = allowed.shape[2] - width
        full_ids = torch.zeros(s.slots, width, dtype=torch.long, device=dev)
        full_ids[:n] = ids
        full_pos = torch.zeros(s.slots, width, dtype=torch.long, device=dev)
        full_pos[:n] = pos
        seen = torch.zeros(s.slots, width, s.capacity, dtype=torch.bool, device=dev)
        seen[:n, :, : n_cols + width] = allowed
        own = torch.arange(width, device=dev)
        seen[n:, own, n_cols + own] = True
        mask = additive(seen, self.model.model.dtype)[:, None]
        if s.dynamic_columns:
            torch._dynamo.mark_dynamic(mask, 3)
        s.full = True
        inputs = {"input_ids": full_ids, "attention_mask": mask, "position_ids": full_pos, "use_cache": True,
                  "logits_to_keep": 0, cache_kwarg(self.model.model): self.cache}
        try:
            return graphs(inputs)
        except Exception as e:  # noqa: BLE001 - a compiler failure: warn once, go eager
            if not is_compile_error(e):
                raise
            graphs.fail(e)
            return None

    # -- buffers: grow into the next bucket, shrink to half, move rows and columns in place
    def _reserve(self, rows: int, cols: int) -> None:
        """Room for ``rows`` rows of ``cols`` columns, growing into the next buckets if needed."""
        s = self.shape
        if rows > s.slots or cols > s.capacity:
            self._resize(max(s.slots, slots_for(rows)), max(s.capacity, columns_for(cols)))

    def _fit(self) -> None:
        """Move down a bucket once the rows or the columns in use fill at most half of it."""
        s, cols = self.shape, self.valid.shape[1]
        slots = min(s.slots, slots_for(max(1, self.n_rows)))
        capacity = capacity_for(cols, self.graphs) if cols <= s.capacity // 2 else s.capacity
        if (slots, capacity) != (s.slots, s.capacity):
            self._resize(slots, min(capacity, s.capacity))

    def _resize(self, slots: int, capacity: int) -> None:
        """New buffers of (slots, capacity), holding the rows and columns in use."""
        rows, cols = min(self.n_rows, slots, self.shape.slots), min(self.valid.shape[1], capacity)
        self.shape.slots, self.shape.capacity = slots, capacity
        for layer, name, buf in self._buffers():
            new = _buffer(buf, self.shape)
            new[:rows, :, :cols] = buf[:rows, :, :cols]
            setattr(layer, name, new)
        for layer in self.layers:
            layer.max_cache_len = capacity

    def _crop(self, keep: int) -> None:
        """Columns from ``keep`` on are forgotten: the next write overwrites them."""

    def _gather(self, order: torch.Tensor) -> None:
        n, cols, width = self.n_rows, self.valid.shape[1], order.shape[1]
        for _, _, buf in self._buffers():
            used = buf[:n, :, :cols]
            idx = order[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]).to(buf.device)
            buf[:n, :, :width] = used.gather(2, idx)

    def select(self, rows: list[int]) -> None:
        """Keep these rows in slots 0..len - 1: rows that move are copied within the buffers where
        none is read after it was overwritten (rows leaving), else gathered (a row repeated)."""
        cols = self.valid.shape[1]
        if cols:
            if len(rows) <= self.shape.slots and moves_in_place(rows, self.n_rows):
                for _, _, buf in self._buffers():
                    for i, src in enumerate(rows):
                        if i != src:
                            buf[i, :, :cols] = buf[src, :, :cols]
            else:
                idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
                self.shape.slots = max(self.shape.slots, slots_for(len(rows)))
                for layer, name, buf in self._buffers():
                    new = _buffer(buf, self.shape)
                    new[: len(rows), :, :cols] = buf.index_select(0, idx)[:, :, :cols]
                    setattr(layer, name, new)
        else:
            self._reserve(len(rows), 0)
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid, self.n_valid = self.valid[idx], self.n_valid[idx]
        self._invalidate([])
        self._fit()

    def take(self, rows: list[int]) -> BatchCache:
        raise NotImplementedError("take serves draft models' caches, which are BatchCaches")

    def extend(self, other: TargetBackend) -> None:
        """Append other's rows after these, the narrower side's columns shifted right (left padding)."""
        assert type(other) is type(self), "rows join from a backend of the same kind"
        if self.n_rows == 0:
            self.cache, self.shape = other.cache, other.shape
            self.valid, self.n_valid = other.valid, other.n_valid
            self._fit()
            return
        n, m = self.n_rows, other.n_rows
        la, lb = self.valid.shape[1], other.valid.shape[1]
        width = max(la, lb)
        self._reserve(n + m, width)
        theirs = other.layers if lb else [None] * len(self.layers)
        for mine, their in zip(self.layers, theirs, strict=True):
            for name in ("keys", "values"):
                src = None if their is None else getattr(their, name)
                if not mine.is_initialized and src is not None:
                    setattr(mine, name, _buffer(src, self.shape))
                buf = getattr(mine, name)
                if buf is None:
                    continue
                if la and la < width:
                    buf[:n, :, width - la: width] = buf[:n, :, :la].clone()
                if src is not None:
                    buf[n: n + m, :, width - lb: width] = src[:m, :, :lb]
            mine.is_initialized = mine.keys is not None
        pad = torch.nn.functional.pad
        self.valid = torch.cat([pad(self.valid, (width - la, 0), value=False),
                                pad(other.valid, (width - lb, 0), value=False)])
        self.n_valid = torch.cat([self.n_valid, other.n_valid])

    def export_prefix(self) -> PrefixKV:
        """This one dense row's KV, as ``BatchCache.export_prefix`` gives it (per layer (keys,
        values), each (1, H, L, D)): a prefix stored by either backend loads into either."""
        assert self.n_rows == 1 and self._dense(), "a prefix is one row computed alone"
        n = self.valid.shape[1]
        layers = [(layer.keys[:1, :, :n].clone(), layer.values[:1, :, :n].clone())   # type: ignore[index]
                  for layer in self.layers]
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        return PrefixKV(n, nbytes, layers)

    def load_prefix(self, kv: PrefixKV) -> None:
        """Every row of this fresh backend starts with ``kv``, written into its slot."""
        assert not self.valid.shape[1], "a prefix loads into a backend with nothing cached"
        n, length = self.n_rows, kv.n_tokens
        self._reserve(n, length)
        for layer, (k, v) in zip(self.layers, kv.data, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys[:n, :, :length] = k       # type: ignore[index]
            layer.values[:n, :, :length] = v     # type: ignore[index]
        self.valid = torch.ones(n, length, dtype=torch.bool, device=self.model.device)
        self.n_valid = torch.full((n,), length, dtype=torch.long, device=self.model.device)
