"""Micro-measurements of step costs: one forward of k tokens after a cached prefix.

T(k) is the time of a target forward scoring k new tokens on top of a KV cache of a
realistic prefix (the cache is cropped back after each timing, so every timing sees the same
length). c = T_draft(1) / T_target(1). Sizes and models are timed round-robin (k=1, 2, ...,
draft, k=1, 2, ...). The harness samples them between its rounds of runs (``CostSampler``) and
keeps medians, so the costs see the same machine load as the runs; ``measure_costs`` is the
stand-alone version (minima of back-to-back timings).

Ratios use the measured T(k) directly; a non-integer k (the mean draft length of adaptive gamma
or of a pool) is interpolated linearly between its integer neighbours, which is the mean cost
when the length alternates between them. T(1) is not on a line with T(k >= 2) on a CPU (one
token is a matrix-vector product; two or more are a matrix-matrix product), so nothing is fitted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from specbatch.engine import clock

COMPILED = "compiled-target"


def _timer(model: Any, device: torch.device, prefix: list[int], k: int,
           full_logits: bool) -> Callable[[], float]:
    """Prefill ``prefix`` once; returns a function timing one forward of k tokens after it.

    ``model``: a transformers model (eager) or a LoadedModel (its ``forward``: compiled if
    installed, see specbatch.engine.compile).
    """
    from specbatch.engine.hf_cache import cache_kwarg
    from specbatch.engine.loading import LoadedModel

    hf = model.model if isinstance(model, LoadedModel) else model
    vocab = int(hf.config.get_text_config().vocab_size)
    new = torch.randint(0, vocab, (1, k), generator=torch.Generator().manual_seed(k)).to(device)
    cache = DynamicCache()

    def call(ids: torch.Tensor, keep: int) -> Any:
        if hf is model:
            return model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(model): cache})
        return model.forward(ids, cache, logits_to_keep=keep)

    with torch.inference_mode():
        call(torch.tensor([prefix], device=device), 1)

    def once() -> float:
        with torch.inference_mode():
            t0 = clock.now(device)
            call(new, 0 if full_logits else 1)
            seconds = clock.now(device) - t0
            cache.crop(-k)
        return seconds

    return once


@dataclass
class CostTable:
    """Measured step costs (seconds) at one prefix length."""

    prefix_tokens: int
    target: dict[int, float] = field(default_factory=dict)   # k -> T(k)
    compiled: dict[int, float] = field(default_factory=dict)  # k -> T(k) through the compiled forward
    drafts: dict[str, float] = field(default_factory=dict)   # draft name -> T_draft(1)
    spread: dict[str, float] = field(default_factory=dict)   # "model:k" -> max / min of timings

    def t(self, k: float) -> float:
        """T(k) in seconds: measured at integer k, linear between measured neighbours, flat beyond.

        Through the compiled forward when it was measured (ours decode through it then)."""
        table = self.compiled or self.target
        if k in table:
            return table[k]  # type: ignore[index]
        ks = sorted(table)
        below = [m for m in ks if m < k]
        above = [m for m in ks if m > k]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (k - lo) / (hi - lo)
            return table[lo] * (1 - w) + table[hi] * w
        return table[below[-1] if below else above[0]]

    def c(self, draft: str) -> float:
        """Cost ratio c of a drafter: T_draft(1) / T(1) (0 for a model-free one such as ngram)."""
        if draft not in self.drafts:
            return 0.0
        return self.drafts[draft] / self.t(1)

    def verify_ratio(self, k: float) -> float:
        """T(k) / T(1)."""
        return self.t(k) / self.t(1)

    def to_dict(self) -> dict[str, Any]:
        return {"prefix_tokens": self.prefix_tokens,
                "target_step_ms": {str(k): v * 1e3 for k, v in sorted(self.target.items())},
                "verify_ratio": {str(k): v / self.target[1] for k, v in sorted(self.target.items())},
                "draft_step_ms": {n: v * 1e3 for n, v in self.drafts.items()},
                "c": {n: self.c(n) for n in self.drafts},
                **({"compiled_step_ms": {str(k): v * 1e3 for k, v in sorted(self.compiled.items())},
                    "compiled_verify_ratio": {str(k): v / self.compiled[1]
                                              for k, v in sorted(self.compiled.items())},
                    "compiled_vs_eager": {str(k): v / self.target[k] for k, v in sorted(self.compiled.items())
                                          if k in self.target}} if self.compiled else {}),
                "max_over_min": self.spread}


class CostSampler:
    """Times every size and model once per ``sample()`` call; call it between benchmark rounds so
    the step costs see the same machine load as the runs they explain."""

    def __init__(self, target: Any, drafts: dict[str, Any], device: torch.device, prefix: list[int],
                 ks: Iterable[int], compiled_target: Any = None) -> None:
        """``compiled_target``: a LoadedModel with a compiled forward, timed beside the eager one."""
        self.prefix_tokens = len(prefix)
        self.timers: dict[tuple[str, int], Callable[[], float]] = {}
        for k in sorted(set(ks) | {1}):   # eager and compiled alternate at each k
            self.timers[("", k)] = _timer(target, device, prefix, k, full_logits=True)
            if compiled_target is not None:
                self.timers[(COMPILED, k)] = _timer(compiled_target, device, prefix, k, full_logits=True)
        for name, model in drafts.items():
            self.timers[(name, 1)] = _timer(model, device, prefix, 1, full_logits=False)
        self.samples: dict[tuple[str, int], list[float]] = {key: [] for key in self.timers}

    def sample(self, times: int = 1) -> None:
        for _ in range(times):
            for key, once in self.timers.items():
                self.samples[key].append(once())

    def table(self) -> CostTable:
        """Medians of the samples (they span the run, so the median is the run's typical cost)."""
        table = CostTable(prefix_tokens=self.prefix_tokens)
        for (name, k), values in self.samples.items():
            if not values:
                continue
            if name == COMPILED:
                table.compiled[k] = statistics.median(values)
            elif name:
                table.drafts[name] = statistics.median(values)
            else:
                table.target[k] = statistics.median(values)
            table.spread[f"{name or 'target'}:{k}"] = max(values) / min(values)
        return table


def measure_costs(target: Any, drafts: dict[str, Any], device: torch.device, prefix: list[int],
                  ks: Iterable[int], *, repeats: int = 7, warmup: int = 2) -> CostTable:
    """T(k) of the target for every k in ``ks`` (1 always), T(1) of each draft model (minima)."""
    sizes = sorted(set(ks) | {1})
    timers: dict[tuple[str, int], Callable[[], float]] = {
        ("", k): _timer(target, device, prefix, k, full_logits=True) for k in sizes}
    for name, model in drafts.items():
        timers[(name, 1)] = _timer(model, device, prefix, 1, full_logits=False)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in timers}
    for i in range(warmup + repeats):
        for key, once in timers.items():
            seconds = once()
            if i >= warmup:
                samples[key].append(seconds)
    table = CostTable(prefix_tokens=len(prefix))
    for (name, k), values in samples.items():
        if name:
            table.drafts[name] = min(values)
        else:
            table.target[k] = min(values)
        table.spread[f"{name or 'target'}:{k}"] = statistics.median(values) / min(values)
    return table
