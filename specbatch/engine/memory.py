"""The memory budget that caps the batch: KV caches and activations, estimated and then checked.

Estimate, per row of the batch (``MemoryBudget.row_bytes``):
  KV cache: for every model (target and draft) ``layers x kv_heads x head_dim x 2 (K and V) x
  dtype bytes`` per cached column, times the columns a row may occupy: prompt + max_new_tokens +
  the draft length, doubled because rejected drafts leave holes until the cache is compacted at
  half holes (``BatchCache.compact_share`` in ``specbatch.engine.cache``), and a quarter more
  for the spare columns a layer keeps to write new tokens in place (``GrowingLayer`` in
  ``specbatch.engine.hf_cache``; its buffer may also keep up to a third more rows than are in
  use, ``hf_cache.SHRINK``, which the holes factor and the measured scale below cover: every row
  is planned at its final width, doubled);
  with ``--compile static`` the target's cache is ``StaticBatchCache``'s buffers instead: the same
  doubled columns rounded up to their bucket (``static_cache.columns_for``: up to 4x short of 200
  columns where a last block widens to 512), in a power of two of slots (up to 2x the rows,
  ``STATIC_SLOTS_FACTOR``), no spare quarter;
  activations: the logits of one verify step (draft length + 1 positions x vocab x 4 bytes, once
  more for their softmax) plus the hidden states of the widest layer over those positions.
The check: after each step the process's memory (``torch.cuda.memory_allocated`` on CUDA, the
resident set on CPU) above what it was before the first step, less ``SLACK`` for allocator caches
and workspaces, against the estimate. When the measurement runs ahead of the estimate the
estimate is scaled up by the same factor, so the cap follows what the machine really uses.
On CUDA the measure is what is allocated now, so it is held against the estimate for the rows
active now. On CPU it is a high-water mark: the resident set does not shrink when rows finish, so
it is held against the largest estimate since the baseline (``MemoryBudget.high_water``). Against
the rows active now, a draining batch would read as a growing under-estimate (32 rows' memory
over 1 row's estimate: a scale of 32) and the next call on the same engine, a worker's next chunk,
would admit a few rows where 32 fit.

The default budget is a safe share of what is free when decoding starts: half of the available
RAM on CPU, 80% of the free memory of the GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
CPU_SHARE = 0.5
GPU_SHARE = 0.8
HOLES_FACTOR = 2.0
SPARE_FACTOR = 1.25     # hf_cache._regrow: a full layer grows by a quarter
MAX_DRAFT = 12          # GammaController.max_gamma: the widest draft an adaptive gamma grows to
SLACK = 256 * 1024**2   # allocator caches and workspaces that do not grow with the rows
STATIC_SLOTS_FACTOR = 2.0   # static_cache.slots_for: n rows sit in the next power of two of slots

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """ "8GiB", "512MB", "1.5 gb", "1000000" -> bytes. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 8GiB, 512MB or 2000000000")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{text!r}: the size must be above 0")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def draft_width(params: Any, default_gamma: int | None = None) -> int:
    """The widest draft one request's steps may verify: what adaptation grows gamma to, or the
    gamma it starts at when wider (a fixed gamma stays there; rules allow up to 64)."""
    gamma = params.gamma if params.gamma is not None else default_gamma
    return max(MAX_DRAFT, gamma or 0)


def row_columns(prompt_tokens: int, params: Any, default_gamma: int | None = None) -> int:
    """The most cache columns one request can need: its prompt, every new token, one draft."""
    return prompt_tokens + int(params.max_new_tokens) + draft_width(params, default_gamma) + 1


def _cfg(config: Any, *names: str) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in names:
        v = getattr(text, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


@dataclass(frozen=True)
class ModelShape:
    """What one model's config says about its per-token KV cache and activations."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        config = model.config
        layers = _cfg(config, "num_hidden_layers", "n_layer") or 1
        heads = _cfg(config, "num_attention_heads", "n_head") or 1
        hidden = _cfg(config, "hidden_size", "n_embd") or 1
        kv_heads = _cfg(config, "num_key_value_heads") or heads
        head_dim = _cfg(config, "head_dim") or max(1, hidden // heads)
        vocab = _cfg(config, "vocab_size") or 1
        dtype = str(getattr(model, "dtype", "float32")).removeprefix("torch.")
        inter = _cfg(config, "intermediate_size", "n_inner") or 4 * hidden
        return cls(layers, kv_heads, head_dim, max(hidden, inter), vocab, DTYPE_BYTES.get(dtype, 4))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass
class MemoryBudget:
    """Caps the rows of a batch so KV caches and activations stay within ``budget`` bytes."""

    budget: int
    shapes: tuple[ModelShape, ...]
    scale: float = 1.0              # measured / estimated, once a measurement ran ahead
    baseline: int | None = None     # process memory before the first step
    reserved: int = 0               # held outside the rows: the prefix cache (engine/prefix.py)
    high_water: bool = False        # the measure never shrinks (a CPU resident set): module docstring
    peak: float = 0.0               # the largest unscaled estimate since the baseline (high_water)
    # the target (``shapes[0]``) over ``StaticBatchCache``: its column buckets (``columns_for``)
    static_columns: Callable[[int], int] | None = None

    def row_bytes(self, columns: int, gamma: int) -> float:
        """Estimated bytes one row needs with ``columns`` tokens of context and draft length gamma."""
        held = columns * HOLES_FACTOR
        target, *drafts = (s.kv_bytes_per_token for s in self.shapes)
        target_columns = held * SPARE_FACTOR if self.static_columns is None \
            else self.static_columns(math.ceil(held)) * STATIC_SLOTS_FACTOR
        kv = target * target_columns + sum(drafts) * held * SPARE_FACTOR
        positions = gamma + 1
        acts = max(s.vocab * 4 * 2 + s.hidden * s.dtype_bytes * 4 for s in self.shapes) * positions
        return (kv + acts) * self.scale

    def max_rows(self, columns: int, gamma: int) -> int:
        """Rows that fit when every row may grow to ``columns`` tokens (at least 1: a request too
        long for the budget still runs, alone)."""
        return max(1, int(self.rows_budget // max(self.row_bytes(columns, gamma), 1.0)))

    def fits(self, rows: int, columns: int, gamma: int, reserving: int = 0) -> bool:
        """``reserving``: bytes about to be reserved beside the rows (prefixes their admission
        computes)."""
        return rows <= 1 or rows * self.row_bytes(columns, gamma) <= self.rows_budget - reserving

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV in every model (what a stored prefix holds per token)."""
        return sum(s.kv_bytes_per_token for s in self.shapes)

    @property
    def rows_budget(self) -> int:
        """What the rows may use: the budget less what is reserved beside them."""
        return max(0, self.budget - self.reserved)

    def check(self, measured: int | None, rows: int, columns: int, gamma: int) -> None:
        """After a step: process memory now (None: cannot measure); recalibrate when it runs ahead."""
        if measured is None:
            return
        if self.baseline is None:       # the first call, before any row: what the models hold
            self.baseline = measured
            return
        if rows <= 0:
            return
        used = measured - self.baseline - SLACK - self.reserved
        estimate = rows * self.row_bytes(columns, gamma)
        if self.high_water:
            self.peak = max(self.peak, estimate / self.scale)
            estimate = self.peak * self.scale
        if used > estimate > 0:
            self.scale *= used / estimate


def is_cuda(device: Any) -> bool:
    """A torch.device or its name ("cuda", "cuda:1"; the name's index once read "cuda:1" != "cuda")."""
    return str(getattr(device, "type", device)).split(":")[0] == "cuda"


def measure(device: Any) -> int | None:
    """Memory in use by this process now: CUDA allocated bytes, else the resident set."""
    import torch

    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def default_budget(device: Any) -> int:
    """A safe share of what is free now (see the module docstring)."""
    import torch

    if is_cuda(device):
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE)
    try:
        import psutil

        return int(psutil.virtual_memory().available * CPU_SHARE)
    except ImportError:
        return 4 * 1024**3
