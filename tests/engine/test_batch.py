"""Batched speculative decoding: every row equals that prompt decoded alone by the target."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.errors import RequestError
from tests.engine.test_greedy_exact import target_greedy
from tests.engine.test_sampling_distribution import PROMPT, WARP, chi2_pvalue, exact_joint, tv

PROMPTS = [
    "Write a haiku about",
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away. Then",
    "A",
    "SELECT id, status FROM jobs WHERE",
    "Once upon a time there was a little robot who liked to count prime numbers",
]
LENGTHS = [5, 40, 64, 1, 23, 50]   # rows finish at very different steps

SETUPS = {"self": (["{a}-same"], False), "partial": (["{a}-partial"], False),
          "random": (["{a}-random"], False), "ngram": ([], True), "partial+ngram": (["{a}-partial"], True)}


def _batch_cases():
    """Every setup at 3 and 8 rows on llama and at 3 on gpt2 in the default run; gpt2 at 8 rows (the
    same code, another architecture) only with -m slow."""
    for batch_size in (3, 8):
        for setup in SETUPS:
            for arch in ("llama", "gpt2"):
                marks = [pytest.mark.slow] if arch == "gpt2" and batch_size == 8 else []
                yield pytest.param(arch, setup, batch_size, marks=marks, id=f"{batch_size}-{setup}-{arch}")


@pytest.mark.parametrize(("arch", "setup", "batch_size"), list(_batch_cases()))
def test_batched_rows_match_target_alone(load, arch, setup, batch_size):
    names, ngram = SETUPS[setup]
    target = load(arch)
    engine = Engine(target, [load(n.format(a=arch)) for n in names] + [NGRAM] * ngram)
    for gamma in (1, 4):
        reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n, gamma=gamma, adaptive=False))
                for p, n in zip(PROMPTS, LENGTHS)]
        got = dict(engine.generate_many(reqs, batch_size=batch_size))
        assert sorted(got) == list(range(len(PROMPTS)))
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            assert got[i].token_ids == target_greedy(target, p, n), (i, gamma)
            s = got[i].stats
            assert s.accepted_tokens <= s.drafted_tokens
            assert s.new_tokens <= s.accepted_tokens + s.verify_steps


def test_batched_eos_and_stop_strings_in_different_rows(load):
    target = load("llama")
    ref0 = target_greedy(target, PROMPTS[0], 40)
    eos = next(t for i, t in enumerate(ref0) if i >= 3 and t not in ref0[:i])
    patched = dataclasses.replace(target, eos_token_ids=frozenset({eos}))
    engine = Engine(patched, [load("llama-partial"), NGRAM])
    ref2 = target_greedy(target, PROMPTS[2], 40)
    text2 = target.tokenizer.decode(ref2, skip_special_tokens=True)
    stop = text2[10:14]
    reqs = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=40, gamma=4)),
            EngineRequest(prompt=PROMPTS[1], params=GenerationParams(max_new_tokens=30, gamma=4)),
            EngineRequest(prompt=PROMPTS[2], params=GenerationParams(max_new_tokens=40, gamma=4, stop=(stop,)))]
    got = dict(engine.generate_many(reqs, batch_size=3))
    assert got[0].token_ids == target_greedy(target, PROMPTS[0], 40, eos_token_id=eos)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == eos
    assert got[2].finish_reason == "stop" and got[2].text == text2[: text2.index(stop)]
    assert got[2].token_ids == ref2[: len(got[2].token_ids)]
    assert got[1].token_ids == target_greedy(target, PROMPTS[1], 30, eos_token_id=eos)


def test_bad_request_in_a_batch_fails_alone(load):
    engine = Engine(load("llama"), [load("llama-partial")])
    reqs = [EngineRequest(prompt="Write a haiku about", params=GenerationParams(max_new_tokens=8)),
            EngineRequest(prompt="   ", params=GenerationParams(max_new_tokens=8)),
            EngineRequest(prompt="def f():", params=GenerationParams(max_new_tokens=600))]
    got = dict(engine.generate_many(reqs, batch_size=4))
    assert isinstance(got[1], RequestError) and "empty" in str(got[1])
    assert isinstance(got[2], RequestError) and "context" in str(got[2])
    assert got[0].token_ids == target_greedy(load("llama"), "Write a haiku about", 8)


@pytest.mark.parametrize("ngram", [False, True])
def test_batched_sampling_keeps_target_distribution(load, ngram):
    target = load("llama")
    engine = Engine(target, [load("llama-partial")] + [NGRAM] * ngram)
    params = dict(max_new_tokens=2, temperature=WARP.temperature, top_k=WARP.top_k, gamma=3, adaptive=False)

    def draw(n, seed0):
        reqs = [EngineRequest(prompt=PROMPT, params=GenerationParams(seed=seed0 + i, **params)) for i in range(n)]
        return collections.Counter(tuple(o.token_ids) for _, o in engine.generate_many(reqs, batch_size=8))

    joint = exact_joint(target)
    small = draw(100, 0)
    large = small + draw(700, 10_000)
    assert tv(large, joint) < tv(small, joint)
    assert tv(large, joint) < 0.08
    assert chi2_pvalue(large, joint) > 1e-3


def test_longest_budgets_join_first_and_samples_stay_together(load):
    """Admission order (docs/DESIGN.md): with 2 places, the two longest budgets start the batch and
    the short ones fill places as they free up; the 3 samples of one request join together."""
    target = load("llama")
    engine = Engine(target)
    budgets = [2, 3, 30, 4, 20]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n))
            for p, n in zip(PROMPTS, budgets)]
    reqs.append(EngineRequest(prompt=PROMPTS[5], params=GenerationParams(max_new_tokens=8, n=3, temperature=1.0, seed=1)))
    joined: list[list[int]] = []
    got = dict(engine.generate_many(reqs, batch_size=2, on_start=joined.append))
    assert joined[0] == [2, 4]                       # 30 and 20 tokens: first, in one join
    assert [i for j in joined for i in j] == [2, 4, 5, 3, 1, 0]
    for i, (p, n) in enumerate(zip(PROMPTS, budgets)):
        assert got[i].token_ids == target_greedy(target, p, n)
    assert len(got[5].siblings) == 2


def test_a_batch_refills_from_more_as_rows_finish_and_every_row_matches_the_target(load):
    """``more`` (a worker claiming more of its job): asked only while rows decode and places are
    free, its requests join the running batch with the next indices; a refused one yields its own
    error; samples of a refilled request fork as usual."""
    target = load("llama")
    engine = Engine(target, [load("llama-partial")])
    first = [EngineRequest(prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=6)),
             EngineRequest(prompt=PROMPTS[1], params=GenerationParams(max_new_tokens=30))]
    later = [EngineRequest(prompt=PROMPTS[2], params=GenerationParams(max_new_tokens=12)),
             EngineRequest(prompt=PROMPTS[3], params=GenerationParams(max_new_tokens=-1)),     # refused
             EngineRequest(prompt=PROMPTS[4], params=GenerationParams(max_new_tokens=8, n=2, temperature=1.0, seed=3)),
             EngineRequest(prompt=PROMPTS[5], params=GenerationParams(max_new_tokens=9))]
    asked: list[int] = []

    def more(room: int) -> list[EngineRequest]:
        asked.append(room)
        out = later[:room]
        del later[:room]
        return out

    got = dict(engine.generate_many(first, batch_size=2, more=more))
    assert sorted(got) == list(range(6)) and not later
    assert all(0 < r <= 2 for r in asked)
    assert isinstance(got[3], RequestError)
    for i, (p, n) in {0: (PROMPTS[0], 6), 1: (PROMPTS[1], 30), 2: (PROMPTS[2], 12), 5: (PROMPTS[5], 9)}.items():
        assert got[i].token_ids == target_greedy(target, p, n), i
    assert len(got[4].siblings) == 1
