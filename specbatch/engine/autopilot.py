"""The throughput autopilot: how many rows decode together, and whether they speculate.

A pure policy: the decode loop asks it, before admitting, how many rows may be active
(``rows_allowed``); before each step, whether to speculate at the current row count
(``speculate``); after each step it reports what happened (``observe``: rows, drafted tokens,
emitted tokens, seconds). It never touches a model, so its decisions are tested with scripted
costs (tests/engine/test_autopilot.py). ``AutopilotPolicy`` plugs it into the decoder's policy
seam (``specbatch.engine.policy``).

Search. Generated tokens per second are kept per configuration (batch-size bucket, speculation
on/off) as ratios of exponential moving averages of tokens and seconds. The first batch takes the
waiting work (up to ``start_max`` rows and the memory cap), plain. The autopilot holds a
*kept* configuration and runs short *trials* of its neighbours: twice the size (while the memory
cap and the waiting work allow; speculation as kept, then toggled), the same size with
speculation toggled, then half the size. A trial that beats the kept configuration by
``margin`` becomes the kept one (so the batch grows while throughput rises); one that loses is
dropped. Measurements older than ``recheck_steps`` are stale and their configurations are tried
again, so a change in the text (acceptance) or the machine (load) is noticed.

When ``rows_allowed`` falls below the active rows (a larger trial lost, a smaller one starts)
the loop pauses the newest rows and resumes them later, so a size change takes effect at once
and nothing drains slowly at a size that lost.

Exploration bound. Steps spent in trials that lost are the exploration cost. A trial starts
only if, should it lose, that cost stays within ``explore_share * steps + explore_allowance``
(by default 10% of all steps + 64 steps); a trial that wins costs nothing (it was the better
configuration all along). ``explore_steps`` never exceeds the bound (asserted in the tests).
A trial that turns speculation on over plainly decoded rows also pays the draft's catch-up (about
a prefill of the batch); it starts only once that cost fits ``explore_share`` of the time spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.engine.policy import MeasuredPolicy, StepReport, bucket

AUTO = "auto"
BatchSize = int | str    # rows decoded together, or "auto"


def check_batch_size(value: object) -> BatchSize:
    """ "auto" or an integer >= 1 (as int or text); raises ValueError otherwise."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError("must be an integer >= 1 or 'auto'") from None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError("must be an integer >= 1 or 'auto'")
    return value


Config = tuple[int, bool]   # (batch-size bucket, speculating)


@dataclass
class _Rate:
    """Tokens per second as the ratio of two EMAs (steady under uneven step sizes)."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    last_step: int = -1

    def add(self, tokens: float, seconds: float, step: int, decay: float) -> None:
        if self.samples == 0:
            self.tokens, self.seconds = tokens, seconds
        else:
            self.tokens += decay * (tokens - self.tokens)
            self.seconds += decay * (seconds - self.seconds)
        self.samples += 1
        self.last_step = step

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Autopilot:
    """Decides batch size and speculation from measured throughput; see the module docstring.

    ``speculation``: False forces plain decoding; ``cap``: the most rows the memory budget allows
    (``specbatch.engine.memory``). A fixed batch size has no autopilot (``MeasuredPolicy``).
    """

    cap: int = 64
    speculation: bool = True
    start: int = 8                  # rows at first (the prior the worker and the compile plan use too); half is tried too
    start_max: int = 32             # ... or up to this many, when that much work waits at the first step
    trial_steps: int = 5            # measured steps a trial needs before it is judged
    trial_timeout: int = 24         # steps a trial may wait for its rows (not enough work: dropped)
    margin: float = 0.03            # a trial must beat the kept configuration by this much
    recheck_steps: int = 160        # a measurement older than this is stale
    explore_share: float = 0.10
    explore_allowance: int = 64
    decay: float = 0.25

    rates: dict[Config, _Rate] = field(default_factory=dict)
    kept: Config = (1, True)
    trial: Config | None = None
    trial_started: int = 0
    trial_samples: int = 0
    steps: int = 0
    explore_steps: int = 0
    pending_trial_steps: int = 0    # steps of the running trial (exploration if it loses)
    seconds_by_size: dict[int, float] = field(default_factory=dict)
    speculated_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    history: list[tuple[int, Config, str]] = field(default_factory=list)   # (step, config, why)
    opened: bool = False            # the first batch's size was set from the waiting work
    prefill_seconds: float = 0.0    # seconds of steps that cached whole contexts (not in ``seconds``)
    explore_seconds: float = 0.0    # prefill/catch-up seconds paid while a trial ran
    prefill_per_row: float | None = None   # seconds a step that cached whole contexts took per row

    def __post_init__(self) -> None:
        self.cap = max(1, self.cap)
        size = bucket(max(1, self.start))
        while size > 1 and size > self.cap:
            size //= 2
        self.kept = (size, self.speculation)

    # -- questions the decode loop asks

    @property
    def current(self) -> Config:
        return self.trial if self.trial is not None else self.kept

    def rows_allowed(self, waiting: int = 0) -> int:
        """How many rows may be active now (before admitting ``waiting`` more requests)."""
        if not self.opened:
            self._open(waiting)
        if self.trial is None and self.steps > 0:
            self._maybe_start_trial(waiting)
        return min(self.current[0], self.cap)

    def speculate(self, rows: int) -> bool:
        """Whether the step at ``rows`` active rows drafts."""
        if not self.speculation:
            return False
        size = bucket(rows)
        if size == self.current[0]:
            return self.current[1]
        # rows off the current size (filling up, draining, the job's tail): what was measured best there
        on, off = self.rates.get((size, True)), self.rates.get((size, False))
        if on is not None and off is not None:
            return on.value >= off.value
        return self.current[1]

    # -- what the loop reports

    def observe(self, rows: int, drafted: int, tokens: int, seconds: float,
                speculating: bool | None = None) -> None:
        """One decode step: ``rows`` active rows, ``drafted`` draft tokens in all, ``tokens`` emitted.

        ``speculating``: whether the step ran with speculation on (what ``speculate`` said); its
        rows' gamma controllers may still have drafted nothing, and that is part of what speculation
        on yields at this size. None: the step speculated if it drafted."""
        if rows <= 0 or seconds <= 0:
            return
        size = bucket(rows)
        config = (size, drafted > 0 if speculating is None else speculating)
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.speculated_steps += int(drafted > 0)
        self.seconds_by_size[size] = self.seconds_by_size.get(size, 0.0) + seconds
        self.rates.setdefault(config, _Rate()).add(tokens, seconds, self.steps, self.decay)
        if self.trial is not None:
            self.pending_trial_steps += 1
            if config == self.trial:
                self.trial_samples += 1
            if self.trial_samples >= self.trial_steps:
                self._judge()
            elif self.steps - self.trial_started >= self.trial_timeout:
                self._end_trial(won=False, why="timeout")

    def observe_prefill(self, rows: int, seconds: float) -> None:
        """A step that also cached whole contexts (a fresh batch's prompts, a draft catching up):
        not a decode measurement, but time the job spent, and what a catch-up would cost."""
        if rows <= 0 or seconds <= 0:
            return
        self.prefill_seconds += seconds
        if self.trial is not None:
            self.explore_seconds += seconds
        per_row = seconds / rows
        self.prefill_per_row = per_row if self.prefill_per_row is None else \
            self.prefill_per_row + self.decay * (per_row - self.prefill_per_row)

    # -- the search

    def budget(self) -> float:
        """The most exploration steps allowed so far."""
        return self.explore_share * self.steps + self.explore_allowance

    def _open(self, waiting: int) -> None:
        """The first batch takes the waiting work, up to ``start_max`` rows and the memory cap.

        Plain throughput rose with the batch up to 32 rows on this CPU
        (docs/bench/report-job-default-pair.md; a GPU's batch pays further), and a batch grown by
        joins pays each join's prefill on its own, so a job starts at the large end and its first
        trials measure half the size and speculation toggled; growing beyond still follows trials.
        Plain first: the draft caches nothing until a speculation trial is affordable
        (``_affordable``); a draft as large as the default one costs most of a target prefill."""
        self.opened = True
        self.kept = (max(self.kept[0], bucket(min(waiting, self.start_max, self.cap))), False)

    def _affordable(self, config: Config) -> bool:
        """Turning speculation on where the rows decoded plainly first catches the draft up on
        every row's context: about a prefill of the batch. Such a trial waits until that cost
        fits ``explore_share`` of the time spent so far (at once on a GPU, where prefill is cheap
        next to decoding; after minutes on a small CPU, where one prefill costs dozens of steps)."""
        if not config[1] or self.kept[1] or self.prefill_per_row is None:
            return True
        cost = self.prefill_per_row * min(config[0], self.cap)
        return self.explore_seconds + cost <= self.explore_share * (self.seconds + self.prefill_seconds)

    def _stale(self, config: Config) -> bool:
        r = self.rates.get(config)
        return r is None or r.samples < self.trial_steps or self.steps - r.last_step > self.recheck_steps

    def _maybe_start_trial(self, waiting: int) -> None:
        size, spec = self.kept
        kept_rate = self.rates.get(self.kept)
        if kept_rate is None or kept_rate.samples < self.trial_steps:
            return   # measure the kept configuration first
        # growing first: a larger batch that wins costs nothing, and the climb is where most
        # throughput is (the larger size also with speculation toggled: speculation may saturate
        # at a size where plain decoding still gains, which no single move reaches); then the
        # same size toggled; then half the size (the text or the machine changed)
        modes = (spec, not spec) if self.speculation else (spec,)
        candidates: list[Config] = []
        if size < self.cap and waiting >= min(2 * size, self.cap) - size:
            candidates += [(2 * size, m) for m in modes]
        candidates += [(size, m) for m in modes[1:]]
        if size > 1 and waiting:
            candidates += [(size // 2, m) for m in modes]
        if self.explore_steps + self.trial_timeout > self.budget():
            return   # a trial that loses costs at most trial_timeout steps: none fits now
        for config in candidates:
            if self._stale(config) and self._affordable(config):
                self.trial, self.trial_started, self.trial_samples = config, self.steps, 0
                self.pending_trial_steps = 0
                self.history.append((self.steps, config, "trial"))
                return

    def _judge(self) -> None:
        assert self.trial is not None
        won = self.rates[self.trial].value > self.rates[self.kept].value * (1 + self.margin)
        self._end_trial(won, "won" if won else "lost")

    def _end_trial(self, won: bool, why: str) -> None:
        assert self.trial is not None
        trial = self.trial
        self.trial = None
        if won:
            self.kept = trial
        else:
            self.explore_steps += self.pending_trial_steps
            # a lost trial counts as fresh: it is not tried again before it goes stale
            self.rates.setdefault(trial, _Rate()).last_step = self.steps
        self.pending_trial_steps = 0
        self.history.append((self.steps, self.kept, why))

    # -- what other decisions weigh (the compile decision: issue "Compiled forward")

    def planned_rows(self, prior: int = 8) -> int:
        """The batch size decoding runs at: the kept size once measured, else ``prior``."""
        r = self.rates.get(self.kept)
        return self.kept[0] if r is not None and r.samples else min(prior, self.cap)

    # -- what the job statistics record

    def summary(self) -> dict[str, object]:
        total = sum(self.seconds_by_size.values())
        return {
            "batch_size": "auto",
            "chosen": {"batch_size": self.kept[0], "speculative": self.kept[1]},
            "batch_size_seconds": {str(k): v for k, v in sorted(self.seconds_by_size.items())},
            "batch_size_share": {str(k): v / total for k, v in sorted(self.seconds_by_size.items())}
                                if total else {},
            "speculated_step_share": self.speculated_steps / self.steps if self.steps else None,
            "tokens_per_second": self.tokens / self.seconds if self.seconds else None,
            "steps": self.steps,
            "explore_steps": self.explore_steps,
        }


@dataclass
class AutopilotPolicy(MeasuredPolicy):
    """The decoder's policy (``specbatch.engine.policy.Policy``) under ``batch_size="auto"``:
    rows and speculation from the ``Autopilot``; step costs per bucket as ``MeasuredPolicy``
    (the rows' gamma controllers choose the draft length where the autopilot speculates)."""

    pilot: Autopilot = field(default_factory=Autopilot)

    def max_rows(self, waiting: int = 0) -> int:
        return max(1, self.pilot.rows_allowed(waiting))

    def gamma_cap(self, n_rows: int) -> int | None:
        if self.pilot.speculate(n_rows) is False:
            return 0
        return super().gamma_cap(n_rows)

    def observe(self, report: StepReport) -> None:
        super().observe(report)
        if report.prefill:   # a step that also cached prompts is no decode measurement
            self.pilot.observe_prefill(report.rows, report.draft_seconds + report.verify_seconds)
        else:
            self.pilot.observe(report.rows, report.drafted, report.emitted,
                               report.draft_seconds + report.verify_seconds,
                               speculating=self.pilot.speculate(report.rows) is not False)
