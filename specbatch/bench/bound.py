"""The analytic speedup bound of speculative decoding (Leviathan et al. 2023), from measurements.

Letters as in the paper: alpha = per-token acceptance probability, gamma = draft length,
c = cost of one draft step / cost of one target step. The target's cost of scoring gamma + 1
tokens at once is measured too: T(gamma + 1) / T(1) (1 on an idealised accelerator, more on a
compute-bound CPU). With i.i.d. acceptance,

    E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha)
    cost of a step     = gamma * c + T(gamma + 1) / T(1)          (in target steps)
    bound              = E[tokens per step] / cost of a step      (speedup over the target alone)

and efficiency = achieved speedup / bound: how much of what the measured acceptance and the
measured step costs allow is actually reached (the rest is per-step overhead).
"""

from __future__ import annotations

import math


def expected_tokens_per_step(alpha: float, gamma: float) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha): tokens per target forward, bonus token included."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def step_cost(gamma: float, c: float, verify_ratio: float) -> float:
    """Cost of one speculative step in target steps: gamma * c + T(gamma + 1) / T(1)."""
    return gamma * c + verify_ratio


def speedup_bound(alpha: float, gamma: float, c: float, verify_ratio: float) -> float:
    """Leviathan et al. 2023's expected speedup with the measured verification cost."""
    return expected_tokens_per_step(alpha, gamma) / step_cost(gamma, c, verify_ratio)


def bound_from_measurements(mean_acceptance_length: float, draft_cost: float,
                            verify_ratio: float) -> float:
    """Tokens per step / step cost, both measured.

    ``draft_cost``: draft forwards per step x c (in target steps). For one drafter with a fixed
    gamma and i.i.d. acceptance this is exactly ``speedup_bound``: the mean acceptance length is
    E[tokens per step] and the draft forwards per step are gamma. It also holds for pools and for
    adaptive gamma, where gamma varies from step to step.
    """
    return mean_acceptance_length / (draft_cost + verify_ratio)


def fit_alpha(mean_acceptance_length: float, gamma: float, tol: float = 1e-10) -> float:
    """The alpha whose i.i.d. model gives the measured tokens per step for draft length gamma.

    The raw acceptance rate (accepted / drafted) counts the draft tokens after a rejection as
    rejected although they were never tested, so it underestimates alpha; this inverts
    E[tokens per step] instead (it is increasing in alpha), by bisection.
    """
    if gamma <= 0:
        return 0.0
    m = min(max(mean_acceptance_length, 1.0), gamma + 1.0)
    if m >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, gamma) < m:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def efficiency(achieved_speedup: float | None, bound: float | None) -> float | None:
    """achieved / bound, or None when either is unknown."""
    if achieved_speedup is None or bound is None or not math.isfinite(bound) or bound <= 0:
        return None
    return achieved_speedup / bound
