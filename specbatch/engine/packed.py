"""Float32 Linears over a weight packed once: faster at the decode loop's row counts, and batch-invariant.

Eager ``F.linear`` on CPU calls MKL's ``sgemm``, which packs the whole weight into its blocked layout
on every call. At the decode loop's few rows that packing is most of the product: on a 2-core Xeon a
576 -> 1536 Linear took 350 us at 8 rows and 120 us at 1 (``python scripts/packed_linears.py``;
docs/DESIGN.md, "Linears multiply by packed weights", has the per-forward figures). Two libraries
in torch can pack a weight once and multiply by the packed copy, the ops inductor's freezing uses:

- **oneDNN** (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``): on a 2-core AMD
  EPYC (AVX-512, stop 44) 1.5-3x MKL's products at 8-64 rows, the vocabulary head included
  (docs/DESIGN.md has the table).
- **MKL** (``cblas_sgemm_pack``: ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``):
  on a 2-core Xeon (AVX-512 + AMX, stop 43) 1.2-2.7x ``F.linear`` from 4 to 48 rows, and from 16 rows
  up bitwise ``F.linear``'s.

Which one a process uses is fixed, not timed: the first whose products pass ``kernel_check`` on
this machine (they agree with ``F.linear`` and every row's output is bitwise the same at every row
count, alone or beside others), in the order the CPU's vendor was measured to favour
(``preferred``): MKL first on an Intel CPU, oneDNN first elsewhere. On stop 50's Intel Xeon
(Emerald Rapids) MKL's products were 1.14-2.41x ``F.linear``'s per Linear at 8-32 rows where
oneDNN's were 0.54-0.99x, and the default job ran 1.05x as fast on MKL's (186.2 against 177.9
tok/s); on stop 44's AMD EPYC oneDNN's ran the job 1.47-1.61x MKL's (whose 1-row product failed
the check there). A timing race at start-up would let two workers of one job round differently;
the vendor does not change under a worker.
``SPECBATCH_LINEARS`` (``onednn``, ``mkl``, ``off``; unset or ``auto``: as above) pins the choice,
e.g. to reproduce another host's numbers: config.py reads it (``Settings.linears``) and the commands
that load models pass it here as ``linears`` (``Engine.load``, ``loading.load_model``,
``pack_linears``). Where neither passes, or torch has neither library (ARM), Linears stay as they are.

Batch invariance is the point as much as speed: ``sgemm`` switches kernels below 16 rows (a
matrix-vector product at 1 row), so a row's output moves with the number of rows beside it. The
packed products do not: a row's logits then depend on the rows beside it only through attention's
padding, not through the Linears. oneDNN's one exception, a 1-row product over a wide K (the MLP's
down projection) rounding unlike 2 rows, is closed by computing one row as two.

A weight that is exactly llama.cpp's Q4_1 or Q8_0 blocks (the default target's) is multiplied as
those blocks instead, under ``linears="auto"`` where engine/blocks.py's product is available: fewer
bytes read, its own fixed order of sums (that module's docstring).

Under ``torch.compile`` the module traces as ``F.linear`` (inductor's freezing packs for itself), as it
runs wherever autograd records (neither op has a backward) and over an inference tensor's weight.
The packed copy doubles the Linears' memory; the weight stays a Parameter, so the state dict, tied
embeddings and an int8 draft quantized from this model (engine/loading.py) see a plain Linear.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch
import torch.nn.functional as F

from specbatch.engine import blocks as block_weights
from specbatch.engine import cpuinfo
from specbatch.engine.siblings import HeldProduct, shared_input_groups

logger = logging.getLogger(__name__)

# The row count a weight is packed for. The layouts do not depend on it, but the kernels picked
# do: packed for 1 row, a 1-row product rounds unlike a 2-row one (either library); packed for
# 16 or more, every row count gives each row the same bits (scripts/packed_linears.py; docs/DESIGN.md).
PACK_ROWS = 32


def _onednn_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) over oneDNN's packed weight; one row is computed as two, the first
    kept: over a wide K oneDNN's 1-row kernel rounds unlike its kernel for 2 rows and up."""
    flat = x.reshape(-1, x.shape[-1])
    one = flat.shape[0] == 1
    y = torch.ops.mkldnn._linear_pointwise(flat.expand(2, -1).contiguous() if one else flat,
                                           packed, bias, "none", [], "")
    return (y[:1] if one else y).view(*x.shape[:-1], weight.shape[0])


def _mkl_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) over MKL's packed weight. torch's op falls back to ``F.linear`` for a
    row count other than the one it is told the weight was packed for; MKL's layout is the same
    whatever that count, so it is told the input's own."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.numel() // weight.shape[1])


@dataclass(frozen=True)
class Kernel:
    """A library's packing of a weight (N, K) and its product by the packed copy."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    available: Callable[[], bool] = lambda: True    # whether this torch build has the library


KERNELS = (
    Kernel("onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), _onednn_product,
           torch.backends.mkldnn.is_available),
    Kernel("mkl", lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS), _mkl_product,
           lambda: torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")),
)


def kernel_check(k: Kernel) -> str | None:
    """None where ``k``'s products agree with ``F.linear`` on this machine and give every row the
    same bits at every row count that matters (alone, a few, a batch, a prompt); else why not.
    Two weights: a narrow K and a wide one, where the libraries switch kernels."""
    if not k.available():
        return f"torch has no {k.name} here"
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for n_in in (96, 1536):
                w, b = torch.randn(160, n_in, generator=gen), torch.randn(160, generator=gen)
                packed = k.pack(w)
                x = torch.randn(300, n_in, generator=gen)
                whole = k.product(x, packed, w, b)
                if not torch.allclose(whole, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                    return f"{k.name}'s packed product disagrees with F.linear"
                for rows in (1, 2, 3, 17, 40, 64):
                    if not torch.equal(k.product(x[:rows], packed, w, b), whole[:rows]):
                        return f"{k.name}'s packed product rounds a row differently at {rows} rows"
                if not torch.equal(k.product(x[5:6], packed, w, b), whole[5:6]):
                    return f"{k.name}'s packed product rounds a row differently alone"
    except RuntimeError as e:
        return f"{k.name}'s packed product failed: {e}"
    return None


@functools.cache
def group_check(k: Kernel) -> str | None:
    """None where ``k``'s product over sibling weights concatenated gives every column the bits of
    its own weight's product, at every row count that matters; else why not."""
    gen = torch.Generator().manual_seed(1)
    try:
        with torch.inference_mode():
            for n_in, outs, bias in ((96, (96, 32, 32), True), (1536, (64, 160), False)):
                ws = [torch.randn(n, n_in, generator=gen) for n in outs]
                bs = [torch.randn(n, generator=gen) if bias else None for n in outs]
                cat = torch.cat(ws)
                cat_b = torch.cat(bs) if bias else None  # type: ignore[arg-type]
                packed, alone = k.pack(cat), [k.pack(w) for w in ws]
                x = torch.randn(300, n_in, generator=gen)
                for rows in (1, 2, 3, 17, 40, 64, 300):
                    want = torch.cat([k.product(x[:rows], p, w, b) for p, w, b in zip(alone, ws, bs)], -1)
                    if not torch.equal(k.product(x[:rows], packed, cat, cat_b), want):
                        return f"{k.name}'s product over concatenated weights rounds unlike each weight's at {rows} rows"
    except RuntimeError as e:
        return f"{k.name}'s product over concatenated weights failed: {e}"
    return None


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``); "" where /proc/cpuinfo has none."""
    return cpuinfo.field("vendor_id")


def preferred(vendor: str | None = None) -> list[Kernel]:
    """``KERNELS`` in the order this CPU's vendor was measured to favour (module docstring)."""
    first = "mkl" if (cpu_vendor() if vendor is None else vendor) == "GenuineIntel" else "onednn"
    return sorted(KERNELS, key=lambda k: k.name != first)


@functools.cache
def kernel(linears: str = "auto") -> Kernel | None:
    """This process's packed product for ``linears`` (``Settings.linears``, SPECBATCH_LINEARS):
    "auto", the first of ``preferred()`` that passes ``kernel_check``; a kernel's name, that one
    where it passes; "off" or none passing: None, Linears stay ``F.linear``. Logged once a choice
    (why not, too). ValueError for any other name (config.py refuses it before)."""
    if linears == "off":
        return None
    candidates = [k for k in preferred() if linears in ("auto", k.name)]
    if not candidates:
        raise ValueError(f"linears={linears!r} is none of auto, {', '.join(k.name for k in KERNELS)}, off")
    reasons = []
    for k in candidates:
        why = kernel_check(k)
        if why is None:
            logger.info("float32 Linears multiply by %s's packed weights", k.name)
            return k
        reasons.append(why)
    logger.info("Linears stay unpacked: %s", "; ".join(reasons))
    return None


class _Packed:
    """A kernel's packed copy of a weight, and which weight (the Parameter itself, weakly, and its
    version) it was packed from. Immutable and shared by copies of its module: a packed tensor has
    no storage ``copy.deepcopy`` or pickle could copy (an int8 draft is a deep copy of its target);
    a copy with other weights packs its own at its first call, and an unpickled one likewise."""

    def __init__(self, weight: torch.Tensor | None, k: Kernel | None, blocks: bool = False) -> None:
        self.kernel = k
        self.source = weakref.ref(weight) if weight is not None else None
        self.version = None if weight is None else _version(weight)
        self.blocks: block_weights.BlockWeight | None = None
        self.tensor: torch.Tensor | None = None
        if weight is None or k is None or self.version is None:
            return
        # a weight of llama.cpp's blocks is multiplied as such (engine/blocks.py) where ``blocks`` allows it
        self.blocks = _blocks_of(weight) if blocks else None
        if self.blocks is None:
            self.tensor = k.pack(weight.detach())

    def packs(self, weight: torch.Tensor) -> bool:
        """Whether this is ``weight``'s packed copy as it is now (not another or an older weight:
        a freed weight's successor may take its address, so identity, not ``data_ptr``)."""
        return self.source is not None and self.source() is weight and self.version == _version(weight)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Packed:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _Packed, (None, None)


def _blocks_of(weight: torch.Tensor) -> block_weights.BlockWeight | None:
    """``weight`` as engine/blocks.py's blocks where it is of that form and this process can
    multiply by them (the question is asked only then, so other weights never build the product)."""
    w = block_weights.of(weight)
    return w if w is not None and block_weights.unavailable() is None else None


def _stacked_blocks(members: list[torch.nn.Linear]) -> block_weights.BlockWeight | None | Literal[False]:
    """Sibling Linears' blocks as one product's where every one has blocks of one form; None where
    none has blocks; False where some have and they cannot make one (another form, or none)."""
    parts = [_blocks_of(m.weight) for m in members]
    given = [p for p in parts if p is not None]
    if not given:
        return None
    stacked = block_weights.BlockWeight.stacked(given) if len(given) == len(parts) else None
    return stacked if stacked is not None else False


def _version(weight: torch.Tensor) -> int | None:
    """The weight's version counter, which in-place writes move. None for an inference tensor (a
    model built under ``torch.inference_mode``): it has none, so a write to it could not be seen,
    and such a weight is multiplied by ``F.linear``."""
    return None if weight.is_inference() else weight._version


class _Group(HeldProduct):
    """Sibling PackedLinears that read one input (engine/siblings.py), multiplied as one packed
    product over their concatenated weights (``HeldProduct``). Each column has the bits of its own
    weight's product (``group_check``), so this saves calls, never changes a number. A member whose
    weight was replaced or written in place is no longer served: it packs its own
    (``PackedLinear``). Shared by copies of its modules (a copy's weights are others: it is not
    served), dead once unpickled, as ``_Packed``. ``blocks``: the members' blocks stacked
    (``_stacked_blocks``), multiplied by instead of a packed copy."""

    def __init__(self, members: list[torch.nn.Linear] | None = None, k: Kernel | None = None,
                 blocks: block_weights.BlockWeight | None = None) -> None:
        super().__init__([m.out_features for m in members or ()])
        self.sources: list[tuple[weakref.ref[torch.Tensor], int | None]] = []
        self.blocks: block_weights.BlockWeight | None = None
        # the kernel's packed copy and the weight its product takes, where no block product serves
        self.packed = self.weight = torch.empty(0, device="meta")
        if not members or k is None:
            return
        self.kernel = k
        self.sources = [(weakref.ref(m.weight), _version(m.weight)) for m in members]
        self.bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
        # (each output of a block product is its own sum: a member's columns are its own product's)
        self.blocks = blocks
        if self.blocks is None:
            cat = torch.cat([m.weight.detach() for m in members])
            self.packed = k.pack(cat)
            # oneDNN's product reads only the weight's shape; MKL's op takes the weight itself
            self.weight = cat if k.name == "mkl" else torch.empty(cat.shape, device="meta")

    def serves(self, member: int, weight: torch.Tensor) -> bool:
        if member >= len(self.sources):
            return False
        ref, version = self.sources[member]
        return ref() is weight and version is not None and version == _version(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return block_weights.product(x, self.blocks, self.bias)
        return self.kernel.product(x, self.packed, self.weight, self.bias)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Group:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _Group, ()


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) whose forward multiplies by the packed
    copy of its weight by this process's kernel for its ``linears`` choice (``kernel``), or takes
    its columns of its siblings' shared product (``_Group``). The copy is made again if the weight
    was replaced or written in place."""

    _packed: _Packed
    _group: _Group | None = None
    _member = 0
    _linears = "auto"

    @classmethod
    def of(cls, linear: torch.nn.Linear, group: _Group | None = None, member: int = 0, *,
           linears: str = "auto") -> PackedLinear:
        """``linear`` itself, its class swapped (its parameters, hooks and tied weights stay);
        with ``group``: its ``member``-th Linear (no packed copy of its own until it leaves it)."""
        linear.__class__ = cls
        assert isinstance(linear, PackedLinear)
        linear._linears = linears
        linear._packed = _Packed(None, None) if group is not None else \
            _Packed(linear.weight, kernel(linears), blocks=linears == "auto")
        linear._group, linear._member = group, member
        return linear

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is multiplied by a packed copy rather than by ``F.linear``."""
        # neither op has a backward (its output would silently carry no gradient): F.linear where
        # autograd records, as outside inference/no_grad with a weight that requires grad
        # and where x is no (..., K): MKL's op takes K from the weight and reads x's rows at that
        # stride (a (2, 100) x times a 96-wide weight gave numbers), F.linear raises
        return not (torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu"
                    or x.shape[-1:] != (self.in_features,)
                    or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) float32 -> (..., N)."""
        if not self.takes(x):
            return F.linear(x, self.weight, self.bias)
        group = self._group
        if group is not None:
            if group.serves(self._member, self.weight):
                return group.columns_of(self._member, x)
            self._group = None      # its weight changed: multiplied alone from now on
        if not self._packed.packs(self.weight):
            self._packed = _Packed(self.weight, kernel(self._linears), blocks=self._linears == "auto")
        if self._packed.blocks is not None:
            return block_weights.product(x, self._packed.blocks, self.bias)
        k = self._packed.kernel
        if self._packed.tensor is None or k is None:
            return F.linear(x, self.weight, self.bias)
        return k.product(x, self._packed.tensor, self.weight, self.bias)

    def extra_repr(self) -> str:
        k = self._group.kernel if self._group is not None and self._group.sources else self._packed.kernel
        way = f", {self._format()} blocks" if self.blocks() else f", {k.name}-packed" if k is not None else ""
        return super().extra_repr() + way + (", columns of a shared product" if self._group is not None else "")

    def blocks(self) -> bool:
        """Whether its products are engine/blocks.py's, over its weight's blocks."""
        return self._format() is not None

    def _format(self) -> str | None:
        held = self._group.blocks if self._group is not None else self._packed.blocks
        return None if held is None else held.format


def sibling_outputs(members: tuple[Any, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each of sibling Linears' outputs for the one input ``x``: views of their group's one product
    where they still make up a packed group in order (the numbers their own forwards would give,
    without handing the product out member by member), else each member's own forward."""
    first = members[0]
    group = first._group if isinstance(first, PackedLinear) else None
    if group is not None and len(group.columns) == len(members) and first.takes(x):
        for i, m in enumerate(members):     # (a loop, not all() over a generator: 60 calls a forward)
            if not (isinstance(m, PackedLinear) and m._group is group and m._member == i
                    and group.serves(i, m.weight)):
                break
        else:
            y = group.product(x)
            return [y[..., a:b] for a, b in group.columns]
    return [m.forward(x) for m in members]


def blocks_used(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s Linears multiplies by llama.cpp's blocks (engine/blocks.py)."""
    return any(isinstance(m, PackedLinear) and m.blocks() for m in model.modules())


def packed_kernel(model: torch.nn.Module) -> str | None:
    """The kernel ``model``'s Linears multiply by ("onednn", "mkl"), None where none is packed."""
    for m in model.modules():
        if isinstance(m, PackedLinear) and m._packed.kernel is not None:
            return m._packed.kernel.name
    return None


def can_pack(model: torch.nn.Module, linears: str = "auto") -> bool:
    """Whether ``pack_linears`` would pack ``model``: float32 on a CPU with a packed kernel."""
    p = next(model.parameters(), None)
    return p is not None and p.dtype == torch.float32 and p.device.type == "cpu" and kernel(linears) is not None


def pack_linears(model: torch.nn.Module, linears: str = "auto") -> int:
    """Every plain float32 CPU ``nn.Linear`` of ``model`` made a PackedLinear, in place, multiplying
    by ``kernel(linears)``; how many."""
    if not can_pack(model, linears):
        return 0
    k = kernel(linears)
    assert k is not None
    shared = group_check(k) is None
    n = 0
    for parent in list(model.modules()):
        grouped = set()
        for names in shared_input_groups(parent) if shared else []:
            members = [getattr(parent, x) for x in names]
            # (an inference tensor cannot be concatenated into the group's weight outside inference mode)
            if all(_packable(m) and not m.weight.is_inference() for m in members):
                blocks = _stacked_blocks(members) if linears == "auto" else None
                if blocks is False:     # (Q4_K q beside a Q6_K v: each multiplies by its own blocks)
                    continue
                group = _Group(members, k, blocks)
                if blocks is not None:          # its stacked copy serves them: not both held
                    for m in members:
                        block_weights.forget(m.weight)
                for i, m in enumerate(members):
                    PackedLinear.of(m, group, i, linears=linears)
                grouped.update(names)
                n += len(members)
        for name, m in parent.named_children():
            if name not in grouped and _packable(m):
                PackedLinear.of(m, linears=linears)
                n += 1
    return n


def _packable(m: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    """A plain float32 CPU Linear."""
    return type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
