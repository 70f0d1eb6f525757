"""The int8 draft's shared-input products (engine/int8.py): q/k/v and gate/up, which read one input,
are one int8 product per layer each, split by column; the logits are bitwise those of one product
per Linear, on a GQA Llama and on a Qwen2 (biases on q/k/v), with fewer int8 calls per layer."""

from __future__ import annotations

import copy
import dataclasses

import torch

from specbatch.engine import int8
from specbatch.engine.cache import BatchCache
from specbatch.engine.int8 import quantize_linears
from tests.engine.test_loading_reuse import assert_same_tensors
from tests.engine.test_prefill import LENGTHS
from tests.engine.test_prefix import corpus_ids


def twins(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(one int8 product per Linear, shared-input products) copies of ``model``."""
    return (quantize_linears(copy.deepcopy(model), fuse=False),
            quantize_linears(copy.deepcopy(model), fuse=True))


def qwen2() -> torch.nn.Module:
    """A tiny random Qwen2 (GQA, biases on q/k/v: made non-zero, its init leaves them 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    return model


def test_a_gqa_llamas_fused_int8_draft_decodes_bitwise_as_the_unfused(load, count_products):
    lm = load("llama-partial")
    feeds = [corpus_ids(lm, n, skip=37 * i) for i, n in enumerate(LENGTHS)]   # 3-95 tokens: pads
    logits, counts = [], []
    for model in twins(lm.model):
        draft = dataclasses.replace(lm, model=model)   # its fields only (copy.copy kept any patched method)
        count_products.clear()
        with torch.inference_mode():
            cache = BatchCache(draft, len(feeds))
            got = [cache.forward(feeds, logits_to_keep=1)]
            for step in range(3):     # one-token steps over the cache: the draft's proposing
                got.append(cache.forward([[7 + step + b] for b in range(len(feeds))], logits_to_keep=1))
        logits.append(torch.cat(got, 1))
        counts.append(len(count_products) // 4)     # int8 products per forward
    assert torch.equal(*logits)
    # 2 layers x (q, k, v, o, gate, up, down) + the head -> 2 x (qkv, o, gate|up, down) + the head
    assert counts == [7 * 2 + 1, 4 * 2 + 1]


def test_a_qwen2_with_qkv_biases_gives_bitwise_the_same_logits_and_state_dict_fused(count_products):
    model = qwen2()
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    logits, counts = [], []
    for m in twins(model):
        count_products.clear()
        with torch.inference_mode():
            out = m(input_ids=ids[:, :30], use_cache=True)
            more = m(input_ids=ids[:, 30:31], past_key_values=out.past_key_values, use_cache=True)
        logits.append(torch.cat([out.logits, more.logits], 1))
        counts.append(len(count_products) // 2)
    assert torch.equal(*logits)
    assert counts == [7 * 2 + 1, 4 * 2 + 1]
    assert_same_tensors(*twins(model))     # the same state_dict: each Linear's int8 weight and bias


def test_siblings_fed_different_inputs_still_get_their_own_products():
    """(Cross-attention reads keys and values from another input than queries: still exact.)"""
    torch.manual_seed(0)
    block = torch.nn.Module()
    for name, n in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        setattr(block, name, torch.nn.Linear(24, n))
    unfused, fused = twins(block)
    assert isinstance(fused.q_proj, int8.RowInt8Part)
    x, y = torch.randn(5, 24), torch.randn(5, 24)
    with torch.inference_mode():
        for name, inp in (("q_proj", x), ("k_proj", y), ("v_proj", x), ("q_proj", x), ("q_proj", y)):
            assert torch.equal(getattr(fused, name)(inp), getattr(unfused, name)(inp)), name


def test_two_threads_calling_one_layers_siblings_in_turn_each_get_one_product(count_products):
    """Decode lanes (engine/lanes.py) run one int8 draft on two threads: a thread's q, k and v
    share its product even where the other thread's calls fall between them."""
    import threading

    torch.manual_seed(0)
    block = torch.nn.Module()
    for name, n in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        setattr(block, name, torch.nn.Linear(24, n))
    unfused, fused = twins(block)
    inputs = {"a": torch.randn(5, 24), "b": torch.randn(3, 24)}
    order = [(t, name) for name in ("q_proj", "k_proj", "v_proj") for t in ("a", "b")]   # a, b in turn
    turn, cond, got = [0], threading.Condition(), {}

    def run(t: str) -> None:
        with torch.inference_mode():
            for k, (who, name) in enumerate(order):
                if who != t:
                    continue
                with cond:
                    cond.wait_for(lambda k=k: turn[0] == k, timeout=10)
                    got[t, name] = getattr(fused, name)(inputs[t])
                    turn[0] += 1
                    cond.notify_all()

    count_products.clear()
    threads = [threading.Thread(target=run, args=(t,)) for t in inputs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(count_products) == 2      # one product per thread's input, not one per call
    with torch.inference_mode():
        for (t, name), out in got.items():
            assert torch.equal(out, getattr(unfused, name)(inputs[t])), (t, name)
