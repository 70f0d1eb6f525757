"""What the CLI says about compiling: the engine returns plans, reports and notices as data
(``specbatch.engine.compile``); these words are the CLI's."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import click

from specbatch.config import Settings
from specbatch.redact import mask

if TYPE_CHECKING:   # the engine (torch) loads with the model, not with the command's module
    from specbatch.engine.compile.decision import CompilePlan
    from specbatch.engine.compile.prepare import CompileNotice
    from specbatch.engine.compile.record import CompileReport


def use_compile_cache(settings: Settings, mode: str) -> None:
    """A command that may compile keeps inductor's caches under the settings' cache directory,
    shared with every later start (torch reads their place from the environment only; see
    ``inductor.use_cache_dir``). Call before loading the engine."""
    from specbatch.engine.compile.decision import resolve_mode
    from specbatch.engine.compile.inductor import use_cache_dir

    if settings.cache_dir and resolve_mode(mode) != "off":
        use_cache_dir(settings.cache_dir)


def compile_notice(message: str) -> None:
    """A line on stderr about compiling (the CLI logs at WARNING, so the engine's own INFO line
    would not show)."""
    click.echo(f"specbatch: {mask(message)}", err=True)


def compiling_notice(notice: CompileNotice) -> None:
    """``Engine.load(notify=...)`` for the CLI: before minutes of compiling, say so."""
    both = ", frozen and not frozen to compare them here" if notice.compare else ""
    compile_notice(f"{notice.model}: compiling {notice.graphs} graphs before decoding{both}, "
                   f"about {notice.seconds:.0f} s ({notice.reason})")


def report_compile(plan: CompilePlan | None, say_eager: bool = True) -> None:
    """One stderr line on what compiling cost, or where auto chose eager, why (a failure to
    compile was already logged once as a warning; off says nothing). ``say_eager`` False: a
    one-off command on the default mode, where auto declining is the usual case, not news."""
    from specbatch.engine.compile.forward import rows_x_tokens

    if plan is None:
        return
    if not plan.enabled:
        if say_eager and plan.mode in ("auto", "static") and not any(m.error for m in plan.models):
            click.echo(f"specbatch: decoding eagerly: {eager_reason(plan.reason)}", err=True)
        return
    cached = all(m.cached for m in plan.models)
    what = "static-cache classes" if plan.mode == "static" else "compiled forward"
    click.echo(f"specbatch: {what} ready in {plan.seconds:.0f}s "
               f"({'cached' if cached else 'first start'}; {plan.reason})", err=True)
    for m in plan.models:   # what it buys on this machine: warm-up timed each graph against eager
        if m.speedups:
            kept = f"; {', '.join(map(rows_x_tokens, m.eager_shapes))} stay eager" if m.eager_shapes else ""
            click.echo(f"specbatch: {m.model}: eager / compiled step time here (rows x tokens): "
                       + ", ".join(f"{rows_x_tokens(k)} {v:.2f}x" for k, v in m.speedups.items()) + kept
                       + frozen_summary(m), err=True)


def frozen_summary(report: CompileReport) -> str:
    """After a comparison (``compare_not_frozen``): '; freezing gains 1x1 1.01x, 1x4 1.03x here:
    kept not frozen' (not-frozen / frozen step time per shape); else empty."""
    from specbatch.engine.compile.forward import rows_x_tokens

    if not report.frozen_gain:
        return ""
    if any(math.isinf(v) for v in report.frozen_gain.values()):
        return "; the not-frozen graphs failed to compile here: kept frozen"
    gains = ", ".join(f"{rows_x_tokens(k)} {v:.2f}x" for k, v in report.frozen_gain.items())
    return f"; freezing gains {gains} here: kept {'frozen' if report.frozen else 'not frozen'}"


def eager_reason(reason: str) -> str:
    """``CompilePlan.reason`` of an auto plan that stays eager, for people: where auto declined
    ("auto: ..."), that --compile on overrides it (the plan's reason is a record; the override
    is the CLI's to name)."""
    if not reason.startswith("auto: "):
        return reason          # e.g. an int8 target: on would not compile either
    return reason.removeprefix("auto: ") + "; --compile on compiles anyway"
