"""The bound and efficiency arithmetic on hand-made numbers (no models)."""

from __future__ import annotations

import pytest

from specbatch.bench import bound as bnd
from specbatch.bench.costs import CostTable
from specbatch.bench.harness import Config, bound_for


def test_expected_tokens_per_step_matches_the_closed_form():
    # (1 - 0.8^5) / (1 - 0.8) = (1 - 0.32768) / 0.2
    assert bnd.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert bnd.expected_tokens_per_step(0.0, 4) == pytest.approx(1.0)
    assert bnd.expected_tokens_per_step(1.0, 4) == pytest.approx(5.0)
    assert bnd.expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)


def test_speedup_bound_divides_by_the_measured_step_cost():
    # cost = gamma * c + T(5)/T(1) = 4 * 0.1 + 1.5 = 1.9
    assert bnd.step_cost(4, 0.1, 1.5) == pytest.approx(1.9)
    assert bnd.speedup_bound(0.8, 4, 0.1, 1.5) == pytest.approx(3.3616 / 1.9)
    # an ideal accelerator (T(gamma+1) = T(1)) and a free draft: the bound is E[tokens per step]
    assert bnd.speedup_bound(0.8, 4, 0.0, 1.0) == pytest.approx(3.3616)


def test_fit_alpha_inverts_expected_tokens():
    assert bnd.fit_alpha(3.3616, 4) == pytest.approx(0.8, abs=1e-6)
    assert bnd.fit_alpha(1.0, 4) == pytest.approx(0.0, abs=1e-6)
    assert bnd.fit_alpha(5.0, 4) == 1.0
    assert bnd.fit_alpha(2.0, 0) == 0.0


def test_bound_from_measurements_equals_leviathan_for_a_fixed_chain():
    assert bnd.bound_from_measurements(3.3616, 4 * 0.1, 1.5) == pytest.approx(
        bnd.speedup_bound(0.8, 4, 0.1, 1.5))


def test_efficiency():
    assert bnd.efficiency(1.2, 1.5) == pytest.approx(0.8)
    assert bnd.efficiency(None, 1.5) is None
    assert bnd.efficiency(1.2, None) is None
    assert bnd.efficiency(1.2, 0.0) is None


def test_bound_for_a_configuration_uses_measured_costs():
    costs = CostTable(prefix_tokens=100, target={1: 0.010, 5: 0.015}, drafts={"d": 0.001})
    assert costs.c("d") == pytest.approx(0.1)
    assert costs.c("ngram") == 0.0
    cfg = Config("ours[d,gamma=4]", "ours", "gamma", ("d",), gamma=4, adaptive=False)
    acc = {"mean_acceptance_length": 3.3616, "draft_tokens_per_step": 4.0,
           "draft_forwards_per_step": 4.0}
    b = bound_for(cfg, acc, costs)
    assert b["verify_tokens"] == 5
    assert b["verify_cost_ratio"] == pytest.approx(1.5)
    assert b["c"] == pytest.approx(0.1)
    assert b["alpha"] == pytest.approx(0.8, abs=1e-6)
    assert b["bound"] == pytest.approx(3.3616 / 1.9)
    # achieved 1.5x of a 1.769x bound
    assert bnd.efficiency(1.5, b["bound"]) == pytest.approx(1.5 * 1.9 / 3.3616)


def test_bound_for_an_ngram_pool_member_costs_nothing_to_draft():
    costs = CostTable(prefix_tokens=10, target={1: 0.010, 3: 0.012}, drafts={"d": 0.002})
    cfg = Config("ours[d+ngram]", "ours", "pool", ("d", "ngram"))
    acc = {"mean_acceptance_length": 2.0, "draft_tokens_per_step": 2.0, "draft_forwards_per_step": 1.0}
    b = bound_for(cfg, acc, costs)
    # c is the model drafters' mean (0.2); k = 2 drafted + 1; cost = 1 * 0.2 + 1.2
    assert b["verify_tokens"] == 3
    assert b["bound"] == pytest.approx(2.0 / (0.2 + 1.2))
    assert b["alpha"] is None


def test_cost_table_interpolates_between_measured_sizes():
    costs = CostTable(prefix_tokens=10, target={1: 0.010, 2: 0.020, 3: 0.022})
    assert costs.verify_ratio(3) == pytest.approx(2.2)
    # a mean draft length of 1.5 (k = 2.5) costs the mean of T(2) and T(3)
    assert costs.t(2.5) == pytest.approx(0.021)
    assert costs.t(1.25) == pytest.approx(0.0125)
    assert costs.t(9) == pytest.approx(0.022)          # flat beyond the largest measured size
