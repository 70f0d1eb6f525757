"""Compiled forward: the whole causal LM through ``torch.compile`` (inductor), caches unchanged.

Why this shape (measured, see docs/COMPILE.md): on CPU most of an eager decode step is not the
matrix products but the Python and dispatch overhead around ~30 layers of small ops, and the
LM head's fp32 GEMM, which eager runs once per row. Compiling only the projections would leave
the overhead; a static KV cache would re-implement rollback, holes and row select/extend, and
measured no faster than this design with the same inductor options. So the whole model is
compiled with dynamic shapes over the unchanged ``DynamicCache``: dynamo replays the cache's
``torch.cat`` appends, so crop / index_select / batch select / extend keep working eagerly
between calls. ``inductor_options``: ``freezing`` makes the weights constants, and on CPU
max-autotune picks inductor's C++ GEMM per linear, whose cost hardly grows with the rows, which
is what makes verifying k tokens cost little more than one.

Shapes: one graph per (rows == 1 or more) x (tokens == 1 or more) x (kept logits == 1 or more)
(dynamo specializes sizes 0 and 1); the cache length, row count and token count are symbolic
inside each graph, so no padding to buckets is needed. Every call is normalized to the same
signature (explicit 4-D additive mask, position ids, kept-logit indices), so a chain verify, a
tree verify and a batched step share graphs. A forward over an empty cache (prefill) stays eager.

Artefacts live under ``<cache_dir>/inductor``, shared across processes (frozen graphs bypass the
FX graph cache, so what a later start reuses is kernels and autotuning); ``warm_up`` compiles the
graphs a decode will need, times each against eager on this machine, and records both, so later
starts know whether they hit the cache, how long compiling takes and what it buys here. On CPU
the first start compares frozen with ``NOT_FROZEN`` graphs and keeps freezing only where it pays
(``compare_not_frozen``); where the frozen graphs' weight copies do not fit the memory budget,
CPU compiles them ``NOT_FROZEN`` without comparing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specbatch.engine.hf_cache import cache_kwarg

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
# Eager / compiled decode time end to end, as measured per device type and batch size (rows;
# docs/COMPILE.md), before a warm-up on this machine has measured it (``recorded_speedup``).
# CPU, 2026-12-01, `specbatch bench --threads 1 --compile on --batch-sizes 1,16` on two 2-core
# hosts: 1.80x / 1.25x at batch 1, 1.41x / 1.05x at batch 16; the lower of the two (a guess errs
# towards not compiling). CUDA: not measured yet, the gpt-fast-like prior.
EXPECTED_SPEEDUP: dict[str, dict[int, float]] = {"cpu": {1: 1.25, 16: 1.05}, "cuda": {1: 2.5}}
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
# Where the frozen graphs do not fit, CPU compiles without freezing: the MKL linears read the
# eager weights (no copies: 1243 MiB resident for the default target's 2 graphs, against about
# 1900 frozen), the FX graph cache works, compiling is faster; it loses inductor's C++ GEMM, which
# on one host made a verify nearly free and on another measured no faster (docs/COMPILE.md)
NOT_FROZEN = {"freezing": False, "max_autotune": False}

# The table above is two machines'. The same code and torch measured 1.80x at one row on one
# 2-core host and 1.25x on the next (docs/COMPILE.md, "Measured on each host"), so warm-up times
# each graph against eager on the machine it runs on; in auto mode a shape class that gains less
# than this stays eager, and later starts decide from that measurement instead of the table.
MIN_SPEEDUP = 1.05
MEASURE_ROUNDS = 3
# Frozen or not, measured per host (docs/COMPILE.md, "Frozen or not"): freezing made a verify
# nearly free on one host and bought 0-4% on the next, while it costs a weight copy per graph and
# minutes of compiling at every start (its graphs bypass the FX graph cache). So the first start
# where both fit compiles both and keeps freezing only where it is at least this much faster;
# later starts compile only the one kept. Seconds per not-frozen graph, first and cached (default
# target, host B: 71 s for 2 graphs, 47 s the next start from the FX graph cache).
FROZEN_MARGIN = 1.03
NOT_FROZEN_SECONDS_PER_GRAPH = {False: 36.0, True: 24.0}

_lock = threading.Lock()


def inductor_cache_dir(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / "inductor"


def inductor_options(device: torch.device | str) -> dict[str, Any]:
    """What inductor is told beyond its defaults, per device type.

    CPU: inductor's own C++ micro-GEMM kernels (max-autotune, chosen per linear against
    oneDNN/MKL) stream each weight once for all M rows, which is what makes a verify of k tokens
    cost about one step; the frozen oneDNN linears alone measured no faster than eager at M=1
    (docs/COMPILE.md).
    """
    options: dict[str, Any] = {"freezing": True}  # weights become constants: packed GEMMs, folded ops
    if torch.device(device).type == "cpu":
        options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return options


def configure_inductor(cache_dir: str | os.PathLike[str], device: torch.device | str = "cpu") -> Path:
    """The one place inductor is configured: on-disk caches under ``cache_dir``, ``inductor_options``.

    Inductor reads its cache location from ``TORCHINDUCTOR_CACHE_DIR`` only, so it is set here
    (before the first compile); the value comes from the settings, never from the environment.
    """
    import torch._inductor.config as ic

    path = inductor_cache_dir(cache_dir)
    with _lock:
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        for name, value in inductor_options(device).items():
            setattr(ic, name, value)
        if ic.max_autotune:   # its per-GEMM timing tables go to stderr: not a user's business
            import torch._inductor.select_algorithm as sa

            ic.max_autotune_report_choices_stats = False
            sa.PRINT_AUTOTUNE = False
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                                    module="torch._inductor")
        ic.fx_graph_cache = True        # compiled graphs reused by later processes
        ic.autotune_local_cache = True
        torch._functorch.config.enable_autograd_cache = True  # type: ignore[attr-defined]
        # every graph of every model this process compiles (targets, drafts, their shape variants)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return path


@dataclass
class CompileReport:
    """What compiling a model cost and whether it worked (errors as data)."""

    model: str
    enabled: bool = False
    seconds: float = 0.0                      # warm-up wall time, all graphs
    graphs: dict[str, float] = field(default_factory=dict)   # shape -> seconds of its first call
    frozen: bool | None = None                # weights frozen into the graphs (see NOT_FROZEN)
    speedups: dict[str, float] = field(default_factory=dict)  # shape -> eager / compiled step time here
    eager_shapes: list[str] = field(default_factory=list)     # shapes auto left eager (no gain here)
    frozen_gain: dict[str, float] = field(default_factory=dict)  # shape -> not-frozen / frozen step time
    cached: bool = False                      # a previous process had warmed the same graphs up
    first_start_seconds: float | None = None  # the first (uncached) start's warm-up, as recorded
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "enabled": self.enabled, "seconds": round(self.seconds, 2),
                "graphs": {k: round(v, 2) for k, v in self.graphs.items()},
                "frozen": self.frozen, "speedups": {k: round(v, 3) for k, v in self.speedups.items()},
                "eager_shapes": self.eager_shapes, "cached": self.cached,
                "frozen_gain": {k: round(v, 3) for k, v in self.frozen_gain.items()},
                "first_start_seconds": None if self.first_start_seconds is None
                else round(self.first_start_seconds, 2), "error": self.error}


class CompiledForward:
    """A model's forward through ``torch.compile``; eager for prefill and after a failure."""

    def __init__(self, model: Any, name: str, device: torch.device, frozen: bool = True) -> None:
        self.model = model
        self.name = name
        self.device = device
        self.frozen = frozen or device.type != "cpu"
        self.failed: str | None = None
        # CUDA: CUDA graphs remove the per-kernel launch cost that dominates small batches. With
        # the cache length symbolic, a graph would be re-recorded at every new length, so inductor
        # is told to skip CUDA graphs for dynamic graphs (Triton kernels still fuse); static
        # shapes (a static cache) are what CUDA graphs need - not built, see docs/COMPILE.md
        mode = "reduce-overhead" if device.type == "cuda" else None
        if device.type == "cuda":
            import torch._inductor.config as ic

            ic.triton.cudagraph_skip_dynamic_graphs = True
        # options patch inductor's config for this compile only (configure_inductor set the rest)
        self._fn = (torch.compile(model, dynamic=True, mode=mode) if self.frozen
                    else torch.compile(model, dynamic=True, options=dict(NOT_FROZEN)))
        # after warm_up, a call that fails every warmed graph's guards runs eagerly instead of
        # compiling for minutes; it is counted and warned about, never silent (docs/COMPILE.md)
        self.warmed = False
        self.calls = 0     # calls after warm-up
        self.misses = 0    # of those, how many missed every warmed graph and ran eagerly
        # shape classes (several rows?, several tokens?) whose graph measured no faster than eager
        # on this machine: auto sends them to the eager model (``prepare``)
        self.eager_classes: set[tuple[bool, bool]] = set()
        # the other variant (frozen or not) where a first start compared the two: its graphs stay
        # on the model's code object anyway (``compare_not_frozen``), so it stays servable
        self.alternative: CompiledForward | None = None
        self.trial = False   # compiled only to be compared (``compare_not_frozen``)
        _forwards.add(self)

    def eligible(self, input_ids: torch.Tensor, n_cached: int) -> bool:
        # an empty cache is a prefill (long, once per request, eager GEMMs are fine there) and
        # takes the cache's lazy-initialization path, which would be one more graph
        return (self.failed is None and n_cached >= 2 and input_ids.dim() == 2
                and shape_class(*input_ids.shape) not in self.eager_classes)

    def __call__(self, input_ids: torch.Tensor, cache: Any, cache_kwarg: str, n_cached: int,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
        rows, width = input_ids.shape
        dev = input_ids.device
        # a crop (rollback) leaves the cache as views whose strides still reflect the longer
        # length; the graphs assume contiguous cache tensors, and a view would recompile them
        for layer in getattr(cache, "layers", ()):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is not None and not keys.is_contiguous():
                layer.keys = keys.contiguous()
            if values is not None and not values.is_contiguous():
                layer.values = values.contiguous()
        # one signature for every call, as warmed up: a 4-D additive mask (a 2-D padding mask, the
        # dense path's, is folded into the causal one), position ids, contiguous inference tensors.
        # Anything else fails a guard of the warmed graphs (dispatch keys, stride 0 of an expanded
        # tensor), and after warm-up a miss runs eagerly: silently no faster (tests hold this)
        if attention_mask is None or attention_mask.dim() == 2:
            causal = causal_mask(rows, width, n_cached, self.model.dtype, dev)
            if attention_mask is not None:
                causal = causal.masked_fill(attention_mask[:, None, None, :] == 0,
                                            torch.finfo(self.model.dtype).min)
            attention_mask = causal
        if position_ids is None:
            position_ids = (n_cached + torch.arange(width, device=dev)).expand(rows, width)
        keep = width
        if isinstance(logits_to_keep, int):
            keep = width if logits_to_keep == 0 else min(logits_to_keep, width)
            # one kept logit would be a graph of its own (sizes 1 are specialized): keep two and
            # drop one here, one extra LM-head row costs next to nothing in a pre-packed GEMM
            logits_to_keep = torch.arange(width - max(keep, min(2, width)), width, device=dev)
        with torch.inference_mode():   # contiguous: an expanded (stride 0) input is a graph of its own
            input_ids, attention_mask, position_ids, logits_to_keep = (
                t.contiguous() if t.is_inference() else t.clone(memory_format=torch.contiguous_format)
                for t in (input_ids, attention_mask, position_ids, logits_to_keep))
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "logits_to_keep": logits_to_keep, "use_cache": True, cache_kwarg: cache, **kwargs}
        out = self._fn(**inputs) if not self.warmed else self._served(inputs)
        if out.logits.shape[1] != keep:
            out.logits = out.logits[:, -keep:]
        return out

    def _served(self, inputs: dict[str, Any]) -> Any:
        """A call after warm-up: through a warmed graph, or eagerly (counted) when it misses them
        all. The stance is scoped to this call: nothing else in the process is affected."""
        self.calls += 1
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._fn(**inputs)
        except RuntimeError as e:   # raised by dynamo before the frame runs: the cache is untouched
            if not str(e).startswith(_MISS):
                raise
            self.misses += 1
            _warn_once(f"miss {self.name}", _miss_message, self.name, e)
            return self.model(**inputs)

    def fail(self, error: BaseException) -> None:
        """Give up compiling this model: log one warning (per process), stay eager from now on.
        A trial (``compare_not_frozen``'s not-frozen graphs) only logs: the frozen ones serve."""
        self.failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}" \
            if str(error).strip() else type(error).__name__
        if self.trial:
            logger.info("%s: the not-frozen graphs failed to compile (%s); frozen ones serve", self.name, self.failed)
            return
        _warn_once("compile", "compiling {} failed, decoding eagerly instead ({})".format, self.name, self.failed)


_warned: set[str] = set()
_forwards: weakref.WeakSet[CompiledForward] = weakref.WeakSet()
# how dynamo's fail_on_recompile stance words a miss (torch is pinned; a unit test holds this)
_MISS = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def forward_counts() -> dict[str, tuple[int, int]]:
    """Per model name: (calls after warm-up, of which missed every warmed graph and ran eagerly),
    over the compiled forwards alive in this process."""
    out: dict[str, tuple[int, int]] = {}
    for f in list(_forwards):
        calls, misses = out.get(f.name, (0, 0))
        out[f.name] = (calls + f.calls, misses + f.misses)
    return out


def _warn_once(key: str, message: Callable[..., str], *args: Any) -> None:
    """One warning per ``key`` and process (``message(*args)`` is built only then)."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message(*args))


def _miss_message(name: str, error: BaseException) -> str:
    # dynamo lists the guard failures as "- ..." lines of its fail_on_recompile error
    reasons = [ln.strip().lstrip("- ") for ln in str(error).splitlines() if ln.strip().startswith("- ")]
    return (f"{name}: a decode step matched no warmed compiled graph and ran eagerly "
            f"({'; '.join(reasons[:3]) or 'no guard reason given'}); further misses are counted, "
            "not logged (specbatch_compiled_forward_misses)")


def causal_mask(rows: int, width: int, n_cached: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """(rows, 1, width, n_cached + width) additive mask: every cached column, causal on the new."""
    cols = torch.arange(n_cached + width, device=device)
    allowed = cols[None, :] <= (n_cached + torch.arange(width, device=device))[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].expand(rows, 1, width, n_cached + width)


def compilable(model: Any) -> str | None:
    """None when the model can be compiled here, else why not."""
    if any("quantized" in type(m).__module__ for m in model.modules()):
        return "dynamically quantized (int8) layers are not compiled"
    return None


def install(lm: Any, frozen: bool = True) -> CompiledForward | None:
    """Route ``lm.forward`` through a compiled forward (compiled lazily, see ``warm_up``)."""
    why = compilable(lm.model)
    if why is not None:
        logger.info("%s: not compiled: %s", lm.name, why)
        return None
    lm.compiled = CompiledForward(lm.model, lm.name, lm.device, frozen=frozen)
    return lm.compiled


def shape_class(rows: int, tokens: int) -> tuple[bool, bool]:
    """Which graph a call of ``rows`` x ``tokens`` runs (dynamo specializes sizes 1 apart)."""
    return rows > 1, tokens > 1


def shape_key(rows: int, tokens: int, keep: int) -> str:
    return f"{rows}x{tokens}:{keep}"


def rows_x_tokens(key: str) -> str:
    """A ``shape_key`` as users read it: "16x4:2" -> "16x4" (the kept-logit count is internal)."""
    return key.split(":")[0]


def key_class(key: str) -> tuple[bool, bool]:
    """The shape class of a ``shape_key`` ("16x4:2"); ValueError for anything else."""
    rows, tokens = (int(x) for x in key.split(":")[0].split("x"))
    return shape_class(rows, tokens)


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


def warm_up(lm: Any, shapes: Iterable[tuple[int, int, int]], cache_dir: str | os.PathLike[str],
            progress: Callable[[str], None] | None = None) -> CompileReport:
    """Compile ``lm``'s graphs for ``shapes`` now (before serving); falls back to eager on failure.

    ``progress`` hears "MODEL graph i/n" before each graph; it may raise ``Cancelled`` to stop
    (between graphs: dynamo cannot be interrupted inside one), which propagates."""
    from transformers import DynamicCache

    report = CompileReport(model=lm.name)
    compiled: CompiledForward | None = getattr(lm, "compiled", None)
    if compiled is None:
        report.error = compilable(lm.model) or "not installed"
        return report
    compiled.warmed = False   # compile what misses (a second warm-up may add shapes)
    report.frozen = compiled.frozen
    marker = _marker(cache_dir, lm, compiled.frozen)
    report.cached = marker.exists()
    t0 = time.perf_counter()
    shapes = tuple(shapes)
    try:
        with torch.inference_mode():
            for i, (rows, width, keep) in enumerate(shapes, 1):
                if progress is not None:
                    progress(f"{lm.name} graph {i}/{len(shapes)}")
                cache = DynamicCache()
                prefix = torch.zeros(rows, 4, dtype=torch.long, device=lm.device)
                lm.forward(prefix, cache, logits_to_keep=1)      # eager prefill
                ids = torch.zeros(rows, width, dtype=torch.long, device=lm.device)
                t = time.perf_counter()
                lm.forward(ids, cache, logits_to_keep=keep)
                report.graphs[shape_key(rows, width, keep)] = time.perf_counter() - t
                if compiled.failed:
                    break
                report.speedups[shape_key(rows, width, keep)] = measure_speedup(lm, cache, ids, keep)
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 - any compiler failure means: decode eagerly
        compiled.fail(e)
    report.seconds = time.perf_counter() - t0
    compiled.warmed = True
    report.enabled = compiled.failed is None
    report.error = compiled.failed
    if report.enabled:
        report.first_start_seconds = _write_marker(marker, report)
    return report


def measure_speedup(lm: Any, cache: Any, ids: torch.Tensor, keep: int,
                    rounds: int = MEASURE_ROUNDS) -> float:
    """Eager / compiled time of one step of ``ids`` after ``cache``, best of ``rounds``, the two
    alternating so both see the same load; the cache is left as it was."""
    kwarg = cache_kwarg(lm.model)
    best = time_steps({"compiled": lambda: lm.forward(ids, cache, logits_to_keep=keep),
                       "eager": lambda: lm.model(input_ids=ids, use_cache=True, logits_to_keep=keep,
                                                 **{kwarg: cache})},
                      cache, ids.shape[1], rounds)
    return best["eager"] / best["compiled"]


def time_steps(steps: dict[str, Callable[[], Any]], cache: Any, width: int, rounds: int) -> dict[str, float]:
    """Best time of each step (each appends ``width`` tokens to ``cache``, cropped back after),
    over ``rounds``, the steps alternating so all see the same load."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t)
            cache.crop(-width)
    return best


def compare_not_frozen(lm: Any, shapes: Iterable[tuple[int, int, int]], cache_dir: str | os.PathLike[str],
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
    kept_graphs: CompiledForward = lm.compiled
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
            _write_marker(_marker(cache_dir, lm, True), frozen)
        return frozen
    frozen.frozen_gain = gain
    keep_frozen = keeps_frozen(gain)
    _write_marker(_marker(cache_dir, lm, True), frozen)      # the decision later starts read
    lm.compiled = forwards[keep_frozen]
    lm.compiled.alternative = forwards[not keep_frozen]
    served = frozen if keep_frozen else other
    served.frozen_gain = gain
    # this start paid both: its report (and the bench's first-start column) says so
    served.first_start_seconds = (frozen.first_start_seconds or frozen.seconds) + other.seconds
    served.seconds = frozen.seconds + other.seconds
    served.cached = frozen.cached and other.cached
    return served


def _time_frozen_against_not(lm: Any, shapes: tuple[tuple[int, int, int], ...],
                             forwards: dict[bool, CompiledForward], rounds: int) -> dict[str, float] | None:
    """Not-frozen / frozen step time per shape, or None where a step did not run through the
    graphs it was to time (a failure or a miss would time eager code; nothing is decided then)."""
    from transformers import DynamicCache

    def through(f: CompiledForward, ids: torch.Tensor, cache: Any, keep: int) -> Callable[[], Any]:
        def step() -> Any:
            lm.compiled = f
            return lm.forward(ids, cache, logits_to_keep=keep)
        return step

    gain: dict[str, float] = {}
    try:
        with torch.inference_mode():
            for rows, width, keep in shapes:
                cache = DynamicCache()
                lm.forward(torch.zeros(rows, 4, dtype=torch.long, device=lm.device), cache, logits_to_keep=1)
                ids = torch.zeros(rows, width, dtype=torch.long, device=lm.device)
                best = time_steps({"frozen": through(forwards[True], ids, cache, keep),
                                   "not frozen": through(forwards[False], ids, cache, keep)},
                                  cache, width, rounds)
                gain[shape_key(rows, width, keep)] = best["not frozen"] / best["frozen"]
    except Exception as e:  # noqa: BLE001 - a failed comparison must not fail the start
        logger.info("%s: comparing frozen and not-frozen graphs failed (%s)", lm.name, e)
        return None
    if any(f.failed or f.misses for f in forwards.values()):
        return None
    return gain


def keeps_frozen(gain: dict[str, float]) -> bool:
    """Whether the frozen graphs are worth their memory and compile time: their step time beats
    the not-frozen one's by ``FROZEN_MARGIN`` (geometric mean over the shapes measured)."""
    values = [g for g in gain.values() if g > 0]
    if not values:
        return True
    return math.exp(sum(math.log(g) for g in values) / len(values)) >= FROZEN_MARGIN


def _marker(cache_dir: str | os.PathLike[str], lm: Any, frozen: bool = True) -> Path:
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{lm.name}-{lm.info.get('source', '')}")
    # graphs compiled with other inductor options are not these (nor are their times and ratios)
    tag = "-".join(f"{v}" for k, v in sorted(inductor_options(lm.device).items()) if k != "freezing")
    tag = "".join(c if c.isalnum() else "_" for c in tag) or "default"
    if not frozen and torch.device(lm.device).type == "cpu":
        tag = "not_frozen"
    return inductor_cache_dir(cache_dir) / "specbatch-warm" / f"{key[-120:]}-{torch.__version__}-{tag}.json"


def _write_marker(marker: Path, report: CompileReport) -> float:
    """Record this warm-up; returns the first start's seconds. Kept from the record before: that
    first start's time (what a cold machine pays) and the frozen / not-frozen comparison (what
    every later start follows, ``recorded_frozen``), which only a first start measures."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    data = report.to_dict()
    first = report.seconds
    try:
        before = json.loads(marker.read_text()) if marker.exists() else {}
    except (OSError, ValueError):
        before = {}
    before = before if isinstance(before, dict) else {}
    if not data["frozen_gain"] and isinstance(before.get("frozen_gain"), dict):
        data["frozen_gain"] = before["frozen_gain"]
    try:
        first = float(before.get("first_start_seconds") or first)
    except (TypeError, ValueError):
        pass
    data["first_start_seconds"] = first
    tmp.write_text(json.dumps(data))
    os.replace(tmp, marker)
    return first


def is_cached(lm: Any, cache_dir: str | os.PathLike[str], frozen: bool = True) -> bool:
    """Whether a previous process warmed this model's compiled graphs up under ``cache_dir``."""
    return _marker(cache_dir, lm, frozen).exists()


def _recorded(lm: Any, cache_dir: str | os.PathLike[str], frozen: bool = True) -> dict[str, Any]:
    try:
        data = json.loads(_marker(cache_dir, lm, frozen).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_seconds(lm: Any, cache_dir: str | os.PathLike[str], frozen: bool = True,
                     n_graphs: int | None = None) -> float | None:
    """The last warm-up time of this model here (a cached start), when one was recorded; with
    ``n_graphs``, scaled to that many graphs (a bench warmed 4, a single-row start needs 2)."""
    record = _recorded(lm, cache_dir, frozen)
    try:
        seconds = float(record["seconds"])
    except (KeyError, TypeError, ValueError):
        return None
    warmed = record.get("graphs")
    if n_graphs is not None and isinstance(warmed, dict) and warmed:
        seconds *= n_graphs / len(warmed)
    return seconds


def recorded_frozen(lm: Any, cache_dir: str | os.PathLike[str],
                    shapes: Iterable[tuple[int, int, int]] = ()) -> bool | None:
    """Whether the start here that compared them kept the frozen graphs (``compare_not_frozen``);
    None when no start here compared them, or compared none of some shape class in ``shapes``
    (a batch-1 start's comparison does not decide for batched graphs)."""
    gain = _recorded(lm, cache_dir, True).get("frozen_gain")
    if not isinstance(gain, dict) or not gain:
        return None
    try:
        gain = {str(k): float(v) for k, v in gain.items()}
        if not {shape_class(r, w) for r, w, _ in shapes} <= {key_class(k) for k in gain}:
            return None
        return keeps_frozen(gain)
    except (TypeError, ValueError):     # a record written by other code: not a measurement
        return None


def recorded_speedup(lm: Any, cache_dir: str | os.PathLike[str], rows: int, frozen: bool = True) -> float | None:
    """What the last warm-up here measured for one-token steps of ``rows`` rows' class (plain
    decoding, most of a job's steps), when it measured it."""
    for key, value in (_recorded(lm, cache_dir, frozen).get("speedups") or {}).items():
        try:
            if key_class(key) == shape_class(rows, 1):
                return float(value)
        except (TypeError, ValueError):   # a record written by other code: not a measurement
            continue
    return None


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers, a tied tensor counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"}
    return sum(storages.values())


def compile_memory_estimate(models: list[tuple[Any, tuple[tuple[int, int, int], ...]]],
                            frozen: bool = True) -> int:
    """Bytes compiling ``models`` (each with the shapes it warms) adds on CPU."""
    if not frozen:
        return MEMORY_FIXED
    return MEMORY_FIXED + sum(int(weight_bytes(m.model) * MEMORY_PER_GRAPH * len(s)) for m, s in models)


def compile_seconds_estimate(n_graphs: int, cached: bool, frozen: bool = True) -> float:
    if not frozen:
        return n_graphs * NOT_FROZEN_SECONDS_PER_GRAPH[cached]
    per = CACHED_COMPILE_SECONDS_PER_GRAPH if cached else FIRST_COMPILE_SECONDS_PER_GRAPH
    return n_graphs * per


def expected_compile_seconds(lm: Any, n_graphs: int, cache_dir: str | os.PathLike[str], cached: bool,
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


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


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


def eager_step_seconds(lm: Any, prefix: int = 32, rows: int = 1) -> float:
    """One eager decode step of ``rows`` rows of ``lm`` after a short prefix (what auto mode weighs
    compiling by: a step of 8 rows costs more than one of 1, so tokens / rows x the 1-row step
    underestimated a batched job's decoding several times over)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kw = {cache_kwarg(lm.model): cache}
    with torch.inference_mode():
        lm.model(input_ids=torch.zeros(rows, prefix, dtype=torch.long, device=lm.device), use_cache=True,
                 logits_to_keep=1, **kw)
        one = torch.zeros(rows, 1, dtype=torch.long, device=lm.device)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            lm.model(input_ids=one, use_cache=True, logits_to_keep=1, **kw)
            best = min(best, time.perf_counter() - t)
    return best


def _variant(lm: Any, cache_dir: str | os.PathLike[str], frozen_fits: bool,
             shapes: tuple[tuple[int, int, int], ...]) -> bool | None:
    """Frozen (True), not (False), or None: compare both at this start (CPU, where both fit and
    no start here has compared these shape classes yet)."""
    if not frozen_fits or torch.device(lm.device).type != "cpu":
        return frozen_fits
    return recorded_frozen(lm, cache_dir, shapes)


def _cached(lm: Any, cache_dir: str | os.PathLike[str], variant: bool | None) -> bool:
    return all(is_cached(lm, cache_dir, v) for v in ((True, False) if variant is None else (variant,)))


def frozen_summary(report: CompileReport) -> str:
    """After a comparison (``compare_not_frozen``): '; freezing gains 1x1 1.01x, 1x4 1.03x here:
    kept not frozen' (not-frozen / frozen step time per shape); else empty."""
    if not report.frozen_gain:
        return ""
    if any(math.isinf(v) for v in report.frozen_gain.values()):
        return "; the not-frozen graphs failed to compile here: kept frozen"
    gains = ", ".join(f"{rows_x_tokens(k)} {v:.2f}x" for k, v in report.frozen_gain.items())
    return f"; freezing gains {gains} here: kept {'frozen' if report.frozen else 'not frozen'}"


def _keep_what_pays(lm: Any, report: CompileReport) -> None:
    """Send the shape classes whose graph measured no faster than eager here to the eager model."""
    for key, speedup in report.speedups.items():
        if speedup < MIN_SPEEDUP:
            lm.compiled.eager_classes.add(key_class(key))
            report.eager_shapes.append(key)


def prepare(target: Any, drafts: list[Any], *, mode: str, batch_size: int,
            cache_dir: str | os.PathLike[str], expected_new_tokens: int | None = None,
            notify: Callable[[str], None] | None = None,
            progress: Callable[[str], None] | None = None) -> CompilePlan:
    """Decide (auto / on / off), then install and warm the compiled forwards up before serving.

    auto compiles only where the compiled forward measured faster than eager: on this machine at
    its last warm-up (``recorded_speedup``), else on this device type (``expected_speedup``); then
    with ``expected_new_tokens`` None (a worker: it serves until stopped) it compiles, and with a
    token count (``run``, ``generate``) only when ``compile_pays``. After warming up, auto leaves
    eager the shape classes that measured no faster than eager (``_keep_what_pays``); on keeps
    every graph, as told (the bench measures them all). ``notify`` hears, before each model
    compiles, that it does and about how long (minutes on a small CPU: a CLI says so);
    ``progress`` hears "compiling i/n" before each graph (see ``warm_up``; a background compile
    stops through it).
    """
    mode = resolve_mode(mode)
    if mode == "off":
        return CompilePlan(mode, False, "compile off")
    models = [(m, warm_shapes(batch_size)) for m in (target, *drafts)]
    models = [(m, s) for m, s in models if compilable(m.model) is None]
    if not models:
        return CompilePlan(mode, False, "no model can be compiled (int8 layers)")
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
                return CompilePlan(mode, False, f"auto: {why}")
            logger.warning("%s; decoding may run short of memory", why)
    # per model: True frozen, False not, None: this start compiles both and keeps what pays here
    variants = {id(m): _variant(m, cache_dir, frozen, s) for m, s in models}
    if variants[id(target)] is False and frozen:
        not_frozen = (f"; not frozen: frozen graphs measured less than {FROZEN_MARGIN:.2f}x faster here "
                      "at the first start, so they are not worth their memory and compile time")
    measured = recorded_speedup(target, cache_dir, batch_size, variants[id(target)] is not False)
    speedup = measured if measured is not None else expected_speedup(target.device, batch_size)
    if mode == "auto" and speedup < MIN_SPEEDUP:
        where = (f"here ({speedup:.2f}x at the last warm-up)" if measured is not None
                 else f"on {torch.device(target.device).type} (docs/COMPILE.md)")
        return CompilePlan(mode, False, f"auto: the compiled forward measured no faster than eager {where}")
    if mode == "auto" and expected_new_tokens is not None:
        cached = all(_cached(m, cache_dir, variants[id(m)]) for m, _ in models)
        estimate = sum(expected_compile_seconds(m, len(s), cache_dir, cached, variants[id(m)]) for m, s in models)
        rows = max(1, batch_size)
        decode = expected_new_tokens / rows * eager_step_seconds(target, rows=rows)
        # the saving, not the decode time, is what compiling is weighed against: "1341 s of
        # decoding would not repay 884 s of compiling" read backwards to a user
        worth = (f"about {_secs(estimate)} and save about {_secs(decode * (1 - 1 / speedup))} of the job's "
                 f"about {_secs(decode)} of eager decoding (at {speedup:.2f}x)")
        if not compile_pays(decode, estimate, cached, speedup):
            return CompilePlan(mode, False, f"auto: compiling would take {worth}")
        reason = f"auto: compiling takes {worth}"
    else:
        reason = "compile on" if mode == "on" else "auto: a long-lived worker"
    configure_inductor(cache_dir, target.device)
    reason += not_frozen
    plan = CompilePlan(mode, True, reason)
    total = sum(len(s) * (2 if variants[id(m)] is None else 1) for m, s in models)
    done = [0]

    def step(what: str) -> None:   # "compiling 2/4 (smollm2-135m graph 2/4)"
        done[0] += 1
        if progress is not None:
            progress(f"compiling {done[0]}/{total} ({what})")

    for lm, shapes in models:
        variant = variants[id(lm)]
        if install(lm, frozen=variant is not False) is None:
            continue
        # minutes on a small CPU: say so before the silence (a worker logs it; --compile off skips)
        both = ", frozen and not frozen to compare them here" if variant is None else ""
        seconds = expected_compile_seconds(lm, len(shapes), cache_dir, _cached(lm, cache_dir, variant), variant)
        notice = f"{lm.name}: compiling {len(shapes)} graphs before decoding{both}, about {seconds:.0f} s ({reason})"
        logger.info(notice)
        if notify is not None:
            notify(notice)
        report = warm_up(lm, shapes, cache_dir, progress=step)
        if variant is None and report.enabled:
            report = compare_not_frozen(lm, shapes, cache_dir, report, progress=step)
        plan.models.append(report)
        if mode == "auto":
            _keep_what_pays(lm, report)
        if report.speedups:   # what compiling buys here, in every worker's log
            logger.info("%s: eager / compiled step time here: %s%s%s", lm.name,
                        ", ".join(f"{k} {v:.2f}x" for k, v in report.speedups.items()),
                        f"; {', '.join(report.eager_shapes)} stay eager (under {MIN_SPEEDUP}x)"
                        if report.eager_shapes else "", frozen_summary(report))
        if report.error:  # the toolchain failed: nothing else will compile either
            break
    failed = next((r.error for r in plan.models if r.error), None)
    if failed:
        for lm, _ in models:
            if lm.compiled is not None and lm.compiled.failed is None:
                lm.compiled.failed = failed
        plan.enabled, plan.reason = False, f"compiling failed, eager instead: {failed}"
    return plan
