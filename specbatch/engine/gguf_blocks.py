"""A GGUF file's K-quant scales, given to the float32 weights dequantized from it (engine/blocks.py).

``blocks.split`` finds Q4_1 and Q8_0 in a float32 weight alone: their scales are float16 values.
llama.cpp's K-quants, the Qwen benchmark pair's Q4_K_M files, scale each block by a product of a
float16 super-block scale (per 256 inputs) and a 6- or 8-bit integer, which the float32 weight does
not show. gguf-py, which transformers dequantizes with, makes each weight as

- Q4_K: ``w = D * q - M``, ``D = d * sc`` and ``M = dmin * mn`` per 32 inputs (d, dmin float16;
  sc, mn 6-bit; q 4-bit): D * q is exact, so one rounding, the fma ``fma(q, D, -M)``'s: the Q4_1
  product of block_product.cpp with float32 d and m;
- Q6_K: ``w = D * q``, ``D = d * sc`` per 16 inputs (sc 8-bit, q in -32..31): exact (at most 23
  significant bits), the Q8_0 product with a d per 16 inputs.

``give`` reads those scales from the file and hands them, with the q that ``blocks.with_scales``
recovers from the weight, to each float32 weight of the model that they make again bitwise
(``blocks.give``). Tensors are matched by shape and by that check alone, never by name, so a weight
the file does not make exactly (a llama GGUF's q/k rows, which transformers permutes; a model changed
since) keeps what ``blocks.split`` or the packed float32 product gives it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specbatch.engine import blocks as block_weights

logger = logging.getLogger(__name__)

SUPER = 256      # inputs a K-quant super-block covers (QK_K)
SIZE = {"Q4_K": 144, "Q6_K": 210}       # bytes a super-block of each


def _scales(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A K-quant tensor's rows of super-blocks (N, K/256, bytes) as float32 (d, m): Q4_K's d and
    -M per 32 inputs (N, K/32); Q6_K's d per 16 (N, K/16) and None."""
    from gguf.quants import Q4_K

    n, supers, _ = raw.shape
    if kind == "Q4_K":      # d f16, dmin f16, 12 bytes of 6-bit sc and mn, 128 bytes of q
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)                  # (N, S, 1)
        dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(raw[..., 4:16].reshape(n * supers, 12))
        scale = (d * sc.reshape(n, supers, 8).astype(np.float32)).reshape(n, -1)
        offset = -(dmin * mn.reshape(n, supers, 8).astype(np.float32)).reshape(n, -1)
        return torch.from_numpy(scale), torch.from_numpy(offset)
    # Q6_K: 128 bytes of low q bits, 64 of high, 16 int8 scales, d f16
    d = raw[..., 208:210].copy().view(np.float16).astype(np.float32)                  # (N, S, 1)
    sc = raw[..., 192:208].copy().view(np.int8).astype(np.float32)                    # (N, S, 16)
    return torch.from_numpy((d * sc).reshape(n, -1)), None


INDEX = "k-quants.json"     # beside a dequantized cache's weights: where the file's K-quants lie


def write_index(path: Path, directory: Path) -> dict[str, Any]:
    """Where ``path``'s 2-D Q4_K and Q6_K tensors lie in it, written to ``directory``/INDEX where
    it can be: gguf-py's reader parses every vocabulary string of the file's metadata (28 s for the
    Qwen 1.5B's 151936 tokens and as many merges on a 2-core EPYC), once, at dequantization, where
    transformers has just parsed it (engine/gguf_once.py), not at every load."""
    from gguf import GGUFReader

    tensors = []
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in SIZE and len(t.shape) == 2:
            k, n = (int(x) for x in t.shape)          # GGUF lists the inner dimension first
            tensors.append({"name": t.name, "kind": t.tensor_type.name, "n": n, "k": k, "offset": int(t.data_offset)})
    index = {"size": path.stat().st_size, "tensors": tensors}
    with contextlib.suppress(OSError):        # a read-only cache: the index is only not kept
        tmp = directory / f"{INDEX}.{os.getpid()}"
        tmp.write_text(json.dumps(index))
        os.replace(tmp, directory / INDEX)
    return index


Candidate = tuple[str, np.ndarray, tuple[torch.Tensor, torch.Tensor | None]]


def _candidates(path: Path, directory: Path) -> dict[tuple[int, int], list[Candidate]]:
    """The file's Q4_K and Q6_K tensors by weight shape (N, K): (kind, rows of raw super-blocks,
    the scales of its first row's first super-block: ``_match``'s probe)."""
    try:
        index = json.loads((directory / INDEX).read_text())
        if index["size"] != path.stat().st_size:
            raise ValueError("another file")
    except (OSError, ValueError, KeyError, TypeError):
        index = write_index(path, directory)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[tuple[int, int], list[Candidate]] = {}
    for t in index["tensors"]:
        n, k, size = t["n"], t["k"], SIZE[t["kind"]]
        raw = data[t["offset"]:t["offset"] + n * (k // SUPER) * size].reshape(n, k // SUPER, size)
        out.setdefault((n, k), []).append((t["kind"], raw, _scales(t["kind"], raw[:1, :1])))
    return out


def give(model: torch.nn.Module, path: Path, directory: Path) -> int:
    """Give each float32 Linear weight of ``model`` that one of ``path``'s K-quant tensors makes
    again bitwise its blocks (``blocks.give``); how many. ``directory``: the dequantized cache,
    which keeps the index of the file's K-quants (``write_index``)."""
    if block_weights.unavailable() is not None:      # (it says why, once)
        return 0
    try:
        found = _candidates(path, directory)
    except Exception as e:  # noqa: BLE001 - a file transformers read but this cannot: no blocks from it
        logger.info("K-quant scales of %s not read (%s): its Linears keep their float32 products", path, e)
        return 0
    if not found:
        return 0
    given = 0
    for m in model.modules():
        if type(m) is not torch.nn.Linear or m.weight.dtype != torch.float32 or m.weight.device.type != "cpu":
            continue
        weight = m.weight.detach()
        n, k = weight.shape
        for candidate in found.get((n, k), ()):
            if (blocks := _match(weight, *candidate)) is not None:
                block_weights.give(m.weight, blocks)
                given += 1
                break
    logger.info("%d Linear weights take their blocks from %s's K-quant scales", given, path.name)
    return given


def _match(weight: torch.Tensor, kind: str, raw: np.ndarray,
           probe: tuple[torch.Tensor, torch.Tensor | None]) -> block_weights.BlockWeight | None:
    """``weight``'s blocks from one tensor's scales, or None: its first row's first super-block
    first (``probe``, those values' scales), so each of the many tensors of its shape that is not
    its own costs 256 values."""
    if not block_weights.fits(weight[:1, :SUPER], *probe):
        return None
    d, m = _scales(kind, raw)
    return block_weights.with_scales(weight, d, m)
