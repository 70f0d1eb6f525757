"""Drafters: propose candidates for a prefix; learn how many were accepted.

A drafter instance serves one request (it holds that request's state: a KV cache, an n-gram
index). A drafter that finds nothing returns None and decoding falls back to one target step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from specbatch.engine._legacy.cache import cache_length, rollback
from specbatch.engine._legacy.sampling import Warp
from specbatch.engine.loading import LoadedModel


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]                 # k candidate tokens
    q: torch.Tensor | None = None     # (k, V) draft probabilities; None: point masses (greedy / n-gram)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits (..., V_draft) on the target's support (..., V_target): q must live where p does."""
    v = logits.shape[-1]
    if v > vocab_size:
        return logits[..., :vocab_size]
    if v < vocab_size:
        return torch.nn.functional.pad(logits, (0, vocab_size - v), value=float("-inf"))
    return logits


class Drafter(Protocol):
    name: str

    def propose(self, ids: list[int], k: int, warp: Warp | None,
                generator: torch.Generator | None) -> Proposal | None:
        """Up to k candidate tokens following ``ids`` (the accepted sequence so far)."""

    def observe(self, n_valid: int) -> None:
        """The first ``n_valid`` tokens of the last prefix + proposal are now the accepted sequence."""

    @property
    def forwards(self) -> int:
        """Model forward passes made so far (0 for a model-free drafter)."""


class ModelDrafter:
    """A small causal LM with its own KV cache (the classic draft model)."""

    def __init__(self, draft: LoadedModel, vocab_size: int) -> None:
        self.name = draft.name
        self.draft = draft
        self.device = draft.device
        self.vocab_size = vocab_size          # the target's logits width: q must live on p's support
        self.cache = DynamicCache()
        self.seq: list[int] = []              # tokens whose keys/values are in self.cache
        self.forwards = 0

    def _step(self, new_ids: list[int]) -> torch.Tensor:
        """Feed tokens after the cache; returns the last position's logits (V_target,)."""
        inp = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        out = self.draft.forward(inp, self.cache, logits_to_keep=1)
        self.forwards += 1
        self.seq.extend(new_ids)
        return fit_vocab(out.logits[0, -1], self.vocab_size)

    def propose(self, ids: list[int], k: int, warp: Warp | None,
                generator: torch.Generator | None) -> Proposal | None:
        # 1. the cache holds a prefix of ids (observe() rolled back rejected drafts): feed the rest
        logits = self._step(ids[len(self.seq):])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for j in range(k):
            # 2. pick the next draft token: argmax when greedy, else a sample from warped q
            if warp is None:
                x = int(logits.argmax())
            else:
                q = warp.probs(logits)
                x = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            tokens.append(x)
            # 3. feed it unless it is the last (the target scores it; no need for its logits)
            if j + 1 < k:
                logits = self._step([x])
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def observe(self, n_valid: int) -> None:
        if n_valid < len(self.seq):
            rollback(self.cache, n_valid)
            del self.seq[n_valid:]
        assert cache_length(self.cache) == len(self.seq)


class NgramDrafter:
    """Prompt lookup: copy what followed the latest earlier occurrence of the trailing n-gram.

    An incremental index (n-gram -> end position of its latest occurrence) makes a lookup O(1).
    Proposals are point masses (no q).
    """

    forwards = 0

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.name = "ngram"
        self.max_n, self.min_n = max_n, min_n
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0                      # n-grams ending before this position are indexed

    def propose(self, ids: list[int], k: int, warp: Warp | None,
                generator: torch.Generator | None) -> Proposal | None:
        end = len(ids) - 1                    # index every n-gram ending before the last token
        for e in range(max(self.indexed, 0), end):
            for n in range(self.min_n, self.max_n + 1):
                if e - n + 1 >= 0:
                    self.index[tuple(ids[e - n + 1: e + 1])] = e
        self.indexed = max(self.indexed, end)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) < n:
                continue
            last = self.index.get(tuple(ids[-n:]))
            if last is not None:
                cont = ids[last + 1: last + 1 + k]
                if cont:
                    return Proposal(cont)
        return None

    def observe(self, n_valid: int) -> None:
        pass  # proposals never enter the index: only accepted tokens are passed to propose()
