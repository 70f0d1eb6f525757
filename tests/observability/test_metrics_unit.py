"""Worker metrics fed from hand-built GenerationStats; the OTEL_* switch; tracing off costs nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specbatch.config import otel_traces_exporters
from specbatch.engine.types import GenerationOutput, GenerationStats
from specbatch.observability.metrics import WorkerMetrics, pair_labels
from tests.worker.services import REPO

LABELS = pair_labels("t", ["d1", "d2", "ngram"], "w0@host")


def _output(tokens: int, drafted: list[int], accepted: list[int], wall: float, first: float,
            disabled: bool = False) -> GenerationOutput:
    """One request whose verify steps drafted ``drafted[i]`` and accepted ``accepted[i]`` tokens."""
    at = [sum(1 for a in accepted if a > j) for j in range(max(drafted, default=0))]
    st = GenerationStats(prompt_tokens=3, new_tokens=tokens, verify_steps=len(drafted),
                         draft_steps=sum(d > 0 for d in drafted), drafted_tokens=sum(drafted),
                         accepted_tokens=sum(accepted), accepted_at_position=at, wall_seconds=wall,
                         first_token_seconds=first, speculation_disabled=disabled)
    return GenerationOutput("x" * tokens, list(range(tokens)), "length", st)


def test_counters_follow_vllm_meanings() -> None:
    m = WorkerMetrics(LABELS)
    # steps: draft 4 accept 2, draft 4 accept 4, plain step (speculation off), draft 2 accept 0
    m.observe_completed(_output(11, [4, 4, 0, 2], [2, 4, 0, 0], wall=2.0, first=1.0), latency_seconds=2.5)
    m.observe_completed(_output(1, [0], [0], wall=0.1, first=0.1, disabled=True), latency_seconds=0.2)
    m.observe_failed()

    def value(name: str, **extra: str) -> float | None:
        return m.registry.get_sample_value(name, {**LABELS, **extra})

    assert LABELS == {"target": "t", "drafts": "d1,d2,ngram", "worker": "w0@host"}
    assert value("specbatch_requests_total", outcome="completed") == 2
    assert value("specbatch_requests_total", outcome="failed") == 1
    assert value("specbatch_generation_tokens_total") == 12
    assert value("specbatch_spec_decode_num_drafts_total") == 3          # steps that drafted
    assert value("specbatch_spec_decode_num_draft_tokens_total") == 10
    assert value("specbatch_spec_decode_num_accepted_tokens_total") == 6
    per_pos = [value("specbatch_spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
               for j in range(4)]
    assert per_pos == [2, 2, 1, 1] and sum(per_pos) == 6                 # positions 0-1 twice, 2-3 once
    assert value("specbatch_request_latency_seconds_count") == 2
    assert value("specbatch_request_latency_seconds_sum") == pytest.approx(2.7)
    # vLLM's time per output token: (last - first token) / (tokens - 1); one-token requests have none
    assert value("specbatch_time_per_output_token_seconds_count") == 1
    assert value("specbatch_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert value("specbatch_speculation_enabled") == 0                  # the latest request switched off
    m.set_decoding(batch_size=8, speculation=True)                      # the autopilot's seam
    assert value("specbatch_batch_size") == 8 and value("specbatch_speculation_enabled") == 1


def test_results_cache_hits_stay_out_of_the_generated_tokens_and_latency_histograms() -> None:
    """As the job's latency percentiles (docs/statistics.md): a hit, answered at once, would pull
    them down. It is still a completed request."""
    import time

    from specbatch.observability.worker import Observer
    from specbatch.worker.chunk import ResultEvent

    m = WorkerMetrics(LABELS)
    obs = Observer(m)
    claimed = time.time_ns()
    obs.on_result(ResultEvent(1, "j", output=_output(5, [4], [4], wall=1.0, first=0.5), claimed_ns=claimed))
    obs.on_result(ResultEvent(2, "j", output=_output(5, [], [], wall=0.0, first=0.0), claimed_ns=claimed,
                              cached=True))

    def value(name: str, **extra: str) -> float | None:
        return m.registry.get_sample_value(name, {**LABELS, **extra})

    assert value("specbatch_requests_total", outcome="completed") == 2
    assert value("specbatch_generation_tokens_total") == 5             # as the job's tokens_generated
    assert value("specbatch_request_latency_seconds_count") == 1
    assert value("specbatch_time_per_output_token_seconds_count") == 1


def test_compiled_forward_counts_are_added_as_they_grow() -> None:
    m = WorkerMetrics(LABELS)
    m.observe_compiled({"t": (10, 0)})
    m.observe_compiled({"t": (25, 2), "d1": (4, 0)})
    m.observe_compiled({"t": (25, 2)})                                  # nothing new: nothing added

    def value(name: str, model: str) -> float | None:
        return m.registry.get_sample_value(name, {**LABELS, "model": model})

    assert value("specbatch_compiled_forward_calls_total", "t") == 25
    assert value("specbatch_compiled_forward_misses_total", "t") == 2
    assert value("specbatch_compiled_forward_calls_total", "d1") == 4
    assert value("specbatch_compiled_forward_misses_total", "d1") is None   # never missed


def test_what_compiling_measured_is_a_gauge_per_graph() -> None:
    from specbatch.engine.compile.decision import CompilePlan
    from specbatch.engine.compile.record import CompileReport

    m = WorkerMetrics(LABELS)
    m.observe_compile_plan(None)
    m.observe_compile_plan(CompilePlan("off", False, "compile off"))
    assert m.registry.get_sample_value("specbatch_compiled_speedup", {**LABELS, "model": "t", "shape": "1x1"}) is None
    report = CompileReport(model="t", enabled=True, speedups={"1x1:1": 1.31, "16x4:2": 0.98})
    m.observe_compile_plan(CompilePlan("auto", True, "auto: a long-lived worker", [report]))

    def value(shape: str) -> float | None:
        return m.registry.get_sample_value("specbatch_compiled_speedup", {**LABELS, "model": "t", "shape": shape})

    assert value("1x1") == pytest.approx(1.31) and value("16x4") == pytest.approx(0.98)


@pytest.mark.parametrize("env, expected", [
    ({}, ()),
    ({"OTEL_SERVICE_NAME": "x"}, ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ("console", "otlp")),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
])
def test_tracing_is_on_only_when_otel_variables_ask(env: dict[str, str], expected: tuple[str, ...]) -> None:
    assert otel_traces_exporters(env) == expected


def test_without_otel_variables_nothing_is_imported_or_recorded(tmp_path) -> None:
    """The chunk loop with a fake engine: no opentelemetry / prometheus_client import, spans are no-ops."""
    code = """
import sys
from pathlib import Path
from specbatch.observability import tracing
from specbatch.observability import worker as observe
from specbatch.worker.chunk import process_chunk
from tests.worker.test_chunk_unit import FakeEngine, _job
s, job_id, ids = _job(Path(sys.argv[1]), 3)
obs = observe.start(target="t", worker="w", metrics=False)
report = process_chunk(s, FakeEngine(), ids, "w", on_result=obs.on_result)
assert len(report.completed) == 3, report
assert not tracing.enabled() and tracing.inject() == {}
with tracing.span("x") as sp:
    assert sp is None
leaked = sorted(m for m in sys.modules if m.startswith(("opentelemetry", "prometheus_client")))
assert not leaked, leaked
print("ok")
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_taken_metrics_port_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, tiny_models) -> None:  # noqa: ANN001
    """SPECBATCH_METRICS_PORT on a port in use: the worker stops before loading anything (a real
    model's name: a name that is no model is refused before the port is tried)."""
    import socket

    from click.testing import CliRunner

    from specbatch.cli.main import cli

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)   # restored after the test
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("SPECBATCH_METRICS_PORT", str(port))
        monkeypatch.setenv("SPECBATCH_METRICS_ADDRESS", "127.0.0.1")
        result = CliRunner().invoke(cli, ["worker", "--target", str(tiny_models / "llama"), "--draft", "none"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: cannot serve metrics on 127.0.0.1:{port}: Address already in use; choose another --metrics-port"]


def test_prompt_tokens_read_from_the_prefix_cache_are_counted() -> None:
    m = WorkerMetrics(LABELS)
    computed, read = _output(2, [0], [0], wall=0.1, first=0.1), _output(2, [0], [0], wall=0.1, first=0.1)
    read.stats.prompt_tokens, read.stats.cached_prompt_tokens = 40, 32
    m.observe_completed(computed)
    m.observe_completed(read)
    assert m.registry.get_sample_value("specbatch_prompt_tokens_total", LABELS) == 43
    assert m.registry.get_sample_value("specbatch_prefix_cache_hit_tokens_total", LABELS) == 32


@pytest.mark.parametrize("address", ["notanip", "10.255.255.1"])   # unresolvable; not this machine's
def test_a_bad_metrics_address_is_named_not_the_port(monkeypatch: pytest.MonkeyPatch, tiny_models,  # noqa: ANN001
                                                     address: str) -> None:
    """qa55: an address that does not resolve got 'choose another --metrics-port'."""
    from click.testing import CliRunner

    from specbatch.cli.main import cli

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("SPECBATCH_METRICS_PORT", "9417")
    monkeypatch.setenv("SPECBATCH_METRICS_ADDRESS", address)
    result = CliRunner().invoke(cli, ["worker", "--target", str(tiny_models / "llama"), "--draft", "none"])
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: cannot serve metrics on {address}:9417: ") and \
        line.endswith("check SPECBATCH_METRICS_ADDRESS (an address of this machine, e.g. 0.0.0.0 or 127.0.0.1)"), line
