"""Prometheus metrics of a worker, fed from each request's GenerationStats as its result is written.

The spec-decode counters follow vLLM's (``vllm:spec_decode_*``, vllm/v1/spec_decode/metrics.py) with
a ``specbatch_`` prefix, so its dashboards translate by renaming:

  specbatch_spec_decode_num_drafts_total                 verify steps that drafted >= 1 token
  specbatch_spec_decode_num_draft_tokens_total           draft tokens proposed
  specbatch_spec_decode_num_accepted_tokens_total        draft tokens accepted
  specbatch_spec_decode_num_accepted_tokens_per_pos_total{position}  accepted at draft position j
  (acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts)
  specbatch_prompt_tokens_total                          prompt tokens of finished requests
  specbatch_prefix_cache_hit_tokens_total                ... of those, read from the prefix cache

With ``--compile``: ``specbatch_compiled_forward_calls_total{model}`` counts forwards through a
warmed compiled graph and ``specbatch_compiled_forward_misses_total{model}`` those that matched none
and ran eagerly (no faster; docs/COMPILE.md). Misses above zero mean the compiled speed is not
being had.

Every series carries the model pair (``target``, ``drafts``) and the ``worker`` node name. The
counters add up to the job statistics in the database for the same work (``specbatch status``):
generation tokens = tokens_generated, draft/accepted tokens = drafted_tokens/accepted_tokens,
requests{outcome="completed"} = results. Latency is measured like the database's
``latency_seconds`` (claim -> result stored); time per output token as vLLM's
``request_time_per_output_token`` (first token -> last token, over the tokens after the first).

A ``specbatch worker`` decodes in a spawned pool child, so metrics are kept in prometheus-client's
multiprocess mode: the parent makes a fresh ``PROMETHEUS_MULTIPROC_DIR`` per worker before the
pool starts (``prepare_multiprocess``) and serves what every child wrote (``serve``). This module
is imported only when metrics are on (``--metrics-port``): nothing is recorded otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

LABELS = ("target", "drafts", "worker")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"   # read by prometheus-client itself, in every process

# vLLM's buckets (e2e request latency; time per output token)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)


def pair_labels(target: str, drafters: Sequence[str], worker: str) -> dict[str, str]:
    """The label values of a worker holding ``target`` + ``drafters`` (the pool's spec strings, in
    ``drafter_specs.parse_drafters``' order)."""
    return {"target": target, "drafts": ",".join(drafters), "worker": worker}


class WorkerMetrics:
    """The metric families of one process, and the label values of the worker it serves."""

    def __init__(self, labels: dict[str, str], registry: Any = None) -> None:
        # imported here: the multiprocess directory must be in the environment first
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        reg: Any = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.labels = {k: labels[k] for k in LABELS}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, (*LABELS, *extra), registry=reg)

        self.generation_tokens = counter("specbatch_generation_tokens", "Tokens generated (results written).")
        self.requests = counter("specbatch_requests", "Requests finished by this worker, by outcome "
                                "(completed: a result stored; failed: the request's own error).", ("outcome",))
        self.prompt_tokens = counter("specbatch_prompt_tokens", "Prompt tokens of finished requests.")
        self.prefix_hit_tokens = counter("specbatch_prefix_cache_hit_tokens",
                                         "Prompt tokens read from the prefix cache, not prefilled.")
        self.num_drafts = counter("specbatch_spec_decode_num_drafts",
                                  "Verify steps that drafted at least one token.")
        self.num_draft_tokens = counter("specbatch_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("specbatch_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target.")
        self.accepted_per_pos = counter("specbatch_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).",
                                        ("position",))
        self.latency = Histogram("specbatch_request_latency_seconds",
                                 "Claim to result stored, per generated request (results-cache hits left out).", LABELS,
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("specbatch_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).", LABELS,
                              buckets=TPOT_BUCKETS, registry=reg)
        # the compiled forward (specbatch.engine.compile): steps after warm-up, and those that
        # matched no warmed graph and ran eagerly (no faster); fed as deltas of its own counts
        self.compiled_calls = counter("specbatch_compiled_forward_calls",
                                      "Forwards through a warmed compiled model, by model.", ("model",))
        self.compiled_misses = counter("specbatch_compiled_forward_misses",
                                       "Of those, forwards that matched no warmed graph and ran eagerly.",
                                       ("model",))
        self._compiled_seen: dict[str, tuple[int, int]] = {}
        # gauges: the value the latest process set wins (a replaced pool child's stale files lose)
        self.batch_size = Gauge("specbatch_batch_size", "Requests the decoder runs together.", LABELS,
                                multiprocess_mode="mostrecent", registry=reg)
        self.compiled_speedup = Gauge("specbatch_compiled_speedup",
                                      "Eager / compiled step time of each warmed graph, measured at "
                                      "warm-up on this machine.", (*LABELS, "model", "shape"),
                                      multiprocess_mode="mostrecent", registry=reg)
        self.speculation = Gauge("specbatch_speculation_enabled",
                                 "1 while decoding speculatively, 0 while decoding plainly.", LABELS,
                                 multiprocess_mode="mostrecent", registry=reg)

    def observe_completed(self, output: Any, latency_seconds: float | None = None, cached: bool = False) -> None:
        """A result was stored: ``output`` is its GenerationOutput; ``cached``: a results-cache hit,
        left out of the generated tokens and of the latency and per-token histograms as the job's
        statistics leave it out (answered at once, generated nothing: docs/statistics.md)."""
        lv, st = self.labels, output.stats
        self.requests.labels(**lv, outcome="completed").inc()
        # a hit's tokens were copied, not generated (jobs/stats.py's tokens_generated leaves them out)
        self.generation_tokens.labels(**lv).inc(0 if cached else len(output.token_ids))
        self.prompt_tokens.labels(**lv).inc(st.prompt_tokens)
        self.prefix_hit_tokens.labels(**lv).inc(st.cached_prompt_tokens)
        self.num_drafts.labels(**lv).inc(st.draft_steps)
        self.num_draft_tokens.labels(**lv).inc(st.drafted_tokens)
        self.num_accepted_tokens.labels(**lv).inc(st.accepted_tokens)
        for j, n in enumerate(st.accepted_at_position):
            self.accepted_per_pos.labels(**lv, position=str(j)).inc(n)
        if cached:
            return
        self.latency.labels(**lv).observe(max(0.0, latency_seconds if latency_seconds is not None
                                              else st.wall_seconds))
        n = len(output.token_ids)
        if n > 1:
            self.tpot.labels(**lv).observe(max(0.0, st.wall_seconds - st.first_token_seconds) / (n - 1))
        if st.verify_steps:   # what the adaptive controller did on this request
            self.speculation.labels(**lv).set(int(st.draft_steps > 0 and not st.speculation_disabled))

    def observe_compiled(self, counts: dict[str, tuple[int, int]]) -> None:
        """``counts``: ``specbatch.engine.compile.forward.forward_counts()`` (totals; the growth is added)."""
        for model, (calls, misses) in counts.items():
            seen_calls, seen_misses = self._compiled_seen.get(model, (0, 0))
            if calls > seen_calls:
                self.compiled_calls.labels(**self.labels, model=model).inc(calls - seen_calls)
            if misses > seen_misses:
                self.compiled_misses.labels(**self.labels, model=model).inc(misses - seen_misses)
            self._compiled_seen[model] = (max(calls, seen_calls), max(misses, seen_misses))

    def observe_compile_plan(self, plan: Any) -> None:
        """``plan``: the engine's ``CompilePlan`` (None or disabled: nothing to show)."""
        from specbatch.engine.compile.forward import rows_x_tokens

        if plan is None or not plan.enabled:
            return
        for report in plan.models:
            for shape, speedup in report.speedups.items():
                self.compiled_speedup.labels(**self.labels, model=report.model,
                                             shape=rows_x_tokens(shape)).set(speedup)

    def observe_failed(self) -> None:
        self.requests.labels(**self.labels, outcome="failed").inc()

    def set_decoding(self, *, batch_size: int | None = None, speculation: bool | None = None) -> None:
        """The decoder's current choice (engine load; later the throughput autopilot)."""
        if batch_size is not None:
            self.batch_size.labels(**self.labels).set(batch_size)
        if speculation is not None:
            self.speculation.labels(**self.labels).set(int(speculation))


def prepare_multiprocess(directory: str | None = None) -> str:
    """Make an empty multiprocess directory for one worker and point prometheus-client at it.

    Must run in the worker's parent before the pool child is spawned and before prometheus-client
    is imported (each process picks its value files from the environment on import). A given ``directory`` is emptied:
    files left by an earlier run would be added to this one's counters.
    """
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    else:
        directory = tempfile.mkdtemp(prefix="specbatch-metrics-")
    os.environ[MULTIPROC_ENV] = directory
    return directory


def serve(port: int, address: str, directory: str) -> Any:
    """Serve ``/metrics`` on ``address:port`` from the multiprocess files in ``directory``.

    Returns the HTTP server (``.shutdown()`` stops it). Raises OSError when the port is taken.
    """
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
