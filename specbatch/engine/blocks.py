"""Float32 products over weights read as llama.cpp's blocks: what a decode step's Linears cost at few rows.

At the decode loop's 4-32 rows a step's products are bound by reading the weights, not by
arithmetic: on a 2-core Xeon MKL's packed products read the default target's 425 MB of float32
Linear weights at 12-16 GB/s where the machine streams 27 (docs/bench/report-job-xeon.md). The
default target is dequantized from a GGUF whose Linears are Q4_1 (every block of 32 inputs of a
weight row is ``d * q + m``, q a 4-bit integer, d and m float16 values) and whose tied embedding,
the vocabulary head, is Q8_0 (``d * q``, q an 8-bit integer). ``split`` finds that form (and
Q5_0's, ``d * q`` with q in -16..15) in a float32 weight, bitwise (never assumed: a weight with one
value off it is refused); the K-quants' scales (Q4_K, Q6_K: the Qwen benchmark pair) are not float16
values and come from the GGUF file itself (engine/gguf_blocks.py, ``with_scales``, ``give``). And
``block_product.cpp`` multiplies by the weight as q, d (and m), 6 to 10 bits a weight instead of 32,
making each float32 weight again in a register, bitwise the same value. Only the order of each
output's sum is its own: one fma chain over the inputs in order, whatever rows share the call
(batch-invariant by construction), the same bits on every CPU with AVX-512 or AVX2 (the two versions
make each output by the same fmas in the same order). So it defines the target's
numbers where it is used, as MKL's or oneDNN's packed products do where they are
(engine/packed.py), and results are fingerprinted by it (engine/fingerprint.py: "+blocks").

Used where all of these hold, else the Linear keeps its packed float32 product: the weight
splits; the CPU has AVX-512 (``avx512f``, ``avx512bw``) or AVX2 with FMA; the C++ source builds (torch's JIT
extension build: a C++ compiler and ``ninja``, once per machine and source, into torch's extension
cache, ``TORCH_EXTENSIONS_DIR``: about 9 s); ``check`` passes; and ``SPECBATCH_LINEARS`` is
``auto`` (a pinned kernel, ``mkl`` or ``onednn``, pins every Linear: to reproduce numbers made
without blocks). No library offers this: torch's own int4 product
(``_weight_int4pack_mm_for_cpu``) makes the same float32 weights but ran 5-80x slower than MKL's
float32 products here, and llama.cpp's kernels round the activations to 8 bits first.
docs/DESIGN.md, "Linears over llama.cpp's blocks", has the measurements.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specbatch.engine import cpuinfo

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("block_product.cpp")
BLOCK = 32          # inputs a block's d (and m) cover, and outputs a tile of the product makes
# the ISAs are set per function in the source; no fused multiply-add but those it writes: their
# order is the numbers'
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


@dataclass(frozen=True)
class BlockWeight:
    """A (N, K) float32 weight as the product reads it (block_product.cpp's layout): Q4_1 (q (N/32,
    K, 16) uint8, two outputs a byte; m the blocks' offsets), Q8_0 (q (N/32, K, 32) int8; m None)
    or Q6_K (as Q8_0, with a d per 16 inputs); d, m (N/32, K/32, 32) float32 (Q6_K's d (N/32, K/16,
    32))."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def format(self) -> str:
        return "q4_1" if self.m is not None else "q8_0" if self.per == BLOCK else "q6_k"

    @property
    def per(self) -> int:
        """Inputs one d covers: 32, or Q6_K's 16."""
        return self.q.shape[1] // self.d.shape[1]

    @property
    def out_features(self) -> int:
        return self.q.shape[0] * BLOCK

    def dense(self) -> torch.Tensor:
        """The float32 weight it stands for, made as the product makes it (``d * q + m``)."""
        tiles, k, _ = self.q.shape
        if self.m is not None:        # Q4_1
            q = torch.stack([self.q & 0x0F, self.q >> 4], -1).reshape(tiles, k, BLOCK).float()
        else:
            q = self.q.float()                                                             # (t, K, 32)
        d = self.d.repeat_interleave(self.per, 1)
        w = q * d if self.m is None else torch.addcmul(self.m.repeat_interleave(BLOCK, 1), q, d)
        return w.permute(0, 2, 1).reshape(tiles * BLOCK, k)

    @staticmethod
    def stacked(parts: list[BlockWeight]) -> BlockWeight | None:
        """Sibling weights' blocks as the blocks of their concatenation (outputs after outputs: a
        tile is 32 outputs of one of them), None where their forms differ."""
        if len({(p.format, p.q.shape[1]) for p in parts}) != 1:
            return None
        m = [p.m for p in parts]
        return BlockWeight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                           None if m[0] is None else torch.cat([x for x in m if x is not None]))


def split(weight: torch.Tensor) -> BlockWeight | None:
    """``weight`` (N, K) float32 as llama.cpp's blocks of 32 inputs where every block of every row
    is exactly of one form (N and K multiples of 32), tried in this order: Q4_1, ``d * q + m`` with
    q in 0..15 (m the block's least value, d the float16 nearest its spread over 15); Q8_0,
    ``d * q`` with q in -128..127 (d the float16 nearest its largest magnitude over 127); Q5_0,
    ``d * q`` with q in -16..15 (d its largest magnitude over 16), multiplied as Q8_0. d and m
    must be float16 values and every weight is checked bitwise; None where no form holds."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" \
            or weight.shape[0] % BLOCK or weight.shape[1] % BLOCK or not weight.numel():
        return None
    n, k = weight.shape
    with torch.no_grad():
        w = weight.detach().reshape(n, k // BLOCK, BLOCK)
        # the first tile of outputs first: a weight of no such form (any safetensors checkpoint's)
        # is refused without passes and temporaries the size of the whole weight at load
        forms = [f for f in (_q4_1, _q8_0, _q5_0) if n == BLOCK or f(w[:BLOCK]) is not None]
        return next((got for f in forms if (got := f(w)) is not None), None)


def with_scales(weight: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> BlockWeight | None:
    """``weight`` (N, K) float32 as blocks whose scales are given, not found (llama.cpp's K-quants,
    whose float32 scales the weight does not show: engine/gguf_blocks.py): with ``m`` (N, K/32),
    ``d * q + m``, q in 0..15 (Q4_K's, as Q4_1's); without, ``d * q`` with q in -32..31 and a d per
    16 inputs (Q6_K's, d (N, K/16)). None unless every weight is made again bitwise. Needs the
    product built (``unavailable()`` None)."""
    n, k = weight.shape
    if n % BLOCK or (q := _q_given(weight, d, m)) is None:
        return None
    if m is None:
        return BlockWeight(_tiles(q.view(n, k // BLOCK, BLOCK)).contiguous(), _per_block(d.unsqueeze(-1)))
    qt = _tiles(q.view(n, k // BLOCK, BLOCK))
    return BlockWeight((qt[..., 0::2] | (qt[..., 1::2] << 4)).contiguous(), _per_block(d.unsqueeze(-1)),
                       _per_block(m.unsqueeze(-1)))


def fits(weight: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> bool:
    """Whether ``with_scales`` would make ``weight`` (any rows) again with these scales."""
    return _q_given(weight, d, m) is not None


def _q_given(weight: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor | None:
    """``with_scales``'s q (N, K), uint8 (int8 without m), where they make every weight bitwise:
    block_product.cpp's ``recover``, one pass (torch's operators took 22 s over the Qwen 1.5B's
    1.5 billion weights on a 2-core EPYC, passes over memory)."""
    n, k = weight.shape
    per = BLOCK if m is not None else BLOCK // 2
    if weight.dtype != torch.float32 or k % BLOCK or d.shape != (n, k // per) \
            or (m is not None and m.shape != (n, k // BLOCK)):
        return None
    q = torch.ops.specbatch_blocks.recover(weight.detach().contiguous(), d.contiguous(),
                                           None if m is None else m.contiguous())
    return q if q.numel() else None


# weights whose blocks were given rather than found (``give``): {id: (the weight, its version then, blocks)}
_given: dict[int, tuple[weakref.ref[torch.Tensor], int, BlockWeight]] = {}


def give(weight: torch.Tensor, blocks: BlockWeight) -> None:
    """Let ``of(weight)`` answer ``blocks`` while ``weight`` is unchanged (engine/gguf_blocks.py,
    which checked them bitwise against it)."""
    key = id(weight)
    _given[key] = (weakref.ref(weight, lambda _: _given.pop(key, None)), weight._version, blocks)


def forget(weight: torch.Tensor) -> None:
    """Drop the blocks given for ``weight``: a sibling group multiplies by a stacked copy of them
    (engine/packed.py), and a weight that leaves its group has changed, so they no longer fit it."""
    _given.pop(id(weight), None)


def of(weight: torch.Tensor) -> BlockWeight | None:
    """``weight``'s blocks: those given for it as it is now, else those ``split`` finds."""
    held = _given.get(id(weight))
    if held is not None and held[0]() is weight and held[1] == weight._version:
        return held[2]
    return split(weight)


def _q4_1(w: torch.Tensor) -> BlockWeight | None:
    m = w.amin(-1, keepdim=True)
    d = ((w.amax(-1, keepdim=True) - m) / 15).half().float()
    if not (torch.equal(m.half().float(), m) and torch.isfinite(d).all()):
        return None
    q = torch.round((w - m) / torch.where(d == 0, 1.0, d)).clamp_(0, 15)
    if not torch.equal(torch.addcmul(m, q, d), w):
        return None
    qt = _tiles(q.to(torch.uint8))                                        # (t, K, 32)
    return BlockWeight((qt[..., 0::2] | (qt[..., 1::2] << 4)).contiguous(), _per_block(d), _per_block(m))


def _q8_0(w: torch.Tensor) -> BlockWeight | None:
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    q = torch.round(w / torch.where(d == 0, 1.0, d)).clamp_(-128, 127)
    if not torch.equal(q * d, w):
        return None
    return BlockWeight(_tiles(q.to(torch.int8)).contiguous(), _per_block(d))


def _q5_0(w: torch.Tensor) -> BlockWeight | None:
    """Q5_0 (``d * q``, q in -16..15: the block's value of largest magnitude is ``-16 d``, so d
    takes the other sign), held as Q8_0's 8-bit q: the same product."""
    d = -w.gather(-1, w.abs().argmax(-1, keepdim=True)) / 16          # (exact: a power of two)
    if not (torch.equal(d.half().float(), d) and torch.isfinite(d).all()):
        return None
    q = torch.round(w / torch.where(d == 0, 1.0, d)).clamp_(-16, 15)
    if not torch.equal(q * d, w):
        return None
    return BlockWeight(_tiles(q.to(torch.int8)).contiguous(), _per_block(d))


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 32) -> (N/32, K, 32): each tile of 32 outputs, input by input."""
    n, blocks, _ = q.shape
    return q.reshape(n // BLOCK, BLOCK, blocks * BLOCK).permute(0, 2, 1)


def _per_block(v: torch.Tensor) -> torch.Tensor:
    """(N, B, 1) -> (N/32, B, 32): each block's value (B blocks a row) for a tile's 32 outputs."""
    n, blocks, _ = v.shape
    return v.reshape(n // BLOCK, BLOCK, blocks).permute(0, 2, 1).contiguous()


def isas() -> list[int]:
    """The vector widths this CPU runs the product at: 512 (AVX-512), 256 (AVX2 with FMA), both give
    the same bits; [] for neither."""
    have = cpuinfo.flags()
    return [isa for isa, flags in ((512, {"avx512f", "avx512bw"}), (256, {"avx2", "fma"})) if flags <= have]


def product(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None, isa: int = 0) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): ``x @ w.dense().T`` (+ bias) in the product's own order.
    ``isa``: 512 or 256 (``isas``) to ask for one; 0, the widest."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if w.m is not None:
        y = torch.ops.specbatch_blocks.q4_1(flat, w.q, w.d, w.m, isa)
    elif w.per == BLOCK:
        y = torch.ops.specbatch_blocks.q8_0(flat, w.q, w.d, isa)
    else:
        y = torch.ops.specbatch_blocks.q6_k(flat, w.q, w.d, isa)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], w.out_features)


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) quantized to llama.cpp's Q4_1 and back to float32 as gguf-py reads it
    (``quantize_row_q4_1_ref``: d the block's spread over 15 and m its least value, both stored as
    float16, q rounded from the unrounded ones): what a GGUF's Q4_1 tensor dequantizes to."""
    n, k = weight.shape
    x = weight.reshape(n, k // BLOCK, BLOCK)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    q = ((x - lo) / torch.where(step == 0, 1.0, step) + 0.5).floor().clamp(0, 15)
    return torch.addcmul(lo.half().float(), q, step.half().float()).reshape(n, k)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) quantized to llama.cpp's Q8_0 and back (``quantize_row_q8_0_ref``: d the
    block's largest magnitude over 127, stored as float16, q rounded with the unrounded d)."""
    n, k = weight.shape
    x = weight.reshape(n, k // BLOCK, BLOCK)
    d = x.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x / torch.where(d == 0, 1.0, d))
    return (q * d.half().float()).reshape(n, k)


def q6_k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) in Q6_K's form, ``d * q`` with q in -32..31 and a d per 16 inputs (here the
    float16 nearest the 16's largest magnitude over 31, where llama.cpp's is a float16 times an
    8-bit integer), and its d (N, K/16): for checks and tests (gguf-py has no Q6_K quantizer)."""
    n, k = weight.shape
    x = weight.reshape(n, k // 16, 16)
    d = (x.abs().amax(-1, keepdim=True) / 31).half().float()
    q = torch.round(x / torch.where(d == 0, 1.0, d)).clamp(-32, 31)
    return (q * d).reshape(n, k), d.squeeze(-1)


@functools.cache
def unavailable() -> str | None:
    """None where this process can use the product (the CPU has AVX-512 or AVX2, the source builds and
    ``check`` passes); else why not, logged once. Asked only when a weight splits, so models of
    other weights never build it."""
    why: str | None = "the CPU has neither AVX-512 nor AVX2"
    if isas():
        why = _build() or check()
    if why is None:
        logger.info("Linears whose weights are llama.cpp blocks multiply by them (engine/blocks.py)")
    else:
        logger.info("products over llama.cpp blocks unavailable (%s): those Linears keep float32 products", why)
    return why


def _build() -> str | None:
    """Build and load the product's library (torch's extension cache keeps it per machine and
    source); None, or why it failed in one line."""
    # (importing it warns "No CUDA runtime is found, using CUDA_HOME=..." where a CUDA toolkit is on
    # the PATH: nothing this CPU build reads, so not in a user's terminal)
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
    finally:
        quiet.setLevel(level)
    path = os.environ.get("PATH")
    if shutil.which("ninja") is None:     # pip's ninja, from a venv whose bin is not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path or ""])
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([torch.__version__, *FLAGS]).encode()).hexdigest()[:12]
    try:
        load(name=f"specbatch_blocks_{digest}", sources=[str(SOURCE)], is_python_module=False, verbose=False,
             extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: keep float32 products
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        return f"building engine/block_product.cpp failed: {first[:200]}"
    finally:     # the build's PATH, not the process's from now on
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
    return None


def check() -> str | None:
    """None where the product agrees with ``F.linear`` over the weight it stands for and gives
    every row the same bits at every row count that matters (alone, a few, a batch, a prompt);
    else why not."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n, k, form in ((64, 1536, "q4_1"), (96, 96, "q4_1"), (64, 1536, "q8_0"), (96, 96, "q8_0"),
                           (64, 1536, "q6_k"), (96, 256, "q6_k")):
            x = torch.randn(n, k, generator=gen) / 16
            if form == "q6_k":         # (its scales are given, not found: engine/gguf_blocks.py)
                weight, scales = q6_k(x)
                w = with_scales(weight, scales, None)
            else:
                weight = q4_1(x) if form == "q4_1" else q8_0(x)
                w = split(weight)
            if w is None or w.format != form or not torch.equal(w.dense(), weight):
                return f"a weight of {form} blocks did not split back to itself"
            x = torch.randn(300, k, generator=gen)
            whole = product(x, w)
            if not torch.allclose(whole, F.linear(x, weight), rtol=1e-4, atol=1e-4):
                return f"the {w.format} product disagrees with F.linear"
            for rows in (1, 2, 3, 5, 6, 12, 13, 17, 40, 64):
                if not torch.equal(product(x[:rows], w), whole[:rows]):
                    return f"the {w.format} product rounds a row differently at {rows} rows"
            for isa in isas():
                if not torch.equal(product(x[:17], w, isa=isa), whole[:17]):
                    return f"the {w.format} product at {isa} bits rounds unlike at the widest"
    return None
