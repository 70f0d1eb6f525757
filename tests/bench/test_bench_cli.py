"""`specbatch bench` end to end on tiny models: JSON schema, identity, files written, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.bench.harness import BenchOptions, plan_configs
from specbatch.bench.prompts import BUNDLED, bundled, load_prompts, select
from specbatch.cli.main import cli

PROMPTS = [
    {"id": "t1", "category": "code", "prompt": "def fibonacci(n):"},
    {"id": "t2", "category": "chat", "prompt": "Write a haiku about queues"},
    {"id": "t3", "category": "grounded", "prompt": "Summarise: the meeting moved to Tuesday."},
]


@pytest.fixture(autouse=True)
def _restore_threads():
    """--threads 1 (fast on a busy 2-core machine) sets a process-wide torch setting: put it back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _args(tiny_models: Path, prompt_file: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "--quick", "--target", str(tiny_models / "llama"),
            "--draft", str(tiny_models / "llama-partial"), "--prompts", str(prompt_file),
            "--num-prompts", "2", "--max-new-tokens", "10", "--repeats", "1",
            "--gamma-grid", "2,3", "--threads", "1", "--out", str(out), *extra]


def test_bench_json_schema_identity_and_files(tiny_models: Path, prompt_file: Path, tmp_path: Path):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, _args(tiny_models, prompt_file, out, "--json", "--batch-sizes", "1,2",
                                        "--throughput-prompts", "3"), obj={})
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    names = [c["name"] for c in data["configs"]]
    assert names[0] == "target"
    assert any(n.startswith("hf-assisted[") for n in names)
    assert any(n.startswith("hf-prompt-lookup[") for n in names)
    assert "ours[llama-partial]" in names and "ours[ngram]" in names
    assert "ours[llama-partial+ngram]" in names
    assert {"ours[llama-partial,gamma=2]", "ours[llama-partial,gamma=3]"} <= set(names)
    for c in data["configs"]:
        for key in ("name", "tokens_per_second", "speedup_vs_target", "ratio_vs_hf_assisted",
                    "efficiency", "identical", "acceptance_rate", "mean_acceptance_length",
                    "accepted_per_position", "c", "verify_cost_ratio", "bound"):
            assert key in c, (c["name"], key)
        assert c["identical"] is True, (c["name"], c["mismatches"], c["errors"])
        assert c["tokens_per_second"] > 0
    target = data["configs"][0]
    assert target["speedup_vs_target"] == pytest.approx(1.0)
    ours = [c for c in data["configs"] if c["kind"] == "ours"]
    for c in ours:
        assert c["runs"] == 2 and c["mean_acceptance_length"] >= 1.0
    fixed = next(c for c in ours if c["name"] == "ours[llama-partial,gamma=3]")
    assert fixed["verify_tokens"] == 4 and fixed["bound"] > 0 and fixed["efficiency"] > 0
    assert len(fixed["accepted_per_position"]) == 3
    assert data["best_hf_assisted"].startswith("hf-assisted[")
    assert data["identical"] is True and data["failures"] == []
    assert data["llama_cpp"]["status"] == "skipped" and "GGUF" in data["llama_cpp"]["reason"]   # a directory
    assert {"1", "4"} <= set(data["costs"]["target_step_ms"])
    tp = data["throughput"]
    assert [(t["batch_size"], t["mode"]) for t in tp] == [
        (1, "speculative"), (1, "target"), (2, "speculative"), (2, "target")]
    for t in tp:
        assert t["tokens_per_second"] > 0 and t["identical"] is True, t
    for name in ("report.md", "result.json", "speedup_vs_drafters.png", "speedup_vs_gamma.png",
                 "acceptance_per_position.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "speedup_vs_gamma.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "| config | tok/s | speedup vs target |" in md and "ours[llama-partial,gamma=2]" in md
    assert "eagerly" not in res.stderr      # --compile off (the bench's default) says nothing


def test_bench_compile_auto_says_once_that_it_decodes_eagerly(tiny_models: Path, prompt_file: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The bench's auto compiles only what the compile cache holds; an empty cache: one stderr line."""
    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path / "cache"))
    args = _args(tiny_models, prompt_file, tmp_path / "out", "--json", "--no-ngram", "--gamma-grid", "2",
                 "--num-prompts", "1", "--compile", "auto")
    res = CliRunner().invoke(cli, args, obj={})
    assert res.exit_code == 0, res.output
    assert res.stderr.count("specbatch: decoding eagerly: the compile cache does not hold these models' "
                            "graphs; --compile on compiles anyway") == 1, res.stderr
    assert json.loads(res.stdout)["compile"] is None


@pytest.mark.parametrize("mode", ["default", "job"])
def test_bench_without_the_bench_extra_says_so_before_measuring(mode: str, tiny_models: Path, prompt_file: Path,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """matplotlib (the bench extra) was first imported to draw the plots: minutes of measuring, then
    "unexpected error (ModuleNotFoundError ...)"."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError
    out = tmp_path / "out"
    args = _args(tiny_models, prompt_file, out) if mode == "default" else \
        ["bench", "--job", str(prompt_file), "--quick", "--target", str(tiny_models / "llama"),
         "--draft", str(tiny_models / "llama-partial"), "--out", str(out)]
    res = CliRunner().invoke(cli, args, obj={})
    assert res.exit_code == 1, res.output
    assert res.stderr.count("\n") == 1, res.stderr
    assert "pip install 'specbatch[bench]'" in res.stderr and "unexpected error" not in res.stderr
    assert not out.exists()        # nothing measured, nothing written


def test_bench_reports_a_mismatch_as_failure(tiny_models: Path, prompt_file: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch):
    from specbatch.bench import runners

    real = runners.EngineRunner.__call__

    def corrupted(self, ids, max_new_tokens):  # type: ignore[no-untyped-def]
        out = real(self, ids, max_new_tokens)
        out.tokens = out.tokens[:-1] + [(out.tokens[-1] + 1) % 50] if out.tokens else [1]
        return out

    monkeypatch.setattr(runners.EngineRunner, "__call__", corrupted)
    out = tmp_path / "out"
    args = _args(tiny_models, prompt_file, out, "--no-ngram", "--gamma-grid", "2", "--num-prompts", "1")
    res = CliRunner().invoke(cli, args, obj={})
    assert res.exit_code == 1, res.output
    assert "FAILED: ours[llama-partial]" in res.stderr
    assert "| config | tok/s |" in res.stdout          # the table is still printed
    assert f"wrote {out / 'report.md'}, {out / 'result.json'}" in res.stderr
    assert (out / "report.md").read_text().count("differs from the target") >= 1


def test_bundled_prompt_sets():
    for name in BUNDLED:
        prompts = bundled(name)
        assert len(prompts) >= 30, name
        assert len({p.id for p in prompts}) == len(prompts)
        assert all(p.category == name and p.prompt for p in prompts)
    assert all("Text:\n" in p.prompt for p in bundled("grounded"))
    assert len(load_prompts("all")) == sum(len(bundled(n)) for n in BUNDLED)
    assert [p.category for p in select(load_prompts("all"), 4)] == ["code", "chat", "grounded", "code"]


def test_plan_configs_covers_baselines_pools_and_gamma_grid():
    opts = BenchOptions(gamma_grid=(2, 4), hf_settings=("default", "const5"))
    names = [c.name for c in plan_configs(opts, ["a-int8", "a", "ngram"])]
    assert names == [
        "target", "hf-assisted[a-int8,default]", "hf-assisted[a-int8,const5]",
        "hf-assisted[a,default]", "hf-assisted[a,const5]", "hf-prompt-lookup[10]",
        "ours[a-int8]", "ours[a]", "ours[ngram]", "ours[a-int8+a]", "ours[a-int8+a+ngram]",
        "ours[a-int8,gamma=2]", "ours[a-int8,gamma=4]"]


def test_random_weights_keep_shapes_and_add_a_self_draft(tiny_models: Path):
    import torch

    from specbatch.bench.harness import load_models

    opts = BenchOptions(target=str(tiny_models / "llama"), drafts=(str(tiny_models / "llama-partial"),),
                        random_weights=True)
    target, drafts = load_models(opts)
    assert list(drafts) == [f"{target.name}-self", str(tiny_models / "llama-partial")]
    assert drafts[f"{target.name}-self"].model is target.model
    assert target.info["random_weights"] is True
    from specbatch.engine.loading import load_model

    orig = load_model(str(tiny_models / "llama"))
    for (n1, p1), (n2, p2) in zip(orig.model.named_parameters(), target.model.named_parameters(), strict=True):
        assert n1 == n2 and p1.shape == p2.shape
    assert not torch.equal(orig.model.lm_head.weight, target.model.lm_head.weight)


@pytest.mark.slow
def test_hf_compiled_assisted_baseline_runs_through_hfs_own_compiled_path(tiny_models: Path, prompt_file: Path,
                                                                         tmp_path: Path):
    """compiled5: HF's static cache + torch.compile (inductor's defaults) beside HF eager; both
    must give the target's own output, and HF's compiled call must actually have compiled."""
    import torch

    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    res = CliRunner().invoke(cli, [*_args(tiny_models, prompt_file, tmp_path / "out", "--json"),
                                   "--hf-settings", "const5,compiled5", "--num-prompts", "1"], obj={})
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    compiled = next(c for c in data["configs"] if c["name"] == "hf-assisted[llama-partial,compiled5]")
    eager = next(c for c in data["configs"] if c["name"] == "hf-assisted[llama-partial,const5]")
    assert compiled["identical"] is True and eager["identical"] is True, (compiled["mismatches"], compiled["errors"])
    assert compiled["tokens_per_second"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames_before
