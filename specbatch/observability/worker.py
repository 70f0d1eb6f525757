"""The hook a worker process calls as each result is written: metrics and spans from its stats.

One ``Observer`` per process (the Celery pool child, or ``specbatch run``): ``start`` makes it,
``current`` returns it. ``set_decoding`` is the seam for whoever chooses the batch size and whether
to speculate (the engine at load, a throughput autopilot later): it moves the gauges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from specbatch.observability import tracing

logger = logging.getLogger(__name__)

_current: dict[str, Observer] = {}


class Observer:
    """Feeds metrics (if on) and traces (if on) from each ``ResultEvent`` of the chunk loop."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics   # a specbatch.observability.metrics.WorkerMetrics, or None

    def on_result(self, event: Any) -> None:
        now = time.time_ns()
        try:
            if self.metrics is not None:
                if event.output is not None:
                    latency = (now - event.claimed_ns) / 1e9 if event.claimed_ns else None
                    self.metrics.observe_completed(event.output, latency, cached=event.cached)
                else:
                    self.metrics.observe_failed()
                from specbatch.engine.compile.forward import forward_counts  # torch: not in the parent

                self.metrics.observe_compiled(forward_counts())
            tracing.record_request(event, now)
        except Exception as e:  # telemetry never fails a request whose result is stored
            logger.warning("recording telemetry for request %s failed: %s", event.request_id, e)

    def set_compile_plan(self, plan: Any) -> None:
        """What compiling measured at warm-up (``Engine.compile_plan``): a gauge per graph."""
        if self.metrics is not None:
            self.metrics.observe_compile_plan(plan)

    def set_decoding(self, *, batch_size: int | None = None, speculation: bool | None = None) -> None:
        if self.metrics is not None:
            self.metrics.set_decoding(batch_size=batch_size, speculation=speculation)


def start(*, target: str, drafters: Sequence[str] = (), worker: str, metrics: bool,
          batch_size: int | None = 1, service: str = "specbatch-worker") -> Observer:
    """The observer of this process (made once): tracing per OTEL_*, metrics if ``metrics``."""
    if "observer" in _current:
        return _current["observer"]
    tracing.configure(service)
    wm = None
    if metrics:
        from specbatch.observability.metrics import WorkerMetrics, pair_labels

        wm = WorkerMetrics(pair_labels(target, drafters, worker))
    obs = _current["observer"] = Observer(wm)
    obs.set_decoding(batch_size=batch_size, speculation=bool(drafters))
    return obs


def current() -> Observer | None:
    return _current.get("observer")


def set_decoding(*, batch_size: int | None = None, speculation: bool | None = None) -> None:
    """Report the decoder's current batch size / speculation choice (no-op without an observer)."""
    obs = current()
    if obs is not None:
        obs.set_decoding(batch_size=batch_size, speculation=speculation)
