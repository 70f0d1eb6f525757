"""Folded grouped-query attention (engine/attention.py): the same numbers as transformers' SDPA
path, no copy of the cache per query head, and every loaded model on it."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from specbatch.engine.attention import NAME, _aligned, _pad_rows, folded_sdpa, rows_move
from specbatch.engine.cache import BatchCache
from specbatch.engine.loading import load_model


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(b: int, heads: int, kv_heads: int, t: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, 16, generator=g)
    k = torch.randn(b, kv_heads, length, 16, generator=g)
    v = torch.randn(b, kv_heads, length, 16, generator=g)
    seen = torch.rand(b, 1, t, length, generator=g) > 0.3
    seen[..., 0] = True                                   # no query sees nothing
    return q, k, v, seen


@pytest.mark.parametrize("boolean", [False, True])
@pytest.mark.parametrize("shape", [(3, 9, 3, 5, 40), (2, 4, 2, 3, 7), (1, 8, 1, 4, 33), (4, 6, 3, 1, 20),
                                   (32, 9, 3, 3, 100), (8, 9, 3, 9, 150)])
def test_folding_gives_transformers_sdpa_numbers_bitwise(shape, boolean):
    """One token, or three and more, a row (two: the next test). Where this CPU's SDPA rounds a
    block of 1-3 query rows its own way (``rows_move``), folding pads such blocks and transformers'
    path does not: equal to rounding there."""
    q, k, v, seen = _inputs(*shape)
    mask = seen if boolean else torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    module = _Attn(shape[1] // shape[2])
    want, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = folded_sdpa(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (shape[0], shape[3], shape[1], 16)
    if rows_move():
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_padding_leaves_no_query_block_of_one_to_three_rows():
    for rows in range(1, 1100):
        padded = rows + _pad_rows(rows)
        block = 32 if padded < 192 else 64 if padded < 768 else 256      # CPU flash attention's
        assert padded % block not in (1, 2, 3) and padded - rows < 4, rows


def test_at_two_query_tokens_folding_differs_from_transformers_in_the_last_bit_only():
    """2 tokens a row: transformers' path multiplies 2 query rows a head, the folded one 2 x groups
    (a GEMM of other rows, another CPU kernel): equal to rounding, not always bitwise."""
    q, k, v, seen = _inputs(8, 9, 3, 2, 57, seed=18)
    mask = torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    want, _ = sdpa_attention.sdpa_attention_forward(_Attn(3), q, k, v, mask, scaling=0.25)
    got, _ = folded_sdpa(_Attn(3), q, k, v, mask, scaling=0.25)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


def test_a_token_gets_what_it_gets_when_sent_alone():
    """Row t of a several-token query equals the same query sent alone over the same columns."""
    q, k, v, seen = _inputs(2, 9, 3, 5, 64, seed=3)
    mask = torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    module = _Attn(3)
    whole, _ = folded_sdpa(module, q, k, v, mask, scaling=0.25)
    for t in range(5):
        alone, _ = folded_sdpa(module, q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], scaling=0.25)
        assert torch.equal(whole[:, t:t + 1], alone)


def test_without_a_mask_or_groups_it_is_transformers_own_path(monkeypatch):
    calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr("specbatch.engine.attention.sdpa_attention_forward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, seen = _inputs(1, 4, 2, 3, 3)
    folded_sdpa(_Attn(2), q, k, v, None, scaling=0.25)                    # a causal prefill
    q1, k1, v1, seen1 = _inputs(1, 4, 4, 3, 8)
    folded_sdpa(_Attn(1), q1, k1, v1, seen1, scaling=0.25)                # no grouped heads
    assert len(calls) == (1 if rows_move() else 2)         # (padded where rows move: not transformers')


def test_a_loaded_models_verify_step_never_copies_the_cache_per_head(tiny_models, monkeypatch):
    """A masked several-token forward (a verify over holes) on a loaded grouped-query model:
    the same logits as transformers' SDPA path, without ``repeat_kv``."""
    lm = load_model(str(tiny_models / "llama"))
    assert lm.model.config._attn_implementation == NAME
    assert lm.model.config.num_key_value_heads < lm.model.config.num_attention_heads

    def verify_logits() -> torch.Tensor:
        with torch.inference_mode():
            cache = BatchCache(lm, 2)
            cache.forward([[5, 6, 7, 8], [9, 10]], logits_to_keep=1)      # left padding: a 4-D mask
            cache.reject([[], [1]])                                       # a hole
            return cache.forward([[11, 12, 13], [14, 15, 16]], logits_to_keep=3)

    copies = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real_repeat(x, n))
    folded = verify_logits()
    assert copies == []
    lm.model.set_attn_implementation("sdpa")
    plain = verify_logits()
    assert copies, "transformers' own path copies the cache per head (the test's control)"
    assert torch.equal(folded, plain) if not rows_move() else torch.allclose(folded, plain, rtol=0, atol=1e-5)



@pytest.mark.parametrize("groups", [1, 3])
def test_a_one_token_step_without_a_mask_gets_what_the_token_gets_in_a_block(groups):
    """A decode step (one token, no mask: it sees every column) against the same query as the last
    row of a several-token block over the same columns: the speculative verify's arithmetic."""
    q, k, v, _ = _inputs(2, 3 * groups, 3, 5, 40, seed=7)
    module = _Attn(groups)
    seen = torch.ones(2, 1, 5, 40, dtype=torch.bool)
    block, _ = folded_sdpa(module, q, k, v, seen, scaling=0.25)
    step, _ = folded_sdpa(module, q[:, :, 4:5], k, v, None, scaling=0.25)
    assert torch.equal(step, block[:, 4:5])


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("length", [7, 16, 22, 29, 45, 64, 77])
def test_a_token_decoded_alone_gets_what_it_gets_in_a_verify_block(groups, length):
    """Five tokens as one causal block over ``length`` columns (a verify: token i sees the first
    length - 4 + i, the rest masked) against each decoded alone over only its own columns: bitwise
    equal, whatever the length (``columns_move``: keys are widened to a multiple of 16, masked)."""
    q, k, v, _ = _inputs(2, 3 * groups, 3, 5, length, seed=11)
    module = _Attn(groups)
    sees = torch.arange(length) < (length - 4 + torch.arange(5))[:, None]      # (5, length)
    block, _ = folded_sdpa(module, q, k, v, sees.expand(2, 1, 5, length), scaling=0.25)
    for i in range(5):
        m = length - 4 + i
        step, _ = folded_sdpa(module, q[:, :, i:i + 1], k[:, :, :m], v[:, :, :m], None, scaling=0.25)
        assert torch.equal(step, block[:, i:i + 1]), (length, i)


def test_widened_keys_are_a_view_where_the_buffer_has_the_columns():
    from specbatch.engine.attention import _wider

    buf = torch.randn(2, 3, 40, 16)
    inside = _wider(buf[:, :, :21], 11)
    assert inside.data_ptr() == buf.data_ptr() and torch.equal(inside, buf[:, :, :32])
    past_the_end = _wider(buf[:, :, :33], 15)     # the last head would read past the storage: zeros copied on
    assert past_the_end.shape == (2, 3, 48, 16) and not past_the_end[:, :, 33:].any()


def test_a_decode_step_equals_its_row_in_a_verify_block_whatever_the_key_length():
    """The lossless contract's arithmetic at the default target's shapes (9 query heads on 3, head
    dim 64): token i fed alone over its L0 + i + 1 columns against the same token as row i of a
    5-token causal block over L0 + 5 columns. Where this CPU's kernels round a score by the key
    length (``columns_move``: sgemm's column tails, the split of the sum over keys past 192
    columns), the keys are padded to lengths that round alike."""
    module = _Attn(3)
    gen = torch.Generator().manual_seed(0)
    differ = []
    for l0 in [*range(2, 40), *range(180, 260, 5), 380, 505, 700]:
        q = torch.randn(1, 9, 5, 64, generator=gen)
        k, v = torch.randn(2, 1, 3, l0 + 5, 64, generator=gen)
        causal = torch.ones(5, l0 + 5, dtype=torch.bool).tril(l0)[None, None]
        block, _ = folded_sdpa(module, q, k, v, causal, scaling=0.125)
        for i in range(5):
            n = l0 + i + 1
            step, _ = folded_sdpa(module, q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], None, scaling=0.125)
            if not torch.equal(step, block[:, i:i + 1]):
                differ.append((l0, i))
    assert differ == []


def test_aligned_key_lengths_keep_a_last_block_out_of_193_to_383_columns():
    for n in range(1, 2000):
        to = _aligned(n)
        assert to >= n and to % 16 == 0 and not 192 < to % 512 < 384, n
        assert to - n < 16 or n % 512 > 176, n                # only past 176 may it pad more than 15


def test_a_cache_buffer_widens_to_any_aligned_length_without_a_copy():
    """The decode path's keys are views of a GrowingLayer's buffer: its zeroed spare columns and
    slack past the last head hold every widening ``_aligned`` asks for (up to 191 columns), so
    no step copies the cache."""
    from specbatch.engine.attention import _wider
    from specbatch.engine.hf_cache import _regrow

    for n in (20, 193, 200, 383, 700):
        buf = _regrow(None, torch.zeros(2, 3, 1, 16), 2, 0, n)
        keys = buf[:2, :, :n]
        wide = _wider(keys, _aligned(n) - n)
        assert wide.data_ptr() == buf.data_ptr() and wide.shape[2] == _aligned(n), n
        assert torch.isfinite(wide).all()


def test_under_dynamo_one_graph_serves_every_key_length(monkeypatch):
    """A compiled forward traces the cache length as a symbol. The column widening's arithmetic on
    it made inductor's lowering fail ("Exponent must be non-negative": every compiled forward fell
    back to eager on a CPU where ``columns_move``), and a branch on it would be one more graph per
    side; so under dynamo nothing is widened, and one graph serves lengths on both sides of 192
    and of a multiple of 16. (A tiny function: about 10 s of compiling.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("specbatch.engine.attention._columns_move", True)
    monkeypatch.setattr("specbatch.engine.attention._rows_move", True)
    torch._dynamo.reset()
    counters.clear()
    attn = _Attn(3)
    compiled = torch.compile(lambda q, k, v, m: folded_sdpa(attn, q, k, v, m)[0], dynamic=True,
                             fullgraph=True)
    for length in (20, 64, 150, 300, 530):
        q, k, v, seen = _inputs(2, 6, 2, 1, length, seed=length)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(q, k, v, seen), folded_sdpa(attn, q, k, v, seen)[0])
    assert counters["stats"]["unique_graphs"] == 1


def test_the_folded_mask_is_let_go_with_the_mask_it_was_made_from(monkeypatch):
    """Every layer of a forward gets one folded mask, made once; it lives no longer than the mask
    it was made from (a forward's: a long padded prefill's stayed held until the thread's next
    forward, the folded one ``groups`` times its size)."""
    import gc
    import weakref

    given: list[weakref.ref[torch.Tensor]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        given.append(weakref.ref(attn_mask))
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v, seen = _inputs(2, 9, 3, 5, 40)
    module = _Attn(3)
    for _ in range(2):      # two layers of one forward
        folded_sdpa(module, q, k, v, seen, scaling=0.25)
    assert given[0]() is not None and given[0]() is given[1](), "made once for both"
    del seen
    gc.collect()
    assert given[0]() is None
