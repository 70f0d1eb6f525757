"""The autopilot's decisions with scripted costs: a simulated decode loop, no model.

Each simulated request lives ``life`` steps; the loop admits up to ``rows_allowed`` rows, asks
``speculate``, and reports a step whose duration comes from a known throughput curve.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specbatch.engine.autopilot import Autopilot, bucket

Curve = Callable[[int, bool], float]   # (bucket, speculating) -> tokens/s


def simulate(pilot: Autopilot, curve: Curve, requests: int = 4000, life: int = 40,
             memory_rows: int | None = None) -> dict[str, int]:
    """Run ``requests`` requests through the policy; returns how many steps ran at each size."""
    waiting, paused, rows, seen = requests, [], [], {}
    max_rows = 0
    while waiting or paused or rows:
        allowed = pilot.rows_allowed(waiting + len(paused))
        while len(rows) > allowed:          # the loop pauses the newest rows
            paused.append(rows.pop())
        while (waiting or paused) and len(rows) < allowed:
            if paused:
                rows.append(paused.pop())
            else:
                rows.append(life)
                waiting -= 1
        max_rows = max(max_rows, len(rows))
        if memory_rows is not None:
            assert len(rows) <= memory_rows
        spec = pilot.speculate(len(rows))
        per_row = 2 if spec else 1         # tokens each row emits per step
        tokens = per_row * len(rows)
        seconds = tokens / curve(bucket(len(rows)), bool(spec))
        pilot.observe(len(rows), drafted=4 * len(rows) if spec else 0, tokens=tokens, seconds=seconds)
        assert pilot.explore_steps <= pilot.budget(), "exploration over its bound"
        rows = [r - per_row for r in rows if r > per_row]
        key = f"{bucket(max(len(rows), 1))}"
        seen[key] = seen.get(key, 0) + 1
    seen["max_rows"] = max_rows
    return seen


def cpu_like(b: int, spec: bool) -> float:
    """Plain throughput rises to a peak at 16 and falls after; speculation wins only at B <= 2."""
    plain = {1: 11, 2: 20, 4: 34, 8: 50, 16: 64, 32: 58, 64: 50}[b]
    return plain * (1.3 if b <= 2 else 0.75) if spec else plain


def gpu_like(b: int, spec: bool) -> float:
    """Throughput keeps rising to 64; speculation wins at every size."""
    plain = {1: 10, 2: 20, 4: 40, 8: 78, 16: 150, 32: 280, 64: 500}[b]
    return plain * 1.6 if spec else plain


def test_finds_the_best_point_of_a_known_curve():
    pilot = Autopilot(cap=64)
    simulate(pilot, cpu_like)
    assert pilot.kept == (16, False)


def test_keeps_growing_while_throughput_rises_and_keeps_speculation_where_it_wins():
    pilot = Autopilot(cap=64)
    simulate(pilot, gpu_like)
    assert pilot.kept == (64, True)


def test_speculation_off_where_it_loses_on_where_it_wins():
    # at a fixed-size-like cap of 1 speculation wins on this curve; at 16 it loses
    small = Autopilot(cap=1)
    simulate(small, cpu_like, requests=400)
    assert small.kept == (1, True)
    big = Autopilot(cap=16, start=16)
    simulate(big, cpu_like, requests=2000)
    assert big.kept == (16, False)
    assert big.speculate(16) is False


def test_respects_the_memory_cap():
    pilot = Autopilot(cap=8)
    seen = simulate(pilot, gpu_like, memory_rows=8)
    assert pilot.kept == (8, True)
    assert seen["max_rows"] == 8


def test_a_cap_between_powers_of_two_is_reached():
    pilot = Autopilot(cap=12)
    seen = simulate(pilot, gpu_like, memory_rows=12)
    assert seen["max_rows"] == 12


@pytest.mark.parametrize("curve", [cpu_like, gpu_like])
def test_exploration_share_is_bounded(curve):
    pilot = Autopilot(cap=64)
    simulate(pilot, curve, requests=6000)
    assert pilot.steps > 1000
    assert pilot.explore_steps <= pilot.explore_share * pilot.steps + pilot.explore_allowance
    # and it did explore: some trials lost (otherwise the bound would prove nothing)
    assert any(why == "lost" for _, _, why in pilot.history)


def test_rechecks_when_the_text_changes():
    """Speculation wins at B=1 on easy text, then the text turns hard: it switches off."""
    phase = {"hard": False}

    def curve(b: int, spec: bool) -> float:
        return 10 * (0.6 if phase["hard"] else 1.5) if spec else 10.0

    pilot = Autopilot(cap=1)
    simulate(pilot, curve, requests=200)
    assert pilot.kept == (1, True)
    phase["hard"] = True
    simulate(pilot, curve, requests=600)
    assert pilot.kept == (1, False)


def test_no_speculation_forces_plain():
    pilot = Autopilot(cap=64, speculation=False)
    simulate(pilot, gpu_like)
    assert pilot.speculated_steps == 0
    assert pilot.speculate(1) is False




def test_summary_records_the_choice():
    pilot = Autopilot(cap=64)
    simulate(pilot, cpu_like)
    s = pilot.summary()
    assert s["chosen"] == {"batch_size": 16, "speculative": False}
    shares = s["batch_size_share"]
    assert abs(sum(shares.values()) - 1) < 1e-9
    assert max(shares, key=shares.__getitem__) == "16"
    assert 0 < s["speculated_step_share"] < 0.5


def test_compile_seam_plans_rows():
    pilot = Autopilot(cap=64)
    assert pilot.planned_rows() == 8
    simulate(pilot, cpu_like)
    assert pilot.planned_rows() == 16


def test_the_first_batch_takes_the_waiting_work_up_to_start_max_and_the_cap():
    assert Autopilot(cap=64).rows_allowed(48) == 32            # start_max
    assert Autopilot(cap=64).rows_allowed(20) == 32            # its bucket: all 20 rows at once
    assert Autopilot(cap=64).rows_allowed(12) == 16
    assert Autopilot(cap=12).rows_allowed(100) == 12           # the memory cap
    assert Autopilot(cap=64).rows_allowed(3) == 8              # less work than the prior: the prior
    pilot = Autopilot(cap=64)
    pilot.rows_allowed(100)
    assert pilot.kept == (32, False)                           # plain until speculation is affordable
    assert pilot.rows_allowed(1000) == 32                      # decided once, at the first call


def _plain_steps(pilot: Autopilot, n: int, rows: int = 32, seconds: float = 0.1) -> None:
    for _ in range(n):
        pilot.rows_allowed(0)
        pilot.observe(rows, drafted=0, tokens=rows, seconds=seconds, speculating=pilot.speculate(rows))


def test_turning_speculation_on_waits_until_the_draft_catch_up_fits_the_exploration_share():
    pilot = Autopilot(cap=32)
    pilot.rows_allowed(32)
    pilot.observe_prefill(32, 3.2)     # caching the batch's contexts cost 0.1 s a row
    # a catch-up of 32 rows costs ~3.2 s: affordable once 10% of the time spent covers it (32 s)
    _plain_steps(pilot, 200)           # 20 s more: 23.2 s spent
    assert all(cfg != (32, True) for _, cfg, _ in pilot.history), pilot.history
    _plain_steps(pilot, 100)           # 33.2 s spent
    assert (32, True) in [cfg for _, cfg, why in pilot.history if why == "trial"], pilot.history


def test_cheap_prefill_lets_speculation_be_tried_at_once():
    pilot = Autopilot(cap=32)
    pilot.rows_allowed(32)
    pilot.observe_prefill(32, 0.032)
    _plain_steps(pilot, 6)
    assert pilot.trial == (32, True)


def test_steps_in_speculative_mode_count_for_it_even_when_no_row_drafts():
    """The rows' gamma controllers may draft nothing at a speculative size; those steps are still
    what speculation on yields there, so the kept configuration gets measured (and judged)."""
    pilot = Autopilot(cap=1, speculation=True)
    pilot.rows_allowed(10)
    pilot.trial = None
    pilot.kept = (1, True)
    for _ in range(6):
        pilot.observe(1, drafted=0, tokens=1, seconds=0.1, speculating=True)
    assert pilot.rates[(1, True)].samples == 6 and (1, False) not in pilot.rates
