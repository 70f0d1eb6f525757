"""The decoder's policy seam: row limit, gamma cap and step reports (what an autopilot plugs into)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.gamma import CostModel
from specbatch.engine.policy import MeasuredPolicy, StepReport, bucket
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_greedy_exact import target_greedy


@dataclass
class Recording:
    """A policy that lets ``limit`` rows decode, caps adaptive gamma at ``cap`` and keeps reports."""

    limit: int
    cap: int | None
    reports: list[StepReport] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)
    model: CostModel = field(default_factory=CostModel)

    def max_rows(self, waiting: int = 0) -> int:
        return self.limit

    def gamma_cap(self, n_rows: int) -> int | None:
        self.asked.append(n_rows)
        return self.cap

    def costs(self, n_rows: int) -> CostModel:
        return self.model

    def observe(self, report: StepReport) -> None:
        self.reports.append(report)


def test_a_policy_bounds_rows_caps_gamma_and_sees_every_step(load):
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), NGRAM])
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
    for cap in (0, 2):
        policy = Recording(limit=2, cap=cap)
        got = dict(engine.generate_many(reqs, policy=policy))
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            assert got[i].token_ids == target_greedy(target, p, n)
        assert max(r.rows for r in policy.reports) == 2 and policy.asked
        assert all(r.depth <= cap for r in policy.reports)
        assert sum(r.emitted for r in policy.reports) >= sum(len(o.token_ids) for o in got.values())
        assert sum(r.drafted for r in policy.reports) == sum(o.stats.drafted_tokens for o in got.values())
        if cap == 0:
            assert all(o.stats.drafted_tokens == 0 for o in got.values())


def test_fixed_gamma_requests_ignore_the_cap(load):
    """A request that asked for a fixed gamma (adaptive=False) drafts it whatever the policy says."""
    engine = Engine(load("llama"), [load("llama-partial")])
    policy = Recording(limit=1, cap=0)
    params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=5, gamma=3, adaptive=False)
    [(_, out)] = engine.generate_many([EngineRequest(prompt="Write a haiku about", params=params)], policy=policy)
    alone = engine.generate(prompt="Write a haiku about", params=params)
    assert out.token_ids == alone.token_ids and out.stats.drafted_tokens > 0


def test_seeded_rows_follow_the_cap_and_keep_their_sample(load):
    """A seeded sampled row is an adaptive row like any other (the policy's cap holds for it: no
    draft over the whole batch for a few seeded rows), and its tokens are the target alone's with
    that seed whether the policy let it draft or not (docs/DESIGN.md, "Sampled rows"). On main
    seeded rows kept a fixed gamma, and a plain step drew other tokens."""
    target = load("llama")
    engine = Engine(target, [load("llama-partial")])
    seeded = GenerationParams(max_new_tokens=12, temperature=1.0, seed=5, gamma=3)
    asked = GenerationParams(max_new_tokens=12, gamma=3, adaptive=False)
    reqs = [EngineRequest(prompt="Write a haiku about", params=p) for p in (seeded, asked)]
    plain = dict(engine.generate_many(reqs, policy=Recording(limit=2, cap=0)))
    drafting = dict(engine.generate_many(reqs, policy=Recording(limit=2, cap=None)))
    assert plain[0].stats.drafted_tokens == 0 and plain[1].stats.drafted_tokens > 0
    assert drafting[0].stats.drafted_tokens > 0
    alone = Engine(target, []).generate(prompt="Write a haiku about", params=seeded)
    assert plain[0].token_ids == drafting[0].token_ids == alone.token_ids


def test_measured_policy_buckets_and_one_plain_step():
    p = MeasuredPolicy(limit=8, warmup_steps=2)
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert p.costs(3) is p.costs(4) and p.costs(3) is not p.costs(2)
    step = StepReport(rows=3, depth=4, drafted=12, emitted=9, draft_seconds=0.04, verify_seconds=0.05,
                      prefill=False)
    p.observe(StepReport(3, 4, 12, 9, 9.0, 9.0, prefill=True))     # a prefill teaches nothing
    assert p.costs(3).verify == {} and p.gamma_cap(3) is None
    p.observe(step)
    p.observe(step)
    assert p.costs(4).verify == {5: 0.05} and p.costs(4).draft_step == 0.01
    assert p.gamma_cap(3) == 0 and p.gamma_cap(1) is None        # bucket 4 measures a plain step
    p.observe(StepReport(3, 0, 0, 3, 0.0, 0.02, prefill=False))
    assert p.gamma_cap(3) is None and p.costs(3).verify[1] == 0.02
    assert p.max_rows() == 8 and MeasuredPolicy(limit=0).max_rows() == 1
