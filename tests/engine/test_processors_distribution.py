"""Seeded statistical test: speculative sampling with logit processors keeps the law of the
processed target exactly.

The exact joint law of the first two tokens is computed from the target alone with
transformers' own processors and warpers (an independent implementation: tests/engine/
test_processors.py); top-k 4 keeps the support at 16 outcomes. The negative control is the bug
vLLM has (vllm#42744): the target's p at a draft position penalised with the root's history,
not counting the drafted tokens before it. The same test must reject it.
"""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

import specbatch.engine.tree as tree_mod
from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from tests.engine.test_processors import hf_processors
from tests.engine.test_sampling_distribution import PROMPT, chi2_pvalue, tv

BASE = dict(max_new_tokens=2, temperature=1.5, top_k=4, gamma=3, adaptive=False)
KINDS = {
    "penalties": dict(frequency_penalty=2.0, presence_penalty=1.5, repetition_penalty=1.5),
    "negative": dict(frequency_penalty=-2.0, presence_penalty=-2.0),
    "bias+min_p": dict(logit_bias={"244": -100, "185": 2.5, "54": 1.5}, min_p=0.35),
}


def exact_joint(target, params: GenerationParams) -> dict[tuple[int, int], float]:
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids
    procs = hf_processors(params, ids.shape[1])
    procs += LogitsProcessorList([TemperatureLogitsWarper(params.temperature), TopKLogitsWarper(params.top_k)])
    if params.min_p:
        procs.append(MinPLogitsWarper(params.min_p))

    def law(seq: torch.Tensor) -> torch.Tensor:
        return procs(seq, target.model(seq).logits[:, -1].float())[0].softmax(-1)

    with torch.inference_mode():
        p1 = law(ids)
        joint = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            ext = torch.cat([ids, torch.tensor([[x1]])], dim=1)
            p2 = law(ext)
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def empirical(engine, params: dict, n: int, seed0: int = 0) -> collections.Counter:
    """n samples, decoded 50 at a time: each row races with its own seeded noise, so the
    batch changes nothing in a sample (tests/engine/test_batch.py) and the test runs faster."""
    reqs = [EngineRequest(prompt=PROMPT, params=GenerationParams(seed=seed0 + i, **params)) for i in range(n)]
    return collections.Counter(tuple(out.token_ids) for _, out in engine.generate_many(reqs, batch_size=50))


@pytest.mark.parametrize("kind", list(KINDS))
def test_processed_distribution_matches_target(load, kind):
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), load("llama-random"), NGRAM])
    params = {**BASE, **KINDS[kind]}
    joint = exact_joint(target, GenerationParams(**params))
    plain = exact_joint(target, GenerationParams(**BASE))
    assert tv(collections.Counter({k: round(v * 10**6) for k, v in plain.items()}), joint) > 0.1, \
        "the processors barely change the law: the test would prove little"
    small = empirical(engine, params, 100)
    large = small + empirical(engine, params, 700, seed0=10_000)
    assert tv(large, joint) < tv(small, joint)
    assert tv(large, joint) < 0.08
    assert chi2_pvalue(large, joint) > 1e-3


def test_penalties_without_the_branch_history_are_detected(load, monkeypatch):
    """Negative control: p at every draft position penalised as if nothing had been drafted."""
    real = tree_mod.TokenTree.branches
    monkeypatch.setattr(tree_mod.TokenTree, "branches", lambda self: [[] for _ in real(self)])
    target = load("llama")
    engine = Engine(target, [load("llama-same")])      # drafts from the target: x2 is always tried
    params = {**BASE, **KINDS["negative"]}      # the right p makes x2 = x1 likely, the wrong one not
    counts = empirical(engine, params, 200)
    joint = exact_joint(target, GenerationParams(**params))
    outside = sum(c for k, c in counts.items() if k not in joint)
    assert outside > 0 or chi2_pvalue(counts, joint) < 1e-3
