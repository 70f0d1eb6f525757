"""Compiling in the background (specbatch.engine.background): eager at once, the compiled forward
adopted between batches once warmed up and faster, not a token changed across the switch."""

from __future__ import annotations

import threading

import pytest
import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine import background as B
from specbatch.engine.compile import decision as D
from specbatch.engine.compile import record as R
from specbatch.engine.compile import warmup as W
from specbatch.engine.loading import load_model

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The", "Write a haiku about",
           "Once upon a time"]
N = 24


def _greedy(engine: Engine, prompts: list[str]) -> list[list[int]]:
    return [engine.generate(prompt=p, params=GenerationParams(max_new_tokens=N)).token_ids for p in prompts]


def _reference(tiny_models) -> list:
    """The target alone's greedy tokens, computed before the engine under test loads: its
    background compile starts at load, and with inductor's cache warm (earlier compiled tests) it
    finished while this ran, so no round decoded eagerly (a Zen 5 host)."""
    return _greedy(Engine(load_model(str(tiny_models / "llama")), batch_size=1), PROMPTS)


def _decode_through_the_switch(engine: Engine, reference: list) -> int:
    """Decode one prompt at a time while the background compile runs (eagerly the whole time),
    then every prompt after it: each the target alone's greedy tokens. Returns the eager rounds."""
    background = engine.background
    assert background is not None
    rounds = 0
    while not background.done:
        assert _greedy(engine, PROMPTS[:1]) == reference[:1]
        rounds += 1
    assert _greedy(engine, PROMPTS) == reference
    return rounds


@pytest.fixture
def dynamo_only(monkeypatch):
    """torch.compile with dynamo's own eager backend: the same tracing, guards and graph dispatch
    in the background thread, no minutes of inductor (the slow test below runs inductor); frozen
    only, as a later start on a host that compared the two."""
    real = torch.compile

    def cheap(model, dynamic=None, mode=None, options=None):  # noqa: ANN001, ANN202
        return real(model, dynamic=dynamic, backend="eager")

    monkeypatch.setattr(torch, "compile", cheap)
    monkeypatch.setattr(D, "recorded_frozen", lambda *a, **k: True)   # one variant: no comparison


@pytest.fixture
def gated(monkeypatch):
    """The background compile starts only once the test opens the gate (no race with decoding)."""
    gate, real = threading.Event(), B.prepare

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(B, "prepare", held)
    return gate


@pytest.mark.slow   # ~40 s on a busy 2-core host: dynamo traces both models while the first batches decode
def test_decodes_eagerly_at_once_then_switches_between_batches_token_identical(
        tiny_models, tmp_path, dynamo_only, gated, monkeypatch):
    monkeypatch.setattr("specbatch.engine.engine.default_budget", lambda device: 8 * 2**30)
    states: list[str] = []
    engine = Engine.load(str(tiny_models / "llama"), [str(tiny_models / "llama-partial")],
                         compile="on", background=states.append, batch_size=1, cache_dir=str(tmp_path))
    reference = Engine(load_model(str(tiny_models / "llama")), batch_size=1)   # the target alone, eager
    assert engine.compile_plan is not None and not engine.compile_plan.enabled
    assert "background" in engine.compile_plan.reason

    first = _greedy(engine, PROMPTS[:2])                # the job's first batches: eager
    assert engine.target.compiled is None and engine.drafts[0].compiled is None
    background = engine.background
    # while it compiles, decoding leaves it the memory it will take
    assert background is not None and engine._memory().budget == 8 * 2**30 - background.reserved_bytes()
    gated.set()
    assert background.join(timeout=600)
    second = _greedy(engine, PROMPTS[2:])               # switched before this batch
    assert engine.compile_plan.enabled and background.adopted, engine.compile_plan.to_dict()
    assert engine.background is None and engine.memory is not None       # a budget measured since
    compiled = engine.target.compiled
    assert compiled is not None and compiled.warmed and compiled.calls > 0 and compiled.misses == 0

    assert first + second == _greedy(reference, PROMPTS)     # lossless across the switch
    assert any(s.startswith("compiling 1/") and s.endswith("decoding eagerly until then") for s in states), states
    assert states[-1].startswith("compiled after"), states


def test_auto_switches_to_nothing_that_measured_no_faster_here(tiny_models, tmp_path, dynamo_only,
                                                               monkeypatch):
    monkeypatch.setattr(W, "measure_speedup", lambda *a, **k: 0.9)
    states: list[str] = []
    engine = Engine.load(str(tiny_models / "llama"), compile="auto", background=states.append, batch_size=1,
                         cache_dir=str(tmp_path))
    assert engine.background is not None and engine.background.join(timeout=600)
    _greedy(engine, PROMPTS[:1])
    assert engine.target.compiled is None and not engine.compile_plan.enabled
    assert "no graph measured faster than eager here" in engine.compile_plan.reason
    assert states[-1].startswith("eager: "), states


def test_a_stopped_background_compile_installs_nothing(tiny_models, tmp_path, dynamo_only, gated):
    engine = Engine.load(str(tiny_models / "llama"), compile="on", background=True, batch_size=1,
                         cache_dir=str(tmp_path))
    assert engine.background is not None
    engine.background.stop()
    gated.set()
    assert engine.background.join(timeout=600)
    _greedy(engine, PROMPTS[:1])
    assert engine.target.compiled is None and "stopped" in engine.compile_plan.reason


def test_off_does_not_start_a_background_compile(tiny_models, tmp_path):
    engine = Engine.load(str(tiny_models / "llama"), compile="off", background=True, cache_dir=str(tmp_path))
    assert engine.background is None and engine.compile_plan.reason == "compile off"


@pytest.mark.slow
def test_inductor_in_the_background_while_decoding_eagerly_then_switched(tiny_models, tmp_path, monkeypatch):
    """The real compiler on another thread while this one decodes: every eager output meanwhile
    and every compiled one after the switch are the target's own greedy tokens."""
    monkeypatch.setattr(D, "recorded_frozen", lambda *a, **k: True)   # frozen only: 2 graphs, not 4
    reference = _reference(tiny_models)
    engine = Engine.load(str(tiny_models / "llama"), compile="on", background=True, batch_size=1,
                         cache_dir=str(tmp_path))
    rounds = _decode_through_the_switch(engine, reference)
    assert engine.compile_plan.enabled, engine.compile_plan.to_dict()
    compiled = engine.target.compiled
    assert compiled is not None and compiled.calls > 0 and compiled.misses == 0 and rounds > 0


def test_a_cpu_worker_in_auto_compiles_nothing_where_the_prior_gains_only_the_margin(
        tiny_models, tmp_path, dynamo_only, monkeypatch):
    """A CPU worker planning 8 rows expects the margin itself (1.05x, the lowest host measured):
    no background compile starts, and the state it announces says why from the start."""
    warmed = []
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: warmed.append(shapes) or
                        R.CompileReport(model=lm.name, enabled=True, seconds=1.0, speedups={"1x1:1": 1.3}))
    states: list[str] = []
    engine = Engine.load(str(tiny_models / "llama"), compile="auto", background=states.append, batch_size=8,
                         cache_dir=str(tmp_path))
    assert engine.background is None or engine.background.join(timeout=600)
    _greedy(engine, PROMPTS[:1])
    why = "compiling gains 1.05x at 8 rows (the least any cpu host measured"
    assert not warmed and engine.target.compiled is None and not engine.compile_plan.enabled
    assert why in engine.compile_plan.reason
    assert len(states) == 1 and states[0].startswith("eager: auto: ") and why in states[0], states


def test_the_one_process_wide_fx_trace_is_done_before_the_compile_thread_starts(tiny_models, tmp_path, monkeypatch):
    """Inductor's first lowering runs ``torch.fx.symbolic_trace`` once, patching ``nn.Module.__call__``
    process-wide while it traces: a decoding step on this thread then raised NameError. ``start``
    does that trace here first, so the compile thread finds it cached."""
    from torch._inductor.loop_body import InterpreterShim  # a torch without it: trace_once_here goes

    InterpreterShim._dummy_gm.cache_clear()
    seen = []

    def prepare(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(InterpreterShim._dummy_gm.cache_info().currsize)
        return D.CompilePlan("on", False, "stub")

    monkeypatch.setattr(B, "prepare", prepare)
    background = B.BackgroundCompile(load_model(str(tiny_models / "llama")), [], mode="on", batch_size=1,
                                     cache_dir=str(tmp_path)).start()
    assert background.join(timeout=600) and seen == [1]


def test_static_classes_compile_in_the_background_while_the_static_backend_decodes_eagerly(
        tiny_models, tmp_path, dynamo_only, monkeypatch):
    """``compile="static"`` with ``background`` (a worker): the engine returns at once over the
    static backend run eagerly, the classes compile on another thread, and between batches the
    engine takes them; every output, before and after the switch, is the target alone's."""
    gate, real = threading.Event(), B.static_plan

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(B, "static_plan", held)
    # dynamo's eager backend measures no faster than eager: keep its classes as if they paid here
    monkeypatch.setattr("specbatch.engine.compile.static.pays", lambda speedup: True)
    states: list[str] = []
    engine = Engine.load(str(tiny_models / "llama"), compile="static", background=states.append, batch_size=4,
                         cache_dir=str(tmp_path))
    reference = _greedy(Engine(load_model(str(tiny_models / "llama")), batch_size=1), PROMPTS)
    assert engine.static_cache and engine.static_graphs is None
    assert engine.compile_plan is not None and "background" in engine.compile_plan.reason

    first = _greedy(engine, PROMPTS[:2])                # eagerly, over the static backend
    background = engine.background
    assert background is not None and background.reserved_bytes() > 0
    gate.set()
    assert background.join(timeout=600)
    second = _greedy(engine, PROMPTS[2:])               # switched before this batch
    graphs = engine.static_graphs
    assert engine.compile_plan.enabled and background.adopted, engine.compile_plan.to_dict()
    assert graphs is not None and graphs.calls > 0 and graphs.misses == 0
    assert first + second == reference
    assert any("static graph 1/" in s and s.endswith("decoding eagerly until then") for s in states), states
    assert states[-1].startswith("compiled after"), states


@pytest.mark.slow
def test_static_classes_through_inductor_in_the_background_then_switched(tiny_models, tmp_path, monkeypatch):
    """The real compiler builds the static classes on another thread while this one decodes over
    the static backend eagerly: every output meanwhile and after the switch is the target's own."""
    monkeypatch.setattr("specbatch.engine.compile.static.pays", lambda speedup: True)   # keep every class
    reference = _reference(tiny_models)
    engine = Engine.load(str(tiny_models / "llama"), compile="static", background=True, batch_size=2,
                         cache_dir=str(tmp_path))
    rounds = _decode_through_the_switch(engine, reference)
    assert engine.compile_plan.enabled, engine.compile_plan.to_dict()
    graphs = engine.static_graphs
    assert graphs is not None and graphs.calls > 0 and graphs.misses == 0 and rounds > 0
