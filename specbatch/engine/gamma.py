"""Choosing gamma from measurements, and switching speculation off when it does not pay.

The expected number of tokens per verify step with a draft of length k and per-token acceptance
alpha is (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023). Its cost is k draft steps plus
one target forward over k + 1 tokens, both measured on this machine as decoding runs (CostModel,
shared by all requests of an engine: costs are properties of the hardware). The controller picks
the k with the best expected tokens per second and compares it with plain decoding (one token per
target forward of 1 token); when speculation loses it turns itself off for the request, probing
again now and then in case the text becomes easier to predict. The costs a controller reads are
those of the batch size its request is decoded at (policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.engine.memory import MAX_DRAFT


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens emitted per verify step] for draft length k, bonus token included."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    """Exponential moving averages of measured step times (seconds)."""

    decay: float = 0.2
    draft_step: float | None = None                       # drafting one position (whole pool)
    verify: dict[int, float] = field(default_factory=dict)  # verify of a draft of depth n - 1

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.decay * (new - old)

    def observe_draft(self, seconds: float, positions: int) -> None:
        if positions > 0:
            self.draft_step = self._ema(self.draft_step, seconds / positions)

    def observe_verify(self, n_tokens: int, seconds: float) -> None:
        self.verify[n_tokens] = self._ema(self.verify.get(n_tokens), seconds)

    @property
    def measured(self) -> bool:
        """Enough to choose a draft length from: the draft's step and verifies of two sizes (one
        size alone extrapolates flat, which would favour the longest draft)."""
        return self.draft_step is not None and len(self.verify) >= 2

    def verify_cost(self, n: int) -> float | None:
        """Measured, else interpolated from the nearest measured sizes (flat beyond them)."""
        if n in self.verify:
            return self.verify[n]
        if not self.verify:
            return None
        below = [m for m in self.verify if m < n]
        above = [m for m in self.verify if m > n]
        if below and above:
            lo, hi = max(below), min(above)
            w = (n - lo) / (hi - lo)
            return self.verify[lo] * (1 - w) + self.verify[hi] * w
        if below:  # extrapolate linearly from the two largest sizes if we have them
            lo = max(below)
            lower = [m for m in below if m < lo]
            if lower:
                lo2 = max(lower)
                slope = max(0.0, (self.verify[lo] - self.verify[lo2]) / (lo - lo2))
                return self.verify[lo] + slope * (n - lo)
            return self.verify[lo]
        return self.verify[min(above)]


@dataclass
class GammaController:
    """Per-request gamma. ``next_gamma()`` returns 0 when speculation is off for this step.

    ``costs`` is swapped by the decoder for the cost model of the current batch-size bucket.
    """

    costs: CostModel
    gamma: int = 4
    max_gamma: int = MAX_DRAFT       # (the memory estimate plans for drafts this wide)
    fixed: bool = False              # gamma stays as given (GenerationParams.adaptive False): no adapting
    warmup_steps: int = 3            # steps before the controller trusts its estimates
    probe_every: int = 16            # plain steps between probes once speculation is off
    max_probe_every: int = 256       # probes that keep losing back off up to this interval
    switch_margin: float = 0.95      # off when speculating is below this share of plain's rate
    prior: float = 0.6               # alpha prior (pseudo-counts below)
    prior_weight: float = 2.0
    memory: float = 0.9              # per-step decay of the acceptance counts: text difficulty drifts
    accepted: float = 0.0
    rejected: float = 0.0
    steps: int = 0
    off: bool = False
    plain_steps: int = 0
    ever_off: bool = False

    def __post_init__(self) -> None:
        self._first_probe_every = self.probe_every

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior * self.prior_weight
        return a / (a + self.rejected + (1 - self.prior) * self.prior_weight)

    def next_gamma(self) -> int:
        if not self.fixed and 0 < self.gamma and self.steps < self.warmup_steps and self.costs.measured:
            # a request joining an engine that has measured its step costs starts at the draft
            # length those costs favour (its acceptance is still the prior's), not at the default:
            # the default's warm-up steps cost the Qwen pair about 1.8x a step at its best length
            # (a request that asked for gamma 0 never drafts: it has no steps to warm up with)
            self._choose(may_switch_off=False)
        if self.off:
            self.plain_steps += 1
            if self.plain_steps % self.probe_every:
                return 0
        return self.gamma

    def observe(self, k: int, n_accepted: int) -> None:
        """After a verify step that drafted k tokens and accepted n_accepted of them."""
        if k == 0:
            return
        self.steps += 1
        self.accepted = self.accepted * self.memory + n_accepted
        self.rejected = self.rejected * self.memory + (1 if n_accepted < k else 0)
        if not self.fixed and self.steps >= self.warmup_steps:
            self._choose()

    def _choose(self, may_switch_off: bool = True) -> None:
        """Pick the draft length with the best expected rate; switching off needs observations of
        this request's own acceptance (``may_switch_off``), not the prior's."""
        c, plain = self.costs.draft_step, self.costs.verify_cost(1)
        if c is None:
            return
        rates = {}
        for k in range(1, self.max_gamma + 1):
            v = self.costs.verify_cost(k + 1)
            if v is not None:
                rates[k] = expected_tokens(self.alpha, k) / (k * c + v)
        if not rates:
            return
        best = max(rates, key=rates.__getitem__)
        self.gamma = best
        if not may_switch_off:
            return
        # plain decoding is measured once speculation has been off; before that take the cost of the
        # smallest measured verify as its cost (pessimistic for plain: switching off needs clear loss)
        plain_cost = plain if plain is not None else self.costs.verify_cost(min(self.costs.verify))
        plain_rate = 1.0 / plain_cost if plain_cost else 0.0
        was_off = self.off
        self.off = rates[best] < self.switch_margin * plain_rate
        if self.off and not was_off:
            self.ever_off = True
            self.plain_steps = 0
        elif self.off:   # a probe that lost: probe half as often (each probe costs a slow step)
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        else:
            self.probe_every = self._first_probe_every
