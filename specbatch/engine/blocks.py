"""Float32 products over weights read as llama.cpp's blocks: what a decode step's Linears cost at few rows.

At the decode loop's 4-32 rows a step's products are bound by reading the weights, not by
arithmetic: on a 2-core Xeon MKL's packed products read the default target's 425 MB of float32
Linear weights at 12-16 GB/s where the machine streams 27 (docs/bench/report-job-xeon.md). The
default target is dequantized from a GGUF whose Linears are Q4_1 (every block of 32 inputs of a
weight row is ``d * q + m``, q a 4-bit integer, d and m float16 values) and whose tied embedding,
the vocabulary head, is Q8_0 (``d * q``, q an 8-bit integer). ``split`` finds that form in a float32
weight, bitwise (never assumed: a weight with one value off it is refused), and
``block_product.cpp`` multiplies by the weight as q, d (and m), 6 or 9 bits a weight instead of 32,
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
    K, 16) uint8, two outputs a byte; m the blocks' offsets) or Q8_0 (q (N/32, K, 32) int8; m
    None); d, m (N/32, K/32, 32) float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def format(self) -> str:
        return "q8_0" if self.m is None else "q4_1"

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
        d = self.d.repeat_interleave(BLOCK, 1)
        w = q * d if self.m is None else torch.addcmul(self.m.repeat_interleave(BLOCK, 1), q, d)
        return w.permute(0, 2, 1).reshape(tiles * BLOCK, k)


def split(weight: torch.Tensor) -> BlockWeight | None:
    """``weight`` (N, K) float32 as llama.cpp's blocks of 32 inputs where every block of every row
    is exactly of one form (N and K multiples of 32), tried in this order: Q4_1, ``d * q + m`` with
    q in 0..15 (m the block's least value, d the float16 nearest its spread over 15); Q8_0,
    ``d * q`` with q in -128..127 (d the float16 nearest its largest magnitude over 127). d and m
    must be float16 values and every weight is checked bitwise; None where no form holds."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" \
            or weight.shape[0] % BLOCK or weight.shape[1] % BLOCK or not weight.numel():
        return None
    n, k = weight.shape
    with torch.no_grad():
        w = weight.detach().reshape(n, k // BLOCK, BLOCK)
        # the first tile of outputs first: a weight of no such form (any safetensors checkpoint's)
        # is refused without passes and temporaries the size of the whole weight at load
        if n > BLOCK and _q4_1(w[:BLOCK]) is None and _q8_0(w[:BLOCK]) is None:
            return None
        return _q4_1(w) or _q8_0(w)


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


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 32) -> (N/32, K, 32): each tile of 32 outputs, input by input."""
    n, blocks, _ = q.shape
    return q.reshape(n // BLOCK, BLOCK, blocks * BLOCK).permute(0, 2, 1)


def _per_block(v: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 1) -> (N/32, K/32, 32): each block's value for a tile's 32 outputs."""
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
    else:
        y = torch.ops.specbatch_blocks.q8_0(flat, w.q, w.d, isa)
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
        for n, k, quantized in ((64, 1536, q4_1), (96, 96, q4_1), (64, 1536, q8_0), (96, 96, q8_0)):
            weight = quantized(torch.randn(n, k, generator=gen) / 16)
            w = split(weight)
            if w is None or w.format != quantized.__name__ or not torch.equal(w.dense(), weight):
                return f"a weight of {quantized.__name__} blocks did not split back to itself"
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
