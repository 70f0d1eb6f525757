"""Tests only, imported in a pool child: the background compile says it compiles graph 1 of 4
and never finishes (minutes of inductor on a small CPU, held as long as a test needs)."""

from __future__ import annotations

import threading

from specbatch.engine import background


def _prepare(target, drafts, *, progress, **_):  # noqa: ANN001, ANN003, ANN202
    progress(f"compiling 1/4 ({target.name} graph 1/4)")
    threading.Event().wait()


background.prepare = _prepare
