"""Warm-up: compile the graphs a decode will hit before serving, time each against eager on this
machine, and (a first start on CPU) compile the same graphs not frozen and keep the faster."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from specbatch.engine import clock
from specbatch.engine.compile import decision
from specbatch.engine.compile.forward import CompiledForward, ModelHandle, compilable, shape_key
from specbatch.engine.compile.record import CompileReport, marker, write_marker
from specbatch.engine.hf_cache import cache_kwarg

logger = logging.getLogger(__name__)

MEASURE_ROUNDS = 3
# (rows, tokens, kept logits): one of each graph (sizes 1 and more than 1 differ). Fewer kept
# logits than tokens, so the graph does not assume they are equal (a verify after a catch-up
# keeps fewer than it feeds).
WARM_SHAPES: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (1, 4, 2))


def warm_shapes(batch_size: int) -> tuple[tuple[int, int, int], ...]:
    """The graphs a decode will hit: single-sequence steps, and batched ones when batching.

    The batched graphs are warmed at ``batch_size`` rows, not the fewest that make a batched
    graph: max-autotune picks each GEMM's kernel for the rows it is warmed at, and every row count
    then runs that kernel. Plain decoding at batch 16 ran 1.44x eager warmed at 16 rows, 1.16x
    warmed at 2 (docs/COMPILE.md)."""
    if batch_size <= 1:
        return WARM_SHAPES
    return WARM_SHAPES + ((batch_size, 1, 1), (batch_size, 4, 2))


class Cancelled(Exception):
    """A background compile was told to stop (the worker is shutting down): nothing is installed."""


def finish(report: CompileReport, graphs: Any, t0: float) -> None:
    """A warm-up's end, compiled forward's or static classes': its time, the graphs serving from
    now (a call must hit a warmed graph), and whether compiling failed."""
    report.seconds = time.perf_counter() - t0
    graphs.warmed = True
    report.enabled = graphs.failed is None
    report.error = graphs.failed


def warm_up(lm: ModelHandle, shapes: Iterable[tuple[int, int, int]], cache_dir: str | os.PathLike[str],
            progress: Callable[[str], None] | None = None) -> CompileReport:
    """Compile ``lm``'s graphs for ``shapes`` now (before serving); falls back to eager on failure.

    ``progress`` hears "MODEL graph i/n" before each graph; it may raise ``Cancelled`` to stop
    (between graphs: dynamo cannot be interrupted inside one), which propagates."""
    report = CompileReport(model=lm.name)
    compiled = lm.compiled
    if compiled is None:
        report.error = compilable(lm.model) or "not installed"
        return report
    compiled.warmed = False   # compile what misses (a second warm-up may add shapes)
    report.frozen = compiled.frozen
    record = marker(cache_dir, lm, compiled.frozen)
    report.cached = record.exists()
    t0 = time.perf_counter()
    shapes = tuple(shapes)
    try:
        with torch.inference_mode():
            for i, (rows, width, keep) in enumerate(shapes, 1):
                if progress is not None:
                    progress(f"{lm.name} graph {i}/{len(shapes)}")
                cache, ids = _primed(lm, rows, width)
                t = clock.now(lm.device)
                lm.forward(ids, cache, logits_to_keep=keep)
                report.graphs[shape_key(rows, width, keep)] = clock.now(lm.device) - t
                if compiled.failed:
                    break
                report.speedups[shape_key(rows, width, keep)] = measure_speedup(lm, cache, ids, keep)
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 - any compiler failure means: decode eagerly
        compiled.fail(e)
    finish(report, compiled, t0)
    if report.enabled:
        report.first_start_seconds = write_marker(record, report)
    return report


def _primed(lm: ModelHandle, rows: int, width: int) -> tuple[Any, torch.Tensor]:
    """A cache of ``rows`` rows after a 4-token eager prefill, and the (rows, width) step to time
    on it. Call under inference mode."""
    from transformers import DynamicCache

    cache = DynamicCache()
    lm.forward(torch.zeros(rows, 4, dtype=torch.long, device=lm.device), cache, logits_to_keep=1)
    return cache, torch.zeros(rows, width, dtype=torch.long, device=lm.device)


def measure_speedup(lm: ModelHandle, cache: Any, ids: torch.Tensor, keep: int,
                    rounds: int = MEASURE_ROUNDS) -> float:
    """Eager / compiled time of one step of ``ids`` after ``cache``, best of ``rounds``, the two
    alternating so both see the same load; the cache is left as it was."""
    kwarg = cache_kwarg(lm.model)
    best = time_steps({"compiled": lambda: lm.forward(ids, cache, logits_to_keep=keep),
                       "eager": lambda: lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep,
                                                 **{kwarg: cache})},
                      cache, ids.shape[1], rounds, ids.device)
    return best["eager"] / best["compiled"]


def time_steps(steps: dict[str, Callable[[], Any]], cache: Any, width: int, rounds: int,
               device: Any = "cpu") -> dict[str, float]:
    """Best time of each step (each appends ``width`` tokens to ``cache``, cropped back after),
    over ``rounds``, the steps alternating so all see the same load; each timed to the end of its
    work on ``device`` (engine/clock.py: CUDA's kernels run after the call returns)."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            t = clock.now(device)
            step()
            best[name] = min(best[name], clock.now(device) - t)
            cache.crop(-width)
    return best


def compare_not_frozen(lm: ModelHandle, shapes: Iterable[tuple[int, int, int]], cache_dir: str | os.PathLike[str],
                       frozen: CompileReport, rounds: int = 2 * MEASURE_ROUNDS,
                       progress: Callable[[str], None] | None = None) -> CompileReport:
    """A start where frozen graphs fit and no start here compared these shapes: compile the same
    graphs not frozen too, time the two on the same steps (alternating), keep freezing only
    where it measured ``FROZEN_MARGIN`` faster (``keeps_frozen``), and record the comparison in
    the frozen warm-up's record, so later starts compile only the variant kept
    (``recorded_frozen``).

    Call right after ``warm_up`` of the frozen graphs (``frozen``). Returns the report of the
    graphs served, with ``frozen_gain`` (not-frozen / frozen step time per shape) and the time
    of both warm-ups. The graphs not served stay in memory until the process ends (dynamo keeps
    them on the model's code object). Where the not-frozen graphs fail to compile, frozen serves
    and that is recorded (a gain of infinity), so later starts do not try again."""
    shapes = tuple(shapes)
    kept_graphs = lm.compiled
    assert kept_graphs is not None, "compare_not_frozen runs after warm_up of the frozen graphs"
    trial = CompiledForward(lm.model, lm.name, lm.device, frozen=False)
    trial.trial = True
    lm.compiled = trial
    other = warm_up(lm, shapes, cache_dir, progress=progress)
    forwards = {True: kept_graphs, False: trial}
    gain = _time_frozen_against_not(lm, shapes, forwards, rounds) if other.enabled else None
    for f in forwards.values():   # the comparison's calls are not decoding (nor its misses: none)
        f.calls = f.misses = 0
    if gain is None:              # no measurement: frozen serves; only a failed compile is recorded
        lm.compiled = kept_graphs
        if not other.enabled:
            frozen.frozen_gain = {shape_key(*shape): math.inf for shape in shapes}
            write_marker(marker(cache_dir, lm, True), frozen)
        return frozen
    frozen.frozen_gain = gain
    keep_frozen = decision.keeps_frozen(gain)
    write_marker(marker(cache_dir, lm, True), frozen)      # the decision later starts read
    served_graphs = forwards[keep_frozen]
    served_graphs.alternative = forwards[not keep_frozen]
    lm.compiled = served_graphs
    served = frozen if keep_frozen else other
    served.frozen_gain = gain
    # this start paid both: its report (and the bench's first-start column) says so
    served.first_start_seconds = (frozen.first_start_seconds or frozen.seconds) + other.seconds
    served.seconds = frozen.seconds + other.seconds
    served.cached = frozen.cached and other.cached
    return served


def _time_frozen_against_not(lm: ModelHandle, shapes: tuple[tuple[int, int, int], ...],
                             forwards: dict[bool, CompiledForward], rounds: int) -> dict[str, float] | None:
    """Not-frozen / frozen step time per shape, or None where a step did not run through the
    graphs it was to time (a failure or a miss would time eager code; nothing is decided then)."""
    def through(f: CompiledForward, ids: torch.Tensor, cache: Any, keep: int) -> Callable[[], Any]:
        def step() -> Any:
            lm.compiled = f
            return lm.forward(ids, cache, logits_to_keep=keep)
        return step

    gain: dict[str, float] = {}
    try:
        with torch.inference_mode():
            for rows, width, keep in shapes:
                cache, ids = _primed(lm, rows, width)
                best = time_steps({"frozen": through(forwards[True], ids, cache, keep),
                                   "not frozen": through(forwards[False], ids, cache, keep)},
                                  cache, width, rounds, ids.device)
                gain[shape_key(rows, width, keep)] = best["not frozen"] / best["frozen"]
    except Exception as e:  # noqa: BLE001 - a failed comparison must not fail the start
        logger.info("%s: comparing frozen and not-frozen graphs failed (%s)", lm.name, e)
        return None
    if any(f.failed or f.misses for f in forwards.values()):
        return None
    return gain
