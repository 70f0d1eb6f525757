"""Blocks from a GGUF file's K-quant scales (engine/gguf_blocks.py): Q4_K and Q6_K weights, which
``blocks.split`` cannot find in the float32 weight alone, multiply by their blocks bitwise, and a
Qwen2 GGUF of K-quants decodes as itself alone, speculating and batched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.engine import blocks as bw
from specbatch.engine import gguf_blocks
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear
from tests.engine.test_blocks import decodes_as_itself, needs_product
from tests.engine.test_loading import write_gguf

RNG = np.random.default_rng(7)
SIZE = gguf_blocks.SIZE


def k_quant(n: int, k: int, kind: str) -> np.ndarray:
    """Random bytes of a (N, K) ``kind`` tensor, rows of super-blocks, with sane float16 scales:
    every 6-bit sc and min, every q, every int8 scale is whatever the bytes say."""
    raw = RNG.integers(0, 256, size=(n, k // 256, SIZE[kind]), dtype=np.uint8)
    scale = RNG.uniform(1e-4, 4e-4, size=(n, k // 256, 1)).astype(np.float16)
    if kind == "Q4_K":
        raw[..., 0:2] = scale.view(np.uint8)
        raw[..., 2:4] = (scale / 2).view(np.uint8)
    else:
        raw[..., 208:210] = (scale / 8).view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, kind: str) -> torch.Tensor:
    """The float32 weight gguf-py makes of it, as transformers loads a GGUF."""
    import gguf

    kinds = {"Q4_K": gguf.GGMLQuantizationType.Q4_K, "Q6_K": gguf.GGMLQuantizationType.Q6_K}
    return torch.from_numpy(gguf.quants.dequantize(raw, kinds[kind]).copy())


def blocks_of(raw: np.ndarray, kind: str, weight: torch.Tensor) -> bw.BlockWeight | None:
    n = raw.shape[0]
    d, m = gguf_blocks._scales(kind, raw.reshape(n, -1, SIZE[kind]))
    return bw.with_scales(weight, d, m)


@needs_product
@pytest.mark.parametrize("kind, form", [("Q4_K", "q4_1"), ("Q6_K", "q6_k")])
def test_a_k_quant_weight_is_its_blocks_with_the_files_scales_and_not_without(kind, form):
    raw = k_quant(64, 512, kind)
    w = dequantized(raw, kind)
    got = blocks_of(raw, kind, w)
    assert got is not None and got.format == form and torch.equal(got.dense(), w)
    assert bw.split(w) is None          # the float32 weight alone does not show its scales
    spoiled = w.clone()
    spoiled[40, 77] = torch.nextafter(spoiled[40, 77], torch.tensor(1.0))
    assert blocks_of(raw, kind, spoiled) is None
    assert blocks_of(k_quant(64, 512, kind), kind, w) is None      # another tensor's scales


def test_a_q5_0_weight_splits_to_8_bit_blocks_without_the_file():
    # Q4_K_M's tensors whose inputs make no super-blocks (Qwen 0.5B's 896) are Q5_0: d * q, q in -16..15
    import gguf

    x = np.random.default_rng(3).standard_normal((64, 896)).astype(np.float32) / 8
    x[:32, :32] = 0.0                                               # a block of zeros: d = 0
    qtype = gguf.GGMLQuantizationType.Q5_0
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).copy())
    got = bw.split(w)
    assert got is not None and got.format == "q8_0" and torch.equal(got.dense(), w)
    assert int(got.q.min()) >= -16 and int(got.q.max()) <= 15
    w[40, 77] = torch.nextafter(w[40, 77], torch.tensor(1.0))
    assert bw.split(w) is None


@needs_product
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_k_quant_product_is_close_to_f_linears_and_batch_invariant_at_every_width(kind):
    raw = k_quant(96, 768, kind)
    w = dequantized(raw, kind)
    blocks = blocks_of(raw, kind, w)
    assert blocks is not None
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = bw.product(x, blocks)
        assert torch.allclose(whole, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
        for rows in (1, 2, 5, 6, 7, 12, 13, 17, 40):
            assert torch.equal(bw.product(x[:rows], blocks), whole[:rows]), rows
            for isa in bw.isas():
                assert torch.equal(bw.product(x[:rows], blocks, isa=isa), whole[:rows]), (rows, isa)


@pytest.fixture(scope="module")
def k_quant_qwen2(tiny_models, tmp_path_factory):
    """A tiny Qwen2 (hidden 256, so every Linear's inputs make super-blocks) written as a GGUF of
    llama.cpp's Q4_K_M mix: Q4_K for most Linears, Q6_K for v, down and the tied embedding."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_models / "tok")
    torch.manual_seed(4)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, bos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    src = tmp_path_factory.mktemp("kq") / "qwen2"
    Qwen2ForCausalLM(cfg).eval().save_pretrained(src)
    tok.save_pretrained(src)

    def raw(name: str, a: np.ndarray):
        if not name.endswith(".weight") or a.ndim != 2 or a.shape[1] % 256:
            return None
        kind = "Q6_K" if any(p in name for p in ("attn_v", "ffn_down", "token_embd")) else "Q4_K"
        return k_quant(a.shape[0], a.shape[1], kind), getattr(__import__("gguf").GGMLQuantizationType, kind)

    return write_gguf(src, src.parent / "qwen2-q4_k_m.gguf", raw)


@needs_product
def test_a_gguf_of_k_quants_decodes_by_its_blocks_as_itself_alone_speculating_and_batched(
        k_quant_qwen2, tmp_path, monkeypatch):
    target = load_model(str(k_quant_qwen2), cache_dir=tmp_path)
    linears = {n: m for n, m in target.model.named_modules() if isinstance(m, PackedLinear)}
    formats = {n: m._format() for n, m in linears.items()}
    assert formats["model.layers.0.self_attn.q_proj"] == "q4_1" and formats["model.layers.1.mlp.down_proj"] == "q6_k"
    assert all(formats.values()), formats        # the head too: the tied Q6_K embedding
    layer = target.model.model.layers[0]
    assert formats["model.layers.0.self_attn.v_proj"] == "q6_k"
    assert layer.self_attn.q_proj._group is None            # Q4_K beside a Q6_K v: each its own product
    assert layer.mlp.gate_proj._group is not None and layer.mlp.gate_proj._group.blocks is not None
    # a group's members' own blocks are not held beside its stacked copy (582 MB in the Qwen 1.5B)
    assert bw.of(layer.mlp.gate_proj.weight) is None and bw.of(layer.self_attn.v_proj.weight) is not None
    decodes_as_itself(target, load_model(str(k_quant_qwen2), cache_dir=tmp_path))
    # without the file's scales no Linear finds its blocks
    monkeypatch.setattr(gguf_blocks, "give", lambda *args: 0)
    plain = load_model(str(k_quant_qwen2), cache_dir=tmp_path)
    assert not any(m.blocks() for m in plain.model.modules() if isinstance(m, PackedLinear))
