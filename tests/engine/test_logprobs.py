"""Log-probabilities come from the target's verification logits: equal to HF generate's
``output_logits`` log-softmax for the same tokens, with each drafter, at batch 1 and 8."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "Write a haiku about", "The quick brown fox jumps over the lazy dog. The",
           "Once upon a time there was a little robot", "SELECT id, status FROM jobs WHERE", "A",
           "Question: what is the capital of France? Answer:", "for i in range(10):"]
DRAFTS = {"one": (["llama-partial"], False), "pool": (["llama-partial", "llama-random"], True),
          "ngram": ([], True), "none": ([], False)}


def hf_logprobs(target, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    """The target's greedy tokens and the log-softmax of its logits at each: (n,), (n, V)."""
    ids = target.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return tokens, torch.cat(out.logits).float().log_softmax(-1)


def check(out, ref_tokens, ref_lp, k: int) -> None:
    assert out.token_ids == ref_tokens
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for j, t in enumerate(out.logprobs):
        assert t.token == ref_tokens[j]
        assert t.logprob == pytest.approx(float(ref_lp[j, t.token]), abs=1e-4)
        top_v, top_i = ref_lp[j].topk(k)
        assert [i for i, _ in t.top] == top_i.tolist()
        assert [v for _, v in t.top] == pytest.approx(top_v.tolist(), abs=1e-4)


@pytest.mark.parametrize("drafts", list(DRAFTS))
def test_logprobs_equal_the_target_alone_batch_1(load, drafts):
    names, ngram = DRAFTS[drafts]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    for prompt in PROMPTS[:2]:
        tokens, lp = hf_logprobs(target, prompt, 16)
        out = engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=16, logprobs=5, gamma=4,
                                                                     adaptive=False))
        check(out, tokens, lp, 5)


@pytest.mark.parametrize("drafts", ["one", "pool"])
def test_logprobs_equal_the_target_alone_batch_8(load, drafts):
    names, ngram = DRAFTS[drafts]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    lengths = [5, 16, 9, 12, 3, 16, 7, 11]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n, logprobs=i % 3 * 10,
                                                            gamma=1 + i % 4, adaptive=False))
            for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = dict(engine.generate_many(reqs, batch_size=8))
    for i, req in enumerate(reqs):
        check(got[i], *hf_logprobs(target, req.prompt or "", req.params.max_new_tokens), i % 3 * 10)


def test_no_logprobs_unless_asked(load):
    out = Engine(load("llama")).generate(prompt="Hi", params=GenerationParams(max_new_tokens=3))
    assert out.logprobs is None and "logprobs" not in out.to_dict()


def test_sampled_tokens_get_the_raw_target_logprob(load):
    """Sampled with processors, the logprob is still the raw model's (as OpenAI's): computed
    here from the target alone on the sampled sequence."""
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), NGRAM])
    params = GenerationParams(max_new_tokens=12, temperature=1.3, top_k=20, seed=3, logprobs=2,
                              presence_penalty=1.0, logit_bias=((7, 3.0),))
    out = engine.generate(prompt=PROMPTS[0], params=params)
    ids = target.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    full = torch.cat([ids, torch.tensor([out.token_ids])], dim=1)
    with torch.inference_mode():
        lp = target.model(full).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
    for j, t in enumerate(out.logprobs or []):
        assert t.logprob == pytest.approx(float(lp[j, t.token]), abs=1e-4)
