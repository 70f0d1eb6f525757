"""Loading without reading the same weights twice: what a load builds equals a separate load.

- a first load of a GGUF file parses it once and keeps the model it dequantized (not read back);
- an int8 model of weights already loaded (``load_model(..., loaded=[target])``, the default pair:
  one GGUF file, fp32 target and int8 draft) is quantized from them in memory, with the target's
  tokenizer; its tensors and greedy output equal those of an int8 model loaded on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specbatch.engine import Engine, GenerationParams, loading
from specbatch.engine.known_models import KNOWN_MODELS, KnownModel
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear
from tests.engine.test_loading import tied_llama, write_gguf  # noqa: F401 - tied_llama: a fixture

PROMPTS = ["def fibonacci(n):", "Write a haiku about queues", "SELECT id FROM jobs"]


def _flat(value: Any) -> list[Any]:
    """A state_dict entry as comparable parts: a quantized tensor as its int8 values and scales."""
    if isinstance(value, (tuple, list)):
        return [part for v in value for part in _flat(v)]
    if isinstance(value, torch.Tensor) and value.is_quantized:
        return [value.int_repr(), value.q_per_channel_scales(), value.q_per_channel_zero_points()]
    return [value]


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        pa, pb = _flat(sa[key]), _flat(sb[key])
        assert len(pa) == len(pb), key
        for x, y in zip(pa, pb):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key


def greedy(m: loading.LoadedModel) -> list[list[int]]:
    engine = Engine(m)
    return [engine.generate(prompt=p, params=GenerationParams(max_new_tokens=16)).token_ids for p in PROMPTS]


@pytest.fixture
def tiny_pair(monkeypatch, tied_llama, tmp_path) -> Path:  # noqa: F811 - the imported fixture
    """Known names "tiny" and "tiny-int8" for one tied tiny Llama GGUF (as the default pair is one
    SmolLM2 GGUF); returns the cache directory."""
    gguf = write_gguf(tied_llama, tmp_path / "tied.F32.gguf")
    for m in (KnownModel("tiny", "test", ("none",), gguf.name),
              KnownModel("tiny-int8", "test", ("none",), gguf.name, int8=True)):
        monkeypatch.setitem(KNOWN_MODELS, m.name, m)
    monkeypatch.setattr(loading, "_known_gguf", lambda known, cache: gguf)
    return tmp_path / "cache"


def _no_reads(monkeypatch) -> None:
    def read(*a: Any, **k: Any) -> Any:
        raise AssertionError("model files were read again")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", read)


def test_an_int8_model_of_loaded_weights_is_quantized_from_them(tiny_pair, monkeypatch):
    target = load_model("tiny", cache_dir=tiny_pair)
    weights = {k: v.clone() for k, v in target.model.state_dict().items()}
    separate = load_model("tiny-int8", cache_dir=tiny_pair)
    with monkeypatch.context() as m:
        _no_reads(m)
        derived = load_model("tiny-int8", cache_dir=tiny_pair, loaded=[target])
    assert derived.tokenizer is target.tokenizer
    assert derived.info == separate.info and derived.eos_token_ids == separate.eos_token_ids
    assert_same_tensors(derived.model, separate.model)
    assert greedy(derived) == greedy(separate)
    # the target is untouched: its own fp32 Linears, the same values, the head still tied
    assert type(target.model.lm_head) in (torch.nn.Linear, PackedLinear)
    assert target.model.lm_head.weight is target.model.get_input_embeddings().weight
    assert all(torch.equal(v, weights[k]) for k, v in target.model.state_dict().items())
    assert not any(p is q for p in derived.model.parameters() for q in target.model.parameters())


def test_off_the_cpu_an_int8_model_of_loaded_weights_is_their_own_module(tiny_pair, monkeypatch):
    """int8 is CPU-only: on a GPU the default pair's draft would be the target's weights read a
    second time onto the device. It is the target's module instead. (The meta device stands in for
    a GPU: only the device's type is read on this path.)"""
    import dataclasses

    gpu = torch.device("meta")
    target = dataclasses.replace(load_model("tiny", cache_dir=tiny_pair), device=gpu)
    with monkeypatch.context() as m:
        _no_reads(m)
        m.setattr(loading, "resolve_device", lambda device: gpu)
        draft = load_model("tiny-int8", device="cuda", cache_dir=tiny_pair, loaded=[target])
    assert draft.model is target.model and draft.tokenizer is target.tokenizer
    assert draft.device == gpu and draft.info["int8"]


def test_weights_loaded_in_another_dtype_are_read_again(tiny_pair):
    target = load_model("tiny", cache_dir=tiny_pair, dtype="bfloat16")
    draft = load_model("tiny-int8", cache_dir=tiny_pair, loaded=[target])
    assert draft.tokenizer is not target.tokenizer
    assert_same_tensors(draft.model, load_model("tiny-int8", cache_dir=tiny_pair).model)


def test_a_first_gguf_load_keeps_the_model_it_dequantized(tiny_pair, monkeypatch):
    reads: list[str] = []
    real = AutoModelForCausalLM.from_pretrained

    def counted(path: Any, *a: Any, **k: Any) -> Any:
        reads.append("gguf" if k.get("gguf_file") else "safetensors")
        return real(path, *a, **k)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    first = load_model("tiny", cache_dir=tiny_pair)
    assert reads == ["gguf"], "the dequantized model was read back from the cache"
    again = load_model("tiny", cache_dir=tiny_pair)
    assert reads == ["gguf", "safetensors"]
    assert_same_tensors(first.model, again.model)
    assert first.model.config.to_dict() == again.model.config.to_dict()
    assert first.model.generation_config.to_dict() == again.model.generation_config.to_dict()
    assert first.model.lm_head.weight is first.model.get_input_embeddings().weight
    assert first.tokenizer.init_kwargs == again.tokenizer.init_kwargs
    assert greedy(first) == greedy(again)


def test_a_gguf_file_is_parsed_once_per_dequantization(tiny_pair, monkeypatch):
    import gguf.gguf_reader
    import gguf.tensor_mapping

    counts = {"parse": 0, "name map": 0}
    for what, cls in (("parse", gguf.gguf_reader.GGUFReader), ("name map", gguf.tensor_mapping.TensorNameMap)):
        real = cls.__init__

        def init(self: Any, *a: Any, _real: Any = real, _what: str = what, **k: Any) -> None:
            counts[_what] += 1
            _real(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", init)
    load_model("tiny", cache_dir=tiny_pair)
    assert counts == {"parse": 1, "name map": 1}


def test_outside_parsed_once_each_call_parses(tiny_pair):
    import gguf

    from specbatch.engine.gguf_once import parsed_once

    path = loading._known_gguf(KNOWN_MODELS["tiny"], tiny_pair)
    with parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_gguf_is_its_own_again_once_the_last_block_closes():
    """The wrappers live only while a block is open, on any thread: afterwards ``gguf.GGUFReader``
    is gguf-py's class (code subclasses it: tests/jobs/test_context.py)."""
    import threading

    import gguf
    import gguf.gguf_reader
    import gguf.tensor_mapping

    from specbatch.engine.gguf_once import parsed_once

    own = (gguf.gguf_reader.GGUFReader, gguf.tensor_mapping.get_tensor_name_map)
    with parsed_once():
        inside, closed = threading.Event(), threading.Event()

        def other() -> None:
            with parsed_once():
                inside.set()
                closed.wait(30)

        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(30)
        closed.set()
        t.join(30)
        # the other thread's block closed; this one is still open, so still wrapped
        assert gguf.GGUFReader is not own[0] and gguf.get_tensor_name_map is not own[1]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == own

    class Sub(gguf.GGUFReader):    # what failed while the wrapper outlived the block
        pass
    assert issubclass(Sub, own[0])


def test_an_int8_draft_beside_a_bfloat16_target_computes_in_float32_and_decodes_as_the_target(tiny_pair):
    """``--dtype bfloat16`` with the default int8 draft: the draft stays float32 around its int8
    products (fbgemm refused bfloat16 activations: a RuntimeError at the first proposal)."""
    target = load_model("tiny", cache_dir=tiny_pair, dtype="bfloat16")
    draft = load_model("tiny-int8", cache_dir=tiny_pair, dtype="bfloat16", loaded=[target])
    assert draft.info["dtype"] == "float32" and draft.model.dtype == torch.float32
    alone = greedy(target)
    engine = Engine(target, [draft])
    params = GenerationParams(max_new_tokens=16, gamma=3, adaptive=False)   # drafts at every step
    outs = [engine.generate(prompt=p, params=params) for p in PROMPTS]
    assert all(o.stats.drafted_tokens > 0 for o in outs)
    # bfloat16 is not the token-exact contract (float32 is): a verify block rounds unlike a
    # one-token step, so where two logits tie within bfloat16's rounding the text may take the
    # other (seen on an AVX2 host: the two best both 5.15625 at the 15th token). So: every token
    # is the target's choice up to that rounding, and the text is the target alone's where none tied
    for p, o in zip(PROMPTS, outs):
        assert _off_target_choice(target, p, o.token_ids) == []
    assert sum(o.token_ids == a for o, a in zip(outs, alone)) >= 2


def _off_target_choice(m: loading.LoadedModel, prompt: str, tokens: list[int]) -> list[int]:
    """The positions of ``tokens`` (a continuation of ``prompt``) that are not ``m``'s greedy choice
    there within two bfloat16 rounding steps of its best logit."""
    ids = m.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = m.model(torch.cat([ids, torch.tensor([tokens])], 1)).logits[0, ids.shape[1] - 1:-1].float()
    best = logits.max(-1).values
    step = 2.0 ** (torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)   # bfloat16's ulp there
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (chosen < best - 2 * step).nonzero()[:, 0].tolist()


@pytest.mark.parametrize("cache", ["new", "written-before-the-fix"])
def test_a_dequantized_cache_is_plain_weights_and_read_in_bfloat16_says_nothing_of_packed_ones(
        tiny_pair, caplog, cache):
    """The cache's config.json has no quantization_config (the GGUF file's): with it transformers
    read the plain tensors through its GGUF quantizer and, in bfloat16, warned that the weights
    "stay quantized". A cache written with it loses it at its next load."""
    import json

    first = load_model("tiny", cache_dir=tiny_pair)                # the cache, dequantized once
    config = next(tiny_pair.glob("dequantized/*/config.json"))
    if cache != "new":
        old = json.loads(config.read_text())
        old["quantization_config"] = {"dequantize": False, "gguf_file": "tied.F32.gguf", "quant_method": "gguf"}
        config.write_text(json.dumps(old))
    caplog.clear()
    m = load_model("tiny", cache_dir=tiny_pair, dtype="bfloat16")
    assert "quantization_config" not in json.loads(config.read_text())
    assert not [r for r in caplog.records if "weights packed" in r.getMessage()]
    assert getattr(m.model, "hf_quantizer", None) is None and getattr(first.model, "hf_quantizer", None) is None
    assert not hasattr(first.model.config, "quantization_config")
    assert all(type(x) is torch.nn.Linear and x.weight.dtype == torch.bfloat16
               for x in m.model.modules() if isinstance(x, torch.nn.Linear))   # plain bfloat16 GEMMs
