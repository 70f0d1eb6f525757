"""The lossless contract on a CUDA device: greedy speculative output equals the target's own greedy
decoding on the same device, alone and batched, for every kind of drafter.

Skipped where CUDA is absent (CI). Run on a GPU machine with
``python -m pytest tests/engine/test_cuda.py -p no:xdist``: docs/bench/report-gpu.md says where it ran.
float32 with TF32 off, the dtype the CLI documents as token-exact (docs/DESIGN.md, "Batch invariance").
"""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.loading import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["Write a haiku about", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The",
           "SELECT id, status FROM jobs WHERE"]
DRAFTS = {"same": (["llama-same"], False), "partial": (["llama-partial"], False),
          "random": (["llama-random"], False), "ngram": ([], True),
          "pool": (["llama-partial", "llama-random"], True)}


@pytest.fixture(scope="module")
def on_cuda(tiny_models):
    # TF32 would round fp32 products to 10-bit mantissas: not the target's float32 numbers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cache: dict = {}

    def _load(name: str):
        if name not in cache:
            cache[name] = load_model(str(tiny_models / name), device="cuda")
        return cache[name]

    return _load


def _target_greedy(target, prompt: str, n: int) -> list[int]:
    ids = target.tokenizer(prompt, return_tensors="pt").input_ids.to(target.device)
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_models_load_on_the_gpu(on_cuda):
    target = on_cuda("llama")
    assert target.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in target.model.parameters())


@pytest.mark.parametrize("drafts", list(DRAFTS))
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_matches_target_alone(on_cuda, drafts, gamma):
    names, ngram = DRAFTS[drafts]
    target = on_cuda("llama")
    engine = Engine(target, [on_cuda(n) for n in names] + [NGRAM] * ngram)
    for prompt in PROMPTS:
        ref = _target_greedy(target, prompt, 48)
        out = engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=48, gamma=gamma,
                                                                     adaptive=False))
        assert out.token_ids == ref, (drafts, gamma, prompt)
        if drafts == "same":
            assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("drafts", ["partial", "pool"])
@pytest.mark.parametrize("batch_size", [2, 4])
def test_batched_rows_match_target_alone(on_cuda, drafts, batch_size):
    names, ngram = DRAFTS[drafts]
    target = on_cuda("llama")
    engine = Engine(target, [on_cuda(n) for n in names] + [NGRAM] * ngram)
    lengths = [48, 17, 33, 5]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n, gamma=3, adaptive=False))
            for p, n in zip(PROMPTS, lengths)]
    got = dict(engine.generate_many(reqs, batch_size=batch_size))
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert got[i].token_ids == _target_greedy(target, p, n), (i, p)


def test_seeded_sampling_repeats_on_the_gpu(on_cuda):
    engine = Engine(on_cuda("llama"), [on_cuda("llama-partial")])
    params = GenerationParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    first = engine.generate(prompt=PROMPTS[0], params=params).token_ids
    assert engine.generate(prompt=PROMPTS[0], params=params).token_ids == first


@pytest.mark.parametrize("drafts", ["partial", "pool"])
def test_structured_rows_with_a_model_draft_run_on_the_gpu(on_cuda, drafts):
    """The grammar's masks are CPU memory (llguidance fills them): the draft model's logits and the
    target's, on the GPU, are masked with them moved over (grammar.refuse), and a greedy structured
    row still equals the target alone masked by the same grammar."""
    from tests.engine.test_structured import SPECS, matcher

    names, ngram = DRAFTS[drafts]
    target = on_cuda("llama")
    engine = Engine(target, [on_cuda(n) for n in names] + [NGRAM] * ngram)
    spec = SPECS["schema"]
    for prompt in PROMPTS[:2]:
        out = engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=40, gamma=4, adaptive=False,
                                                                     structured=spec))
        # the reference: one token at a time, the target's greedy choice under the grammar's mask
        m, ids, ref = matcher(target, spec), target.tokenizer(prompt).input_ids, []
        with torch.inference_mode():
            for _ in range(40):
                logits = target.model(torch.tensor([ids + ref], device=target.device)).logits[0, -1]
                x = logits.masked_fill(~m.mask()[: logits.shape[-1]].to(logits.device), float("-inf"))
                ref.append(int(x.argmax()))
                if ref[-1] in target.eos_token_ids or not m.advance(ref[-1:]):
                    break
        assert out.token_ids == ref, (drafts, prompt)


@pytest.mark.parametrize("drafts", ["partial", "ngram"])
def test_the_static_backend_matches_target_alone_on_the_gpu(on_cuda, drafts):
    """The static slot-cache backend (engine/static_cache.py) eagerly, batched rows joining and
    leaving: each row equals the target's own greedy decoding on the device."""
    names, ngram = DRAFTS[drafts]
    target = on_cuda("llama")
    engine = Engine(target, [on_cuda(n) for n in names] + [NGRAM] * ngram, batch_size=3, static_cache=True)
    lengths = [40, 9, 27, 16]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n, gamma=3, adaptive=False))
            for p, n in zip(PROMPTS, lengths)]
    got = dict(engine.generate_many(reqs))
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert got[i].token_ids == _target_greedy(target, p, n), (i, p)


def test_static_classes_as_cuda_graphs_decode_what_eager_decodes(on_cuda, tmp_path):
    """``--compile static`` on CUDA: every slot class up to the batch is a CUDA graph
    (``reduce-overhead``) over buffers at static addresses, all of one column capacity
    (``compile.static.FIXED_COLUMNS``). A batch of 4 draining to 1, greedy and seeded sampling:
    the same tokens as the static backend eagerly, no call missing the graphs. (Stop 47's H200
    run, with classes warmed at one 128-column bucket: every call at 384 columns missed; the fixed
    capacity that replaced the buckets on CUDA has not run on a GPU yet.)"""
    from specbatch.engine.compile.static import prepare_static, static_classes
    from specbatch.engine.static_cache import StaticBatchCache
    from tests.engine.test_static_cache import drain_eager_and_compiled

    target = on_cuda("llama")
    graphs, report = prepare_static(target, static_classes("cuda", 4), tmp_path,
                                    lambda n, g: StaticBatchCache(target, n, g), keep_all=True)
    assert graphs is not None and report.enabled, report.to_dict()
    drain_eager_and_compiled(target, graphs)
