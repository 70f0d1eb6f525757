"""Statistics are data with exact definitions (docs/statistics.md), and gamma adapts from measurements.

Exact expectations come from a *scripted* drafter that knows the target's greedy continuation
and proposes it correctly for its first ``good`` positions, then a wrong token: every step then
accepts exactly min(good, k) tokens, so every statistic can be computed by hand. The gamma
controller is tested with hand-fed costs; timing-based end-to-end checks stay loose.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.drafters import Drafter, Proposal
from specbatch.engine.gamma import CostModel, GammaController, expected_tokens
from specbatch.engine.policy import MeasuredPolicy

DESIGN_FIELDS = {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                 "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds",
                 "verify_seconds", "wall_seconds", "tokens_per_second"}
EXTRA_FIELDS = {"prompt_tokens", "new_tokens", "verify_steps", "pool_wins", "step_winners",
                "final_gamma", "speculation_disabled", "draft_steps", "accepted_at_position",
                "first_token_seconds", "batch_size_seconds", "grammar_drafted_tokens", "grammar_accepted_tokens",
                "cached_prompt_tokens", "prefill_seconds_saved"}
PROMPT = "Once upon a time there was"


def _greedy_continuation(target, prompt_ids: list[int], n: int) -> list[int]:
    """The target's argmax continuation, computed without a cache (independent of the engine)."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = target.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


class Scripted(Drafter):
    """Proposes the target's greedy tokens for its first ``good`` positions, then wrong ones."""

    def __init__(self, name: str, full: list[int], good: int, vocab: int) -> None:
        super().__init__(name)
        self.full, self.good, self.vocab = full, good, vocab

    def propose(self, rows, k):
        self.last = [self.scripted(r.ids, kb) if kb else None for r, kb in zip(rows, k)]
        return self.last

    def scripted(self, ids, k):
        right = self.full[len(ids): len(ids) + k]
        assert len(right) == k, "scripted reference too short"
        return Proposal([t if j < self.good else (t + 1) % self.vocab for j, t in enumerate(right)])


def decode_one(target, pool, prompt_ids, params):
    """One request through the decoder, alone."""
    [(_, out)] = Decoder(target, pool, MeasuredPolicy(1)).run([(0, prompt_ids, params)])
    return out


def _expected(n: int, gamma: int, goods: list[int]) -> dict:
    """Hand simulation of the loop with fixed gamma: per step k = min(gamma, remaining - 1)."""
    done, steps, drafted, accepted, winners = 0, 0, 0, 0, []
    drafted_at, accepted_at = [0] * gamma, [0] * gamma
    while done < n:
        k = min(gamma, n - done - 1)
        acc = max(min(g, k) for g in goods) if k else 0
        best = [i for i, g in enumerate(goods) if min(g, k) == acc]
        winners.append(best[0] if acc else -1)
        steps, drafted, accepted, done = steps + 1, drafted + k, accepted + acc, done + acc + 1
        for j in range(k):
            drafted_at[j] += 1
        for j in range(acc):
            accepted_at[j] += 1
    app = [a / d for a, d in zip(accepted_at, drafted_at) if d]
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "winners": winners, "app": app}


@pytest.fixture(scope="module")
def scripted_setup(load):
    target = dataclasses.replace(load("llama"), eos_token_ids=frozenset())   # never stop on EOS
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    full = prompt_ids + _greedy_continuation(target, prompt_ids, 80)
    return target, prompt_ids, full


@pytest.mark.parametrize("gamma,good,n", [(4, 2, 40), (4, 0, 17), (4, 4, 41), (1, 1, 9), (6, 3, 1),
                                          (8, 5, 64)])
def test_scripted_single_drafter_exact_stats(scripted_setup, gamma, good, n):
    target, prompt_ids, full = scripted_setup
    d = Scripted("script", full, good, target.vocab_size)
    out = decode_one(target, [d], prompt_ids, GenerationParams(max_new_tokens=n, gamma=gamma,
                                                                         adaptive=False))
    exp = _expected(n, gamma, [good])
    s = out.stats
    assert out.token_ids == full[len(prompt_ids): len(prompt_ids) + n]
    assert out.finish_reason == "length"
    assert s.new_tokens == n == s.accepted_tokens + s.verify_steps
    assert (s.verify_steps, s.drafted_tokens, s.accepted_tokens) == (exp["steps"], exp["drafted"],
                                                                     exp["accepted"])
    assert s.target_forwards == s.verify_steps
    assert s.accepted_per_position == pytest.approx(exp["app"])
    assert s.step_winners == exp["winners"]
    assert sum(s.pool_wins.values()) == sum(w >= 0 for w in s.step_winners) <= s.verify_steps
    assert s.mean_acceptance_length == pytest.approx((s.accepted_tokens + s.verify_steps) / s.verify_steps)
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0)
    assert s.final_gamma == gamma and not s.speculation_disabled


@pytest.mark.parametrize("goods", [[1, 3], [3, 1], [2, 2], [0, 0, 4]])
def test_scripted_pool_winners(scripted_setup, goods):
    target, prompt_ids, full = scripted_setup
    pool = [Scripted(f"s{i}", full, g, target.vocab_size) for i, g in enumerate(goods)]
    n, gamma = 30, 4
    out = decode_one(target, pool, prompt_ids, GenerationParams(max_new_tokens=n, gamma=gamma,
                                                                          adaptive=False))
    exp = _expected(n, gamma, goods)
    s = out.stats
    assert out.token_ids == full[len(prompt_ids): len(prompt_ids) + n]
    assert (s.verify_steps, s.accepted_tokens) == (exp["steps"], exp["accepted"])
    assert s.accepted_per_position == pytest.approx(exp["app"])
    assert len(s.step_winners) == s.verify_steps
    assert s.step_winners == exp["winners"]
    wins = {f"s{i}": exp["winners"].count(i) for i in range(len(goods)) if exp["winners"].count(i)}
    assert s.pool_wins == wins


def test_scripted_eos_inside_a_draft_cuts_the_tokens(scripted_setup):
    target, prompt_ids, full = scripted_setup
    cont = full[len(prompt_ids):]
    at = next(i for i in range(2, 8) if cont[i] not in cont[:i])
    patched = dataclasses.replace(target, eos_token_ids=frozenset({cont[at]}))
    d = Scripted("script", full, 8, target.vocab_size)
    out = decode_one(patched, [d], prompt_ids, GenerationParams(max_new_tokens=40, gamma=8,
                                                                          adaptive=False))
    s = out.stats
    assert out.finish_reason == "stop" and out.token_ids == cont[: at + 1]
    assert s.verify_steps == 1 and s.accepted_tokens == 8
    assert s.new_tokens == at + 1 < s.accepted_tokens + s.verify_steps


# --- invariants on real tiny drafters --------------------------------------------------------------

SETUPS = {"same": (["llama-same"], False), "partial": (["llama-partial"], False),
          "random": (["llama-random"], False), "ngram": ([], True),
          "pool3": (["llama-partial", "llama-random"], True)}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("adaptive", [False, True])
def test_invariants(load, setup, adaptive):
    names, ngram = SETUPS[setup]
    engine = Engine(load("llama"), [load(n) for n in names] + [NGRAM] * ngram)
    for prompt, n, stop in (("Write a haiku about", 48, ()), ("def fibonacci(n):", 33, ()),
                            ("The quick brown fox", 40, ("fox",)), ("SELECT id", 1, ())):
        out = engine.generate(prompt=prompt, params=GenerationParams(max_new_tokens=n, gamma=4,
                                                                     adaptive=adaptive, stop=stop))
        s = out.stats
        d = s.to_dict()
        assert set(d) == DESIGN_FIELDS | EXTRA_FIELDS, set(d) ^ (DESIGN_FIELDS | EXTRA_FIELDS)
        assert 0 <= s.accepted_tokens <= s.drafted_tokens
        assert s.new_tokens == len(out.token_ids) <= n
        early = out.finish_reason == "stop"
        if early:
            assert s.new_tokens <= s.accepted_tokens + s.verify_steps
        else:
            assert s.new_tokens == s.accepted_tokens + s.verify_steps == n
        assert d["mean_acceptance_length"] == pytest.approx((s.accepted_tokens + s.verify_steps) / s.verify_steps)
        assert d["acceptance_rate"] == (s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0)
        assert len(s.step_winners) == s.verify_steps == s.target_forwards
        assert sum(s.pool_wins.values()) == sum(w >= 0 for w in s.step_winners) <= s.verify_steps
        assert set(s.pool_wins) <= set(engine.drafter_names)
        assert all(-1 <= w < len(engine.drafter_names) for w in s.step_winners)
        assert all(0.0 <= a <= 1.0 for a in s.accepted_per_position)
        if s.drafted_tokens:
            assert s.accepted_per_position, "drafted tokens but no per-position figures"
        # the counts behind vLLM's spec-decode counters (fed to Prometheus by the worker)
        assert sum(s.accepted_at_position) == s.accepted_tokens
        assert len(s.accepted_at_position) == len(s.accepted_per_position)
        assert (s.accepted_at_position[:1] or [0])[0] <= s.draft_steps <= s.verify_steps
        assert (s.draft_steps > 0) == (s.drafted_tokens > 0)
        assert 0 < s.first_token_seconds <= s.wall_seconds
        assert s.wall_seconds >= s.draft_seconds + s.verify_seconds >= 0
        assert (s.draft_seconds > 0) == (s.draft_steps > 0)     # qa50: no draft time where none drafted
        assert d["tokens_per_second"] == pytest.approx(s.new_tokens / s.wall_seconds)
        if not adaptive:
            assert s.final_gamma == 4 and not s.speculation_disabled
        if setup in ("same", "partial", "random") and not adaptive:
            # one model drafter: k forwards for a k-token draft (catch-up feed + k - 1 steps)
            assert s.draft_forwards == s.drafted_tokens
        if setup == "same":
            assert s.accepted_tokens == s.drafted_tokens
            assert all(a == 1.0 for a in s.accepted_per_position)
        if setup == "ngram":
            assert s.draft_forwards == 0


def test_accepted_per_position_is_conditional_on_drafting_j(scripted_setup):
    """docs/statistics.md: accepted at j / steps that drafted j. Near the end drafts are capped by the
    remaining length, so the ratios need not be non-increasing in j even for one drafter: here
    step 1 drafts 4 and accepts 2, step 2 drafts 1 (2 tokens left) and it is rejected, step 3
    drafts nothing (1 token left)."""
    target, prompt_ids, full = scripted_setup

    class PerStep(Scripted):
        def scripted(self, ids, k):
            self.good = self.goods.pop(0)
            return super().scripted(ids, k)

    d = PerStep("script", full, 0, target.vocab_size)
    d.goods = [2, 0]
    out = decode_one(target, [d], prompt_ids, GenerationParams(max_new_tokens=5, gamma=4,
                                                                         adaptive=False))
    s = out.stats
    assert (s.verify_steps, s.drafted_tokens, s.accepted_tokens) == (3, 5, 2)
    assert s.accepted_per_position == pytest.approx([0.5, 1.0, 0.0, 0.0])
    assert s.step_winners == [0, -1, -1]


def test_no_drafters_is_plain_decoding(load):
    out = Engine(load("llama")).generate(prompt="Write a haiku about", params=GenerationParams(max_new_tokens=20))
    s = out.stats
    assert s.drafted_tokens == s.accepted_tokens == s.draft_forwards == 0
    assert s.verify_steps == s.target_forwards == s.new_tokens == len(out.token_ids)
    assert s.acceptance_rate == 0.0 and s.mean_acceptance_length == 1.0
    assert s.accepted_per_position == [] and s.pool_wins == {} and set(s.step_winners) == {-1}


# --- the gamma controller, with hand-fed costs -------------------------------------------------------

def costs(draft: float, verify: dict[int, float]) -> CostModel:
    return CostModel(draft_step=draft, verify=dict(verify))


def flat(v: float, upto: int = 14) -> dict[int, float]:
    return {n: v for n in range(1, upto)}


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert all(expected_tokens(0.7, k) < expected_tokens(0.7, k + 1) for k in range(1, 12))


def test_cost_model_ema_and_interpolation():
    c = CostModel(decay=0.5)
    assert c.verify_cost(3) is None
    c.observe_verify(2, 0.2)
    c.observe_verify(4, 0.4)
    assert c.verify_cost(2) == 0.2 and c.verify_cost(3) == pytest.approx(0.3)
    assert c.verify_cost(1) == 0.2                                 # flat below the smallest size
    assert c.verify_cost(6) == pytest.approx(0.6)                  # linear beyond the largest two
    c.observe_verify(2, 0.4)
    assert c.verify[2] == pytest.approx(0.3)                       # EMA with decay 0.5
    c.observe_draft(0.3, 3)
    assert c.draft_step == pytest.approx(0.1)
    c.observe_draft(1.0, 0)                                        # no forwards: nothing learned
    assert c.draft_step == pytest.approx(0.1)


def test_gamma_grows_with_a_cheap_draft_that_is_always_right():
    ctl = GammaController(costs(0.001, flat(0.05)), gamma=4)
    for _ in range(30):
        k = ctl.next_gamma()
        ctl.observe(k, k)
    assert ctl.gamma > 4 and ctl.gamma == ctl.max_gamma
    assert not ctl.off and not ctl.ever_off
    assert ctl.alpha > 0.95


def test_gamma_shrinks_then_switches_off_with_a_useless_draft():
    ctl = GammaController(costs(0.02, flat(0.05)), gamma=4)
    seen = []
    for _ in range(10):
        k = ctl.next_gamma()
        seen.append(k)
        ctl.observe(k, 0)
    assert ctl.off and ctl.ever_off
    assert ctl.gamma < 4
    assert seen[-1] == 0


def test_switched_off_probes_every_probe_every_steps_and_can_turn_back_on():
    ctl = GammaController(costs(0.02, flat(0.05)), gamma=4, probe_every=5)
    while not ctl.off:
        ctl.observe(ctl.next_gamma(), 0)
    ks = [ctl.next_gamma() for _ in range(10)]
    assert ks[:4] == [0] * 4 and ks[4] > 0 and ks[5:9] == [0] * 4 and ks[9] > 0
    # the text becomes predictable and drafting becomes cheap: probes turn speculation back on
    ctl.costs.draft_step = 0.0005
    for _ in range(200):
        k = ctl.next_gamma()
        ctl.observe(k, k)
        if not ctl.off:
            break
    assert not ctl.off and ctl.ever_off


def test_warmup_and_fixed_gamma():
    ctl = GammaController(costs(0.001, flat(0.05)), gamma=4, warmup_steps=3)
    ctl.observe(4, 4)
    ctl.observe(4, 4)
    assert ctl.gamma == 4                              # its own acceptance is not yet trusted
    fixed = GammaController(costs(0.02, flat(0.05)), gamma=4, fixed=True)
    for _ in range(50):
        fixed.observe(fixed.next_gamma(), 0)
    assert fixed.gamma == 4 and not fixed.off and not fixed.ever_off


# the Qwen 1.5B target's shape on hosts B/C: verifying 3 tokens costs about 1, the 4th a whole step
STEP_AT_FOUR = {n: 1.0 + 0.02 * min(n, 3) + 0.85 * max(0, n - 3) for n in range(1, 14)}


def test_a_request_on_measured_costs_starts_at_their_best_length():
    ctl = GammaController(costs(0.11, STEP_AT_FOUR), gamma=4)
    assert ctl.next_gamma() == 2                        # not 4 for the warm-up steps
    # one size measured extrapolates flat (the longest draft would look free): keep the default
    one = GammaController(costs(0.11, {5: 2.0}), gamma=4)
    assert one.next_gamma() == 4


def test_a_request_that_asked_for_gamma_0_never_drafts_on_measured_costs_either():
    ctl = GammaController(costs(0.11, STEP_AT_FOUR), gamma=0)
    assert [ctl.next_gamma() for _ in range(5)] == [0] * 5


def test_the_prior_alone_never_switches_a_request_off():
    """Costs on which speculation loses at the prior's acceptance: the request still drafts until
    its own acceptance says so (a good pair must not start plain on a pessimistic prior)."""
    ctl = GammaController(costs(0.5, flat(0.05)), gamma=4)
    assert ctl.next_gamma() > 0 and not ctl.off
    while ctl.steps < ctl.warmup_steps:
        ctl.observe(ctl.next_gamma(), 0)
    assert ctl.off and ctl.next_gamma() == 0           # its own rejections do


def test_no_cost_measurements_keep_gamma():
    ctl = GammaController(CostModel(), gamma=5)
    for _ in range(10):
        ctl.observe(ctl.next_gamma(), 0)
    assert ctl.gamma == 5 and not ctl.off


def test_expensive_verify_of_many_tokens_keeps_gamma_small():
    """A compute-bound target (verify cost grows with tokens) and alpha ~0.6: a middle gamma."""
    ctl = GammaController(costs(0.002, {n: 0.02 * n for n in range(1, 14)}), gamma=8)
    for _ in range(40):
        k = ctl.next_gamma() or 1
        ctl.observe(k, min(k, 1))
    assert ctl.gamma <= 2


# --- end to end, with frozen costs (deterministic) and with measured costs (loose) -----------------

class FrozenCosts(CostModel):
    """Hand-set costs that measurements do not move."""

    def observe_draft(self, seconds, forwards):
        pass

    def observe_verify(self, n_tokens, seconds):
        pass


def test_loop_grows_gamma_with_an_exact_draft(load):
    engine = Engine(load("llama"), [load("llama-same")])
    engine.costs[1] = FrozenCosts(draft_step=0.001, verify=flat(0.05))
    out = engine.generate(prompt="Once upon a time", params=GenerationParams(max_new_tokens=120))
    s = out.stats
    assert s.final_gamma > 4 and not s.speculation_disabled
    assert s.accepted_tokens == s.drafted_tokens
    assert s.mean_acceptance_length > 5


def test_loop_starts_a_request_at_the_length_the_engines_costs_favour(load):
    """An exact draft on a target whose 4th verified token costs a whole step: no step drafts
    more than 2, the warm-up steps included (they drafted the default 4 before)."""
    engine = Engine(load("llama"), [load("llama-same")])
    engine.costs[1] = FrozenCosts(draft_step=0.11, verify=dict(STEP_AT_FOUR))
    out = engine.generate(prompt="Once upon a time", params=GenerationParams(max_new_tokens=40))
    s = out.stats
    assert s.drafted_tokens > 0 and s.accepted_tokens == s.drafted_tokens
    assert len(s.accepted_at_position) == 2


def test_loop_switches_off_with_an_unrelated_draft(load):
    engine = Engine(load("llama"), [load("llama-random")])
    engine.costs[1] = FrozenCosts(draft_step=0.02, verify=flat(0.05))
    out = engine.generate(prompt="Once upon a time", params=GenerationParams(max_new_tokens=120))
    s = out.stats
    assert s.speculation_disabled
    assert s.drafted_tokens < 60                       # most steps were plain target steps
    assert s.step_winners.count(-1) > 0.8 * s.verify_steps


def test_measured_costs_random_draft_loose(load):
    """Timing is noisy on a shared machine: only require that the controller reacted at all (the
    switching off itself is tested on frozen costs above). A loaded CI run measured the draft's step
    cheap enough that gamma 1 kept drafting (343 tokens over 200 steps): not switching off is a
    measurement's answer there, but staying at the default 4 a step would be no reaction at all."""
    engine = Engine(load("llama"), [load("llama-random")])
    out = engine.generate(prompt="Once upon a time", params=GenerationParams(max_new_tokens=200))
    s = out.stats
    assert s.speculation_disabled or s.final_gamma < 4
    assert s.drafted_tokens < 3 * s.verify_steps


def test_a_drafter_that_proposed_nothing_charges_no_draft_seconds(load):
    """review50: the n-gram drafter ran at every step of a prompt it found no match in and
    proposed nothing: draft_steps 0 and drafted_tokens 0 beside draft seconds (docs/statistics.md:
    a step that drafted nothing has none)."""
    engine = Engine(load("llama"), [NGRAM])
    s = engine.generate(prompt="x", params=GenerationParams(max_new_tokens=3, gamma=4, adaptive=False)).stats
    assert s.verify_steps == 3 and s.draft_steps == 0 and s.drafted_tokens == 0
    assert s.draft_seconds == 0.0 and s.verify_seconds > 0
