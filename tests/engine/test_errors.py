"""Bad input gets a SpecBatchError subclass whose message names the problem (issue 2, item 7).

Never a torch or transformers exception: callers (the worker, the CLI) turn SpecBatchError into
a failed request or one readable line; anything else is a crash.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model
from specbatch.errors import DeviceError, ModelLoadError, RequestError, SpecBatchError
from tests.tiny import build_tokenizer, without_chat_template

OTHER_CORPUS = [
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "Zebras quietly vex jumping wolves; 0123456789 !?#%&*+-/<=>@[]^_{|}~",
    "Les sanglots longs des violons de l'automne blessent mon coeur.",
] * 8


def _user_readable(err: BaseException) -> str:
    """The message, after checking it is one of ours and does not read like a stack trace."""
    assert isinstance(err, SpecBatchError), f"{type(err).__module__}.{type(err).__name__}: {err}"
    msg = str(err)
    assert msg.strip()
    for noise in ("Traceback", "torch.", "Tensor", "index out of range"):
        assert noise not in msg, msg
    return msg


@pytest.fixture(scope="module")
def engine(load) -> Engine:
    return Engine(load("llama"), [load("llama-partial")])


# --- requests ---------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": ({"prompt": ""}, {}, ["prompt", "empty"]),
    "whitespace prompt": ({"prompt": "  \n\t "}, {}, ["prompt", "empty"]),
    "empty input_ids": ({"input_ids": []}, {}, ["empty"]),
    "prompt and messages": ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, {},
                            ["prompt", "messages"]),
    "neither prompt nor messages": ({}, {}, ["prompt", "messages"]),
    "empty messages": ({"messages": []}, {}, ["messages"]),
    "message without content": ({"messages": [{"role": "user"}]}, {}, ["messages", "content"]),
    "temperature < 0": ({"prompt": "hi"}, {"temperature": -0.5}, ["temperature", "[0, 2]"]),
    "temperature > 2": ({"prompt": "hi"}, {"temperature": 2.5}, ["temperature", "[0, 2]"]),
    "temperature nan": ({"prompt": "hi"}, {"temperature": float("nan")}, ["temperature"]),
    "top_p 0": ({"prompt": "hi"}, {"top_p": 0.0}, ["top_p", "(0, 1]"]),
    "top_p > 1": ({"prompt": "hi"}, {"top_p": 1.5}, ["top_p", "(0, 1]"]),
    "top_p negative": ({"prompt": "hi"}, {"top_p": -0.1}, ["top_p"]),
    "max_new_tokens 0": ({"prompt": "hi"}, {"max_new_tokens": 0}, ["max_new_tokens", ">= 1"]),
    "max_new_tokens negative": ({"prompt": "hi"}, {"max_new_tokens": -3}, ["max_new_tokens"]),
    "max_new_tokens float": ({"prompt": "hi"}, {"max_new_tokens": 2.5}, ["max_new_tokens", "integer"]),
    "top_k negative": ({"prompt": "hi"}, {"top_k": -1}, ["top_k"]),
    "gamma negative": ({"prompt": "hi"}, {"gamma": -1}, ["gamma"]),
    "gamma huge": ({"prompt": "hi"}, {"gamma": 1000}, ["gamma"]),
    "empty stop string": ({"prompt": "hi"}, {"stop": ("",)}, ["stop"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_a_request_error(engine, case):
    kwargs, params, words = BAD_REQUESTS[case]
    with pytest.raises(RequestError) as info:
        engine.generate(params=GenerationParams(**{"max_new_tokens": 4, **params}), **kwargs)
    msg = _user_readable(info.value)
    for w in words:
        assert w in msg, (case, msg)


def test_invalid_params_fail_before_any_forward(engine, monkeypatch):
    """Validation happens up front: a bad request never reaches the model."""
    def boom(*a, **k):
        raise AssertionError("the target ran on an invalid request")

    monkeypatch.setattr(engine.target, "forward", boom)
    with pytest.raises(RequestError):
        engine.generate(prompt="hi", params=GenerationParams(top_p=0.0))


def test_prompt_plus_max_new_tokens_beyond_context(engine):
    limit = engine.target.max_positions
    assert limit == 512
    prompt = "hello " * 600                    # > 512 tokens on its own
    with pytest.raises(RequestError) as info:
        engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=4))
    msg = _user_readable(info.value)
    assert "512" in msg and "context" in msg and "max_new_tokens" in msg


def test_short_prompt_with_too_many_new_tokens(engine):
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=600))
    msg = _user_readable(info.value)
    assert "600" in msg and "512" in msg


def test_a_one_token_prompt_is_worded_in_the_singular(engine):
    with pytest.raises(RequestError) as info:
        engine.generate(input_ids=[5], params=GenerationParams(max_new_tokens=600))
    assert _user_readable(info.value).startswith("max_new_tokens: prompt (1 token) + max_new_tokens (600)")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_exactly_full_context_is_allowed(load, arch):
    """prompt + max_new_tokens == context is the largest valid request (gpt2's position table ends
    there: one position more would be an IndexError inside torch)."""
    target = load(arch)
    engine = Engine(target, [load(f"{arch}-same"), NGRAM])
    ids = [5, 6, 7] * 166 + [5, 6]              # 500 tokens, n-gram proposals everywhere
    out = engine.generate(input_ids=ids, params=GenerationParams(max_new_tokens=12, gamma=8,
                                                                 adaptive=False))
    assert len(out.token_ids) <= 12
    with pytest.raises(RequestError):
        engine.generate(input_ids=ids, params=GenerationParams(max_new_tokens=13))


def test_generate_many_returns_errors_per_request(engine):
    from specbatch.engine import EngineRequest

    reqs = [EngineRequest(prompt="", params=GenerationParams(max_new_tokens=2)),
            EngineRequest(prompt="Write a haiku", params=GenerationParams(max_new_tokens=2)),
            EngineRequest(prompt="hi", params=GenerationParams(max_new_tokens=2, top_p=2.0))]
    got = dict(engine.generate_many(reqs))
    assert isinstance(got[0], RequestError) and isinstance(got[2], RequestError)
    assert len(got[1].token_ids) == 2


@pytest.mark.parametrize("bad_id", [-1, 384, 10**6])
def test_input_ids_outside_vocabulary(engine, bad_id):
    with pytest.raises(RequestError) as info:
        engine.generate(input_ids=[5, bad_id], params=GenerationParams(max_new_tokens=2))
    assert "input_ids" in _user_readable(info.value)


@pytest.mark.parametrize("seed", ["x", 2**70])
def test_bad_seed(engine, seed):
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=2, temperature=1.0, seed=seed))
    assert "seed" in _user_readable(info.value)


def test_non_numeric_temperature(engine):
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=2, temperature="0.5"))
    assert "temperature" in _user_readable(info.value)


def test_stop_given_as_a_plain_string(engine):
    params = GenerationParams(max_new_tokens=16, stop="<never in the output>")
    try:
        out = engine.generate(prompt="Write a haiku", params=params)
    except RequestError as e:
        assert "stop" in _user_readable(e)
        return
    ref = engine.generate(prompt="Write a haiku", params=GenerationParams(max_new_tokens=16))
    assert out.token_ids == ref.token_ids


# --- devices and dtypes -----------------------------------------------------------------------

@pytest.mark.parametrize("device", ["tpu", "gpu", "", "meta", "cuda:x"])
def test_unknown_device(tiny_models, device):
    with pytest.raises(DeviceError) as info:
        load_model(str(tiny_models / "llama"), device=device)
    msg = _user_readable(info.value)
    assert repr(device) in msg and "cpu" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:99"])
def test_cuda_without_cuda(tiny_models, device):
    with pytest.raises(DeviceError) as info:
        load_model(str(tiny_models / "llama"), device=device)
    msg = _user_readable(info.value)
    assert device in msg and "CUDA" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_beyond_devices(tiny_models):
    with pytest.raises(DeviceError) as info:
        load_model(str(tiny_models / "llama"), device="cuda:99")
    assert "cuda:99" in _user_readable(info.value)


def test_engine_load_unknown_device(tiny_models):
    with pytest.raises(DeviceError):
        Engine.load(str(tiny_models / "llama"), [str(tiny_models / "llama-partial")], device="tpu")


@pytest.mark.parametrize("dtype", ["float64", "int8", "half-ish", ""])
def test_unknown_dtype(tiny_models, dtype):
    with pytest.raises(DeviceError) as info:
        load_model(str(tiny_models / "llama"), dtype=dtype)
    msg = _user_readable(info.value)
    assert repr(dtype) in msg and "float32" in msg and "bfloat16" in msg


# --- model paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["/no/such/model-dir", "./no-such-model-dir", "no-such-model",
                                  "~/no-such-model-dir"])
def test_missing_model_path(name):
    with pytest.raises(ModelLoadError) as info:
        load_model(name)
    msg = _user_readable(info.value)
    assert repr(name) in msg and "not found" in msg


def test_missing_gguf_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in _user_readable(info.value)


def test_missing_draft_path_names_the_draft(tiny_models):
    with pytest.raises(ModelLoadError) as info:
        Engine.load(str(tiny_models / "llama"), ["/no/such/draft"])
    assert "/no/such/draft" in _user_readable(info.value)


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))
    assert str(tmp_path) in _user_readable(info.value)


def test_corrupt_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), cache_dir=tmp_path / "cache")
    assert str(path) in _user_readable(info.value)
    assert not (tmp_path / "cache" / "dequantized").exists() or not any(
        (tmp_path / "cache" / "dequantized").iterdir()), "a failed conversion left a cache entry"


# --- a draft with another tokenizer -------------------------------------------------------------

def _build_other_tokenizer(out: Path, vocab: int) -> None:
    build_tokenizer(out, corpus=OTHER_CORPUS, vocab=vocab, chat_template=None)


@pytest.fixture(scope="module", params=[320, 384], ids=["smaller-vocab", "same-size-vocab"])
def foreign_draft(request, tmp_path_factory, tiny_models) -> Path:
    """A tiny Llama whose tokenizer was trained on another corpus (same vocab size or smaller)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = request.param
    out = tmp_path_factory.mktemp(f"foreign-{vocab}") / "draft"
    _build_other_tokenizer(out, vocab)
    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(11)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def test_draft_with_another_tokenizer_is_refused(load, foreign_draft):
    target, draft = load("llama"), load_model(str(foreign_draft))
    with pytest.raises(ModelLoadError) as info:
        Engine(target, [draft])
    msg = _user_readable(info.value)
    assert repr(str(foreign_draft)) in msg and repr(target.name) in msg
    assert "tokenizer" in msg


def test_engine_load_refuses_foreign_draft_in_a_pool(tiny_models, foreign_draft):
    with pytest.raises(ModelLoadError) as info:
        Engine.load(str(tiny_models / "llama"), [str(tiny_models / "llama-partial"), str(foreign_draft)])
    msg = _user_readable(info.value)
    assert str(foreign_draft) in msg and str(tiny_models / "llama") in msg


def test_same_tokenizer_other_architecture_is_accepted(load):
    """The check compares vocabularies, not classes: a GPT-2 draft for a Llama target is fine."""
    engine = Engine(load("llama"), [load("gpt2-same")])
    assert engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=3)).token_ids


# --- a draft whose context is shorter than the target's ------------------------------------------

@pytest.fixture(scope="module")
def short_context_draft(tmp_path_factory, tiny_models) -> Path:
    """A GPT-2 draft with the target's tokenizer but only 64 positions (learned position table)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("short") / "gpt2-64"
    tok = AutoTokenizer.from_pretrained(tiny_models / "tok")
    torch.manual_seed(3)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                     eos_token_id=tok.eos_token_id, bos_token_id=0, pad_token_id=0)
    GPT2LMHeadModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_draft_with_shorter_context(load, short_context_draft):
    target = load("gpt2")
    engine = Engine(target, [load_model(str(short_context_draft))])
    ids = [5] * 60
    try:
        out = engine.generate(input_ids=ids, params=GenerationParams(max_new_tokens=20, adaptive=False))
    except SpecBatchError as e:
        _user_readable(e)
        return
    ref = Engine(target).generate(input_ids=ids, params=GenerationParams(max_new_tokens=20))
    assert out.token_ids == ref.token_ids


# --- chat messages without a chat template --------------------------------------------------------

@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory, tiny_models) -> Path:
    return without_chat_template(tiny_models / "llama", tmp_path_factory.mktemp("notemplate") / "llama")


def test_messages_without_chat_template(load, no_template_model):
    target = load_model(str(no_template_model))
    assert not getattr(target.tokenizer, "chat_template", None)
    engine = Engine(target, [load("llama-partial")])
    with pytest.raises(RequestError) as info:
        engine.generate(messages=[{"role": "user", "content": "hi"}], params=GenerationParams(max_new_tokens=2))
    msg = _user_readable(info.value)
    assert "chat template" in msg and "prompt" in msg and str(no_template_model) in msg
    # a plain prompt still works on that model
    assert engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=2)).token_ids
