"""Sibling Linears that read one input, in the architectures we run (transformers' Llama, Qwen2,
Mistral: the attention's q/k/v projections, the MLP's gate and up). One product over their
concatenated weights serves each group: the int8 draft's (engine/int8.py) and the float32
target's packed one (engine/packed.py). A model that feeds them different inputs (cross-attention)
still gets the same numbers, each call then computing the whole group's product."""

from __future__ import annotations

import threading
from typing import Any

import torch

SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_input_groups(model: torch.nn.Module) -> list[list[str]]:
    """The SHARED_INPUT groups among ``model``'s own children that can share one product: all
    Linears of one input width, all with a bias or all without."""
    kids = dict(model.named_children())
    out = []
    for names in SHARED_INPUT:
        ms = [kids.get(n) for n in names]
        if all(isinstance(m, torch.nn.Linear) for m in ms) \
                and len({(m.in_features, m.bias is None) for m in ms if m is not None}) == 1:
            out.append(list(names))
    return out


class HeldProduct:
    """A product over sibling weights concatenated, computed once per input tensor: the first
    member called with ``x`` computes every member's columns (``product``), the others take
    theirs, a view. Held per thread from the first member's call to the last one's: decode lanes
    (engine/lanes.py) call one model on several threads, whose calls interleave, and one slot for
    all made each thread's next member redo the product of the other's input. Identity is safe:
    the held input cannot be freed and its id reused."""

    def __init__(self, out_features: list[int]) -> None:
        ends = torch.tensor(out_features).cumsum(0).tolist()
        self.columns = list(zip([0, *ends[:-1]], ends))
        self._held = threading.local()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., sum of the members' N)."""
        raise NotImplementedError

    def columns_of(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """The member's columns of the group's product for ``x`` (..., K) -> (..., N_member)."""
        last: tuple[torch.Tensor, torch.Tensor, set[int]] | None = getattr(self._held, "last", None)
        if last is None or last[0] is not x or member in last[2]:
            last = (x, self.product(x), set())
        served = last[2]
        served.add(member)
        # every member served: let go of the input and output
        self._held.last = None if len(served) == len(self.columns) else last
        a, b = self.columns[member]
        return last[1][..., a:b]    # a view: the callers reshape the last axis or multiply

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles hold nothing (a ``threading.local`` is neither)."""
        return {k: v for k, v in self.__dict__.items() if k != "_held"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._held = threading.local()
