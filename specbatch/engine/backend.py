"""What the decode loop needs of a target model: the target-backend protocol.

The decoder never touches a KV cache or a model directly; it asks a *backend* to score ragged
feeds of tokens for a batch of rows and to forget what verification rejected. ``BatchCache``
(engine/cache.py: transformers models over a ``DynamicCache`` with 4-D masks) is the backend every
model runs on today; a second one (llama.cpp on CPUs, vLLM's paged attention on GPUs, a static
compiled cache) implements the same surface and reaches the decoder through ``Decoder(backend=...)``.
tests/engine/test_backend.py drives the decoder through a toy backend that shares no code with
``BatchCache``: that is the proof the seam is whole.

A backend holds one batch of rows. Row b's *valid* tokens are the accepted sequence cached so
far; the decoder feeds each row what it lacks plus its draft tree, then rejects the tree nodes off
the accepted path. Rows leave (``select``), join (``extend``) and are copied (``fork``) between
steps. A row may join with a shared prompt prefix already cached (``load_prefix``, its KV from
``export_prefix``): then only the rest of its prompt is fed (engine/prefix.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class PrefixKV:
    """A prefix's cached state in a backend's own form (``data``), for ``load_prefix``."""

    n_tokens: int
    nbytes: int      # what keeping it costs (the prefix store's budget counts it)
    data: Any


class TargetBackend(Protocol):
    """One target model's state for a batch of rows (call under ``torch.inference_mode()``)."""

    n_valid: torch.Tensor       # (B,) long: valid (accepted and cached) tokens per row
    last_hidden: torch.Tensor | None   # (B, keep, H): set by a forward with hidden=True, else None

    @property
    def n_rows(self) -> int: ...

    def forward(self, feeds: Sequence[Sequence[int]], logits_to_keep: int,
                parents: Sequence[Sequence[int]] | None = None, *, hidden: bool = False) -> torch.Tensor:
        """Append feeds[b] to row b and score it: logits (B, logits_to_keep, V), the last
        ``logits_to_keep`` fed positions of each row, right-aligned (shorter feeds are left-padded).

        ``parents[b][i]``: index in feeds[b] of token i's parent, -1 for a token that follows the
        row's valid tokens; None: every feed is a chain. A token sees its row's valid tokens and
        its ancestors only. With ``hidden`` set, ``last_hidden`` holds the final layer's states
        of the same positions, (B, logits_to_keep, H), for drafters that read them.
        """
        ...

    def reject(self, rejected: Sequence[Sequence[int]]) -> None:
        """Feed indices rejected[b] of the last forward were not accepted: forget them."""
        ...

    def drop_tail(self, n_drop: Sequence[int]) -> None:
        """Forget row b's last n_drop[b] valid tokens."""
        ...

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""
        ...

    def fork(self, rows: list[int]) -> None:
        """Row i becomes a copy of old row rows[i] (rows may repeat): the samples of one request
        share the prompt cached once (parameter ``n``); later, rows reusing a cached prefix."""
        ...

    def extend(self, other: TargetBackend) -> None:
        """Append ``other``'s rows (a backend of the same kind, built by the same factory)."""
        ...

    def export_prefix(self) -> PrefixKV:
        """One row that fed exactly one chain and kept all of it (a prefix computed alone):
        its cached state, to load into other backends built by the same factory."""
        ...

    def load_prefix(self, kv: PrefixKV) -> None:
        """A fresh backend (nothing cached yet): every row starts with ``kv``'s tokens as its
        valid tokens (a copy per row is allowed), positions 0 .. n_tokens - 1."""
        ...


BackendFactory = Callable[[int], TargetBackend]
"""n_rows -> an empty backend for that many rows (nothing cached yet)."""


def joining(factory: BackendFactory, prefixes: Sequence[PrefixKV | None]) -> TargetBackend:
    """A backend for rows about to join: row b starts with ``prefixes[b]`` cached (None: with
    nothing). Rows that share one prefix must be adjacent: each run of them is one load."""
    runs: list[tuple[PrefixKV | None, int]] = []
    for kv in prefixes:
        if runs and runs[-1][0] is kv:
            runs[-1] = (kv, runs[-1][1] + 1)
        else:
            runs.append((kv, 1))
    if len(runs) <= 1 and (not runs or runs[0][0] is None):
        return factory(len(prefixes))
    out = factory(0)
    for kv, n in runs:
        part = factory(n)
        if kv is not None:
            part.load_prefix(kv)
        out.extend(part)
    return out
