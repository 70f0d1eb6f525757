"""Compiling in the background: decode eagerly at once, switch to the compiled forward once it is
warmed up here and measured faster.

A worker is long-lived, so auto compiles (``compile.prepare``), but on a small CPU that is
minutes per graph (docs/COMPILE.md); doing it before consuming left a worker invisible and idle
for half an hour. Here ``prepare`` runs in a daemon thread on *shadow* copies of the loaded
models: they share the modules' weights, but their ``compiled`` slot is their own, so the models
that decode keep running eager PyTorch until ``adopt`` (called by the engine between jobs'
batches, on the decoding thread) moves the warmed forwards over. Dynamo keeps its frame hook
per thread (measured with torch 2.13: eager decoding on one thread, ``torch.compile`` warming up
the same module on another, every eager output unchanged), so the decoding thread never enters
the compiler. The compiled forward computes the same function as the eager one (the compiled
tests hold greedy outputs identical), so a switch between two batches changes no token.

``adopt`` installs nothing when auto found nothing that measured faster here: then every shape
class went to ``eager_classes`` and the compiled forward would only add a dispatch.

``compile="static"`` goes the same way: its shape classes (``compile.static.static_plan``) compile
and warm up here over static caches of their own, while the engine decodes over the static
backend eagerly; ``adopt`` hands the engine the graphs (``graphs``), whose classes compute what the
eager backend computes for the same rows (tests/engine/test_static_cache.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from specbatch.engine.compile.decision import CompilePlan, compile_memory_estimate
from specbatch.engine.compile.forward import StaticForward, compilable
from specbatch.engine.compile.prepare import prepare
from specbatch.engine.compile.record import CompileReport
from specbatch.engine.compile.static import Backend, static_classes, static_plan
from specbatch.engine.compile.warmup import Cancelled, warm_shapes
from specbatch.engine.loading import LoadedModel

logger = logging.getLogger(__name__)

def trace_once_here() -> None:
    """Run, on the decoding thread, the one FX symbolic trace inductor's first lowering does.

    ``torch.fx.symbolic_trace`` patches ``nn.Module.__call__`` for the whole process while it
    traces; a module called on another thread meanwhile goes to that tracer, which raises
    ``NameError: module is not installed as a submodule`` (seen once: the decoding thread's step
    failed mid-job). Inductor traces so only once per process (``InterpreterShim._dummy_gm`` in
    torch/_inductor/loop_body.py, cached; AOTAutograd's tracer passes module calls through), so
    doing it here before the compile thread starts closes that window. A torch without it: nothing
    to settle (tests/engine/test_background_compile.py notices)."""
    try:
        from torch._inductor.loop_body import InterpreterShim
    except ImportError:
        return
    dummy = getattr(InterpreterShim, "_dummy_gm", None)
    if callable(dummy):
        dummy()


class BackgroundCompile:
    """``prepare`` for ``target`` and ``drafts`` in a daemon thread; ``adopt`` installs the result.

    ``state`` says where it is, for a worker to announce ("compiling 2/4 (...)", then
    "compiled", "eager: ..."); ``on_state`` hears each change (from the compiling thread).
    """

    def __init__(self, target: LoadedModel, drafts: Sequence[LoadedModel], *, mode: str, batch_size: int,
                 cache_dir: str, on_state: Callable[[str], None] | None = None,
                 static_backend: Backend | None = None) -> None:
        self.models = [target, *drafts]
        # the same modules and tokenizers, their own compiled slot: what prepare installs lands here
        self.shadows = [dataclasses.replace(m, compiled=None) for m in self.models]
        self.mode, self.batch_size, self.cache_dir = mode, batch_size, cache_dir
        self.on_state = on_state
        self.static_backend = static_backend   # mode "static": the engine's StaticBatchCache factory
        self.graphs: StaticForward | None = None   # mode "static": the classes, once warmed
        self.plan: CompilePlan | None = None
        self.state = "compiling"
        self.adopted = False
        self.seconds = 0.0
        self._reports: list[CompileReport] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specbatch-compile", daemon=True)

    def start(self) -> BackgroundCompile:
        self._set("compiling (decoding eagerly until then)")
        trace_once_here()
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self.plan is not None

    def stop(self) -> None:
        """Stop after the graph now compiling (nothing is adopted then)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def reserved_bytes(self) -> int:
        """Memory the compile adds on CPU while it runs (``compile_memory_estimate``), else 0."""
        # (the estimate counts graphs: a static class, (slots, tokens), is one, spelled as a warm shape)
        shapes = tuple((s, w, w) for s, w in static_classes(self.models[0].device, self.batch_size)) \
            if self.static_backend is not None else warm_shapes(self.batch_size)
        models = [(m, shapes) for m in self.models if compilable(m.model) is None]
        if self.done or not models or torch.device(self.models[0].device).type != "cpu":
            return 0
        return compile_memory_estimate(models)

    def _set(self, state: str) -> None:
        self.state = state
        if self.on_state is not None:
            try:
                self.on_state(state)
            except Exception:   # noqa: BLE001 - announcing must never break compiling
                logger.debug("state callback failed", exc_info=True)

    def _progress(self, what: str) -> None:
        if self._stop.is_set():
            raise Cancelled("stopped")
        self._set(f"{what}, decoding eagerly until then")

    def _run(self) -> None:
        t0 = time.perf_counter()
        target, *drafts = self.shadows
        try:
            if self.static_backend is not None:
                self.graphs, plan = static_plan(target, self.batch_size, self.cache_dir, self.static_backend,
                                                progress=self._progress)
            else:
                plan = prepare(target, drafts, mode=self.mode, batch_size=self.batch_size,
                               cache_dir=self.cache_dir, progress=self._progress)
        except Cancelled:
            plan = CompilePlan(self.mode, False, "compiling stopped (shutting down)")
        except Exception as e:  # noqa: BLE001 - a failed background compile leaves eager serving
            logger.warning("compiling in the background failed, decoding eagerly (%s)", e)
            plan = CompilePlan(self.mode, False, f"compiling failed, eager instead: {e}")
        self.seconds = time.perf_counter() - t0
        self._reports = plan.models
        if plan.enabled and not self._useful():
            plan.enabled = False
            plan.reason += "; no graph measured faster than eager here: decoding stays eager"
        self.plan = plan   # last: ``done`` now, for the decoding thread
        if not plan.enabled:
            logger.info("%s: decoding eagerly: %s", self.models[0].name, plan.reason)
        self._set(f"compiled after {self.seconds:.0f} s" if plan.enabled else f"eager: {plan.reason}")

    def _useful(self) -> bool:
        """Whether some warmed graph serves: auto left eager every shape that measured no faster
        here (``eager_shapes``); ``on`` keeps them all, as told."""
        assert self.plan is None
        if self.static_backend is not None:   # static_plan kept only the classes that paid here
            return self.graphs is not None
        return any(s.compiled is not None and s.compiled.failed is None for s in self.shadows) and \
            any(r.enabled and len(r.eager_shapes) < max(1, len(r.speedups)) for r in self._reports)

    def adopt(self) -> CompilePlan | None:
        """On the decoding thread, between batches: install the warmed forwards once they are
        ready and worth it; returns the plan when this call installed it, else None."""
        if self.adopted or self.plan is None:
            return None
        self.adopted = True
        if not self.plan.enabled:
            return None
        if self.static_backend is None:   # (static: the engine takes ``graphs``)
            for model, shadow in zip(self.models, self.shadows):
                model.compiled = shadow.compiled
        logger.info("compiled forward in use from now on (%s, warmed up in %.0f s in the background)",
                    self.plan.reason, self.seconds)
        return self.plan
