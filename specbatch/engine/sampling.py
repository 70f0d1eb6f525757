"""Warping and the coupled draw of sampled rows (the exponential race keyed by position).
p = target distribution, q = draft distribution. The verifiers built on them live in tree.py.

The functions are pure (tensors in, tensors out); ``RowNoise`` keeps one row's noise. Call under
``torch.inference_mode()``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Below this temperature the logits are shifted by their max before dividing (Warp.probs): where
# dividing alone could overflow float32. Above it, the plain division, as every seeded output was
# drawn before (a shift moves the probabilities' last bits, and so a race within rounding of a tie).
TINY_TEMPERATURE = 1e-3


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
        x = logits.float()
        if self.temperature < TINY_TEMPERATURE:
            # logits / 1e-40 overflow float32 to inf (and 1e-300 is 0 in float32): shifted by their
            # max first, the top logits stay 0 and the rest fall to -inf, the limit as T -> 0
            x = (x - x.amax(dim=-1, keepdim=True)) / max(self.temperature, torch.finfo(torch.float32).tiny)
        else:
            x = x / self.temperature
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


def race(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax_x p(x) / e(x) over the last dim; p, e: (..., V) -> (...) ids.

    With e i.i.d. Exp(1), e(x) / p(x) ~ Exp(p(x)) and the smallest wins with probability
    p(x) / sum p: an exact draw from p. A token with p = 0 never wins. The same e drives every
    distribution raced at one position (the target's p, a draft's q, the target alone), so two
    races at a position agree where p and q are close: the coupling that makes a seeded sample
    independent of drafting (docs/DESIGN.md, "Sampled rows")."""
    e = e.to(p.device)
    return torch.where(p > 0, p / e, -1.0).argmax(dim=-1)


def position_seed(seed: int, t: int) -> int:
    """The seed of the noise at output position t of a row seeded ``seed``."""
    digest = hashlib.sha256(f"specbatch-race:{seed}:{t}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1      # [0, 2**63), what manual_seed takes


class RowNoise:
    """A sampled row's Exp(1) noise, one (V,) vector per output position, a function of (seed,
    position) only: how many tokens a step drafts, verifies or emits never moves it.

    ``next`` is the row's next output position (its tokens emitted so far); the vectors of the
    positions a step drafts and verifies are kept until emitted, so the drafter and the verifier
    (and the next step, for positions drafted but not reached) generate each once."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.seed, self.device = seed, torch.device(device)
        self.next = 0
        self.kept: dict[int, torch.Tensor] = {}

    def at(self, t: int, vocab: int) -> torch.Tensor:
        """(vocab,) float32 Exp(1) noise of output position t."""
        e = self.kept.get(t)
        if e is None or e.shape[0] != vocab:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(position_seed(self.seed, t))
            # Exp(1) as -log U: a quarter of ``exponential_``'s time on this CPU (0.3 against 1.3 ms
            # at V = 49152, one thread); U = 0 gives E = inf, a token that cannot win
            e = self.kept[t] = torch.rand(vocab, device=self.device, generator=gen).log_().neg_()
        return e

    def advance(self, n: int) -> None:
        """n tokens were emitted: their positions' noise is done with."""
        self.next += n
        self.kept = {t: e for t, e in self.kept.items() if t >= self.next}


def sample_seed(seed: int, i: int) -> int:
    """The seed of sample i of a request seeded with ``seed`` (parameter ``n``): sample 0 keeps
    the seed itself (an n = 1 request is sample 0); sample i > 0 a hash of (seed, i), so each
    sample's noise depends on nothing but the request and its index (not the batch)."""
    if i == 0:
        return seed
    digest = hashlib.sha256(f"specbatch-sample:{seed}:{i}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1      # [0, 2**63), what manual_seed takes
