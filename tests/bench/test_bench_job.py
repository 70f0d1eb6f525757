"""`specbatch bench --job FILE` end to end on tiny models: the --json shape, identity, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specbatch.bench.breakdown import BUCKETS, _bucket, fastest, profile_pass
from specbatch.bench.job import PUBLIC_KEYS, plan
from specbatch.cli.main import cli


@pytest.fixture(autouse=True)
def _restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_plan_covers_the_grid():
    names = [c.name for c in plan((1, 4))]
    assert names == ["ours-auto", "ours[B=1,spec]", "ours[B=1,plain]", "hf-generate[B=1]",
                     "ours[B=4,spec]", "ours[B=4,plain]", "hf-generate[B=4]", "hf-assisted[B=1]"]
    assert [c.name for c in plan((8,))] == ["ours-auto", "ours[B=8,spec]", "ours[B=8,plain]", "hf-generate[B=8]"]
    assert [c.name for c in plan((8,), llama_cpp=True)][-1] == "llama-cpp[B=8]"
    assert [c.name for c in plan((4, 8), shared_prefix=True, llama_cpp=True)][2:] == [
        "hf-generate[B=4]", "llama-cpp[B=4]", "hf-generate[B=8]", "llama-cpp[B=8]"]


def test_breakdown_buckets_tell_the_head_from_a_layer_gemm():
    vocab = 49152
    assert _bucket("aten::mm", [[8, 576], [576, 1536]], vocab) == "gemm"
    assert _bucket("aten::mm", [[8, 576], [576, vocab]], vocab) == "head_and_sampling"
    assert _bucket("aten::_scaled_dot_product_flash_attention_for_cpu", [], vocab) == "attention"
    assert _bucket("aten::cat", [], vocab) == "cache_management"
    assert _bucket("aten::silu", [], vocab) == "elementwise"
    # engine/blocks.py's products: the weight as (N/32, K, ...) tiles
    assert _bucket("specbatch_blocks::q4_1", [[8, 576], [48, 576, 16], [48, 18, 32], [48, 18, 32]], vocab) == "gemm"
    assert _bucket("specbatch_blocks::q8_0", [[8, 576], [vocab // 32, 576, 32], [vocab // 32, 18, 32]],
                   vocab) == "head_and_sampling"


def test_a_peak_is_the_fastest_trial_not_one_a_neighbour_slowed(monkeypatch):
    """A product of tens of microseconds: one trial interrupted (here: a fake clock that loses 1 s
    in the first trial) must not set the peak the report divides by."""
    from specbatch.bench import breakdown

    now = [0.0]
    calls = [0]

    def call():
        calls[0] += 1
        now[0] += 1.0 if calls[0] == 1 else 1e-5

    monkeypatch.setattr(breakdown.time, "perf_counter", lambda: now[0])
    assert fastest(call, repeats=10, trials=3) == pytest.approx(1e-5)
    assert calls[0] == 30


def test_a_cat_called_by_the_rotary_embedding_is_elementwise():
    rope = ["<built-in method cat of type object at 0x7f>",
            "transformers/models/llama/modeling_llama.py(119): rotate_half",
            "transformers/models/llama/modeling_llama.py(126): apply_rotary_pos_emb"]
    assert _bucket("aten::cat", [], 49152, rope) == "elementwise"
    cache = ["<built-in method cat of type object at 0x7f>", "transformers/cache_utils.py(120): update"]
    assert _bucket("aten::cat", [], 49152, cache) == "cache_management"


def rotate_half(x):
    """RoPE's rotation, as transformers writes it (the profiler sees this function's name)."""
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-b, a), dim=-1)


class _Layer(torch.nn.Module):
    def __init__(self, cache: bool) -> None:
        super().__init__()
        self.cache = cache

    def forward(self, x):
        return torch.cat((x, x), dim=-2) if self.cache else rotate_half(x)


def test_the_profiled_pass_buckets_rotary_cats_by_their_caller():
    x = torch.randn(2, 4, 8, 16)
    for cache, bucket in ((False, "elementwise"), (True, "cache_management")):
        layer = _Layer(cache)
        b = profile_pass(lambda m=layer: [m(x) for _ in range(5)], layer, vocab=1000)
        assert b["target_forwards"] == 5
        assert (b["ms_per_forward"]["cache_management"] > 0) == cache, (cache, b["ms_per_forward"])
        assert b["ms_per_forward"][bucket] > 0


def test_the_profiled_pass_records_one_step_in_every_and_only_those():
    """Recording every step of the default job held 13 GB (2 million events); one step in
    ``every`` is recorded, the middle one of each ``every`` (not the first: a prefill). Step r runs
    from forward r-1's start to forward r's: here only forwards 2 and 6 concatenate (cache
    management), so only a pass that records steps 3 and 7 sees a cat in every step it recorded."""
    x = torch.randn(64, 64)
    calls = [0]

    class Layer(torch.nn.Module):
        def forward(self, y):
            calls[0] += 1
            return torch.cat((y, y)) if (calls[0] - 1) % 4 == 2 else y + y

    layer = Layer()
    b = profile_pass(lambda: [layer(x) for _ in range(9)], layer, vocab=1000, every=4)
    assert (b["target_forwards"], b["recorded_steps"]) == (9, 2)
    cats = b["ms_per_forward"]["cache_management"]
    calls[0] = 1                       # now forwards 3 and 7 cat: no recorded step does
    b = profile_pass(lambda: [layer(x) for _ in range(9)], layer, vocab=1000, every=4)
    assert cats > 0 and b["ms_per_forward"]["cache_management"] == 0, (cats, b["ms_per_forward"])
    calls[0] = 0
    assert profile_pass(lambda: [layer(x) for _ in range(9)], layer, vocab=1000, every=1)["recorded_steps"] == 9


def test_bench_job_json_shape_identity_and_files(tiny_models: Path, tmp_path: Path):
    prompts = tmp_path / "job.jsonl"
    lines = [{"custom_id": f"q{i}", "prompt": p, "max_tokens": 6 + 2 * i} for i, p in
             enumerate(["def fibonacci(n):", "Write a haiku about", "SELECT id FROM", "Once upon a time"])]
    lines.append({"custom_id": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["bench", "--job", str(prompts), "--target", str(tiny_models / "llama"),
                                   "--draft", str(tiny_models / "llama-partial"), "--batch-sizes", "1,2",
                                   "--threads", "1", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"job", "best_fixed", "llama_cpp"}
    # the tiny models have no GGUF file: llama.cpp is skipped, and says why, whether or not it is installed
    assert data["llama_cpp"]["status"] == "skipped" and "GGUF" in data["llama_cpp"]["reason"]
    names = [r["name"] for r in data["job"]]
    assert names == [c.name for c in plan((1, 2))]
    for r in data["job"]:
        assert tuple(r) == PUBLIC_KEYS
        assert r["tokens_per_second"] > 0
    ours = {r["name"]: r for r in data["job"] if r["name"].startswith("ours")}
    assert all(r["identical"] for r in ours.values()), ours
    assert data["best_fixed"] in ours and ours[data["best_fixed"]]["ratio_vs_best_fixed"] == pytest.approx(1.0)
    assert all(r["ratio_vs_best_fixed"] <= 1.0 + 1e-9 for n, r in ours.items() if n != "ours-auto")
    assert ours["ours-auto"]["batch_size"] == "auto"
    report = (out / "job-report.md").read_text()
    assert "| ours-auto | auto |" in report and "ours-auto#1: kept B=" in report
    assert "llama.cpp baseline: skipped: " in report and "vs best llama.cpp" not in report
    assert (out / "job-throughput.png").stat().st_size > 1000
    full = json.loads((out / "job-result.json").read_text())
    b = full["breakdown"]           # one profiled pass of ours-auto: buckets add up to its wall time
    assert b["target_forwards"] > 0 and set(b["ms_per_forward"]) == set(BUCKETS)
    assert b["ms_per_forward"]["gemm"] > 0 and b["ms_per_forward"]["attention"] > 0
    assert sum(b["share"].values()) == pytest.approx(1.0, abs=1e-6)
    assert full["gemm_peak_gflops"] > 0 and "Where ours-auto's time goes" in report


def test_bench_job_rejects_a_bad_file(tiny_models: Path, tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    res = CliRunner().invoke(cli, ["bench", "--job", str(bad), "--target", str(tiny_models / "llama"),
                                   "--draft", str(tiny_models / "llama-partial")])
    assert res.exit_code == 1 and "bad.jsonl" in res.output and "Traceback" not in res.output


def test_bench_shared_prefix_runs_the_prefix_cache_on_and_off(tiny_models: Path, tmp_path: Path):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["bench", "--shared-prefix", "60", "--target", str(tiny_models / "llama"),
                                   "--draft", str(tiny_models / "llama-partial"), "--num-prompts", "6",
                                   "--max-new-tokens", "5", "--batch-sizes", "3", "--threads", "1",
                                   "--no-breakdown", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["name"] for r in data["job"]] == ["ours-auto", "ours-auto[no-prefix-cache]", "hf-generate[B=3]"]
    full = json.loads((out / "job-result.json").read_text())
    assert full["breakdown"] is None and "Where ours-auto's time goes" not in (out / "job-report.md").read_text()
    assert all(r["identical"] for r in data["job"])
    pc = data["prefix_cache"]
    assert pc["identical"] and pc["ratio"] > 0
    # five of the six requests read the shared system prompt (the first computes it)
    assert pc["cached_prompt_tokens"] >= 5 * 60 and 0 < pc["cached_share"] < 1
    lines = [json.loads(x) for x in (out / "shared-prefix-60.jsonl").read_text().splitlines()]
    assert len(lines) == 48 and len({x["messages"][0]["content"] for x in lines}) == 1
    assert len({x["messages"][1]["content"] for x in lines}) == 48
    assert all(32 <= x["max_tokens"] <= 64 for x in lines)
    assert "prefix cache: ours-auto on / off = " in (out / "job-report.md").read_text()


def test_shared_prefix_is_a_mode_of_its_own(tiny_models: Path, tmp_path: Path):
    res = CliRunner().invoke(cli, ["bench", "--shared-prefix", "60", "--no-prefix-cache"])
    assert res.exit_code == 2 and "drop --job / --no-prefix-cache" in res.output
    res = CliRunner().invoke(cli, ["bench", "--no-prefix-cache", "--quick"])
    assert res.exit_code == 2 and "job mode" in res.output
