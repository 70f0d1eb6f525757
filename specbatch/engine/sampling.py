"""Warping and the acceptance rule of speculative sampling. p = target distribution, q = draft
distribution. The verifiers built on them live in tree.py.

All functions are pure: tensors in, tensors or a Verdict out. Call under ``torch.inference_mode()``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warp:
    """Sampling parameters applied identically to p and q, after the logit processors
    (processors.py), in HF's order: temperature, top-k, top-p, min-p."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (..., V) -> probabilities (..., V) in float32."""
        x = logits.float() / self.temperature
        if 0 < self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            # same rule as transformers' TopPLogitsWarper: drop the low tail whose mass <= 1 - top_p
            sorted_x, idx = torch.sort(x, dim=-1, descending=False)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - self.top_p)
            remove[..., -1] = False
            x = x.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
        if self.min_p > 0:
            # transformers' MinPLogitsWarper: drop tokens below min_p * the top token's probability
            probs = x.softmax(dim=-1)
            x = x.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return x.softmax(dim=-1)


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]        # accepted draft tokens + one token from the target
    n_accepted: int          # accepted draft tokens
    path: list[int]          # tree node indices (1-based) of the accepted draft tokens
    winner: int = -1         # pool index of the drafter whose candidate was accepted (-1: none)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: (V,) -> one token id."""
    return int(torch.multinomial(probs, 1, generator=generator))


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(0, p - q)) after rejecting x; a drafter with no q is a point mass at x."""
    r = p.clone()
    if q is None:
        r[x] = 0.0
    else:
        r = (r - q).clamp_(min=0.0)
    total = r.sum()
    # total == 0 only when p == q exactly, where rejection has probability 0; keep p as a guard
    return r / total if total > 0 else p


def accept(p: torch.Tensor, q: torch.Tensor | None, x: int, generator: torch.Generator | None) -> bool:
    """Accept draft token x with probability min(1, p(x) / q(x))."""
    px = float(p[x])
    qx = 1.0 if q is None else float(q[x])
    if px >= qx:
        return True
    u = float(torch.rand((), generator=generator, device=p.device))
    return u * qx < px


def sample_seed(seed: int, i: int) -> int:
    """The seed of sample i of a request seeded with ``seed`` (parameter ``n``): sample 0 keeps
    the seed itself (an n = 1 request draws as it always did); sample i > 0 a hash of (seed, i),
    so each sample's draws depend on nothing but the request and its index (not the batch)."""
    if i == 0:
        return seed
    digest = hashlib.sha256(f"specbatch-sample:{seed}:{i}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1      # [0, 2**63), what manual_seed takes
