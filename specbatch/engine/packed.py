"""Float32 Linears over MKL's packed weights: faster from 4 rows up, and batch-invariant.

Eager ``F.linear`` on CPU calls MKL's ``sgemm``, which packs the whole weight into its blocked layout
on every call. At the decode loop's few rows that packing is most of the product: on a 2-core Xeon a
576 -> 1536 Linear took 350 us at 8 rows and 120 us at 1 (``python scripts/packed_linears.py``;
docs/DESIGN.md, "Linears multiply by packed weights", has the per-forward figures). MKL can pack a weight once (``cblas_sgemm_pack``, reached through
``torch.ops.mkl._mkl_reorder_linear_weight``, the op inductor's freezing uses) and multiply by the
packed copy (``torch.ops.mkl._mkl_linear``).

What that gives, measured on the default target's shapes (scripts/packed_linears.py):

- From 16 rows up the products are bitwise ``F.linear``'s: the same MKL kernel, without the packing.
- Below 16 rows ``sgemm`` switches to other kernels (a matrix-vector product at 1 row), so its numbers
  move with the batch's row count; the packed product does not: every row's output is bitwise the
  same at every row count (1 to 64 on every Linear of the default target, 1 to 4096 on one; docs/
  DESIGN.md). A row's logits then depend on the
  rows beside it only through attention's padding, not through the Linears.
- 1.2-2.7x faster per Linear from 4 to 48 rows, about the same at 1-3 rows (a whole forward at 1-3
  rows: 5-11% slower, kept for the invariance above).

torch's op takes the row count the weight was packed for and falls back to ``F.linear`` for any other.
The packed layout has the same size whatever that count, and products over it at other row counts
were correct in every check (bitwise those of a copy packed for that count, from 2 rows up), so the
call passes the input's own row count. ``pack_check`` verifies that on the running machine once per process
before anything is packed; where it fails, or where torch has no MKL (ARM), Linears stay as they are.

Under ``torch.compile`` the module traces as ``F.linear`` (inductor's freezing packs for itself), as it
runs wherever autograd records (MKL's op has no backward) and over an inference tensor's weight.
The packed copy doubles the Linears' memory; the weight stays a Parameter, so the state dict, tied
embeddings and an int8 draft quantized from this model (engine/loading.py) see a plain Linear.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The row count a weight is packed for. MKL's layout does not depend on it, but the kernels it picks
# do: packed for 1 row, a 1-row product rounds unlike a 2-row one; packed for 16 or more, every row
# count gives each row the same bits (scripts/packed_linears.py; docs/DESIGN.md).
PACK_ROWS = 32


class _Packed:
    """MKL's packed copy of a weight, and which weight (the Parameter itself, weakly, and its
    version) it was packed from. Immutable and shared by copies of its module: an MKL-DNN tensor has
    no storage ``copy.deepcopy`` or pickle could copy (an int8 draft is a deep copy of its target);
    a copy with other weights packs its own at its first call, and an unpickled one likewise."""

    def __init__(self, weight: torch.Tensor | None) -> None:
        self.source = weakref.ref(weight) if weight is not None else None
        self.version = None if weight is None else _version(weight)
        self.tensor = None if weight is None or self.version is None else \
            torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)

    def packs(self, weight: torch.Tensor) -> bool:
        """Whether this is ``weight``'s packed copy as it is now (not another or an older weight:
        a freed weight's successor may take its address, so identity, not ``data_ptr``)."""
        return self.source is not None and self.source() is weight and self.version == _version(weight)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Packed:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _Packed, (None,)


def _version(weight: torch.Tensor) -> int | None:
    """The weight's version counter, which in-place writes move. None for an inference tensor (a
    model built under ``torch.inference_mode``): it has none, so a write to it could not be seen,
    and such a weight is multiplied by ``F.linear``."""
    return None if weight.is_inference() else weight._version


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) whose forward multiplies by MKL's packed
    copy of its weight. The copy is made again if the weight was replaced or written in place."""

    _packed: _Packed

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> PackedLinear:
        """``linear`` itself, its class swapped (its parameters, hooks and tied weights stay)."""
        linear.__class__ = cls
        assert isinstance(linear, PackedLinear)
        linear._packed = _Packed(linear.weight)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) float32 -> (..., N)."""
        # MKL's op has no backward (its output would silently carry no gradient): F.linear where
        # autograd records, as outside inference/no_grad with a weight that requires grad
        # and where x is no (..., K): MKL's op takes K from the weight and reads x's rows at that
        # stride (a (2, 100) x times a 96-wide weight gave numbers), F.linear raises
        if torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu" or \
                x.shape[-1:] != (self.in_features,) or \
                (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        if not self._packed.packs(self.weight):
            self._packed = _Packed(self.weight)
        if self._packed.tensor is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        return torch.ops.mkl._mkl_linear(x, self._packed.tensor, self.weight, self.bias, rows)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", MKL-packed"


@functools.cache
def pack_check() -> str | None:
    """None where packed products agree with ``F.linear`` on this machine at the row counts that
    matter (including ones the weight was not packed for); else why not."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "torch has no MKL here"
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(160, 96, generator=gen), torch.randn(160, generator=gen)
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
        for rows in (1, 3, 17, 40):
            x = torch.randn(rows, 96, generator=gen)
            y = torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
            if not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                return f"MKL's packed product disagrees with F.linear at {rows} rows"
    except RuntimeError as e:
        return f"MKL's packed product failed: {e}"
    return None


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``pack_linears`` would pack ``model``: float32 on a CPU whose MKL passes the check."""
    p = next(model.parameters(), None)
    return p is not None and p.dtype == torch.float32 and p.device.type == "cpu" and pack_check() is None


def pack_linears(model: torch.nn.Module) -> int:
    """Every plain float32 CPU ``nn.Linear`` of ``model`` made a PackedLinear, in place; how many."""
    if not can_pack(model):
        if (why := pack_check()) is not None:
            logger.info("Linears stay unpacked: %s", why)
        return 0
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            PackedLinear.of(m)
            n += 1
    return n
