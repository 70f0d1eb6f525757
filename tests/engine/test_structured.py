"""Structured outputs are exact under speculation.

Greedy: a constrained request's tokens equal the target's own greedy decoding under the same
grammar mask (transformers' generate with a LogitsProcessor that applies the mask), for one draft,
a pool, n-gram, B=1 and B=8. Sampling: the first two tokens of a ``choice`` follow the masked
target's law (chi-square), and a lossy verifier is caught (negative control).
"""

from __future__ import annotations

import collections
import json

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessor, LogitsProcessorList

import specbatch.engine.decoder as decoder_mod
from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.constrained import drafters_part, forced_cap
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.drafters import Proposal
from specbatch.engine.gamma import GammaController
from specbatch.engine.grammar import GrammarSpec, Matcher, vocab_for
from specbatch.engine.sampling import Warp
from tests.engine.test_sampling_distribution import accept_every_draft

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 3}}}
SPECS = {
    "schema": GrammarSpec.json_schema(PERSON),
    "json_object": GrammarSpec.json_schema({"type": "object"}),
    "regex": GrammarSpec("regex", r"[0-9]{2,4}-(queue|worker|fox)"),
    "choice": GrammarSpec.choice(["the quick fox", "the lazy dog", "queues"]),
}
PROMPTS = ["Write a haiku about", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The"]


def matcher(target, spec: GrammarSpec) -> Matcher:
    return Matcher(vocab_for(target.tokenizer, target.vocab_size, tuple(sorted(target.eos_token_ids))), spec)


class GrammarMask(LogitsProcessor):
    """The reference: transformers' generate, the target's logits masked by the grammar state
    after the tokens generated so far (batch of one)."""

    def __init__(self, m: Matcher, prompt_len: int) -> None:
        self.m, self.n0 = m, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert self.m.advance(input_ids[0, self.n0 + self.m.consumed:].tolist())
        return scores.masked_fill(~self.m.mask()[: scores.shape[-1]], float("-inf"))


_REF: dict = {}


def reference(target, prompt: str, spec: GrammarSpec, n: int) -> list[int]:
    key = (id(target.model), prompt, spec, n)
    if key not in _REF:
        ids = target.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                logits_processor=LogitsProcessorList([GrammarMask(matcher(target, spec), ids.shape[1])]))
        _REF[key] = out[0, ids.shape[1]:].tolist()
    return _REF[key]


def valid_prefix(target, spec: GrammarSpec, tokens: list[int]) -> bool:
    m = matcher(target, spec)
    return m.allows(tokens) == len(tokens)


DRAFTS = {
    "self": (["llama-same"], False),
    "random": (["llama-random"], False),
    "partial": (["llama-partial"], False),
    "ngram": ([], True),
    "pool3": (["llama-partial", "llama-random"], True),
    "none": ([], False),
}


@pytest.mark.parametrize("drafts", list(DRAFTS))
@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_matches_the_masked_target(load, drafts, kind):
    names, ngram = DRAFTS[drafts]
    target = load("llama")
    engine = Engine(target, [load(n) for n in names] + [NGRAM] * ngram)
    spec = SPECS[kind]
    for prompt in PROMPTS[:2]:
        for n in (1, 40):
            ref = reference(target, prompt, spec, n)
            out = engine.generate(prompt=prompt, params=GenerationParams(
                max_new_tokens=n, gamma=4, adaptive=False, structured=spec))
            assert out.token_ids == ref, (prompt, n)
            assert valid_prefix(target, spec, out.token_ids)
            ended = bool(out.token_ids) and out.token_ids[-1] in target.eos_token_ids
            assert out.finish_reason == ("stop" if ended else "length")


def test_greedy_batch_of_eight_rows_each_with_its_own_grammar(load):
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), NGRAM])
    cases = [(p, s) for p in PROMPTS for s in (None, *SPECS.values())][:8]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=30, gamma=4, adaptive=False,
                                                            structured=s)) for p, s in cases]
    got = dict(engine.generate_many(reqs, batch_size=8))
    for i, (p, s) in enumerate(cases):
        if s is None:
            ids = target.tokenizer(p, return_tensors="pt").input_ids
            with torch.inference_mode():
                want = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                             do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        else:
            want = reference(target, p, s, 30)
        assert got[i].token_ids == want, (p, s)


def test_a_finished_schema_output_parses_and_the_grammar_drafted_some_of_it(load):
    target = load("llama")
    engine = Engine(target, [load("llama-partial")])
    out = engine.generate(prompt=PROMPTS[0], params=GenerationParams(
        max_new_tokens=120, structured=SPECS["schema"]))
    s = out.stats
    assert s.grammar_drafted_tokens > 0 and 0 < s.grammar_accepted_tokens <= s.grammar_drafted_tokens
    if out.finish_reason == "stop":
        doc = json.loads(out.text)
        assert list(doc) == ["name", "age", "tags"] and set(doc["tags"]) <= {"fox", "dog"}
    else:   # a long name or tag list: cut at max_tokens, but every token so far allowed
        assert valid_prefix(target, SPECS["schema"], out.token_ids)


def test_the_grammar_drafts_with_no_draft_model(load):
    """Forced tokens are verified as drafts even where no drafter runs."""
    target = load("llama")
    spec = GrammarSpec.choice(["queues and workers waiting"])
    out = Engine(target, []).generate(prompt=PROMPTS[0], params=GenerationParams(
        max_new_tokens=20, structured=spec))
    assert out.text.rstrip() == "queues and workers waiting" or out.text.startswith("queues")
    assert out.token_ids == reference(target, PROMPTS[0], spec, 20)
    assert out.stats.grammar_drafted_tokens > 0
    assert out.stats.verify_steps < len(out.token_ids)     # several tokens a step
    off = Engine(target, [])
    off.grammar_drafts = False
    plain = off.generate(prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=20, structured=spec))
    assert plain.token_ids == out.token_ids and plain.stats.grammar_drafted_tokens == 0
    assert plain.stats.verify_steps == len(plain.token_ids)


def test_a_forced_run_is_not_credited_to_the_draft_model(load, monkeypatch):
    """Every token of a one-option choice is forced: the draft model (masked while drafting, so it
    proposes the forced tokens too) adds nothing, and its gamma controller must learn nothing."""
    seen: list[tuple[int, int]] = []
    real = GammaController.observe
    monkeypatch.setattr(GammaController, "observe", lambda self, k, n: (seen.append((k, n)), real(self, k, n))[1])
    spec = GrammarSpec.choice(["queues and workers waiting for the lazy dog"])
    target = load("llama")
    out = Engine(target, [load("llama-same")]).generate(prompt=PROMPTS[0], params=GenerationParams(
        max_new_tokens=30, gamma=4, adaptive=False, structured=spec))
    assert out.token_ids == reference(target, PROMPTS[0], spec, 30)
    assert out.stats.grammar_drafted_tokens > 0 and seen
    assert all(k == 0 for k, _ in seen), seen


def test_forced_cap_weighs_the_padded_step_against_the_tokens_it_brings():
    flat = lambda n: 1.0                       # noqa: E731 - verify cost that does not grow (B=1, memory-bound)
    linear = lambda n: 0.5 + 0.5 * n           # noqa: E731 - each position costs half a step (compute-bound)
    assert forced_cap([6], 0, flat) == 6
    assert forced_cap([6, 0, 0, 0, 0, 0, 0, 0], 0, linear) == 0      # 8 rows pay 6 positions for 6 tokens
    assert forced_cap([6, 6, 6, 6, 6, 6, 6, 6], 0, linear) == 6      # every row gains as much as it pays
    assert forced_cap([6, 0], 0, lambda n: None) == 6               # not measured: no cap, so it is measured
    assert forced_cap([3, 0], 4, linear) == 3                        # within the drafts' depth: free
    assert forced_cap([0, 0], 0, linear) == 0
    slight = lambda n: 1.0 + 0.45 * (n - 1)    # noqa: E731 - a run of 1 on one of 2 rows: 3 tokens per 1.45
    assert forced_cap([1, 0], 0, slight) == 0                        # 2.07 against 2 a step: 3.4% is noise
    assert forced_cap([1, 1], 0, slight) == 1                        # 2.76 against 2: a clear gain


def test_drafters_part_counts_only_past_the_forced_run():
    forced = Proposal([5, 6])
    assert drafters_part([Proposal([5, 6, 7, 8]), None], forced, [5, 6, 7]) == (2, 1)
    assert drafters_part([Proposal([5, 6, 9])], None, [5, 6]) == (3, 2)      # free text: as before
    assert drafters_part([Proposal([5])], forced, [5, 6]) == (0, 0)
    assert drafters_part([], forced, [5, 6]) == (0, 0)


# ------------------------------------------------------------------ sampling: the masked target's law

CHOICE = GrammarSpec.choice(["fox", "dog", "queue", "worker", "the fox", "the dog", "def"])
WARP = Warp(temperature=1.5)
PROMPT = "The quick brown fox"


def exact_joint(target) -> dict[tuple[int, ...], float]:
    """The law of the first two tokens under the masked target (a one-token output ends with EOS)."""
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids
    m = matcher(target, CHOICE)
    joint: dict[tuple[int, ...], float] = {}
    with torch.inference_mode():
        p1 = WARP.probs(target.model(ids).logits[0, -1].masked_fill(~m.mask(), float("-inf")))
        for x1 in torch.nonzero(p1).flatten().tolist():
            m.advance([x1])
            ext = torch.cat([ids, torch.tensor([[x1]])], dim=1)
            p2 = WARP.probs(target.model(ext).logits[0, -1].masked_fill(~m.mask(), float("-inf")))
            m.rollback(1)
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def empirical(engine, n: int, seed0: int = 0) -> collections.Counter:
    params = dict(max_new_tokens=2, temperature=WARP.temperature, gamma=3, adaptive=False, structured=CHOICE)
    return collections.Counter(
        tuple(engine.generate(prompt=PROMPT, params=GenerationParams(seed=seed0 + i, **params)).token_ids)
        for i in range(n))


def chi2_pvalue(counts: collections.Counter, joint: dict) -> float:
    assert set(counts) <= set(joint), "sampled an outcome the masked target cannot produce"
    keys = sorted(joint)
    n = sum(counts.values())
    total = sum(joint.values())
    return float(chisquare([counts.get(k, 0) for k in keys], [joint[k] / total * n for k in keys]).pvalue)


@pytest.mark.slow    # 800 seeded requests per pool (minutes on a shared 2-core CPU)
@pytest.mark.parametrize("pool", ["single", "pool"])
def test_sampling_follows_the_masked_target(load, pool):
    target = load("llama")
    drafts = [load("llama-partial")] + ([load("llama-random")] if pool == "pool" else [])
    engine = Engine(target, drafts + [NGRAM] * (pool == "pool"))
    joint = exact_joint(target)
    assert len(joint) > 4
    counts = empirical(engine, 800)
    assert chi2_pvalue(counts, joint) > 1e-3


@pytest.mark.slow
def test_a_lossy_verifier_is_caught(load, monkeypatch):
    """Negative control: accepting every draft token skews the law toward the masked q."""
    monkeypatch.setattr(decoder_mod, "verify_race", accept_every_draft)
    target = load("llama")
    engine = Engine(target, [load("llama-random")])
    counts = empirical(engine, 400)
    joint = exact_joint(target)
    outside = sum(c for k, c in counts.items() if k not in joint)
    assert outside > 0 or chi2_pvalue(counts, joint) < 1e-3


# ------------------------------------------------------------------ score (the audit's support check)

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_score_sees_the_grammar_as_the_decoder_does(load, temperature):
    """engine.score masks by the grammar before the processors and the warp, as a decode step does:
    with top_k 1 every token the engine emitted under a regex is the masked target's only choice
    (probability 1), although the unmasked target's top token is another (the audit failed such
    results: 'token 0 has probability 0 under the target's sampling parameters')."""
    target = load("llama")
    spec = GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}")
    params = GenerationParams(max_new_tokens=12, temperature=temperature, top_k=1, seed=3, structured=spec)
    engine = Engine(target, [load("llama-partial")])
    out = engine.generate(prompt=PROMPTS[0], params=params)
    assert valid_prefix(target, spec, out.token_ids) and out.token_ids
    scored = engine.score(out.token_ids, prompt=PROMPTS[0], params=params)
    assert scored.probs == [1.0] * len(out.token_ids)
    # a token the grammar refuses has probability 0 even where the unmasked target prefers it
    ids = target.tokenizer(PROMPTS[0]).input_ids
    with torch.inference_mode():
        free = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())
    assert not valid_prefix(target, spec, [free])
    assert engine.score([free], prompt=PROMPTS[0], params=params).probs == [0.0]
