"""Int8 Linear layers whose rows do not see each other: int8 weights per output channel, int8
activations per row, an exact integer product.

torch.ao's dynamic quantization (``quantize_dynamic``) takes one activation scale over the whole
input of a Linear, so a row's output moves with the other rows and the pads of the same forward:
a draft's proposals then depend on its batch (issue 31). Here each row gets its own scale. The row
is divided by it in float and handed to fbgemm with scale 1 (``quantized::linear_with_input_q_dq_
qweight_dq_output_fp32``: it rounds, multiplies in int32, exact, and scales by the weight's
per-channel scales), and the result is multiplied back by the row's scale: every step is per row
or element-wise, so a row's output is bitwise the same alone or beside any rows, at the cost of
``quantize_dynamic``'s own kernel. Where the quantized engine is not fbgemm's (ARM: qnnpack) the
same numbers come from ``torch._int_mm``, slower on the LM head. scripts/int8_rows_bench.py
measures the candidates (docs/DESIGN.md, "Batch invariance").
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from specbatch.engine import cpuinfo
from specbatch.engine.siblings import HeldProduct, shared_input_groups

_QMAX = 127.0     # symmetric int8: -127..127, so a row's max |x| lands on 127 exactly
_ZERO = 128       # fbgemm's activations are uint8: -127..127 sits at 1..255


@functools.cache
def fbgemm_activation_range() -> tuple[float, int]:
    """(largest |level|, zero point) of the activations handed to fbgemm: 8 bits where the CPU
    multiplies uint8 by int8 into int32 (AVX512-VNNI), 7 bits elsewhere. AVX2's kernel sums pairs
    of products in int16, which 8-bit activations can saturate (255 x 127 x 2 > 32767): torch.ao's
    ``reduce_range`` on x86 for the same reason. Saturation would only lower the draft's
    acceptance (the target verifies every token), but silently."""
    return (_QMAX, _ZERO) if "avx512_vnni" in cpuinfo.flags() else (63.0, 64)


def numerics() -> str:
    """What a RowInt8Linear computes on this machine, for fingerprints: ``rows8`` or ``rows7``
    (per-row activation scales of 8 or 7 bits)."""
    return "rows8" if not _fbgemm() or fbgemm_activation_range()[0] == _QMAX else "rows7"


def row_scales(x: torch.Tensor, qmax: float = _QMAX) -> torch.Tensor:
    """x (M, K) -> (M, 1): max |x| of each row over ``qmax`` (a zero row: a tiny scale, all zeros)."""
    return x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(qmax)


def _fbgemm() -> bool:
    return torch.backends.quantized.engine in ("fbgemm", "x86")


class RowInt8Linear(torch.nn.Module):
    """A Linear's int8 twin: y = (round(x / s_x) @ Wq^T) * s_w * s_x + b, with s_w per output
    channel (weights, fixed) and s_x per row (activations, taken at each call). CPU only."""

    weight_t: torch.Tensor          # (K, N) int8, _int_mm's layout: buffers off fbgemm only
    weight_scale: torch.Tensor      # (1, N)

    def __init__(self, linear: torch.nn.Linear, fbgemm: bool | None = None) -> None:
        """``fbgemm``: through fbgemm's kernel (None: where the quantized engine is fbgemm's), else
        through ``torch._int_mm``."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = row_scales(w)                               # a weight row is an output channel
        q = torch.round(w / scale).to(torch.int8)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(),
                                                                        requires_grad=False)
        self._packed: Any = None
        if _fbgemm() if fbgemm is None else fbgemm:
            with warnings.catch_warnings():     # quantized tensors are deprecated; fbgemm's packing isn't
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    q, scale.reshape(-1).double(), torch.zeros(len(q), dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(qw, None)  # bias: added after s_x
        else:
            self.register_buffer("weight_t", q.t().contiguous())
            self.register_buffer("weight_scale", scale.reshape(1, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) float32 -> (..., N) float32."""
        flat = x.reshape(-1, self.in_features)
        if self._packed is not None:
            qmax, zero = fbgemm_activation_range()
            s = row_scales(flat, qmax)
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                flat / s, 1.0, zero, self._packed)
        else:       # (int32 products and sums: every 8 bits exact)
            s = row_scales(flat)
            q = torch.round(flat / s).to(torch.int8)
            y = torch._int_mm(q, self.weight_t) * self.weight_scale
        y.mul_(s)           # (in place: y is this call's own; the same numbers as y * s)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """The int8 weight as a per-channel quantized tensor (as torch.ao's Linear saves it)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._packed is not None:
            destination[prefix + "weight"] = torch.ops.quantized.linear_unpack(self._packed)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


class _SharedProduct(HeldProduct):
    """One RowInt8Linear over sibling Linears' concatenated weights, run once per input tensor
    (``HeldProduct``). A plain object, not a Module, so the model's state_dict and modules() list
    it through its members only. Per-row scales and an exact int32 product make each column the
    same, bit for bit, as its own Linear's (tests/engine/test_int8_fused.py)."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__([m.out_features for m in linears])
        cat = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                              bias=linears[0].bias is not None, device="meta")
        cat.weight = torch.nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        if cat.bias is not None:
            cat.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
        self.linear = RowInt8Linear(cat)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class RowInt8Part(torch.nn.Module):
    """Stands in for one Linear of a _SharedProduct group: the same outputs as its RowInt8Linear,
    bit for bit (a strided view of the group's product), and the same state_dict entries."""

    def __init__(self, shared: _SharedProduct, member: int) -> None:
        super().__init__()
        self.shared, self.member = shared, member
        a, b = shared.columns[member]
        self.in_features, self.out_features = shared.linear.in_features, b - a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.columns_of(self.member, x)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """The member's rows of the group's int8 weight, scales and bias (a RowInt8Linear's keys)."""
        a, b = self.shared.columns[self.member]
        for k, v in self.shared.linear.state_dict().items():
            destination[prefix + k] = v[:, a:b] if k in ("weight_t", "weight_scale") else v[a:b]

    def extra_repr(self) -> str:
        a, b = self.shared.columns[self.member]
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows, columns {a}:{b} of a shared product"


def quantize_linears(model: torch.nn.Module, fuse: bool = True) -> torch.nn.Module:
    """``model`` with every Linear replaced by a RowInt8Linear, in place (returned for chaining);
    ``fuse``: siblings.SHARED_INPUT groups by RowInt8Parts of one product (the same numbers, fewer calls)."""
    for names in shared_input_groups(model) if fuse else []:
        shared = _SharedProduct([getattr(model, n) for n in names])
        for i, n in enumerate(names):
            setattr(model, n, RowInt8Part(shared, i))
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, RowInt8Linear(child))
        else:
            quantize_linears(child, fuse)
    return model
