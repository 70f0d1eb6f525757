"""``prepare``: decide, install the compiled forwards, warm them up, keep what pays here."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specbatch.engine.compile import decision, forward, inductor, warmup
from specbatch.engine.compile.decision import MIN_SPEEDUP, CompilePlan, Shapes, pays
from specbatch.engine.compile.forward import ModelHandle, compilable, key_class
from specbatch.engine.compile.record import CompileReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileNotice:
    """Before a model compiles (minutes on a small CPU): what ``prepare`` tells ``notify``."""

    model: str
    graphs: int
    compare: bool      # frozen and not frozen, to compare them here (``compare_not_frozen``)
    seconds: float     # about how long (``expected_compile_seconds``)
    reason: str        # the plan's


def prepare(target: ModelHandle, drafts: Sequence[ModelHandle], *, mode: str, batch_size: int,
            cache_dir: str | os.PathLike[str], expected_new_tokens: int | None = None,
            notify: Callable[[CompileNotice], None] | None = None,
            progress: Callable[[str], None] | None = None) -> CompilePlan:
    """Decide (auto / on / off, ``decision.decide``), then install and warm the compiled forwards
    up before serving. After warming up, auto leaves eager the shape classes that measured no
    faster than eager here (``keep_what_pays``); on keeps every graph, as told (the bench measures
    them all). ``notify`` hears, before each model compiles, that it does and about how long (a
    CLI says so); ``progress`` hears "compiling i/n" before each graph (see ``warm_up``; a
    background compile stops through it). Inductor's caches go where the caller pointed them
    (``inductor.use_cache_dir``); the warm-up records live under ``cache_dir``."""
    mode = decision.resolve_mode(mode)
    models = _compilable(target, drafts, batch_size)
    chosen = _decide(target, models, mode, batch_size, cache_dir, expected_new_tokens)
    if isinstance(chosen, CompilePlan):
        return chosen
    plan, variants = chosen.plan, chosen.variants
    inductor.configure_inductor(target.device)
    step = _counter(progress, sum(len(s) * (2 if variants[id(m)] is None else 1) for m, s in models))
    for lm, shapes in models:
        if forward.install(lm, frozen=variants[id(lm)] is not False) is None:
            continue
        _announce(lm, shapes, variants[id(lm)], cache_dir, plan.reason, notify)
        report = warmup.warm_up(lm, shapes, cache_dir, progress=step)
        if variants[id(lm)] is None and report.enabled:
            report = warmup.compare_not_frozen(lm, shapes, cache_dir, report, progress=step)
        plan.models.append(report)
        if mode == "auto":
            keep_what_pays(lm, report)
        _log_speedups(lm.name, report)
        if report.error:  # the toolchain failed: nothing else will compile either
            return _eager_after_failure(plan, models, report.error)
    return plan


def declined(target: ModelHandle, drafts: Sequence[ModelHandle], *, mode: str, batch_size: int,
             cache_dir: str | os.PathLike[str]) -> CompilePlan | None:
    """The plan when nothing will compile (off, a target that cannot be, auto's decision), decided
    as ``prepare`` decides and at once (no job size: a worker); None when ``prepare`` would compile.
    A worker asks before starting a background compile: where auto declines, its state says why
    from the start instead of "compiling" for the moment the thread takes to decide."""
    mode = decision.resolve_mode(mode)
    chosen = _decide(target, _compilable(target, drafts, batch_size), mode, batch_size, cache_dir, None)
    if isinstance(chosen, CompilePlan):
        return chosen
    return None if chosen.plan.enabled else chosen.plan


def _compilable(target: ModelHandle, drafts: Sequence[ModelHandle], batch_size: int) -> list[tuple[ModelHandle, Shapes]]:
    return [(m, warmup.warm_shapes(batch_size)) for m in (target, *drafts) if compilable(m.model) is None]


def _decide(target: ModelHandle, models: list[tuple[ModelHandle, Shapes]], mode: str, batch_size: int,
            cache_dir: str | os.PathLike[str], expected_new_tokens: int | None) -> decision.Decision | CompilePlan:
    """A declined plan, or the decision (enabled or not) with the variants to compile."""
    if mode == "off":
        return CompilePlan(mode, False, "compile off")
    if (why := compilable(target.model)) is not None:   # the decision weighs the target's own speedup
        return CompilePlan(mode, False, f"the target is not compiled: {why}")
    chosen = decision.decide(target, models, mode, batch_size, cache_dir, expected_new_tokens)
    return chosen if chosen.plan.enabled else chosen.plan


def _counter(progress: Callable[[str], None] | None, total: int) -> Callable[[str], None]:
    """``warm_up``'s progress as "compiling 2/4 (smollm2-135m graph 2/4)" over all graphs."""
    done = [0]

    def step(what: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(f"compiling {done[0]}/{total} ({what})")
    return step


def _announce(lm: ModelHandle, shapes: Shapes, variant: bool | None, cache_dir: str | os.PathLike[str],
              reason: str, notify: Callable[[CompileNotice], None] | None) -> None:
    """Minutes on a small CPU: say so before the silence (a worker logs it; --compile off skips)."""
    seconds = decision.expected_compile_seconds(lm, len(shapes), cache_dir,
                                                decision.cached(lm, cache_dir, variant), variant)
    notice = CompileNotice(lm.name, len(shapes), variant is None, seconds, reason)
    logger.info("%s: compiling %d graphs before decoding%s, about %.0f s (%s)", notice.model, notice.graphs,
                ", frozen and not frozen to compare them here" if notice.compare else "", seconds, reason)
    if notify is not None:
        notify(notice)


def keep_what_pays(lm: ModelHandle, report: CompileReport) -> None:
    """Send the shape classes whose graph measured no more than ``MIN_SPEEDUP`` faster than eager
    here to the eager model (``decision.pays``)."""
    assert lm.compiled is not None
    for key, speedup in report.speedups.items():
        if not pays(speedup):
            lm.compiled.eager_classes.add(key_class(key))
            report.eager_shapes.append(key)


def _log_speedups(name: str, report: CompileReport) -> None:
    """What compiling buys here, in every worker's log (data: the CLI words it for people)."""
    if report.speedups:
        logger.info("%s: eager / compiled step time here: %s; at most %sx, eager: %s; not-frozen / frozen: %s",
                    name, _rounded(report.speedups), MIN_SPEEDUP, report.eager_shapes or "none",
                    _rounded(report.frozen_gain) or "not compared")


def _rounded(ratios: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in ratios.items()}


def _eager_after_failure(plan: CompilePlan, models: list[tuple[ModelHandle, Shapes]], error: str) -> CompilePlan:
    """Compiling failed: every model decodes eagerly, and the plan says why."""
    for lm, _ in models:
        if lm.compiled is not None and lm.compiled.failed is None:
            lm.compiled.failed = error
    plan.enabled, plan.reason = False, f"compiling failed, eager instead: {error}"
    return plan
