"""What tracing and metrics cost a worker: the chunk loop with both on against both off, interleaved.

Each run is one job of the same prompts through ``process_chunk`` (claim, generate, store, the
``on_result`` hook) on a throwaway SQLite file, as a Celery task runs it. "on" = the OpenTelemetry
SDK with a BatchSpanProcessor and the real OTLP/HTTP exporter posting to a local sink, and the
Prometheus metrics; the buffered spans are flushed inside the timed region, so the export is
counted. "off" = no OTEL_* variables, no metrics port (the no-op path). Runs alternate
off/on, on/off, ... so drift on a shared machine hits both alike; the ratio compares medians.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TelemetryOptions:
    target: str
    drafts: tuple[str, ...]
    ngram: bool = False
    prompts: str = "all"
    num_prompts: int = 6
    max_new_tokens: int = 32
    repeats: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    cache_dir: str | None = None
    linears: str = "auto"                      # how float32 CPU Linears multiply (SPECBATCH_LINEARS)


class _Sink:
    """An OTLP/HTTP endpoint that accepts and counts what it is sent (the collector's side is not ours)."""

    def __init__(self) -> None:
        received = self.received = {"posts": 0, "bytes": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                self.rfile.read(n)
                received["posts"] += 1
                received["bytes"] += n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _new_job(settings: Any, rows: list[Any], params: dict[str, Any], path: Path) -> list[int]:
    import json

    from specbatch.db import session_factory
    from specbatch.jobs import intake, store

    path.write_text("".join(json.dumps({"prompt": p.prompt} if p.prompt is not None
                                       else {"messages": list(p.messages or ())}) + "\n" for p in rows))
    parsed = intake.parse_file(path, params, settings)
    with session_factory(settings.database_url).begin() as s:
        # cache=False: every run must decode the same work (a results-cache hit would time nothing)
        job = store.create_job(s, target="bench", drafts=[], params=params, requests=parsed,
                               queue="bench", cache=False)
        return list(store.resumable_request_ids(s, job.id))


def run_telemetry_cost(opts: TelemetryOptions, progress: Progress | None = None) -> dict[str, Any]:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from specbatch.bench.prompts import load_prompts, select
    from specbatch.config import Settings
    from specbatch.engine import Engine
    from specbatch.observability import tracing
    from specbatch.observability.metrics import WorkerMetrics, pair_labels, prepare_multiprocess
    from specbatch.observability.worker import Observer
    from specbatch.worker.chunk import process_chunk

    pool = [*opts.drafts, *(["ngram"] if opts.ngram else [])]
    engine = Engine.load(opts.target, pool, device=opts.device,
                         dtype=opts.dtype, cache_dir=opts.cache_dir, linears=opts.linears)
    rows = select(load_prompts(opts.prompts), opts.num_prompts)
    params = {"max_new_tokens": opts.max_new_tokens}
    sink = _Sink()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint)))
    # the worker's multiprocess mode (mmap value files), as a `specbatch worker --metrics-port` child
    metrics_dir = tempfile.TemporaryDirectory(prefix="specbatch-bench-metrics-")
    prepare_multiprocess(metrics_dir.name)
    metrics = WorkerMetrics(pair_labels(opts.target, engine.drafter_names, "bench"))
    times: dict[str, list[float]] = {"off": [], "on": []}
    hook = {"off": 0.0, "on": 0.0, "flush": 0.0}   # seconds inside the on_result hook / the final flush
    tokens: dict[str, list[int]] = {"off": [], "on": []}
    order = [m for r in range(opts.repeats) for m in (("off", "on") if r % 2 == 0 else ("on", "off"))]
    with tempfile.TemporaryDirectory(prefix="specbatch-bench-telemetry-") as tmp:
        settings = Settings(database_url=f"sqlite:///{Path(tmp) / 'bench.db'}")
        # one warm-up run, untimed: first forwards allocate and the database file is created
        process_chunk(settings, engine, _new_job(settings, rows[:1], params, Path(tmp) / "w.jsonl"), "bench")
        for i, mode in enumerate(order):
            if progress:
                progress(f"telemetry {mode} (run {i + 1})", i, len(order))
            ids = _new_job(settings, rows, params, Path(tmp) / f"{i}.jsonl")
            on = mode == "on"
            tracing.use(provider if on else None)
            observer = Observer(metrics if on else None)

            def on_result(event: Any, mode: str = mode, observer: Observer = observer) -> None:
                h0 = time.perf_counter()
                observer.on_result(event)
                hook[mode] += time.perf_counter() - h0

            t0 = time.perf_counter()
            with tracing.continued({}, "chunk", {"specbatch.request_ids": ids}):
                report = process_chunk(settings, engine, ids, "bench", on_result=on_result)
            if on:
                f0 = time.perf_counter()
                provider.force_flush()
                hook["flush"] += time.perf_counter() - f0
            times[mode].append(time.perf_counter() - t0)
            tokens[mode].append(report.new_tokens)
            tracing.use(None)
    sink.server.shutdown()
    multiprocess = any(Path(metrics_dir.name).glob("counter_*.db"))   # the values went to mmap files
    metrics_dir.cleanup()
    if progress:
        progress("done", len(order), len(order))
    med = {m: statistics.median(t) for m, t in times.items()}
    rate = {m: sum(tokens[m]) / sum(times[m]) for m in times}
    return {
        "target": opts.target, "drafts": list(opts.drafts), "ngram": opts.ngram,
        "prompts": len(rows), "max_new_tokens": opts.max_new_tokens, "repeats": opts.repeats,
        "order": order, "seconds": times, "tokens": tokens,
        "median_seconds": med, "tokens_per_second": rate,
        "ratio_on_off_median_seconds": med["on"] / med["off"],
        "ratio_on_off_tokens_per_second": rate["on"] / rate["off"],
        "spread_off": (max(times["off"]) - min(times["off"])) / med["off"],
        "otlp_posts": sink.received["posts"], "otlp_bytes": sink.received["bytes"],
        # the direct cost, steadier than the ratio on a busy machine: the hook per request, and its
        # share (plus the flushes) of the "on" runs' time
        "hook_ms_per_request": {m: 1000 * hook[m] / (len(rows) * opts.repeats) for m in ("off", "on")},
        "flush_ms_per_run": 1000 * hook["flush"] / opts.repeats,
        "hook_share_of_on_time": (hook["on"] + hook["flush"]) / sum(times["on"]),
        "metrics_multiprocess": multiprocess,
    }


def markdown(result: dict[str, Any], command: str | None) -> str:
    lines = [f"## Telemetry cost: {result['target']} + {', '.join(result['drafts']) or '-'}", "",
             f"{result['prompts']} prompts x {result['max_new_tokens']} new tokens, "
             f"{result['repeats']} interleaved repeats (order {' '.join(result['order'])})", "",
             "| telemetry | median s / run | tokens/s | runs (s) |", "|---|---|---|---|"]
    for m in ("off", "on"):
        runs = " ".join(f"{t:.2f}" for t in result["seconds"][m])
        lines.append(f"| {m} | {result['median_seconds'][m]:.3f} | {result['tokens_per_second'][m]:.1f} | {runs} |")
    lines += ["", f"on / off: median time x{result['ratio_on_off_median_seconds']:.3f}, tokens/s "
              f"x{result['ratio_on_off_tokens_per_second']:.3f}; run-to-run spread with it off "
              f"{result['spread_off']:.1%}; {result['otlp_posts']} OTLP posts, {result['otlp_bytes']} bytes",
              "", f"direct cost: the result hook takes {result['hook_ms_per_request']['on']:.2f} ms per request "
              f"with telemetry on ({result['hook_ms_per_request']['off']:.3f} ms off), the span flush "
              f"{result['flush_ms_per_run']:.1f} ms per run: {result['hook_share_of_on_time']:.2%} of the "
              "\"on\" runs' time"]
    if command:
        lines += ["", f"command: `{command}`"]
    return "\n".join(lines)
