"""The static-cache backend's compiled shape classes: which to compile, compiling them before
serving, timing each against the same backend eagerly, keeping the ones that pay here.

``StaticBatchCache`` (engine/static_cache.py) sends a compiled class's call at a fixed shape:
(slots, new tokens, columns), the columns dynamic on CPU and one fixed capacity on CUDA
(``FIXED_COLUMNS``). Which classes are worth a graph is a
per-device measurement (docs/COMPILE.md, "The static-cache backend"): on a small CPU inductor's
C++ GEMM template wins where the rows are few and the eager packed products are as good from ~8 rows,
so CPU compiles one-token steps of up to ``MAX_SLOTS["cpu"]`` slots (a batch's drain, as rows
finish); on CUDA every slot bucket up to the batch (CUDA graphs remove launch costs at any size).
Records, failure handling and the inductor cache directory are the compiled forward's
(``record``, ``forward.Graphs``, ``inductor``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from specbatch.engine import clock
from specbatch.engine.compile.decision import CompilePlan, compile_seconds_estimate, pays
from specbatch.engine.compile.forward import ModelHandle, StaticForward, compilable, shape_key
from specbatch.engine.compile.inductor import configure_inductor
from specbatch.engine.compile.prepare import CompileNotice
from specbatch.engine.compile.record import CompileReport, marker, write_marker
from specbatch.engine.compile.warmup import Cancelled, finish

logger = logging.getLogger(__name__)

# the most slots a one-token class compiles for, per device type: on a 2-core CPU the compiled
# step measured 2.2-2.4x eager at 1-4 slots, 0.95x at 8, 0.76x at 16 (docs/COMPILE.md)
MAX_SLOTS = {"cpu": 4}
# the one column capacity a class is compiled at, per device type; absent: the columns are dynamic.
# On CUDA every size of a CUDA graph is static, and classes warmed at one bucket missed at every
# other (an H200, docs/bench/report-gpu.md); there attention over masked columns is cheap beside the
# launches a graph saves. A row past it decodes eagerly (its misses are counted).
FIXED_COLUMNS = {"cuda": 2048}
PRIMED = 100        # tokens a row has cached when a class is timed (a decode's column counts)
ROUNDS = 3


Backend = Callable[[int, StaticForward | None], Any]
"""(slots, graphs or None: eager) -> an empty ``StaticBatchCache`` of the model being compiled
(passed in: this package imports nothing of the engine's modules that load models)."""


def static_classes(device: torch.device | str, batch_size: int, widths: Iterable[int] = (1,)
                   ) -> list[tuple[int, int]]:
    """(slots, new tokens) classes to compile for a batch of up to ``batch_size`` rows: every
    power-of-two slot count up to the batch's (``static_cache.slots_for``), capped per device
    type (``MAX_SLOTS``)."""
    top = 1 << max(0, batch_size - 1).bit_length()
    cap = MAX_SLOTS.get(torch.device(device).type)
    slots = [1 << i for i in range(top.bit_length()) if cap is None or 1 << i <= cap]
    return [(s, w) for w in widths for s in slots]


def prepare_static(lm: ModelHandle, classes: Iterable[tuple[int, int]], cache_dir: str | os.PathLike[str],
                   backend: Backend, *, keep_all: bool = False, progress: Callable[[str], None] | None = None
                   ) -> tuple[StaticForward | None, CompileReport]:
    """Compile and warm ``classes`` up now, each timed against the static backend eagerly at
    the same rows; without ``keep_all`` only the classes that measured faster here
    (``decision.pays``) stay compiled. Returns the graphs (None: nothing compiles, the report
    says why) and the report, also recorded under ``cache_dir`` (``record.marker``, static)."""
    report = CompileReport(model=lm.name)
    classes = list(classes)
    if (why := compilable(lm.model)) is not None:
        report.error = why
        return None, report
    configure_inductor(lm.device)
    graphs = StaticForward(lm.model, lm.name, lm.device, classes, columns=FIXED_COLUMNS.get(lm.device.type))
    report.frozen = graphs.frozen
    record = marker(cache_dir, lm, graphs.frozen, static=True)
    report.cached = record.exists()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for i, (slots, width) in enumerate(classes, 1):
                if progress is not None:
                    progress(f"{lm.name} static graph {i}/{len(classes)}")
                compiled, eager = backend(slots, graphs), backend(slots, None)
                for b in (compiled, eager):
                    b.forward([list(range(1, PRIMED + 1))] * slots, 1)
                feed = [[7] * width] * slots
                t = clock.now(lm.device)
                compiled.forward(feed, width)
                compiled.drop_tail([width] * slots)
                key = shape_key(slots, width, width)
                report.graphs[key] = clock.now(lm.device) - t
                if graphs.failed:
                    break
                report.speedups[key] = _speedup(eager, compiled, feed, lm.device)
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 - any compiler failure means: decode eagerly
        graphs.fail(e)
    finish(report, graphs, t0)
    if not report.enabled:
        return None, report
    if not keep_all:
        for slots, width in classes:
            key = shape_key(slots, width, width)
            if key in report.speedups and not pays(report.speedups[key]):
                graphs.classes.discard((slots, width))
                report.eager_shapes.append(key)
    report.first_start_seconds = write_marker(record, report)
    logger.info("%s: static classes compiled in %.0f s; eager / compiled step here: %s; eager: %s",
                lm.name, report.seconds, {k: round(v, 2) for k, v in report.speedups.items()},
                report.eager_shapes or "none")
    return (graphs if graphs.classes else None), report


def _speedup(eager: Any, compiled: Any, feed: list[list[int]], device: torch.device,
             rounds: int = ROUNDS) -> float:
    """Eager / compiled time of one step of ``feed`` over the same cached rows, best of
    ``rounds``, alternating (the same load); each step rolled back after."""
    best = {"eager": float("inf"), "compiled": float("inf")}
    width = len(feed[0])
    for _ in range(rounds):
        for name, backend in (("eager", eager), ("compiled", compiled)):
            t = clock.now(device)
            backend.forward(feed, width)
            best[name] = min(best[name], clock.now(device) - t)
            backend.drop_tail([width] * len(feed))
    return best["eager"] / best["compiled"]


def static_plan(lm: ModelHandle, batch_size: int, cache_dir: str | os.PathLike[str], backend: Backend,
                notify: Callable[[CompileNotice], None] | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[StaticForward | None, CompilePlan]:
    """``compile="static"``: the classes ``static_classes`` picks for ``batch_size`` rows,
    compiled and warmed up now, those that measured no faster here left eager. Returns the
    graphs for the engine's ``StaticBatchCache``s and the plan (its report, or why not);
    ``progress`` hears each class as it starts (``prepare_static``)."""
    classes = static_classes(lm.device, batch_size)
    cached = marker(cache_dir, lm, static=True).exists()
    reason = f"static-cache classes (slots x tokens) {', '.join(f'{s}x{w}' for s, w in classes)}"
    if notify is not None:
        notify(CompileNotice(lm.name, len(classes), False, compile_seconds_estimate(len(classes), cached), reason))
    graphs, report = prepare_static(lm, classes, cache_dir, backend, progress=progress)
    if not report.enabled:
        reason = f"compiling failed, eager instead: {report.error}"
    elif graphs is None:
        measured = ", ".join(f"{k.split(':')[0]} {v:.2f}x" for k, v in report.speedups.items())
        reason = f"static: no class measured faster than eager here ({measured}); the static cache runs eagerly"
    elif report.eager_shapes:   # the classes that serve, not those asked for (a worker logs it as in use)
        kept = ", ".join(f"{s}x{w}" for s, w in sorted(graphs.classes))
        eager = [k.split(":")[0] for k in report.eager_shapes]
        reason = (f"static-cache classes (slots x tokens) {kept} compiled; {', '.join(eager)} "
                  f"{'stays' if len(eager) == 1 else 'stay'} eager (no faster here)")
    return graphs, CompilePlan("static", graphs is not None, reason, models=[report])
