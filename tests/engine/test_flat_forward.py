"""The flat forward (engine/flat_forward.py) gives transformers' forward's numbers bit for bit, on
every path the engine takes, and honours the hooks that ``specbatch run`` and the bench install."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

from specbatch.engine.cache import BatchCache
from specbatch.engine.flat_forward import FlatForward
from specbatch.engine.loading import LoadedModel, load_model
from specbatch.engine.packed import PackedLinear


@pytest.fixture(scope="module")
def qwen2_dir(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (biased q/k/v, tied head) saved with the tiny models' tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_models / "llama")
    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _pair(lm: LoadedModel, rows: int) -> tuple[BatchCache, BatchCache]:
    """Two caches of ``rows`` rows over one model: the first decodes flat, the second through transformers."""
    assert lm.flat_forward() is not None
    return BatchCache(lm, rows), BatchCache(dataclasses.replace(lm, flat=False), rows)


def _same(a: BatchCache, b: BatchCache, feeds: list[list[int]], keep: int,
          parents: list[list[int]] | None = None) -> None:
    with mock.patch.object(FlatForward, "__call__", autospec=True, side_effect=FlatForward.__call__) as spy:
        x = a.forward(feeds, keep, parents)
    y = b.forward(feeds, keep, parents)
    assert spy.call_count == 1, "the flat forward served the call"
    assert torch.equal(x, y), f"max difference {(x - y).abs().max().item()}"


def _walk(lm: LoadedModel) -> None:
    """A padded prefill, dense steps, a verify of a token tree, rejected tokens (holes), rows leaving
    and joining: logits equal bit for bit at each."""
    a, b = _pair(lm, 3)
    with torch.inference_mode():
        prompts = [[5, 9, 14, 3, 7, 22, 8], [11, 4], [6, 6, 19, 2]]
        _same(a, b, prompts, 1)                           # left-padded prefill: a 4-D mask
        _same(a, b, [[7], [3], [12]], 1)                  # a one-token step over holes (the pads)
        for c in (a, b):
            c.compact()
        _same(a, b, [[7], [3], [12]], 1)                  # dense: the model's own causal mask
        tree = [[4, 8, 8, 2], [1, 9, 5, 5], [3, 3, 6, 10]]
        parents = [[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 2]]
        _same(a, b, tree, 4, parents)                     # a verify: a tree mask, every position kept
        for c in (a, b):
            c.reject([[2], [3], [1, 3]])                  # holes where branches lost
        _same(a, b, [[13], [2], [9]], 1)
        for c in (a, b):
            c.select([0, 2])
        _same(a, b, [[5, 6], [8, 1]], 2)
    with torch.inference_mode():
        a, b = _pair(lm, 1)
        _same(a, b, [list(range(3, 40))], 0)              # an unmasked causal prefill, every logit


def test_llama_packed_matches_transformers(load) -> None:
    lm = load("llama")
    assert isinstance(lm.model.model.layers[0].self_attn.q_proj, PackedLinear), "packed Linears here"
    _walk(lm)


def _uneven_norms(lm: LoadedModel) -> LoadedModel:
    """The tiny models' RMSNorm weights are all ones, under which a cast misplaced around the
    weight's product changes nothing: random weights make it show."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return lm


def test_llama_plain_linears_and_bfloat16_match_transformers(tiny_models: Path) -> None:
    _walk(_uneven_norms(load_model(str(tiny_models / "llama"), linears="off")))
    _walk(_uneven_norms(load_model(str(tiny_models / "llama"), dtype="bfloat16")))


def test_qwen2_matches_transformers(qwen2_dir: Path) -> None:
    lm = load_model(str(qwen2_dir))
    assert lm.flat_forward() is not None
    _walk(_uneven_norms(lm))


def test_int8_draft_matches_transformers(load) -> None:
    from specbatch.engine.loading import _quantized_copy

    lm = load("llama")
    model = _quantized_copy(lm.model, torch.device("cpu"))
    twin = dataclasses.replace(lm, model=model)
    assert twin.flat_forward() is not None and twin.flat_forward() is not lm.flat_forward(), "its own model's"
    assert twin.flat_forward().model is model
    _walk(twin)


def test_other_architectures_are_transformers_own(load, tiny_models: Path) -> None:
    assert load("gpt2").flat_forward() is None
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                               use_sliding_window=True, sliding_window=8, max_window_layers=1)
    sliding = AutoModelForCausalLM.from_config(cfg).eval()
    assert FlatForward.of(sliding) is None, "a sliding-window layer takes another mask"
    cfg = AutoConfig.for_model("mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64, sliding_window=8)
    assert FlatForward.of(AutoModelForCausalLM.from_config(cfg).eval()) is None, "Mistral's window: every layer's"


def test_keywords_hooks_and_grad_it_does_not_serve_go_to_transformers(load) -> None:
    flat = load("llama").flat_forward()
    assert flat is not None
    with torch.inference_mode():
        assert flat.serves({"attention_mask": None, "position_ids": None, "logits_to_keep": 1})
        assert not flat.serves({"output_hidden_states": True})
        handle = flat.layers[0].mlp.register_forward_hook(lambda *_: None)
        assert not flat.serves({})
        handle.remove()
        handle = flat.layers[1].register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
        assert not flat.serves({})
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None)
        assert not flat.serves({})
        handle.remove()
        assert flat.serves({})
    with torch.enable_grad():
        assert not flat.serves({})


def test_pre_hooks_on_the_model_and_its_layers_run_as_module_calls_run_them(load) -> None:
    """worker/interrupt.py's stop check: a pre-hook on the model and on each decoder layer; one
    raising stops the forward there."""
    lm = load("llama")
    flat = lm.flat_forward()
    assert flat is not None
    seen: list[str] = []
    handles = [lm.model.register_forward_pre_hook(lambda m, args: seen.append(f"model {args}"))]
    handles += [layer.register_forward_pre_hook(lambda m, args, i=i: seen.append(f"layer {i} {args[0].shape}"))
                for i, layer in enumerate(flat.layers)]

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    try:
        with torch.inference_mode():
            assert flat.serves({})
            BatchCache(lm, 1).forward([[3, 4, 5]], 1)
            assert seen == ["model ()", "layer 0 torch.Size([1, 3, 64])", "layer 1 torch.Size([1, 3, 64])"]
            handles.append(flat.layers[1].register_forward_pre_hook(stop))
            with pytest.raises(Stop):
                BatchCache(lm, 1).forward([[3, 4, 5]], 1)
    finally:
        for h in handles:
            h.remove()


def test_hidden_states_asked_of_transformers_once_leave_the_flat_forward_serving(tiny_models: Path) -> None:
    """A forward asked for hidden states (a drafter that reads the target's) is transformers'; its
    first one installs transformers' output-capturing hooks on every layer for good. They record
    nothing outside such a forward, so later calls are still served flat, with the same numbers."""
    lm = load_model(str(tiny_models / "llama"))
    flat = lm.flat_forward()
    assert flat is not None
    with torch.inference_mode():
        BatchCache(lm, 1).forward([[3, 4, 5]], 1, hidden=True)
        assert any(m._forward_hooks for m in lm.model.modules()), "transformers hooked its layers"
        assert flat.serves({"logits_to_keep": 1})
    _walk(lm)


def test_a_same_named_class_of_other_code_is_transformers_own(tiny_models: Path) -> None:
    """Remote code (``trust_remote_code``) may name its classes as transformers' are named: a
    ``LlamaMLP`` of its own, with its own forward, is not the forward this reproduces, and its
    numbers are its own forward's."""
    lm = load_model(str(tiny_models / "llama"))

    class LlamaMLP(type(lm.model.model.layers[0].mlp)):     # (the same name, another forward)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    for layer in lm.model.model.layers:
        layer.mlp.__class__ = LlamaMLP
    assert FlatForward.of(lm.model) is None
    with torch.inference_mode():
        x = BatchCache(lm, 1).forward([[3, 4, 5]], 1)
        y = BatchCache(dataclasses.replace(lm, flat=False), 1).forward([[3, 4, 5]], 1)
    assert torch.equal(x, y)


def test_a_module_whose_forward_was_replaced_is_transformers_own(tiny_models: Path) -> None:
    """A forward replaced on the module itself (accelerate's offloading hooks wrap ``forward`` so)
    is not the class's forward this reproduces. ``unroute_hub_kernels``' replacement, the class's
    own forward unwrapped, is (every model ``load_model`` gives has it)."""
    lm = load_model(str(tiny_models / "llama"))
    assert "forward" in vars(lm.model.model.layers[0].self_attn), "load_model unrouted the hub kernels"
    assert FlatForward.of(lm.model) is not None
    norm = lm.model.model.layers[1].post_attention_layernorm
    plain = norm.forward
    norm.forward = lambda h: plain(h) * 2
    assert FlatForward.of(lm.model) is None


_CONFIGS = {
    "biases": {"attention_bias": True, "mlp_bias": True},
    "head_dim 24": {"head_dim": 24},
    "one kv head, gelu, tied": {"num_key_value_heads": 1, "hidden_act": "gelu", "tie_word_embeddings": True},
    "llama3 rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn rope (attention scaling)": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                          "original_max_position_embeddings": 64}},
    "dynamic rope past its length": {"max_position_embeddings": 8,
                                     "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
}


@pytest.mark.parametrize("attention", ["specbatch", "sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", list(_CONFIGS))
def test_configs_match_transformers(config: str, arch: str, dtype: torch.dtype, attention: str) -> None:
    """What ``FlatForward.of`` accepts is computed as transformers computes it, for what configs
    vary (biases, head size, rope kinds, tied head, activation) on any attention implementation:
    a left-padded prefill (2-D mask), steps without position ids, a tensor ``logits_to_keep``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specbatch.engine.attention import use_folded_attention
    from specbatch.engine.hf_cache import new_cache

    kw = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **_CONFIGS[config],
          **({"sliding_window": None} if arch == "mistral" else {})}     # (its default: 4096, a window mask)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw), dtype=dtype,
                                             attn_implementation="eager" if attention == "eager" else "sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:          # norms (all ones: a misplaced cast would not show) and biases
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) + 0.5)
    if attention == "specbatch":
        use_folded_attention(model)
    flat = FlatForward.of(model)
    assert flat is not None
    g = torch.Generator().manual_seed(1)
    pads = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    calls = [(torch.randint(3, 96, (2, 6), generator=g), {"attention_mask": pads, "position_ids": (pads.cumsum(-1) - 1).clamp(min=0)}),
             (torch.randint(3, 96, (2, 3), generator=g), {"logits_to_keep": torch.tensor([0, 2])}),
             (torch.randint(3, 96, (2, 1), generator=g), {"logits_to_keep": 1})]
    ours, theirs = new_cache(), new_cache()
    with torch.inference_mode():
        for ids, kwargs in calls:
            assert flat.serves(kwargs)
            x = flat(ids, ours, **kwargs).logits
            y = model(input_ids=ids, use_cache=True, cache=theirs, **kwargs).logits
            assert torch.equal(x, y), f"max difference {(x - y).abs().max().item()}"
