"""Logit processors under speculation: greedy equals HF generate with the same processors, token
for token, with one draft, a pool and the n-gram drafter, at batch 1 and 8; the processors
themselves against transformers' own.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.drafters import Proposal
from specbatch.engine.processors import RowProcessors
from specbatch.engine.sampling import Warp
from specbatch.engine.tree import TokenTree, build_tree
from specbatch.errors import RequestError


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency/presence penalties over the generated tokens only (vLLM's reading)."""

    def __init__(self, n_prompt: int, frequency: float, presence: float) -> None:
        self.n_prompt, self.frequency, self.presence = n_prompt, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.n_prompt:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(params: GenerationParams, n_prompt: int) -> LogitsProcessorList:
    """transformers' processors in specbatch's order (docs/statistics.md): bias, repetition,
    frequency/presence."""
    procs = LogitsProcessorList()
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[int(i)], float(b)] for i, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        procs.append(OpenAIPenalties(n_prompt, params.frequency_penalty, params.presence_penalty))
    return procs


def hf_greedy(target, prompt: str, params: GenerationParams) -> list[int]:
    ids = target.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=params.max_new_tokens, pad_token_id=0,
                                    logits_processor=hf_processors(params, ids.shape[1]))
    return out[0, ids.shape[1]:].tolist()


PROMPTS = [
    "def fibonacci(n):\n    if n < 2:",
    "Write a haiku about",
    "The quick brown fox jumps over the lazy dog. The",
    "Once upon a time there was a little robot who liked to count prime numbers",
]
# token ids of the tiny tokenizer (vocab 384): the bias both bans and favours
PARAMS = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition<1": dict(repetition_penalty=0.7),
    "frequency+presence": dict(frequency_penalty=2.0, presence_penalty=1.5),
    "negative": dict(frequency_penalty=-1.5, presence_penalty=-1.0),
    "bias": dict(logit_bias={"300": 8.0, "120": -100, "45": 3.5}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.9,
                logit_bias={"77": 2.0, "200": -5.0}, min_p=0.2),
}
DRAFTS = {"one": (["llama-partial"], False), "pool": (["llama-partial", "llama-random"], True),
          "ngram": ([], True), "same": (["llama-same"], False)}


def _params(kind: str, n: int = 20, gamma: int = 4) -> GenerationParams:
    return GenerationParams(max_new_tokens=n, gamma=gamma, adaptive=False, **PARAMS[kind])


def check_greedy(load, drafts: str, kind: str, prompts: list[str]) -> None:
    names, ngram = DRAFTS[drafts]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    refs = {p: hf_greedy(target, p, _params(kind)) for p in prompts}
    assert any(refs[p] != hf_greedy(target, p, GenerationParams(max_new_tokens=20)) for p in prompts), \
        "the processors change nothing here: the test would prove nothing"
    for prompt in prompts:
        out = engine.generate(prompt=prompt, params=_params(kind))
        assert out.token_ids == refs[prompt], (prompt, kind)
        if drafts == "same":          # a draft that is the target: q is processed as p is
            assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("kind", list(PARAMS))
def test_greedy_with_processors_matches_hf(load, kind):
    """A pool (two draft models and the n-gram drafter: a token tree) under each processor."""
    check_greedy(load, "pool", kind, PROMPTS[:1])


@pytest.mark.parametrize("drafts", ["one", "ngram", "same"])
def test_greedy_each_drafter_matches_hf(load, drafts):
    check_greedy(load, drafts, "all", PROMPTS[1:2])
    check_greedy(load, drafts, "negative", PROMPTS[:1])


@pytest.mark.slow
@pytest.mark.parametrize("drafts", list(DRAFTS))
@pytest.mark.parametrize("kind", list(PARAMS))
def test_greedy_matrix_matches_hf(load, drafts, kind):
    check_greedy(load, drafts, kind, PROMPTS)


@pytest.mark.parametrize("drafts", ["one", "pool", "ngram"])
def test_batch_of_eight_with_mixed_processors(load, drafts):
    names, ngram = DRAFTS[drafts]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    kinds = [*PARAMS, "plain", "bias"]
    reqs = [EngineRequest(prompt=PROMPTS[i % len(PROMPTS)], params=GenerationParams(
                max_new_tokens=6 + 3 * i, gamma=1 + i % 4, adaptive=False, **PARAMS.get(kind, {})))
            for i, kind in enumerate(kinds)]
    got = dict(engine.generate_many(reqs, batch_size=8))
    for i, req in enumerate(reqs):
        assert got[i].token_ids == hf_greedy(target, req.prompt or "", req.params), i


def test_min_p_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    for min_p in (0.05, 0.3, 1.0):
        ref = MinPLogitsWarper(min_p)(torch.zeros(5, 1, dtype=torch.long), logits.clone() / 0.7).softmax(-1)
        assert torch.allclose(Warp(0.7, min_p=min_p).probs(logits), ref, atol=1e-6)


def test_tree_positions_see_their_own_branch():
    """Each node's penalties count the drafted tokens on its own path, not a sibling's."""
    tree = build_tree([Proposal([5, 6, 7]), Proposal([5, 9])])
    assert tree.branches() == [[], [5], [5, 6], [5, 6, 7], [5, 9]]
    procs = RowProcessors.build(GenerationParams(frequency_penalty=1.0, repetition_penalty=2.0), n_prompt=2)
    assert procs is not None
    logits = torch.ones(5, 12)
    x = procs(logits, [1, 2, 5], tree.branches())     # prompt [1, 2], one output token 5
    # root: output 5 once; node 2 (path 5, 6): 5 twice, 6 once; node 4 (path 5, 9): 9, not 6
    assert x[0, 5] == pytest.approx(0.5 - 1) and x[0, 6] == 1
    assert x[2, 5] == pytest.approx(0.5 - 2) and x[2, 6] == pytest.approx(0.5 - 1)
    assert x[4, 6] == 1 and x[4, 9] == pytest.approx(0.5 - 1)
    assert x[1, 1] == pytest.approx(0.5)    # a prompt token: repetition only
    assert isinstance(tree, TokenTree)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -3, "in [-2, 2]"),
    ("repetition_penalty", 0, "> 0"),
    ("min_p", 1.5, "in [0, 1]"),
    ("logit_bias", {"5": 101}, "in [-100, 100]"),
    ("logit_bias", {"abc": 1}, "not a token id"),
    ("logit_bias", {"384": 1}, "outside the target's vocabulary [0, 384)"),
])
def test_bad_processor_params_are_request_errors(load, field, value, words):
    engine = Engine(load("llama"))
    with pytest.raises(RequestError) as info:
        engine.generate(prompt="hi", params=GenerationParams(max_new_tokens=2, **{field: value}))
    assert field in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("penalty", [1e-300, 1e-40])
def test_a_tiny_repetition_penalty_samples_its_limit(load, penalty):
    """walk8: a seen token's positive logit / 1e-300 was inf, the softmax NaN and every sampled
    token 0 (greedy took the first inf, not the largest logit). As the penalty goes to 0 the seen
    token with the largest positive logit takes all the mass: sampled rows, with a draft or not,
    give greedy's tokens, which are those of a penalty small but still finite in float32."""
    target, draft = load("llama"), load("llama-partial")
    prompt = PROMPTS[0]
    limit = Engine(target).generate(prompt=prompt, params=GenerationParams(
        max_new_tokens=10, repetition_penalty=1e-30)).token_ids
    assert len(set(limit)) > 1
    for engine in (Engine(target), Engine(target, [draft])):
        greedy = engine.generate(prompt=prompt, params=GenerationParams(
            max_new_tokens=10, repetition_penalty=penalty)).token_ids
        assert greedy == limit
        for seed in (0, 1):
            sampled = engine.generate(prompt=prompt, params=GenerationParams(
                max_new_tokens=10, temperature=1.0, seed=seed, repetition_penalty=penalty)).token_ids
            assert sampled == limit, seed


def test_repetition_penalty_keeps_its_bits_and_stays_finite_at_the_extremes():
    """Ordinary penalties (>= TINY_PENALTY) compute exactly the plain formula, so seeded outputs
    keep their bits; a tiny one gives finite probabilities on the largest seen positive logit; a
    huge one (float32 inf) no NaN from a zero logit times it."""
    from specbatch.engine.processors import TINY_PENALTY

    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 4
    logits[:, 7] = 0.0
    ids = [1, 2, 7, 9, 30, 31]     # prompt [1, 2, 7], output [9, 30, 31]
    seen = torch.zeros(40, dtype=torch.bool)
    seen[ids] = True

    def processed(penalty: float) -> torch.Tensor:
        procs = RowProcessors.build(GenerationParams(repetition_penalty=penalty), n_prompt=3)
        assert procs is not None
        return procs(logits, ids, [[], [], []])

    for penalty in (TINY_PENALTY, 0.7, 1.3, 1e30):
        plain = torch.where(logits > 0, logits / penalty, logits * penalty)
        assert torch.equal(processed(penalty), torch.where(seen, plain, logits)), penalty
    top = logits.masked_fill(~(seen & (logits > 0)), float("-inf")).argmax(-1)
    for penalty in (1e-300, 1e-40, 1e-20):
        probs = Warp(0.01).probs(processed(penalty))
        assert torch.isfinite(probs).all() and torch.equal(probs.argmax(-1), top), penalty
        assert torch.equal(probs.amax(-1), torch.ones(3)), penalty
    probs = Warp(1.0).probs(processed(1e39))
    assert torch.isfinite(probs).all()
    assert torch.all(probs[:, 7] > 0)      # the zero logit stays 0, not NaN
