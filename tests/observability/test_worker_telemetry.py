"""A real `specbatch worker` (prefork, spawned child) with --metrics-port and OTLP/HTTP tracing, fed by
a real `specbatch submit`: its /metrics add up to the job's statistics in the database, and the
spans of both processes arrive at a small OTLP receiver as one trace."""

from __future__ import annotations

import gzip
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.tiny import without_chat_template
from tests.worker.conftest import CLI
from tests.worker.services import Proc, free_port, wait_for

pytestmark = pytest.mark.integration


class OTLPReceiver:
    """POST /v1/traces (OTLP/HTTP protobuf) -> decoded spans, with their service name."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans: list[dict[str, Any]] = []
        self.spans, self.paths = spans, []
        paths = self.paths

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                paths.append(self.path)
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            spans.append({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                          "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                          "attrs": {a.key: a.value for a in s.attributes}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.server.shutdown()


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_worker_metrics_add_up_to_the_job_and_spans_reach_the_collector(receiver: OTLPReceiver,
                                                                        cluster: Any) -> None:
    # (the receiver is set up first so it outlives the worker, whose last flush posts to it)
    import subprocess

    port = free_port()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    m = cluster.models
    # a base model (no chat template): the engine fails a chat line on its own (a token id past
    # the vocabulary or a prompt over the context no longer reaches a worker: intake refuses it)
    base = without_chat_template(m / "llama", cluster.tmp / "base")
    pair = ["--target", str(base), "--draft", str(m / "llama-partial")]
    proc = Proc([*CLI, "worker", *pair, "-n", "obs@%h", "--metrics-port", str(port), "--batch-size", "1"], {**cluster.env, **otel},
                cluster.tmp / "worker-obs.log")
    cluster.procs.append(proc)
    cluster.wait_consuming(proc, str(base))   # (an absolute path: models / it is itself)
    before = _scrape(port)   # the gauges are set once the child has its models
    host = next(dict(k[1])["worker"] for k in before if k[0] == "specbatch_batch_size")
    labels = {"target": str(base), "drafts": str(m / "llama-partial"), "worker": host}
    assert host.startswith("obs@")
    assert before[("specbatch_batch_size", frozenset(labels.items()))] == 1
    assert before[("specbatch_speculation_enabled", frozenset(labels.items()))] == 1

    rows = [{"custom_id": f"r{i}", "prompt": f"The quick brown fox {i}", "max_new_tokens": 5 + 3 * i}
            for i in range(4)] + [{"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}],
                                   "max_new_tokens": 5}]   # fails: the target has no chat template
    out = subprocess.run([*CLI, "submit", str(cluster.prompts(rows)), *pair, "--json"], env={**cluster.env, **otel},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    job_id = __import__("json").loads(out.stdout)["job_id"]
    summary = cluster.wait_finished(job_id)
    stats, counts = summary["stats"], summary["request_counts"]
    assert counts["completed"] == 4 and counts["failed"] == 1, summary

    def value(name: str, **extra: str) -> float:
        return scraped.get((name, frozenset({**labels, **extra}.items())), 0.0)

    # the last result is written a moment before the worker counts it
    scraped: dict[Any, float] = {}

    def counted() -> bool:
        scraped.update(_scrape(port))
        return value("specbatch_requests_total", outcome="failed") == 1 and \
            value("specbatch_requests_total", outcome="completed") == 4
    wait_for(counted, 10, "the worker to count the job's requests")
    assert value("specbatch_generation_tokens_total") == stats["tokens_generated"] > 0
    assert value("specbatch_spec_decode_num_draft_tokens_total") == stats["drafted_tokens"] > 0
    assert value("specbatch_spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    per_pos = {dict(k[1])["position"]: v for k, v in scraped.items()
               if k[0] == "specbatch_spec_decode_num_accepted_tokens_per_pos_total"}
    assert sum(per_pos.values()) == stats["accepted_tokens"]
    drafts = value("specbatch_spec_decode_num_drafts_total")
    # a draft step drafts >= 1 token and accepts position 0 at most once; every target forward is one step
    assert per_pos.get("0", 0) <= drafts <= min(stats["target_forwards"], stats["drafted_tokens"])
    assert drafts > 0
    assert value("specbatch_request_latency_seconds_count") == stats["results"] == 4
    # claim -> stored holds the generation itself
    assert value("specbatch_request_latency_seconds_sum") >= stats["generation_seconds_sum"]
    assert value("specbatch_time_per_output_token_seconds_count") == 4

    # spans: the CLI's and the worker child's, one trace, the chunks under the CLI's enqueue span
    wait_for(lambda: sum(s["name"] == "request" for s in receiver.spans) == 5, 20, "the worker's spans")
    wait_for(lambda: any(s["name"] == "submit" for s in receiver.spans), 20, "the CLI's spans")
    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.spans
    (submit,) = [s for s in spans if s["name"] == "submit"]
    (enqueue,) = [s for s in spans if s["name"] == "enqueue"]
    assert submit["service"] == "specbatch" and submit["attrs"]["specbatch.job.id"].string_value == job_id
    chunks = [s for s in spans if s["name"] == "chunk"]
    assert len(chunks) == 3 and {c["service"] for c in chunks} == {"specbatch-worker"}
    assert {c["parent"] for c in chunks} == {enqueue["span_id"]}
    assert {s["trace_id"] for s in spans} == {submit["trace_id"]}
    failed = [s for s in spans if s["name"] == "request" and "specbatch.error" in s["attrs"]]
    assert len(failed) == 1 and "has no chat template" in failed[0]["attrs"]["specbatch.error"].string_value
