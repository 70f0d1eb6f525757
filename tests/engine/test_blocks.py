"""Products over weights of 4-bit blocks (engine/blocks.py): the split is exact, the product is
batch-invariant, and a target whose Linears multiply by blocks decodes losslessly."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from specbatch.engine import Engine, EngineRequest, GenerationParams, fingerprint, packed
from specbatch.engine import blocks as bw
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear, blocks_used, pack_linears
from tests.engine.test_greedy_exact import PROMPTS, target_greedy

GEN = torch.Generator().manual_seed(5)
# skipped only where the product cannot be built (no AVX-512, no compiler); where it is built, a
# product that fails its check fails these tests, not skips them
NOT_BUILT = "the CPU has neither AVX-512 nor AVX2" if not bw.isas() else bw._build()
needs_product = pytest.mark.skipif(NOT_BUILT is not None, reason=f"{NOT_BUILT}")


FORMATS = {"q4_1": bw.q4_1, "q8_0": bw.q8_0}


def q4_weight(n: int = 96, k: int = 128, form: str = "q4_1") -> torch.Tensor:
    return FORMATS[form](torch.randn(n, k, generator=GEN) / 8)


@pytest.mark.parametrize("form", FORMATS)
def test_a_weight_of_blocks_splits_back_to_itself_bitwise(form):
    w = q4_weight(form=form)
    w[:32, :32] = 0.25 if form == "q4_1" else 0.0       # a block of one value (d = 0)
    got = bw.split(w)
    assert got is not None and got.format == form and torch.equal(got.dense(), w)
    assert got.q.shape == (3, 128, 16 if form == "q4_1" else 32) and got.d.shape == (3, 4, 32)
    assert got.q.dtype == (torch.uint8 if form == "q4_1" else torch.int8)


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("spoil", ["one value off", "dense", "m not float16", "odd width", "odd height"])
def test_a_weight_not_wholly_of_blocks_does_not_split(spoil, form):
    w = q4_weight(form=form)
    if spoil == "one value off":
        w[40, 77] = torch.nextafter(w[40, 77], torch.tensor(1.0))
    elif spoil == "dense":
        w = torch.randn(96, 128, generator=GEN)
    elif spoil == "m not float16":
        w = w + 1e-6                     # every value moved: no float16 least value, no float16 step
    elif spoil == "odd width":
        w = q4_weight(96, 128, form)[:, :120]
    else:
        w = w[:90]
    assert bw.split(w) is None


@needs_product
@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("k", [96, 576, 1536])
def test_the_product_is_close_to_f_linears_and_a_rows_bits_do_not_depend_on_its_neighbours(k, form):
    w, bias = q4_weight(160, k, form), torch.randn(160, generator=GEN)
    blocks = bw.split(w)
    assert blocks is not None and blocks.format == form
    x = torch.randn(64, k, generator=GEN)
    with torch.inference_mode():
        whole = bw.product(x, blocks, bias)
        assert torch.allclose(whole, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
        for rows in (1, 2, 3, 5, 11, 12, 13, 24, 25, 40):
            assert torch.equal(bw.product(x[:rows], blocks, bias), whole[:rows]), rows
        assert torch.equal(bw.product(x[7:8], blocks, bias), whole[7:8])
        assert torch.equal(bw.product(x.view(4, 16, k), blocks, bias), whole.view(4, 16, 160))


@needs_product
@pytest.mark.parametrize("form", FORMATS)
def test_the_avx2_and_avx512_products_give_the_same_bits(form):
    """Each output is the same fmas in the same order at either width: a host with AVX2 only (Zen 3,
    most laptops) makes the numbers an AVX-512 host makes."""
    if bw.isas() != [512, 256]:
        pytest.skip("needs a CPU with both")
    w, bias = q4_weight(160, 576, form), torch.randn(160, generator=GEN)
    blocks = bw.split(w)
    x = torch.randn(40, 576, generator=GEN)
    with torch.inference_mode():
        for rows in (1, 4, 5, 6, 11, 12, 13, 40):
            assert torch.equal(bw.product(x[:rows], blocks, bias, isa=256),
                               bw.product(x[:rows], blocks, bias, isa=512)), rows


@needs_product
def test_the_product_passes_its_check_where_it_is_built():
    assert bw.check() is None
    assert bw.unavailable() is None


@needs_product
def test_a_packed_linear_over_blocks_multiplies_by_them_unless_a_kernel_is_pinned():
    lin = torch.nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q4_weight())
    pinned = PackedLinear.of(copy.deepcopy(lin), linears="mkl" if packed.kernel("mkl") else "onednn")
    auto = PackedLinear.of(lin)
    assert auto.blocks() and "q4_1 blocks" in repr(auto) and not pinned.blocks()
    x = torch.randn(9, 128, generator=GEN)
    with torch.inference_mode():
        assert torch.equal(auto(x), bw.product(x, bw.split(auto.weight)))
        assert torch.allclose(auto(x), pinned(x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():                # written in place: no longer blocks, multiplied as float32 again
        auto.weight.mul_(1.001)
    with torch.inference_mode():
        assert torch.allclose(auto(x), F.linear(x, auto.weight), rtol=1e-4, atol=1e-5)
    assert not auto.blocks()


@needs_product
def test_siblings_over_blocks_share_one_product_with_each_columns_own_bits():
    from tests.engine.test_int8_fused import qwen2

    model = qwen2()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.shape[0] % 32 == 0:
                m.weight.copy_(bw.q4_1(m.weight))
    attn = model.model.layers[0].self_attn
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    group = packed._Group(members, packed.kernel(), packed._stacked_blocks(members) or None)
    assert group.blocks is not None
    # nor does it hold the float32 concatenation its kernel would take (its storage, a weight's
    # size, was kept beside the blocks: 278 MB in the default target's 30 layers)
    assert [k for k, v in vars(group).items()
            if isinstance(v, torch.Tensor) and v.device.type != "meta" and v is not group.bias] == []
    x = torch.randn(5, 64, generator=GEN)
    with torch.inference_mode():
        y = group.product(x)
        for (a, b), m in zip(group.columns, (attn.q_proj, attn.k_proj, attn.v_proj)):
            assert torch.equal(y[:, a:b], bw.product(x, bw.split(m.weight), m.bias))


@pytest.fixture(scope="module")
def q4_llama(tiny_models, tmp_path_factory):
    """The tiny llama with its layers' Linears quantized to Q4_1 and its head to Q8_0 where its
    vocabulary comes in 32s, as the default target's GGUF, saved as a model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("q4-llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "llama")
    with torch.no_grad():
        for m in model.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(bw.q4_1(m.weight))
        head = model.lm_head.weight
        if head.shape[0] % 32 == 0:
            head.copy_(bw.q8_0(head))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_models / "llama").save_pretrained(out)
    return out


@needs_product
def test_a_target_of_blocks_decodes_as_itself_alone_speculating_and_batched(q4_llama, tiny_models):
    target = load_model(str(q4_llama))
    assert blocks_used(target.model)
    assert fingerprint.decoded_with(target)["linears"].endswith("+blocks")
    decodes_as_itself(target, load_model(str(q4_llama)))


def decodes_as_itself(target, draft) -> None:
    """``target``'s greedy outputs alone are its outputs speculating (``draft`` and n-grams, gamma 4)
    one prompt at a time and three rows at a time."""
    engine = Engine(target, [draft, NGRAM])
    params = GenerationParams(max_new_tokens=24, gamma=4, adaptive=False)
    alone = {p: target_greedy(target, p, 24) for p in PROMPTS}
    for p in PROMPTS:
        assert engine.generate(prompt=p, params=params).token_ids == alone[p]
    batched = dict(engine.generate_many([EngineRequest(prompt=p, params=params) for p in PROMPTS], 3))
    assert [batched[i].token_ids for i in range(len(PROMPTS))] == [alone[p] for p in PROMPTS]


def test_a_model_of_other_weights_never_asks_for_the_product(monkeypatch, tiny_models):
    asked = []
    monkeypatch.setattr(bw, "unavailable", lambda: asked.append(1))
    model = load_model(str(tiny_models / "llama")).model
    assert not blocks_used(model) and not asked
    assert pack_linears(copy.deepcopy(model)) == 0      # (already packed: nothing more)


@needs_product
def test_the_build_leaves_the_process_path_as_it_found_it(monkeypatch):
    # pip's ninja is put on PATH for the build only: it was prepended for the rest of the process,
    # so every subprocess a worker started afterwards saw it
    monkeypatch.setenv("PATH", "/nonexistent")
    assert bw._build() is None
    assert os.environ["PATH"] == "/nonexistent"
