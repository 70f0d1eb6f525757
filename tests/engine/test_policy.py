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
    plain_steps: bool = False         # the job's plain decision (the autopilot's, under batch auto)
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

    def plain(self, n_rows: int) -> bool:
        return self.plain_steps

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
    """Seeded sampling keeps its gamma whatever the policy says: its draws must not depend on it."""
    engine = Engine(load("llama"), [load("llama-partial")])
    policy = Recording(limit=1, cap=0)
    params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=5, gamma=3)
    [(_, out)] = engine.generate_many([EngineRequest(prompt="Write a haiku about", params=params)], policy=policy)
    alone = engine.generate(prompt="Write a haiku about", params=params)
    assert out.token_ids == alone.token_ids and out.stats.drafted_tokens > 0


def test_a_jobs_plain_decision_holds_for_seeded_rows_but_not_for_an_explicit_fixed_gamma(load):
    """Under batch auto the autopilot's "plain" holds for seeded rows too: a few seeded rows
    drafting every step ran the draft over the whole batch (the default job at half its plain
    speed). A request that asked for a fixed gamma (adaptive=False) keeps drafting, as asked."""
    engine = Engine(load("llama"), [load("llama-partial")])
    seeded = GenerationParams(max_new_tokens=12, temperature=1.0, seed=5, gamma=3)
    asked = GenerationParams(max_new_tokens=12, gamma=3, adaptive=False)
    reqs = [EngineRequest(prompt="Write a haiku about", params=p) for p in (seeded, asked)]
    got = dict(engine.generate_many(reqs, policy=Recording(limit=2, cap=0, plain_steps=True)))
    assert got[0].stats.drafted_tokens == 0 and got[1].stats.drafted_tokens > 0
    # plain sampling with the seed: the same draws as the target alone, plain, with that seed
    plain = engine.generate(prompt="Write a haiku about", params=GenerationParams(
        max_new_tokens=12, temperature=1.0, seed=5, gamma=0))
    assert got[0].token_ids == plain.token_ids
    # and the autopilot's policy says plain exactly where it decided speculation is off
    from specbatch.engine.autopilot import Autopilot, AutopilotPolicy

    assert AutopilotPolicy(limit=8, pilot=Autopilot(speculation=False)).plain(8)
    assert not AutopilotPolicy(limit=8, pilot=Autopilot()).plain(8)
    assert not MeasuredPolicy(limit=8).plain(8)


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
