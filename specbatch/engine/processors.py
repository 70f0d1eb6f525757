"""Logit processors: what a request changes in the next-token logits before the Warp, applied
to the target's p and to every draft's q alike, position by position.

Speculative sampling is exact for whatever distribution p the verifier holds, as long as each
q is the distribution its draft token was really drawn from (Leviathan et al. 2023). So a
processor is lossless under speculation when it runs on the target's logits at every tree
position *with the history that position would have had*, and on the draft's logits the same
way: at draft position j the penalties count the accepted output plus the tokens drafted
before j on that branch. Then the accepted text is distributed as the processed target alone.

A processor is a pure function ``(logits (N, V), Positions) -> logits (N, V)``: N positions of
one row, each with its own history (``Positions``). The order is HF generate's and vLLM's
(docs/statistics.md, "Logit processors"):

    logit_bias -> repetition_penalty -> frequency_penalty, presence_penalty    (here, on logits)
    -> temperature -> top-k -> top-p -> min-p                                  (sampling.Warp)

A new per-position processor (a grammar mask, say) is one more function of the same shape,
added to ``processors_for``. Call under ``torch.inference_mode()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specbatch.engine.types import GenerationParams


@dataclass
class History:
    """One row's token counts, kept across the row's steps (the row's ``ids`` only grow).

    ``n_prompt``: the prompt's length at the start of ids. Counts of the output tokens (for
    frequency/presence penalties, which OpenAI and vLLM apply to generated tokens only) and the
    set of every token seen (prompt + output, for repetition_penalty, as HF and vLLM do) are
    computed once per step and shared by the drafter and the verifier.
    """

    n_prompt: int
    _key: tuple[int, int] = (-1, -1)                     # (len(ids), V) the cache holds
    _counts: torch.Tensor | None = None                  # (V,) float: output token counts
    _seen: torch.Tensor | None = None                    # (V,) bool: prompt or output
    _prompt_seen: torch.Tensor | None = field(default=None, repr=False)

    def base(self, ids: Sequence[int], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts (V,), seen (V,)) of ``ids``: the accepted sequence, prompt first."""
        if self._key != (len(ids), vocab) or self._counts is None or self._seen is None:
            if self._prompt_seen is None or self._prompt_seen.shape[0] != vocab:
                prompt = torch.tensor(list(ids[: self.n_prompt]), dtype=torch.long, device=device)
                self._prompt_seen = torch.bincount(prompt, minlength=vocab)[:vocab] > 0
            out = torch.tensor(list(ids[self.n_prompt:]), dtype=torch.long, device=device)
            self._counts = torch.bincount(out, minlength=vocab)[:vocab].float()
            self._seen = self._prompt_seen | (self._counts > 0)
            self._key = (len(ids), vocab)
        return self._counts, self._seen


@dataclass(frozen=True)
class Positions:
    """What N positions of one row have seen: the row's accepted ``ids`` and, per position, the
    drafted tokens before it on its branch (``branches[i]``; ``[]`` at the root)."""

    history: History
    ids: Sequence[int]
    branches: Sequence[Sequence[int]]

    def counts(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts (N, V) float, seen (N, V) bool) at each position."""
        base, seen = self.history.base(self.ids, vocab, device)
        n = len(self.branches)
        counts = base.expand(n, vocab).clone()
        rows = [i for i, b in enumerate(self.branches) for _ in b]
        if rows:
            toks = torch.tensor([t for b in self.branches for t in b], dtype=torch.long, device=device)
            at = torch.tensor(rows, dtype=torch.long, device=device)
            counts.index_put_((at, toks), torch.ones(len(rows), device=device), accumulate=True)
        return counts, seen.expand(n, vocab) | (counts > 0)


Processor = Callable[[torch.Tensor, Positions], torch.Tensor]

# Below this repetition_penalty a seen token's positive logit divided by it can overflow float32
# (1e-300 is 0 there: inf, then NaN in the softmax, and every sampled token was 0), here or in the
# warp's division by a temperature: the row is shifted so that its penalised top is 0 first
# (``_tiny_repetition``). Above it, the plain division, as every seeded output was drawn before.
TINY_PENALTY = 1e-3
FLOAT32_MAX = torch.finfo(torch.float32).max


def logit_bias(bias: Sequence[tuple[int, float]]) -> Processor:
    """OpenAI's logit_bias: add bias[id] to that token's logit."""
    ids = [int(i) for i, _ in bias]
    values = [float(b) for _, b in bias]

    def apply(logits: torch.Tensor, _: Positions) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
        return logits.index_add(-1, idx, torch.tensor(values, device=logits.device).expand(logits.shape[0], -1))
    return apply


def penalties(repetition: float, frequency: float, presence: float) -> Processor:
    """vLLM's ``apply_penalties``: a token seen in prompt or output has its logit divided by
    ``repetition`` when positive, multiplied when not (HF's RepetitionPenaltyLogitsProcessor);
    then minus ``frequency`` per occurrence in the output and ``presence`` once if it occurs."""
    def apply(logits: torch.Tensor, pos: Positions) -> torch.Tensor:
        counts, seen = pos.counts(logits.shape[-1], logits.device)
        if repetition < TINY_PENALTY:
            logits = _tiny_repetition(logits, seen, repetition)
        elif repetition != 1.0:
            # (a factor past float32's max would be inf there, and a zero logit times it NaN)
            factor = min(repetition, FLOAT32_MAX)
            penalised = torch.where(logits > 0, logits / factor, logits * factor)
            logits = torch.where(seen, penalised, logits)
        if frequency:
            logits = logits - frequency * counts
        if presence:
            logits = logits - presence * (counts > 0).float()
        return logits
    return apply


def _tiny_repetition(logits: torch.Tensor, seen: torch.Tensor, repetition: float) -> torch.Tensor:
    """logits (N, V) with a repetition penalty under TINY_PENALTY, less a constant per row: where a
    seen token has a positive logit, the largest of them M gives every logit minus M / repetition,
    the seen positive ones as (l - M) / repetition (0 at the top, the rest -inf where the quotient
    overflows: the limit as the penalty goes to 0), so nothing overflows to +inf. What follows
    only subtracts (frequency, presence), ranks (greedy's argmax) or softmaxes (the warp), so the
    shift changes no probability; p and every q get it alike. A row with no seen positive logit
    cannot overflow: its seen logits are multiplied, as above TINY_PENALTY."""
    r = max(repetition, torch.finfo(torch.float32).tiny)   # (1e-300 is 0 in float32)
    plain = torch.where(seen & (logits <= 0), logits * r, logits)
    positive = seen & (logits > 0)
    top = logits.masked_fill(~positive, float("-inf")).amax(dim=-1, keepdim=True)   # (N, 1) M
    # (a row without M gets inf here, which torch.where below leaves unused)
    shifted = torch.where(positive, (logits - top) / r, plain - top / r)
    return torch.where(top > 0, shifted, plain)


def processors_for(params: GenerationParams) -> tuple[Processor, ...]:
    """The request's processors in order; empty when it asks for none (min_p lives in the Warp)."""
    out: list[Processor] = []
    if params.logit_bias:
        out.append(logit_bias(params.logit_bias))
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        out.append(penalties(params.repetition_penalty, params.frequency_penalty, params.presence_penalty))
    return tuple(out)


@dataclass
class RowProcessors:
    """A row's processors and its History: ``row_procs(logits, ids, branches)`` processes the
    N positions of one row (logits (N, V) -> float32 (N, V))."""

    processors: tuple[Processor, ...]
    history: History

    @classmethod
    def build(cls, params: GenerationParams, n_prompt: int) -> RowProcessors | None:
        procs = processors_for(params)
        return cls(procs, History(n_prompt)) if procs else None

    def __call__(self, logits: torch.Tensor, ids: Sequence[int], branches: Sequence[Sequence[int]]
                 ) -> torch.Tensor:
        pos = Positions(self.history, ids, branches)
        x = logits.float()
        for proc in self.processors:
            x = proc(x, pos)
        return x
