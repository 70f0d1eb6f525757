"""`specbatch bench --structured` on tiny models: every configuration at every B, identical greedy
outputs, the grammar's share counted only where it drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.bench.structured import MODES
from specbatch.cli.main import cli


@pytest.fixture(autouse=True)
def _restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_structured_json_shape_and_identity(tiny_models: Path, tmp_path: Path):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["bench", "--structured", "--target", str(tiny_models / "llama"),
                                   "--draft", str(tiny_models / "llama-partial"), "--batch-sizes", "1,2",
                                   "--num-prompts", "3", "--max-new-tokens", "24", "--threads", "1",
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == [f"{m}[B={b}]" for b in ("auto", 1, 2) for m in MODES]
    assert all(r["identical"] for r in rows.values()), rows
    for b in ("auto", 1, 2):
        assert rows[f"constrained[B={b}]"]["grammar_token_share"] == 0
        assert rows[f"grammar[B={b}]"]["grammar_token_share"] > 0      # the schema's keys are forced
        assert rows[f"draft+grammar[B={b}]"]["grammar_on_over_off"] is not None
    assert "| grammar[B=1] | 1 |" in (out / "structured-report.md").read_text()
