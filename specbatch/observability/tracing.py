"""OpenTelemetry traces: one job is one trace, from ``specbatch submit`` through Celery to every worker.

  submit                      (CLI)       specbatch.job.id, specbatch.requests
    intake                                parse the prompt file, store the job
    enqueue                               publish the tasks; each message carries this context
      chunk                   (worker)    one Celery task: specbatch.job.id, specbatch.request_ids
        claim                             lease the requests
        request               (per request, timed after the fact from its GenerationStats)
          prefill                         the prompt's forward, up to the first token
          decode                          the remaining tokens
          db.write                        the result stored

The context travels in the Celery message headers (W3C ``traceparent``/``tracestate``).

Configuration is OpenTelemetry's own: OTEL_TRACES_EXPORTER (``otlp``, ``console``),
OTEL_EXPORTER_OTLP_ENDPOINT (OTLP over HTTP/protobuf), OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_BSP_*; see ``specbatch.config.otel_traces_exporters`` for when tracing is on. This is the only
module that imports ``opentelemetry``, and only once tracing is on: otherwise (or without the
``otel`` extra) every helper here is a no-op costing one check.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
_NOOP = contextlib.nullcontext()
_state: dict[str, Any] = {"tracer": None, "provider": None}


def enabled() -> bool:
    return _state["tracer"] is not None


def configure(service: str) -> bool:
    """Install a tracer for this process if the OTEL_* variables ask for one; True if tracing is on.

    ``service`` is the default service name (OTEL_SERVICE_NAME wins). Idempotent per process.
    """
    if _state["tracer"] is not None:
        return True
    from specbatch.config import otel_traces_exporters

    names = otel_traces_exporters()
    if not names:
        return False
    try:
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning("OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
                       "(pip install 'specbatch[otel]'); tracing stays off")
        return False
    exporters = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            logger.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console); ignored", name)
    if not exporters:
        return False
    resource = Resource({"service.name": service}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    use(provider)
    return True


def use(provider: Any) -> None:
    """Trace with ``provider`` (an SDK TracerProvider) in this process; None switches tracing off."""
    _state["provider"] = provider
    _state["tracer"] = provider.get_tracer("specbatch") if provider is not None else None


def shutdown() -> None:
    """Export what is buffered (a pool child may exit without running atexit handlers)."""
    provider = _state["provider"]
    if provider is not None:
        try:
            provider.force_flush(5000)
        except Exception as e:  # telemetry never fails the work
            logger.warning("flushing spans failed: %s", e)


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A context manager: a child span of the current one (a no-op when tracing is off)."""
    tracer = _state["tracer"]
    if tracer is None:
        return _NOOP
    return tracer.start_as_current_span(name, attributes=_clean(attributes or {}))


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Add ``attributes`` to the current span (once known, e.g. a new job's id)."""
    if _state["tracer"] is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(_clean(attributes))


def inject() -> dict[str, str]:
    """The current trace context as message headers ({} when tracing is off)."""
    if _state["tracer"] is None:
        return {}
    from opentelemetry.propagate import inject as _inject

    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


def headers_of(request: Any) -> dict[str, str]:
    """The trace headers of a Celery task request (custom headers may sit on it or under .headers)."""
    nested = getattr(request, "headers", None) or {}
    out = {}
    for key in TRACE_HEADERS:
        value = getattr(request, key, None) or (nested.get(key) if isinstance(nested, Mapping) else None)
        if isinstance(value, str):
            out[key] = value
    return out


@contextlib.contextmanager
def continued(headers: Mapping[str, str], name: str,
              attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span continuing the trace whose context came in ``headers`` (a new trace without one)."""
    tracer = _state["tracer"]
    if tracer is None:
        yield None
        return
    from opentelemetry.propagate import extract

    with tracer.start_as_current_span(name, context=extract(dict(headers)), attributes=_clean(attributes or {}),
                                      kind=_consumer()) as s:
        yield s


def record_request(event: Any, end_ns: int | None = None) -> None:
    """The spans of one finished request, under the current span, timed from its statistics.

    ``event``: a ``specbatch.worker.chunk.ResultEvent`` (``generated_ns``: when the engine returned
    it; the result was stored between then and ``end_ns``, default now).
    """
    tracer = _state["tracer"]
    if tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    end = end_ns or time.time_ns()
    generated = event.generated_ns or end
    attrs: dict[str, Any] = {"specbatch.job.id": event.job_id, "specbatch.request.id": event.request_id}
    out = event.output
    if out is None:
        start = event.claimed_ns or generated
        s = tracer.start_span("request", attributes=attrs, start_time=min(start, end))
        s.set_status(Status(StatusCode.ERROR, event.error or "failed"))
        s.set_attribute("specbatch.error", event.error or "")
        s.end(end_time=end)
        return
    st = out.stats
    start = generated - int(st.wall_seconds * 1e9)
    first = start + int(st.first_token_seconds * 1e9)
    attrs.update({
        "gen_ai.usage.input_tokens": st.prompt_tokens, "gen_ai.usage.output_tokens": len(out.token_ids),
        "gen_ai.response.finish_reasons": [out.finish_reason], "specbatch.finish_reason": out.finish_reason,
        "specbatch.tokens.drafted": st.drafted_tokens, "specbatch.tokens.accepted": st.accepted_tokens,
        "specbatch.acceptance_rate": st.acceptance_rate,
        "specbatch.mean_acceptance_length": st.mean_acceptance_length,
        "specbatch.verify_steps": st.verify_steps, "specbatch.speculation_disabled": st.speculation_disabled,
    })
    req = tracer.start_span("request", attributes=attrs, start_time=start)
    ctx = trace.set_span_in_context(req)
    for name, t0, t1 in (("prefill", start, first), ("decode", first, generated), ("db.write", generated, end)):
        tracer.start_span(name, context=ctx, start_time=t0).end(end_time=max(t0, t1))
    req.end(end_time=end)


def _consumer() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.CONSUMER


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str/bool/int/float values and lists of them; None is dropped."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = list(v) if isinstance(v, (list, tuple)) else v
    return out
