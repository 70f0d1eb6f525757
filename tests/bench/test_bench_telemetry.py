"""`specbatch bench --telemetry` on tiny models: both modes run the same work, the "on" runs really
export spans over OTLP/HTTP and write multiprocess metric files (a subprocess: it sets
PROMETHEUS_MULTIPROC_DIR, which must not leak into other tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.services import REPO


@pytest.mark.slow     # ~25 s on 2 busy cores; a benchmark's own bookkeeping, not in CI
def test_telemetry_cost_runs_both_modes_on_the_same_work(tiny_models: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "code", "prompt": f"def f{i}(x):"}) + "\n"
                               for i in range(2)))
    argv = [sys.executable, "-c", "from specbatch.cli.main import main; main()", "bench", "--telemetry",
            "--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"), "--no-ngram",
            "--prompts", str(prompts), "--max-new-tokens", "8", "--repeats", "2", "--threads", "1", "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}
    out = subprocess.run(argv, env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["order"] == ["off", "on", "on", "off"]
    assert r["tokens"]["on"] == r["tokens"]["off"] == [16, 16]        # 2 prompts x 8 tokens, every run
    assert r["otlp_posts"] >= 2 and r["otlp_bytes"] > 0 and r["metrics_multiprocess"]
    assert r["ratio_on_off_median_seconds"] == r["median_seconds"]["on"] / r["median_seconds"]["off"]
    assert r["hook_ms_per_request"]["on"] > r["hook_ms_per_request"]["off"] >= 0 and r["flush_ms_per_run"] > 0
