"""Whether compiling pays: the measured priors, the cost estimates, and the auto / on / off
decision for one engine (``decide``), before anything is compiled."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specbatch.engine import clock
from specbatch.engine.compile.forward import ModelHandle
from specbatch.engine.compile.record import (
    CompileReport,
    is_cached,
    recorded_frozen_gain,
    recorded_seconds,
    recorded_speedup,
)
from specbatch.engine.hf_cache import cache_kwarg

logger = logging.getLogger(__name__)

# static: the target decodes over the static-cache backend with its small-row classes compiled
# (engine/static_cache.py, compile/static.py), not through the compiled forward
COMPILE_MODES = ("auto", "on", "off", "static")
# Eager / compiled decode time end to end, as measured per device type and batch size (rows;
# docs/COMPILE.md), before a warm-up on this machine has measured it (``recorded_speedup``).
# CPU, 2026-12-01, `specbatch bench --threads 1 --compile on --batch-sizes 1,16` on four 2-core
# hosts: 1.78x / 1.25x / 1.17x / 1.84x at batch 1, 1.41x / 1.05x / 1.08x / 1.38x at batch 16
# (docs/COMPILE.md, "Measured on each host"); the lowest host's (a guess errs towards not
# compiling: a worker that compiles for nothing spends a core for a quarter of an hour).
# CUDA: not measured yet, the gpt-fast-like prior.
EXPECTED_SPEEDUP: dict[str, dict[int, float]] = {"cpu": {1: 1.17, 16: 1.05}, "cuda": {1: 2.5}}
# Seconds per graph when nothing is cached and when a previous process warmed the same graphs up
# (default target, 2 threads, max-autotune: 733 s for 4 graphs first, 319 s for 2 cached; the FX
# graph cache is bypassed for frozen graphs, so a cached start saves little)
FIRST_COMPILE_SECONDS_PER_GRAPH = 185.0
CACHED_COMPILE_SECONDS_PER_GRAPH = 160.0

# Resident memory compiling adds on CPU. A compiled model holds its weights again per graph
# (frozen constants, packed for the C++ GEMM), beside the eager module prefill still uses, plus
# the compiler's own state. Measured on the default target (400 MiB of weights, 1 thread):
# +1430 MiB after one graph, +2455 MiB after three (docs/COMPILE.md, "Memory").
MEMORY_PER_GRAPH = 1.25          # x the model's weight bytes
MEMORY_FIXED = 900 * 2**20       # bytes, once per process

# The table above is two machines'. The same code and torch measured 1.80x at one row on one
# 2-core host and 1.25x on the next (docs/COMPILE.md, "Measured on each host"), so warm-up times
# each graph against eager on the machine it runs on; in auto mode a shape class that gains less
# than this stays eager, and later starts decide from that measurement instead of the table.
MIN_SPEEDUP = 1.05
# Frozen or not, measured per host (docs/COMPILE.md, "Frozen or not"): freezing made a verify
# nearly free on one host and bought 0-4% on the next, while it costs a weight copy per graph and
# minutes of compiling at every start (its graphs bypass the FX graph cache). So the first start
# where both fit compiles both and keeps freezing only where it is at least this much faster;
# later starts compile only the one kept. Seconds per not-frozen graph, first and cached (default
# target, host B: 71 s for 2 graphs, 47 s the next start from the FX graph cache).
FROZEN_MARGIN = 1.03
NOT_FROZEN_SECONDS_PER_GRAPH = {False: 36.0, True: 24.0}

Shapes = tuple[tuple[int, int, int], ...]   # (rows, tokens, kept logits) per graph, see warm_shapes


def pays(speedup: float) -> bool:
    """Whether a graph (or a model's compiled forward) gaining ``speedup`` is worth compiling in
    auto mode: strictly more than ``MIN_SPEEDUP``. At exactly the margin a CPU worker would spend
    one of two cores compiling for a quarter of an hour to gain what the measurement's own noise
    can hide (the CPU prior at 8-16 rows is 1.05x)."""
    return speedup > MIN_SPEEDUP


def resolve_mode(mode: str) -> str:
    mode = mode.strip().lower()
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: use one of {', '.join(COMPILE_MODES)}")
    return mode


@dataclass
class CompilePlan:
    """The decision for one engine (auto / on / off) and what warming up cost."""

    mode: str
    enabled: bool
    reason: str
    models: list[CompileReport] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.models)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "enabled": self.enabled, "reason": self.reason,
                "seconds": round(self.seconds, 2), "models": [r.to_dict() for r in self.models]}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tied tensor counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
    return sum(storages.values())


def compile_memory_estimate(models: Sequence[tuple[ModelHandle, Shapes]], frozen: bool = True) -> int:
    """Bytes compiling ``models`` (each with the shapes it warms) adds on CPU."""
    if not frozen:
        return MEMORY_FIXED
    return MEMORY_FIXED + sum(int(weight_bytes(m.model) * MEMORY_PER_GRAPH * len(s)) for m, s in models)


def compile_seconds_estimate(n_graphs: int, cached: bool, frozen: bool = True) -> float:
    if not frozen:
        return n_graphs * NOT_FROZEN_SECONDS_PER_GRAPH[cached]
    per = CACHED_COMPILE_SECONDS_PER_GRAPH if cached else FIRST_COMPILE_SECONDS_PER_GRAPH
    return n_graphs * per


def expected_compile_seconds(lm: ModelHandle, n_graphs: int, cache_dir: str | os.PathLike[str], cached: bool,
                             frozen: bool | None = True) -> float:
    """This model's last recorded warm-up here, else the per-graph prior; ``frozen`` None: both
    variants (a first start that compares them, ``compare_not_frozen``)."""
    if frozen is None:
        return sum(expected_compile_seconds(lm, n_graphs, cache_dir, is_cached(lm, cache_dir, v), v)
                   for v in (True, False))
    return recorded_seconds(lm, cache_dir, frozen, n_graphs) or compile_seconds_estimate(n_graphs, cached, frozen)


def expected_speedup(device: torch.device | str, rows: int = 1) -> float:
    """Eager / compiled decode time measured on this device type at ``rows``; between two measured
    batch sizes the lower of the two (a guess errs towards not compiling); 1.0 (no gain) where
    nothing was measured."""
    table = EXPECTED_SPEEDUP.get(torch.device(device).type, {})
    below = [k for k in table if k <= rows]
    above = [k for k in table if k >= rows]
    near = ([max(below)] if below else []) + ([min(above)] if above else [])
    return min(table[k] for k in near) if near else 1.0


def compile_pays(expected_decode_seconds: float, compile_seconds_estimate: float, cached: bool,
                 speedup: float) -> bool:
    """Whether compiling repays itself: the eager decode time it saves exceeds its cost.

    ``expected_decode_seconds``: eager decoding time of the job (tokens x eager step time);
    ``compile_seconds_estimate``: what warm-up costs (first start or cached, see
    ``compile_seconds_estimate``); ``cached``: whether the on-disk cache holds the graphs (the
    estimate should already reflect it; a cached start is cheap, so ties go to compiling);
    ``speedup``: ``expected_speedup(device)``.
    """
    saved = expected_decode_seconds * (1.0 - 1.0 / speedup)
    return saved > compile_seconds_estimate or (cached and saved >= compile_seconds_estimate)


def keeps_frozen(gain: dict[str, float]) -> bool:
    """Whether the frozen graphs are worth their memory and compile time: their step time beats
    the not-frozen one's by ``FROZEN_MARGIN`` (geometric mean over the shapes measured)."""
    values = [g for g in gain.values() if g > 0]
    if not values:
        return True
    return math.exp(sum(math.log(g) for g in values) / len(values)) >= FROZEN_MARGIN


def recorded_frozen(lm: ModelHandle, cache_dir: str | os.PathLike[str],
                    shapes: Iterable[tuple[int, int, int]] = ()) -> bool | None:
    """Whether the start here that compared them kept the frozen graphs; None when no start here
    compared them for every shape class in ``shapes`` (``recorded_frozen_gain``)."""
    gain = recorded_frozen_gain(lm, cache_dir, shapes)
    return None if gain is None else keeps_frozen(gain)


def variant(lm: ModelHandle, cache_dir: str | os.PathLike[str], frozen_fits: bool, shapes: Shapes) -> bool | None:
    """Frozen (True), not (False), or None: compare both at this start (CPU, where both fit and
    no start here has compared these shape classes yet)."""
    if not frozen_fits or torch.device(lm.device).type != "cpu":
        return frozen_fits
    return recorded_frozen(lm, cache_dir, shapes)


def cached(lm: ModelHandle, cache_dir: str | os.PathLike[str], frozen: bool | None) -> bool:
    """Whether a previous process warmed ``lm``'s variant up here (both, for None)."""
    return all(is_cached(lm, cache_dir, v) for v in ((True, False) if frozen is None else (frozen,)))


def eager_step_seconds(lm: ModelHandle, prefix: int = 32, rows: int = 1) -> float:
    """One eager decode step of ``rows`` rows of ``lm`` after a short prefix (what auto mode weighs
    compiling by: a step of 8 rows costs more than one of 1, so tokens / rows x the 1-row step
    underestimated a batched job's decoding several times over)."""
    from transformers import DynamicCache

    kw = {cache_kwarg(lm.model): DynamicCache()}
    with torch.inference_mode():
        lm.model(input_ids=torch.zeros(rows, prefix, dtype=torch.long, device=lm.device), use_cache=True,
                 logits_to_keep=1, **kw)
        one = torch.zeros(rows, 1, dtype=torch.long, device=lm.device)
        best = float("inf")
        for _ in range(3):
            t = clock.now(lm.device)
            lm.model(input_ids=one, use_cache=True, logits_to_keep=1, **kw)
            best = min(best, clock.now(lm.device) - t)
    return best


def no_gain(speedup: float, measured: bool, target: ModelHandle, batch_size: int) -> str:
    """Why auto does not compile at ``speedup``: where the figure comes from, and the margin."""
    rows = f"{max(1, batch_size)} row{'s' if batch_size > 1 else ''}"
    where = ("measured here at the last warm-up" if measured
             else f"the least any {torch.device(target.device).type} host measured, docs/COMPILE.md; "
                  "a --compile on start measures this one")
    return f"compiling gains {speedup:.2f}x at {rows} ({where}); auto compiles only above {MIN_SPEEDUP:.2f}x"


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


@dataclass
class Decision:
    """What ``decide`` chose: the plan (declined, or enabled with why) and, per model, the
    variant to compile: frozen (True), not (False), or both to compare here (None)."""

    plan: CompilePlan
    variants: dict[int, bool | None] = field(default_factory=dict)   # id(model) -> variant


def decide(target: ModelHandle, models: list[tuple[ModelHandle, Shapes]], mode: str, batch_size: int,
           cache_dir: str | os.PathLike[str], expected_new_tokens: int | None = None) -> Decision:
    """auto / on for ``models`` (those of ``target`` and its drafts that can be compiled, each with
    the graphs it would warm).

    auto compiles only where the compiled forward measured faster than eager: on this machine at
    its last warm-up (``recorded_speedup``), else on this device type (``expected_speedup``); then
    with ``expected_new_tokens`` None (a worker: it serves until stopped) it compiles, and with a
    token count (``run``, ``generate``) only when ``compile_pays``. On CPU the frozen graphs'
    weight copies must fit the memory budget, else they are compiled not frozen."""
    frozen, not_frozen = True, ""
    if torch.device(target.device).type == "cpu":   # measured there only (CUDA: not yet)
        from specbatch.engine.memory import default_budget, format_bytes

        need, budget = compile_memory_estimate(models), default_budget(target.device)
        if need > budget:   # the frozen graphs' weight copies do not fit: compile without them
            frozen = False
            not_frozen = (f"; not frozen: frozen graphs would need about {format_bytes(need)} more memory "
                          f"(a copy of the weights per graph), over the {format_bytes(budget)} budget")
            need = compile_memory_estimate(models, frozen=False)
        if need > budget:
            why = (f"compiling needs about {format_bytes(need)} more memory, over the "
                   f"{format_bytes(budget)} budget of what is free")
            if mode == "auto":
                return Decision(CompilePlan(mode, False, f"auto: {why}"))
            logger.warning("%s; decoding may run short of memory", why)
    # per model: True frozen, False not, None: this start compiles both and keeps what pays here
    variants = {id(m): variant(m, cache_dir, frozen, s) for m, s in models}
    if variants[id(target)] is False and frozen:
        not_frozen = (f"; not frozen: frozen graphs measured less than {FROZEN_MARGIN:.2f}x faster here "
                      "at the first start, so they are not worth their memory and compile time")
    measured = recorded_speedup(target, cache_dir, batch_size, variants[id(target)] is not False)
    speedup = measured if measured is not None else expected_speedup(target.device, batch_size)
    if mode == "auto" and not pays(speedup):
        return Decision(CompilePlan(mode, False, f"auto: {no_gain(speedup, measured is not None, target, batch_size)}"))
    if mode == "auto" and expected_new_tokens is not None:
        hit = all(cached(m, cache_dir, variants[id(m)]) for m, _ in models)
        estimate = sum(expected_compile_seconds(m, len(s), cache_dir, hit, variants[id(m)]) for m, s in models)
        rows = max(1, batch_size)
        decode = expected_new_tokens / rows * eager_step_seconds(target, rows=rows)
        # the saving, not the decode time, is what compiling is weighed against: "1341 s of
        # decoding would not repay 884 s of compiling" read backwards to a user
        worth = (f"about {_secs(estimate)} and save about {_secs(decode * (1 - 1 / speedup))} of the job's "
                 f"about {_secs(decode)} of eager decoding (at {speedup:.2f}x)")
        if not compile_pays(decode, estimate, hit, speedup):
            return Decision(CompilePlan(mode, False, f"auto: compiling would take {worth}"))
        reason = f"auto: compiling takes {worth}"
    else:
        reason = "compile on" if mode == "on" else "auto: a long-lived worker"
    return Decision(CompilePlan(mode, True, reason + not_frozen), variants)
