"""The compiled forward (docs/COMPILE.md): lossless through it, eager fallback, auto decision.

Compiling a tiny model still takes tens of seconds on 2 cores, so the compiled tests share one
module-scoped pair of compiled models (their own instances: the session's ``load`` fixture keeps
eager ones for every other test) and are marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specbatch.config import Settings
from specbatch.engine import Engine, GenerationParams
from specbatch.engine.compile import decision as D
from specbatch.engine.compile import forward as F
from specbatch.engine.compile import inductor as I
from specbatch.engine.compile import prepare as P
from specbatch.engine.compile import record as R
from specbatch.engine.compile import warmup as W
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model
from tests.engine.test_sampling_distribution import WARP, chi2_pvalue, empirical, exact_joint, tv

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The",
           "Write a haiku about"]
N = 40


# ------------------------------------------------------------------------------------------------
# fast: the decision and the settings


def test_compile_pays_weighs_saved_decode_time_against_compile_time():
    # 2.5x faster decoding saves 60% of the eager decode time
    assert D.compile_pays(1000.0, 500.0, cached=False, speedup=2.5)
    assert not D.compile_pays(100.0, 500.0, cached=False, speedup=2.5)
    assert not D.compile_pays(100.0, 60.0, cached=False, speedup=2.5)       # saves exactly 60
    assert D.compile_pays(100.0, 60.0, cached=True, speedup=2.5)           # a cached tie compiles
    assert D.compile_seconds_estimate(4, cached=True) < D.compile_seconds_estimate(4, cached=False)


def test_expected_speedup_is_the_measurement_or_the_lower_neighbour(monkeypatch):
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 1.8, 16: 1.4})
    assert D.expected_speedup("cpu") == 1.8
    assert D.expected_speedup("cpu", 8) == 1.4           # between two measurements: the lower
    assert D.expected_speedup("cpu", 16) == D.expected_speedup("cpu", 64) == 1.4
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {4: 1.2, 16: 1.4})
    assert D.expected_speedup("cpu", 1) == 1.2           # below the smallest: the smallest
    assert D.expected_speedup("mps", 16) == 1.0          # unmeasured: no gain assumed


def test_batched_graphs_are_warmed_at_the_planned_rows():
    """Autotune picks each GEMM's kernel for the rows it is warmed at (docs/COMPILE.md)."""
    assert W.warm_shapes(1) == W.WARM_SHAPES
    assert W.warm_shapes(16) == (*W.WARM_SHAPES, (16, 1, 1), (16, 4, 2))


def test_an_int8_target_stays_eager_beside_a_draft_that_could_compile(tiny_models, tmp_path, monkeypatch):
    """The decision weighs the target's speedup; an int8 target used to end it in a KeyError."""
    target, draft = load_model(str(tiny_models / "llama")), load_model(str(tiny_models / "llama-partial"))
    monkeypatch.setattr(P, "compilable", lambda model: "int8 layers" if model is target.model else None)
    monkeypatch.setattr(W, "warm_up", lambda *a, **k: pytest.fail("nothing compiles"))
    for mode in ("auto", "on"):
        plan = P.prepare(target, [draft], mode=mode, batch_size=8, cache_dir=tmp_path)
        assert not plan.enabled and "int8 layers" in plan.reason


def test_a_worker_in_auto_compiles_where_compiling_measured_faster(tiny_models, tmp_path, monkeypatch):
    """A long-lived worker (no job size) compiles, before it consumes; a short job does not."""
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 1.8, 16: 1.4})   # a device where it pays
    target = load_model(str(tiny_models / "llama"))
    warmed = []
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: warmed.append(shapes) or
                        R.CompileReport(model=lm.name, enabled=True, seconds=1.0))
    _no_comparison(monkeypatch)
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path, expected_new_tokens=16)
    assert not plan.enabled and "compiling would take" in plan.reason and not warmed
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert plan.enabled and plan.reason == "auto: a long-lived worker" and warmed == [W.warm_shapes(8)]


def test_auto_weighs_a_batched_job_by_a_step_at_its_rows(tiny_models, tmp_path, monkeypatch):
    """tokens / rows x the eager step at those rows (a step of 8 rows costs more than one of 1)."""
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 1.8, 16: 1.4})   # a device where it pays
    target = load_model(str(tiny_models / "llama"))
    real = D.eager_step_seconds
    assert real(target, rows=3) > 0               # the real measurement runs at several rows
    asked = []
    monkeypatch.setattr(D, "eager_step_seconds", lambda lm, rows=1: asked.append(rows) or 0.5)
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path, expected_new_tokens=160)
    assert asked == [8] and "of the job's about 10 s of eager decoding" in plan.reason, plan.reason
    speedup = D.expected_speedup(target.device, 8)      # what compiling saves, not what decoding costs
    assert plan.reason.startswith("auto: compiling would take about ")
    assert f"save about {10 * (1 - 1 / speedup):.1f} s of" in plan.reason and f"(at {speedup:.2f}x)" in plan.reason


def test_where_frozen_graphs_do_not_fit_cpu_compiles_them_not_frozen(tiny_models, tmp_path, monkeypatch,
                                                                       caplog):
    """A frozen graph holds its own copy of the weights: past the memory budget the graphs are
    compiled without freezing (no copies); past it even so, auto declines and on warns."""
    import specbatch.engine.memory as memory

    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 1.8, 16: 1.4})   # a device where it pays
    target = load_model(str(tiny_models / "llama"))
    weights = D.weight_bytes(target.model)
    listed = sum(t.numel() * t.element_size() for t in (*target.model.parameters(), *target.model.buffers()))
    assert 0 < weights <= listed        # a tied head is counted once
    need = D.compile_memory_estimate([(target, W.warm_shapes(8))])
    assert need == D.MEMORY_FIXED + int(weights * D.MEMORY_PER_GRAPH * 4)
    assert D.compile_memory_estimate([(target, W.warm_shapes(8))], frozen=False) == D.MEMORY_FIXED
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: R.CompileReport(model=lm.name, enabled=True))
    _no_comparison(monkeypatch)

    monkeypatch.setattr(memory, "default_budget", lambda device: need)
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert plan.enabled and "not frozen" not in plan.reason and target.compiled.frozen

    monkeypatch.setattr(memory, "default_budget", lambda device: need - 1)
    target.compiled = None
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert plan.enabled and "not frozen: frozen graphs would need" in plan.reason
    assert target.compiled is not None and not target.compiled.frozen

    monkeypatch.setattr(memory, "default_budget", lambda device: D.MEMORY_FIXED - 1)
    target.compiled = None
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert not plan.enabled and "more memory" in plan.reason and target.compiled is None
    with caplog.at_level("WARNING", logger="specbatch.engine.compile"):
        plan = P.prepare(target, [], mode="on", batch_size=8, cache_dir=tmp_path)
    assert plan.enabled and "more memory" in caplog.text and not target.compiled.frozen


def test_compile_mode_setting_and_validation():
    assert Settings.from_env({}).compile == "auto"
    assert Settings.from_env({"SPECBATCH_COMPILE": "off"}).compile == "off"
    assert D.resolve_mode(" ON ") == "on"
    with pytest.raises(ValueError, match="auto, on, off"):
        D.resolve_mode("sometimes")


def test_cpu_gets_cpp_gemm_and_a_warm_up_under_other_options_is_not_cached(tmp_path):
    from types import SimpleNamespace

    cpu = I.inductor_options("cpu")
    assert cpu["max_autotune"] and "CPP" in cpu["max_autotune_gemm_backends"].split(",")
    assert "max_autotune" not in I.inductor_options("cuda")
    lm = SimpleNamespace(name="m", info={"source": "/w"}, device=torch.device("cpu"))
    R.write_marker(R.marker(tmp_path, lm), R.CompileReport(model="m", enabled=True, seconds=3.0))
    assert R.is_cached(lm, tmp_path)
    # graphs compiled not frozen are other graphs: their record (times, ratios) is their own
    assert not R.is_cached(lm, tmp_path, frozen=False) and R.recorded_seconds(lm, tmp_path) == 3.0
    assert R.recorded_seconds(lm, tmp_path, frozen=False) is None
    # a start that warms fewer graphs than the one recorded takes proportionally less
    R.write_marker(R.marker(tmp_path, lm), R.CompileReport(model="m", enabled=True, seconds=8.0,
                                                             graphs={"1x1:1": 1.0, "1x4:2": 1.0,
                                                                     "4x1:1": 1.0, "4x4:2": 1.0}))
    assert D.expected_compile_seconds(lm, 2, tmp_path, cached=True) == 4.0
    assert not R.is_cached(SimpleNamespace(name="m", info={"source": "/w"}, device=torch.device("cuda")),
                           tmp_path)


def test_compiling_leaves_the_environment_alone_unless_the_edge_points_the_caches(tiny_models, tmp_path,
                                                                                monkeypatch):
    """Torch reads inductor's cache location from TORCHINDUCTOR_CACHE_DIR only; prepare must not
    write it behind its caller's back: the CLI and the worker ask for it (use_compile_cache)."""
    from specbatch.cli.compile_text import use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: R.CompileReport(model=lm.name, enabled=True))
    _no_comparison(monkeypatch)
    plan = P.prepare(load_model(str(tiny_models / "llama")), [], mode="on", batch_size=1, cache_dir=tmp_path)
    ours = str(I.inductor_cache_dir(tmp_path))
    assert plan.enabled and os.environ.get("TORCHINDUCTOR_CACHE_DIR") != ours   # (torch may write its default)
    use_compile_cache(Settings.from_env({"SPECBATCH_CACHE_DIR": str(tmp_path)}), "off")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != ours    # off compiles nothing: nothing to point
    use_compile_cache(Settings.from_env({"SPECBATCH_CACHE_DIR": str(tmp_path)}), "auto")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours


@pytest.mark.parametrize("command", ["run", "worker", "generate", "bench"])
def test_compile_option_on_every_decoding_command(command):
    from click.testing import CliRunner

    from specbatch.cli.main import cli

    # (static: the static-cache backend, engine/compile/static.py; the bench measures the compiled forward)
    choices = ["auto", "on", "off"] + ([] if command == "bench" else ["static"])
    assert f"--compile [{'|'.join(choices)}]" in CliRunner().invoke(cli, [command, "--help"]).output
    bad = CliRunner().invoke(cli, [command, "--compile", "sometimes"])
    assert bad.exit_code == 2 and f"'sometimes' is not one of {', '.join(map(repr, choices))}" in bad.output


def test_off_and_uncompilable_models_stay_eager(tiny_models, tmp_path, monkeypatch):
    target = load_model(str(tiny_models / "llama"))
    plan = P.prepare(target, [], mode="off", batch_size=1, cache_dir=tmp_path)
    assert not plan.enabled and target.compiled is None
    # auto where nothing was measured: no gain assumed, so neither a job nor a worker compiles
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {})
    for tokens in (8, None):
        plan = P.prepare(target, [], mode="auto", batch_size=1, cache_dir=tmp_path, expected_new_tokens=tokens)
        assert not plan.enabled and "gains 1.00x at 1 row (the least any cpu host measured" in plan.reason
        assert target.compiled is None
    # where it measured faster, a short job in auto mode still does not repay a first compile
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 2.5})
    plan = P.prepare(target, [], mode="auto", batch_size=1, cache_dir=tmp_path, expected_new_tokens=8)
    assert not plan.enabled and "compiling would take" in plan.reason and target.compiled is None
    from specbatch.engine.loading import _quantize_int8

    int8 = load_model(str(tiny_models / "llama"))
    int8.model = _quantize_int8(int8.model, int8.device)
    assert F.compilable(int8.model) is not None
    assert F.install(int8) is None


def test_bench_times_the_loaded_models_forward_beside_the_eager_model(tiny_models):
    """T(k) through ``LoadedModel.forward`` (compiled when installed) next to the raw model's."""
    from specbatch.bench.costs import CostSampler

    lm = load_model(str(tiny_models / "llama"))
    sampler = CostSampler(lm.model, {}, lm.device, list(range(5, 25)), [1, 3], compiled_target=lm)
    sampler.sample(2)
    table = sampler.table()
    assert set(table.target) == set(table.compiled) == {1, 3}
    d = table.to_dict()
    assert set(d["compiled_vs_eager"]) == {"1", "3"} and d["compiled_verify_ratio"]["1"] == 1.0
    assert table.t(3) == table.compiled[3]     # ours decode through the compiled forward


def test_causal_mask_matches_the_models_own_masking(tiny_models):
    """The compiled path always passes an explicit mask; it must equal the implicit causal one."""
    from transformers import DynamicCache

    lm = load_model(str(tiny_models / "llama"))
    ids = torch.tensor([[5, 9, 13, 2, 7, 7, 30]])
    with torch.inference_mode():
        cache = DynamicCache()
        lm.model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        implicit = lm.model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True).logits
        cache = DynamicCache()
        lm.model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        explicit = lm.model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True,
                            attention_mask=F.causal_mask(1, 3, 4, torch.float32, lm.device),
                            position_ids=torch.arange(4, 7)[None]).logits
    torch.testing.assert_close(explicit, implicit)


def test_a_call_missing_every_warmed_graph_runs_eagerly_counted_and_warned(tiny_models, caplog):
    """After warm-up a miss neither compiles (minutes) nor passes silently: it runs eagerly, is
    counted (specbatch_compiled_forward_misses) and warned about once. Dynamo's guards are what
    decide a miss, so the test keeps the real ones and swaps only inductor for the eager backend."""
    from transformers import DynamicCache

    lm = load_model(str(tiny_models / "llama"))
    fwd = F.install(lm)
    fwd._fn = torch.compile(lm.model, dynamic=True, backend="eager")
    caches = [DynamicCache() for _ in range(3)]
    with torch.inference_mode():
        for c in caches:
            lm.model(input_ids=torch.tensor([[5, 9, 13, 2]]), past_key_values=c, use_cache=True)
        lm.forward(torch.tensor([[7, 8]]), caches[0])       # warm-up: compiles this graph
        fwd.warmed = True
        hit = lm.forward(torch.tensor([[7, 8]]), caches[1]).logits
        assert (fwd.calls, fwd.misses) == (1, 0)
        with caplog.at_level("WARNING", logger="specbatch.engine.compile"):
            miss = lm.forward(torch.tensor([[7, 8]], dtype=torch.int32), caches[2]).logits
    assert (fwd.calls, fwd.misses) == (2, 1)
    assert F.forward_counts()[lm.name] == (2, 1)
    assert "ran eagerly" in caplog.text and "dtype mismatch" in caplog.text
    torch.testing.assert_close(miss, hit)
    assert caches[2].get_seq_length() == caches[1].get_seq_length() == 6   # appended once


def _eager_backend(monkeypatch):
    """``torch.compile`` with dynamo's real guards but no inductor (seconds, not minutes)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, dynamic=True, backend="eager"))


def _no_comparison(monkeypatch):
    """Frozen graphs only, as before a first start compared them (tests of other decisions)."""
    monkeypatch.setattr(W, "compare_not_frozen", lambda lm, shapes, cache_dir, report, **_: report)


def test_frozen_is_kept_only_where_it_measured_worth_it(tmp_path):
    from types import SimpleNamespace

    assert D.keeps_frozen({"1x1:1": 1.10, "1x4:2": 1.20})
    assert not D.keeps_frozen({"1x1:1": 1.01, "1x4:2": 1.02})           # within the margin: not worth it
    assert not D.keeps_frozen({"1x1:1": 0.95, "1x4:2": 1.10})           # geometric mean 1.022
    assert D.keeps_frozen({})                                           # nothing measured: as before
    lm = SimpleNamespace(name="m", info={"source": "/w"}, device=torch.device("cpu"))
    assert D.recorded_frozen(lm, tmp_path) is None
    R.write_marker(R.marker(tmp_path, lm), R.CompileReport(model="m", enabled=True, seconds=3.0))
    assert D.recorded_frozen(lm, tmp_path) is None                      # warmed, never compared
    R.write_marker(R.marker(tmp_path, lm), R.CompileReport(model="m", enabled=True,
                                                             frozen_gain={"1x1:1": 1.01, "1x4:2": 1.0}))
    assert D.recorded_frozen(lm, tmp_path) is False
    # a later start (which compiles only the variant kept, no comparison) keeps the decision
    R.write_marker(R.marker(tmp_path, lm), R.CompileReport(model="m", enabled=True, seconds=2.0))
    assert D.recorded_frozen(lm, tmp_path) is False and R.recorded_seconds(lm, tmp_path) == 2.0
    # a batch-1 comparison does not decide for batched graphs
    assert D.recorded_frozen(lm, tmp_path, W.warm_shapes(1)) is False
    assert D.recorded_frozen(lm, tmp_path, W.warm_shapes(16)) is None
    R.marker(tmp_path, lm).write_text('{"frozen_gain": {"1x1:1": "fast"}}')
    assert D.recorded_frozen(lm, tmp_path) is None                      # not a measurement


@pytest.mark.parametrize("kept", [True, False])
def test_the_first_start_compares_frozen_and_not_and_later_starts_compile_the_one_kept(
        kept, tiny_models, tmp_path, monkeypatch):
    """Real dynamo graphs of both variants (eager backend: seconds, so both time alike and the
    decision is forced each way); the decision is recorded for later starts."""
    _eager_backend(monkeypatch)
    monkeypatch.setattr(D, "keeps_frozen", lambda gain: kept)
    target = load_model(str(tiny_models / "llama"))
    plan = P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path)
    report = plan.models[0]
    assert plan.enabled and set(report.frozen_gain) == set(report.graphs) == {"1x1:1", "1x4:2"}
    assert min(report.frozen_gain.values()) > 0
    assert target.compiled.frozen is kept is report.frozen is D.recorded_frozen(target, tmp_path)
    assert R.is_cached(target, tmp_path, True) and R.is_cached(target, tmp_path, False)
    assert report.first_start_seconds >= report.seconds > 0        # this start paid both compiles
    # the other variant's graphs were warmed as well: serving either misses nothing
    both = [target.compiled, target.compiled.alternative]
    assert sorted(f.frozen for f in both) == [False, True] and all(f.warmed for f in both)
    assert all(f.calls == 0 for f in both)        # the comparison's steps are not counted as decoding
    with torch.inference_mode():
        outs = []
        for f in both:
            target.compiled = f
            outs.append(_greedy(Engine(target), PROMPTS[0], n=8))
    assert outs[0] == outs[1] and all(f.misses == 0 and f.calls > 0 for f in both)

    # a later start compiles only the variant kept, and says why where that is not frozen
    compared = []
    monkeypatch.setattr(W, "compare_not_frozen", lambda *a, **_: compared.append(a) or a[-1])
    target.compiled = None
    plan = P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path)
    assert not compared and target.compiled.frozen is kept
    assert D.recorded_frozen(target, tmp_path) is kept          # and its record keeps the decision
    assert ("not frozen: frozen graphs measured less than" in plan.reason) is not kept
    # a batched start needs graphs the batch-1 comparison did not measure: it compares them
    target.compiled = None
    P.prepare(target, [], mode="on", batch_size=3, cache_dir=tmp_path)
    assert len(compared) == 1


def test_a_not_frozen_compile_that_fails_leaves_frozen_serving_without_a_warning(
        tiny_models, tmp_path, monkeypatch, caplog):
    real = torch.compile

    def compile_(model, **kw):
        if "options" not in kw:          # the frozen variant (inductor's global options)
            return real(model, dynamic=True, backend="eager")

        def broken(**inputs):
            raise RuntimeError("the not-frozen compile broke")
        return broken
    monkeypatch.setattr(torch, "compile", compile_)
    target = load_model(str(tiny_models / "llama"))
    with caplog.at_level("INFO", logger="specbatch.engine.compile"):
        plan = P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path)
    assert plan.enabled and target.compiled.frozen and target.compiled.failed is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "not-frozen graphs failed to compile" in caplog.text
    assert D.recorded_frozen(target, tmp_path) is True          # recorded: later starts do not retry
    from specbatch.cli.compile_text import frozen_summary

    assert "failed to compile here: kept frozen" in frozen_summary(plan.models[0])
    assert _greedy(Engine(target), PROMPTS[0], n=4) and target.compiled.misses == 0


def test_auto_keeps_eager_the_shapes_that_measured_no_faster_here(tiny_models, tmp_path, monkeypatch):
    """Warm-up times each graph against eager on this machine; auto routes the shape classes that
    gain nothing to the eager model, and a later start decides from that measurement."""
    from transformers import DynamicCache

    _eager_backend(monkeypatch)
    _no_comparison(monkeypatch)
    monkeypatch.setitem(D.EXPECTED_SPEEDUP, "cpu", {1: 2.0})
    monkeypatch.setattr(W, "measure_speedup", lambda lm, cache, ids, keep: 0.9 if ids.shape[1] > 1 else 1.5)
    target = load_model(str(tiny_models / "llama"))
    plan = P.prepare(target, [], mode="auto", batch_size=3, cache_dir=tmp_path)
    report = plan.models[0]
    assert plan.enabled and report.speedups == {"1x1:1": 1.5, "1x4:2": 0.9, "3x1:1": 1.5, "3x4:2": 0.9}
    assert report.eager_shapes == ["1x4:2", "3x4:2"]
    assert target.compiled.eager_classes == {(False, True), (True, True)}
    calls = target.compiled.calls
    with torch.inference_mode():
        cache = DynamicCache()
        target.forward(torch.tensor([[5, 9, 13, 2]]), cache)         # prefill: eager
        target.forward(torch.tensor([[7, 8]]), cache)                # a verify: eager here
        assert target.compiled.calls == calls
        target.forward(torch.tensor([[7]]), cache)                   # a plain step: compiled
    assert target.compiled.calls == calls + 1 and target.compiled.misses == 0
    assert R.recorded_speedup(target, tmp_path, 1) == R.recorded_speedup(target, tmp_path, 8) == 1.5

    # on compiles every graph as told, whatever it measures
    target.compiled = None
    plan = P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path)
    assert plan.models[0].eager_shapes == [] and target.compiled.eager_classes == set()

    # a later start: the measurement here, not the device table, decides
    monkeypatch.setattr(W, "measure_speedup", lambda lm, cache, ids, keep: 1.01)
    target.compiled = None
    P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path)
    assert R.recorded_speedup(target, tmp_path, 1) == 1.01
    target.compiled = None
    plan = P.prepare(target, [], mode="auto", batch_size=1, cache_dir=tmp_path)
    assert not plan.enabled and "gains 1.01x at 1 row (measured here" in plan.reason and target.compiled is None


def test_auto_compiles_only_where_the_gain_is_strictly_above_the_margin(tiny_models, tmp_path, monkeypatch):
    """The CPU prior is the lowest host measured (1.17x at 1 row, 1.05x at 16): a CPU worker
    planning 8 rows expects exactly MIN_SPEEDUP and must not spend a core compiling for a quarter
    of an hour to gain that; at 1 row it compiles. A graph measured at exactly the margin stays
    eager too."""
    _eager_backend(monkeypatch)
    _no_comparison(monkeypatch)
    warmed = []
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: warmed.append(shapes) or
                        R.CompileReport(model=lm.name, enabled=True, seconds=1.0))
    target = load_model(str(tiny_models / "llama"))
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert not plan.enabled and not warmed and target.compiled is None
    assert "gains 1.05x at 8 rows (the least any cpu host" in plan.reason and "; auto compiles only above 1.05x" in plan.reason
    plan = P.prepare(target, [], mode="auto", batch_size=1, cache_dir=tmp_path)
    assert plan.enabled and warmed == [W.warm_shapes(1)]
    assert D.EXPECTED_SPEEDUP["cpu"] == {1: 1.17, 16: 1.05}
    assert not D.pays(D.MIN_SPEEDUP) and D.pays(D.MIN_SPEEDUP + 1e-3)
    report = R.CompileReport(model="m", enabled=True, speedups={"1x1:1": 1.06, "1x4:2": D.MIN_SPEEDUP})
    P.keep_what_pays(target, report)
    assert report.eager_shapes == ["1x4:2"]


def test_an_on_start_records_the_gain_a_later_auto_start_uses(tiny_models, tmp_path, monkeypatch):
    """Where the prior declines (8 rows on CPU), a --compile on start measures this host, and a
    later auto start compiles on that measurement."""
    _eager_backend(monkeypatch)
    _no_comparison(monkeypatch)
    target = load_model(str(tiny_models / "llama"))
    assert not P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path).enabled
    monkeypatch.setattr(W, "measure_speedup", lambda lm, cache, ids, keep: 1.8)
    assert P.prepare(target, [], mode="on", batch_size=8, cache_dir=tmp_path).enabled
    assert R.recorded_speedup(target, tmp_path, 8) == 1.8
    target.compiled = None
    assert P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path).enabled


def test_a_gain_recorded_on_another_host_does_not_decide_here(tiny_models, tmp_path, monkeypatch):
    """Four 2-core hosts measured 1.17x to 1.84x with the same code: a record another machine
    wrote into a shared cache directory is not this host's measurement; the prior decides."""
    _eager_backend(monkeypatch)
    _no_comparison(monkeypatch)
    monkeypatch.setattr(W, "measure_speedup", lambda lm, cache, ids, keep: 1.8)
    target = load_model(str(tiny_models / "llama"))
    monkeypatch.setattr(R, "host_key", lambda device: "another-host")
    assert P.prepare(target, [], mode="on", batch_size=8, cache_dir=tmp_path).enabled
    assert R.recorded_speedup(target, tmp_path, 8) == 1.8
    monkeypatch.undo()
    _eager_backend(monkeypatch)
    target.compiled = None
    assert R.recorded_speedup(target, tmp_path, 8) is None
    plan = P.prepare(target, [], mode="auto", batch_size=8, cache_dir=tmp_path)
    assert not plan.enabled and "(the least any cpu host measured" in plan.reason


def test_measure_speedup_times_both_and_leaves_the_cache_as_it_was(tiny_models, monkeypatch):
    from transformers import DynamicCache

    _eager_backend(monkeypatch)
    lm = load_model(str(tiny_models / "llama"))
    F.install(lm)
    with torch.inference_mode():
        cache = DynamicCache()
        lm.forward(torch.tensor([[5, 9, 13, 2]]), cache)
        before = [t.clone() for t in (cache.layers[0].keys, cache.layers[0].values)]
        speedup = W.measure_speedup(lm, cache, torch.tensor([[7, 8, 9]]), keep=2)
    assert 0 < speedup < float("inf")
    assert cache.get_seq_length() == 4
    for old, new in zip(before, (cache.layers[0].keys, cache.layers[0].values)):
        torch.testing.assert_close(new, old)


# ------------------------------------------------------------------------------------------------
# slow: through compiled models


@pytest.fixture(scope="module")
def compiled_pair(tiny_models, tmp_path_factory):
    """The target compiled for single and batched steps (4 graphs). The draft stays eager: it goes
    through the same ``LoadedModel.forward`` and cannot change what the target accepts, and
    compiling it too would double this file's CI time (a compiled draft was checked by hand)."""
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    target = load_model(str(tiny_models / "llama"))
    draft = load_model(str(tiny_models / "llama-partial"))
    plan = P.prepare(target, [], mode="on", batch_size=3, cache_dir=cache_dir)
    assert plan.enabled, plan.to_dict()
    return target, draft, plan


def _greedy(engine: Engine, prompt: str, n: int = N, gamma: int = 4) -> list[int]:
    return engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=n, gamma=gamma,
                                                                  adaptive=False)).token_ids


@pytest.mark.slow
def test_compiled_forward_is_used_and_close_to_eager(compiled_pair):
    from transformers import DynamicCache

    target, _, plan = compiled_pair
    assert target.compiled is not None and target.compiled.failed is None
    assert all(r.graphs for r in plan.models) and plan.seconds > 0
    # every graph was timed against eager as it was warmed (what auto decides by on this machine)
    assert all(set(r.speedups) == set(r.graphs) and min(r.speedups.values()) > 0 for r in plan.models)
    # a first start compiled them frozen and not, timed the two, and serves the one kept
    report = plan.models[0]
    assert set(report.frozen_gain) == set(report.graphs)
    assert target.compiled.frozen is report.frozen is D.keeps_frozen(report.frozen_gain)
    assert target.compiled.alternative.frozen is not target.compiled.frozen
    ids = target.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        caches = [DynamicCache(), DynamicCache()]
        for c in caches:
            target.model(input_ids=ids, past_key_values=c, use_cache=True)
        eager = target.model(input_ids=torch.tensor([[3, 17, 40]]), past_key_values=caches[0],
                             use_cache=True).logits
    # a tensor made outside inference mode and a 2-D padding mask (what the dense decode path
    # passes) still hit the warmed graphs: a miss would run eagerly and be counted
    new = torch.tensor([[3, 17, 40]])
    misses = target.compiled.misses
    with torch.inference_mode():
        fast = target.forward(new, caches[1], attention_mask=torch.ones(1, ids.shape[1] + 3,
                                                                          dtype=torch.long)).logits
    assert target.compiled.misses == misses
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=1e-4)
    assert caches[1].get_seq_length() == caches[0].get_seq_length()   # the cache was appended to


@pytest.mark.slow
def test_greedy_through_compiled_target_is_lossless_for_every_setup(compiled_pair, tiny_models):
    """Every drafter setup and batch size gives exactly the compiled target's own greedy output."""
    target, draft, _ = compiled_pair
    served = target.compiled
    try:
        for graphs in (served, served.alternative):    # frozen and not frozen, whichever was kept
            target.compiled = graphs
            calls, misses = graphs.calls, graphs.misses
            _lossless_for_every_setup(target, draft)
            assert graphs.calls > calls and graphs.misses == misses, graphs.frozen  # every step compiled
    finally:
        target.compiled = served


def _lossless_for_every_setup(target, draft):
    alone = Engine(target)
    refs = {p: _greedy(alone, p) for p in PROMPTS}
    setups = {"draft": Engine(target, [draft]), "ngram": Engine(target, [NGRAM]),
              "pool": Engine(target, [draft, NGRAM])}
    for name, engine in setups.items():
        for gamma in (1, 4):
            for p in PROMPTS:
                assert _greedy(engine, p, gamma=gamma) == refs[p], (name, gamma, p)
    from specbatch.engine.engine import EngineRequest

    for name in ("draft", "ngram"):
        reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=N, adaptive=False))
                for p in PROMPTS]
        for batch in (2, 3):
            outs = dict(setups[name].generate_many(reqs, batch_size=batch))
            assert [outs[i].token_ids for i in range(len(PROMPTS))] == [refs[p] for p in PROMPTS], \
                (name, batch)


@pytest.mark.slow
def test_compiled_target_against_eager_hf_generate(compiled_pair):
    """On the tiny models the logit margins are wide: no near-tie, so no divergence at all."""
    target, _, _ = compiled_pair
    alone = Engine(target)
    for p in PROMPTS:
        ids = target.tokenizer(p, return_tensors="pt").input_ids
        with torch.inference_mode():
            hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                       do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert _greedy(alone, p) == hf, p


@pytest.mark.slow
def test_sampling_distribution_through_compiled_target(compiled_pair):
    target, draft, _ = compiled_pair
    engine = Engine(target, [draft])
    joint = exact_joint(target)
    counts = empirical(engine, 400)
    assert WARP.top_k == 4
    assert tv(counts, joint) < 0.1
    assert chi2_pvalue(counts, joint) > 1e-3


FAILING = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from specbatch.engine import Engine, GenerationParams
    e = Engine.load(sys.argv[1], compile="on", cache_dir=sys.argv[2])
    plan = e.compile_plan
    assert not plan.enabled and plan.models and plan.models[0].error, plan.to_dict()
    p = GenerationParams(max_new_tokens=12, adaptive=False)
    a = e.generate(prompt="def fibonacci(n):", params=p).token_ids
    b = e.generate(prompt="The quick brown fox", params=p).token_ids
    e.target.compiled = None
    assert e.generate(prompt="def fibonacci(n):", params=p).token_ids == a
    print("EAGER-OK", flush=True)
""")


@pytest.mark.slow
def test_no_cxx_compiler_falls_back_to_eager_with_one_warning(tiny_models, tmp_path):
    """A machine without a working C++ compiler: one warning, then the same output eagerly."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", FAILING, str(tiny_models / "gpt2"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert "EAGER-OK" in proc.stdout, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "decoding eagerly instead" in line]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert "WARNING" in ours[0]


def test_the_cli_says_what_compiling_bought_on_this_machine(capsys):
    from specbatch.cli.compile_text import report_compile

    report = R.CompileReport(model="m", enabled=True, seconds=12.0, speedups={"1x1:1": 1.3, "1x4:2": 0.9},
                             eager_shapes=["1x4:2"])
    report_compile(D.CompilePlan("auto", True, "auto: a long-lived worker", [report]))
    err = capsys.readouterr().err
    assert "compiled forward ready in 12s (first start; auto: a long-lived worker)" in err
    assert "m: eager / compiled step time here (rows x tokens): 1x1 1.30x, 1x4 0.90x; 1x4 stay eager" in err


def test_auto_weighs_only_what_the_requests_can_decode(tiny_models, monkeypatch, tmp_path):
    """A budget at or past the target's context fails at once and decodes nothing: it must not
    count as minutes of decoding that compiling would repay."""
    import specbatch.engine.engine as E

    seen = []
    monkeypatch.setattr(E, "prepare_compiled", lambda *a, expected_new_tokens=None, **k:
                        seen.append(expected_new_tokens) or D.CompilePlan("auto", False, "test"))
    target = str(tiny_models / "llama")
    context = E.Engine.load(target).target.max_positions
    assert context == 512
    E.Engine.load(target, compile="auto", expected_new_tokens=[100_000, 5, context, 7], cache_dir=str(tmp_path))
    E.Engine.load(target, compile="auto", expected_new_tokens=100_000, cache_dir=str(tmp_path))   # a total: as given
    assert seen[-2:] == [12, 100_000]


@pytest.mark.parametrize(("compile_", "message"), [("sometimes", "compile mode 'sometimes'"),
                                                   (" ON ", "needs cache_dir")])
def test_a_bad_compile_setting_fails_before_any_model_loads(compile_, message, monkeypatch):
    """The mode was read (three times) only after the target and its drafts had loaded: minutes
    of loading on a real pair before the error."""
    import specbatch.engine.engine as engine_module

    loads: list[str] = []
    monkeypatch.setattr(engine_module, "load_model", lambda name, **_: loads.append(name))
    with pytest.raises(ValueError, match=message):
        Engine.load("some-target", ["some-draft"], compile=compile_)
    assert loads == []
