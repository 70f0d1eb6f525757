"""What a stored result records about the engine that made it (worker.guard.engine_models): read
once per engine, not for every result, and made again when the compiled forward is adopted."""

from __future__ import annotations

from typing import Any

import pytest

from specbatch.engine import Engine, packed
from specbatch.engine.loading import load_model
from specbatch.worker.guard import engine_models


def test_the_record_is_read_once_per_compiled_state_not_for_every_result(tiny_models, monkeypatch):
    """engine_models runs for every stored result, on the decoding thread: it walked the target's
    modules for its packed kernel (0.26 ms a result on 32 layers, unpacked) and re-read the
    processor's flags each time (review53). The record changes only with the compiled forward."""
    engine = Engine(load_model(str(tiny_models / "llama")))
    walks: list[Any] = []
    real = packed.packed_kernel
    monkeypatch.setattr(packed, "packed_kernel", lambda m: walks.append(m) or real(m))
    first = engine_models(engine)["numerics"]
    for _ in range(5):
        assert engine_models(engine)["numerics"] == first
    assert len(walks) == 1 and first["compiled"] is False, walks
    engine.target.compiled = object()        # a background compile adopted between batches
    assert engine_models(engine)["numerics"] == {**first, "compiled": True}
    assert len(walks) == 2
    engine.target.compiled = None            # (compiling failed its trial: eager again)
    assert engine_models(engine)["numerics"] == first


def test_static_graphs_are_recorded_as_compiled(tiny_models):
    """compile=static decodes through compiled graphs the engine holds (Engine.static_graphs), the
    target's own compiled forward unset: its results were recorded as decoded eagerly."""
    engine = Engine(load_model(str(tiny_models / "llama")))
    assert engine_models(engine)["numerics"]["compiled"] is False
    engine.static_graphs = object()
    assert engine_models(engine)["numerics"]["compiled"] is True


@pytest.mark.parametrize("engine", [object(), None])
def test_an_engine_with_no_loaded_target_records_no_numerics(engine):
    assert engine_models(engine)["numerics"] is None


def _compiled_forward(model: Any) -> Any:
    """A real compiled forward installed on ``model`` that never runs a graph (every shape class
    eager): nothing compiles, yet the model holds a compiled forward as an adopted one."""
    from specbatch.engine.compile.forward import install

    compiled = install(model)
    assert compiled is not None
    compiled.eager_classes = {(rows, tokens) for rows in (False, True) for tokens in (False, True)}
    return compiled


def test_a_failed_compiled_forward_is_recorded_as_eager(tiny_models):
    """After a compiler failure the model decodes eagerly for good (CompiledForward.fail): its
    results are eager ones, and so is their record (it said compiled while the forward was set)."""
    engine = Engine(load_model(str(tiny_models / "llama")))
    compiled = _compiled_forward(engine.target)
    assert engine_models(engine)["numerics"]["compiled"] is True
    compiled.fail(RuntimeError("inductor fell over"))
    assert engine_models(engine)["numerics"]["compiled"] is False


def test_failed_static_graphs_are_recorded_as_eager(tiny_models):
    from types import SimpleNamespace

    engine = Engine(load_model(str(tiny_models / "llama")))
    engine.static_graphs = SimpleNamespace(failed=None)
    assert engine_models(engine)["numerics"]["compiled"] is True
    engine.static_graphs.failed = "BackendCompilerFailed: boom"
    assert engine_models(engine)["numerics"]["compiled"] is False


def test_a_decode_that_began_compiled_and_ended_eager_says_partly(tiny_models):
    """A result whose decode straddled a swap (a compile failing mid-batch) records neither state."""
    from specbatch.engine.fingerprint import PARTLY

    engine = Engine(load_model(str(tiny_models / "llama")))
    assert engine_models(engine, began_compiled=True)["numerics"]["compiled"] == PARTLY
    assert engine_models(engine, began_compiled=False)["numerics"]["compiled"] is False
    assert engine_models(engine)["numerics"]["compiled"] is False
