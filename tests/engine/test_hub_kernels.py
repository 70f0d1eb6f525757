"""Loaded models run their layers' own forwards, not the ``kernels`` package's per-call routing
(engine/hub_kernels.py): that routing writes a process-wide global once dynamo traces it, which
raced eager decoding on another thread and failed every background compile."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specbatch.engine.hub_kernels import unroute_hub_kernels
from specbatch.engine.loading import load_model

layer = pytest.importorskip("kernels._internals.layer.layer")   # transformers routes only with it


@pytest.fixture
def sets(monkeypatch):
    """Every value the routing stores in its context variable."""
    stored: list[object] = []
    var = layer._ACTIVE_KERNEL_FUNCS
    real = var.set
    monkeypatch.setattr(var, "set", lambda value: stored.append(value) or real(value))
    return stored


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


def test_transformers_routes_a_llama_layer_through_kernels_and_unrouting_keeps_its_numbers(tiny_models, sets):
    """The premise (transformers' llama attention goes through the routing) and the fix: the same
    logits without it, and nothing stored."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "llama").eval()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    routed = _logits(model, ids)
    assert sets, "transformers' llama no longer routes through kernels: engine/hub_kernels.py may go"
    assert unroute_hub_kernels(model) == model.config.num_hidden_layers
    sets.clear()
    assert torch.equal(_logits(model, ids), routed) and not sets
    assert unroute_hub_kernels(model) == model.config.num_hidden_layers   # again: the same forwards


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_loaded_model_never_stores_into_the_kernels_routing(tiny_models, sets, name):
    loaded = load_model(str(tiny_models / name))
    _logits(loaded.model, torch.tensor([[1, 5, 9, 2]]))
    assert not sets
