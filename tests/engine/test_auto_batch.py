"""The batched loop under the autopilot: outputs never depend on its choices (greedy equals the
target alone), rows paused and resumed keep their text, the memory budget caps admission."""

from __future__ import annotations

import pytest

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.autopilot import check_batch_size
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.memory import MAX_DRAFT, SLACK, MemoryBudget, ModelShape, parse_bytes, row_columns
from specbatch.engine.policy import MeasuredPolicy, StepReport
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_greedy_exact import target_greedy


class Swinging(MeasuredPolicy):
    """Allows 4, 1, 3, 1, 4 ... rows in turn and turns speculation off every other step: forces
    pause and resume."""

    def __init__(self) -> None:
        super().__init__(limit=4)
        self.calls = 0
        self.seen_rows: list[int] = []

    def max_rows(self, waiting: int = 0) -> int:
        self.calls += 1
        return (4, 1, 3, 1)[(self.calls // 3) % 4]

    def gamma_cap(self, n_rows: int) -> int | None:
        self.seen_rows.append(n_rows)
        return 0 if self.calls % 2 else None


class Recording(MeasuredPolicy):
    def __init__(self) -> None:
        super().__init__(limit=64)
        self.seen: list[int] = []

    def observe(self, report: StepReport) -> None:
        super().observe(report)
        self.seen.append(report.rows)


@pytest.mark.parametrize("drafts,ngram", [(["llama-partial"], False), ([], True), ([], False)])
def test_auto_outputs_equal_the_target_alone(load, drafts, ngram):
    target = load("llama")
    engine = Engine(target, [load(d) for d in drafts] + [NGRAM] * ngram, batch_size="auto")
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
    got = dict(engine.generate_many(reqs))
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
        assert sum(got[i].stats.batch_size_seconds.values()) > 0
    report = engine.batch_report()
    assert report is not None and report["steps"] > 0
    if not drafts and not ngram:
        assert report["speculated_step_share"] == 0


def test_rows_now_is_the_fixed_size_or_what_the_autopilot_keeps(load):
    target = load("llama")
    assert Engine(target, batch_size=3).rows_now() == 3
    engine = Engine(target, [load("llama-partial")], batch_size="auto")
    assert engine.rows_now() is None and engine.speculating_now()
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=4)) for p in PROMPTS[:3]]
    dict(engine.generate_many(reqs))
    assert engine.autopilot is not None
    assert (engine.rows_now(), engine.speculating_now()) == engine.autopilot.kept


def test_paused_rows_resume_with_the_same_text(load):
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), NGRAM])
    reqs = [(i, engine.encode(p), GenerationParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    pilot = Swinging()
    import torch

    starts: list[list[int]] = []
    with torch.inference_mode():
        got = dict(Decoder(target, engine.new_drafters(), pilot).run(reqs, starts.append))
    assert max(pilot.seen_rows) >= 3 and 1 in pilot.seen_rows
    # each request starts once, as it joins (a resumed row does not start again), at most 4 at a time
    assert sorted(i for s in starts for i in s) == list(range(len(reqs)))
    assert len(starts[0]) <= 4 < len(reqs)
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i


def test_memory_budget_caps_the_rows_and_a_long_request_runs_alone(load):
    target = load("llama")
    shape = ModelShape.of(target.model)
    budget = MemoryBudget(0, (shape,))
    one_row = budget.row_bytes(120, 4)
    budget.budget = int(2.5 * one_row)         # two rows of ~120 columns fit, three do not
    reqs = [(i, target.tokenizer(p)["input_ids"], GenerationParams(max_new_tokens=n))
            for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    import torch

    policy = Recording()
    with torch.inference_mode():
        got = dict(Decoder(target, [], policy, memory=budget).run(reqs))
    assert max(policy.seen) == 2
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
    # a budget below one row: every request still runs, alone
    budget.budget = 1
    policy = Recording()
    with torch.inference_mode():
        got = dict(Decoder(target, [], policy, memory=budget).run(reqs))
    assert set(policy.seen) == {1} and len(got) == len(PROMPTS)


def test_row_estimate_follows_the_model_config(load):
    shape = ModelShape.of(load("llama").model)
    cfg = load("llama").model.config
    assert shape.kv_bytes_per_token == cfg.num_hidden_layers * cfg.num_key_value_heads * \
        (cfg.hidden_size // cfg.num_attention_heads) * 2 * 4
    b = MemoryBudget(10**9, (shape,))
    assert b.row_bytes(200, 4) > b.row_bytes(100, 4)
    assert b.max_rows(100, 4) > b.max_rows(200, 4)
    n = b.max_rows(200, 4)
    assert n * b.row_bytes(200, 4) <= b.budget < (n + 1) * b.row_bytes(200, 4)
    b.check(1000, 0, 0, 0)                       # baseline
    before = b.row_bytes(100, 4)
    b.check(1000 + SLACK + int(3 * 8 * before), 8, 100, 4)   # measured 3x the estimate for 8 rows
    assert b.row_bytes(100, 4) == pytest.approx(3 * before)


def test_a_draining_batch_does_not_inflate_a_high_water_measure():
    """A CPU resident set keeps the memory of finished rows: 8 rows' worth measured while one row
    is left is not a 8x under-estimate. A measure that shrinks (CUDA) is held to the rows now."""
    shape = ModelShape(layers=4, kv_heads=2, head_dim=16, hidden=64, vocab=100, dtype_bytes=4)
    for high_water, rescaled in ((True, False), (False, True)):
        b = MemoryBudget(10**12, (shape,), high_water=high_water)
        b.check(1000, 0, 0, 0)                                    # baseline
        peak = 1000 + SLACK + int(8 * b.row_bytes(100, 4))        # 8 rows, as estimated
        for rows in (8, 8, 4, 2, 1):                              # the batch drains
            b.check(peak, rows, 100, 4)
        assert (b.scale > 1.0) is rescaled, high_water
    # a real under-estimate is still found at the peak, and after it
    b = MemoryBudget(10**12, (shape,), high_water=True)
    b.check(1000, 0, 0, 0)
    b.check(1000 + SLACK + int(3 * 8 * b.row_bytes(100, 4)), 8, 100, 4)
    assert b.scale == pytest.approx(3.0)
    b.check(1000 + SLACK + int(3 * 8 * b.row_bytes(100, 4) / 3), 1, 100, 4)   # draining: no change
    assert b.scale == pytest.approx(3.0)


def test_a_second_call_on_one_engine_is_admitted_at_full_batch(load, monkeypatch):
    """A worker's next chunk runs on the engine its last chunk drained: with the process's memory
    a high-water mark (CPU), the drain must not shrink the next call's batch."""
    import specbatch.engine.decoder as decoder

    target = load("llama")
    shape = ModelShape.of(target.model)
    width = MAX_DRAFT
    one_row = MemoryBudget(0, (shape,)).row_bytes(120, width)
    seen: list[int] = []
    peak = {"bytes": 0}

    def resident(device):   # what a resident set does: it grows with the rows, never shrinks
        rows = max(seen[-1:] or [0])
        peak["bytes"] = max(peak["bytes"], 10**9 + (SLACK + int(rows * one_row) if rows else 0))
        return peak["bytes"]

    class Rows(MeasuredPolicy):
        def observe(self, report):
            super().observe(report)
            seen.append(report.rows)

    monkeypatch.setattr(decoder, "measure", resident)
    engine = Engine(target, [], batch_size=4, max_memory=int(4.5 * one_row))
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
    firsts = []
    for _ in range(2):
        seen.clear()
        got = dict(engine.generate_many(reqs, policy=Rows(limit=4)))
        firsts.append(seen[0])
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            assert got[i].token_ids == target_greedy(target, p, n), i
    assert min(seen) < 4              # the first call drained below full rows
    assert firsts == [4, 4], engine.memory


def test_a_fixed_gamma_wider_than_adaptation_reaches_is_in_the_memory_estimate(load):
    """Rules allow gamma up to 64 while adaptation stops at MAX_DRAFT: a row kept at 64 verifies
    64 drafted positions, which its columns and the step's activations must be counted for."""
    wide = GenerationParams(max_new_tokens=8, gamma=64, adaptive=False)
    assert row_columns(10, wide) == 10 + 8 + 64 + 1
    assert row_columns(10, GenerationParams(max_new_tokens=8)) == 10 + 8 + MAX_DRAFT + 1

    class Seen(MemoryBudget):
        def check(self, measured, rows, columns, gamma):
            self.seen.append((columns, gamma))
            super().check(measured, rows, columns, gamma)

    target = load("llama")
    budget = Seen(10**12, (ModelShape.of(target.model),))
    budget.seen = []
    reqs = [(0, target.tokenizer(PROMPTS[0])["input_ids"], wide)]
    import torch

    with torch.inference_mode():
        got = dict(Decoder(target, Engine(target, [load("llama-partial")]).new_drafters(),
                           MeasuredPolicy(limit=1), memory=budget).run(reqs))
    assert got[0].token_ids == target_greedy(target, PROMPTS[0], 8)
    steps = budget.seen[1:]                     # (the first call is the baseline)
    assert steps and all(g == 64 and c >= len(reqs[0][1]) + 8 + 64 + 1 for c, g in steps)


@pytest.mark.parametrize("text,value", [("8GiB", 8 * 1024**3), ("512MB", 512 * 10**6), ("1.5 gb", 1.5e9),
                                        ("1000", 1000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1GB", "0", "5 parsecs", "1e9"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("value,ok", [("auto", "auto"), ("AUTO", "auto"), ("4", 4), (8, 8), ("0", None),
                                      (0, None), ("-2", None), ("2.5", None), ("x", None), (True, None)])
def test_check_batch_size(value, ok):
    if ok is None:
        with pytest.raises(ValueError):
            check_batch_size(value)
    else:
        assert check_batch_size(value) == ok


class PlainThenSpeculate(MeasuredPolicy):
    """Decodes plainly for the first ``plain_steps`` steps, then lets the rows draft."""

    def __init__(self, plain_steps: int) -> None:
        super().__init__(limit=2)
        self.plain_steps, self.steps = plain_steps, 0
        self.prefill_steps = 0

    def gamma_cap(self, n_rows: int) -> int | None:
        return 0 if self.steps < self.plain_steps else None

    def observe(self, report: StepReport) -> None:
        self.steps += 1
        self.prefill_steps += report.prefill
        super().observe(report)


def test_rows_that_join_while_decoding_plainly_cost_the_draft_nothing_until_it_drafts(load):
    """Where the policy decodes plainly the draft model caches no prompt; when speculation comes
    back its first proposal catches the rows up (a step reported as prefill, not measured), and
    outputs still equal the target alone."""
    import torch

    target, draft = load("llama"), load("llama-partial")
    engine = Engine(target, [draft])
    reqs = [(i, engine.encode(p), GenerationParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    calls = []
    real = draft.forward
    draft.forward = lambda *a, **k: calls.append(1) or real(*a, **k)   # type: ignore[method-assign]
    try:
        never = MeasuredPolicy(limit=2)
        never.gamma_cap = lambda n_rows: 0   # type: ignore[method-assign]
        with torch.inference_mode():
            got = dict(Decoder(target, engine.new_drafters(), never).run(reqs))
        assert calls == []
        for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
            assert got[i].token_ids == target_greedy(target, p, n), i
        later = PlainThenSpeculate(plain_steps=3)
        with torch.inference_mode():
            got = dict(Decoder(target, engine.new_drafters(), later).run(reqs))
    finally:
        del draft.forward      # the class's method again (a bound copy left here would pin this object:
        #                        a copy of the session's cached model would call the original's forward)
    assert calls and later.prefill_steps >= 2   # the fresh batch's first step, the catch-up
    assert sum(o.stats.drafted_tokens for o in got.values()) > 0
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i


class Erratic(MeasuredPolicy):
    """Row limits and caps drawn at random every call, on costs that do not move
    (so a seed replays the same run): the autopilot's choices in any order, timing aside."""

    def __init__(self, seed: int) -> None:
        import random

        from specbatch.engine.gamma import CostModel

        super().__init__(limit=16)
        self.rng = random.Random(seed)
        self.frozen = CostModel(draft_step=0.002, verify={n: 0.01 + 0.001 * n for n in range(1, 14)})

    def max_rows(self, waiting: int = 0) -> int:
        return self.rng.choice([1, 2, 3, 5, 8, 13, 16])

    def gamma_cap(self, n_rows: int) -> int | None:
        return self.rng.choice([None, None, 0, 1, 2, 5])

    def costs(self, n_rows: int):
        return self.frozen

    def observe(self, report: StepReport) -> None:
        pass


@pytest.mark.parametrize("seed", range(6))
def test_erratic_batching_and_speculation_decisions_never_change_the_text(load, seed):
    import random

    import torch

    rng = random.Random(seed)
    target = load("llama")
    engine = Engine(target, [load("llama-partial")] + [NGRAM] * (rng.random() < 0.5))
    n = rng.randint(8, 24)
    cases = [(f"word {i} and", rng.randint(1, 40), rng.choice([None, 2, 8])) for i in range(n)]
    reqs = [(i, engine.encode(p), GenerationParams(max_new_tokens=m, gamma=g)) for i, (p, m, g) in enumerate(cases)]
    with torch.inference_mode():
        got = dict(Decoder(target, engine.new_drafters(), Erratic(seed)).run(reqs, lambda started: None))
    for i, (p, m, _) in enumerate(cases):
        assert got[i].token_ids == target_greedy(target, p, m), i


@pytest.mark.parametrize("seed", range(3))
def test_erratic_decisions_never_change_a_seeded_sample(load, seed):
    """Seeded sampled rows under random row limits and caps (speculating or not, pausing, any
    gamma) give the target alone's tokens with their seeds. On main the draws followed drafting."""
    import random

    import torch

    rng = random.Random(seed)
    target = load("llama")
    engine = Engine(target, [load("llama-partial")] + [NGRAM] * (rng.random() < 0.5))
    n = rng.randint(6, 12)
    cases = [(f"word {i} and", rng.randint(1, 30), rng.choice([None, 2, 8])) for i in range(n)]
    params = [GenerationParams(max_new_tokens=m, gamma=g, temperature=0.8, seed=100 + i)
              for i, (_, m, g) in enumerate(cases)]
    reqs = [(i, engine.encode(p), params[i]) for i, (p, _, _) in enumerate(cases)]
    with torch.inference_mode():
        got = dict(Decoder(target, engine.new_drafters(), Erratic(seed)).run(reqs, lambda started: None))
    alone = Engine(target, [])
    for i, (p, _, _) in enumerate(cases):
        assert got[i].token_ids == alone.generate(prompt=p, params=params[i]).token_ids, i
