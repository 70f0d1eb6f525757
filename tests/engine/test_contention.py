"""Torch threads that follow the cores the machine leaves (specbatch/engine/contention.py)."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams, contention, threads
from specbatch.engine.contention import FIRST_HOLD, LOW, MAX_HOLD, WINDOW, Contention, governor
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_greedy_exact import target_greedy


def scripted(full: int = 2) -> tuple[Contention, list[int]]:
    calls: list[int] = []
    return Contention(full, set_threads=calls.append), calls


def end_line(c: Contention) -> str | None:
    """The run's end line of one governor, as the engine makes it (``Engine.contention_line``)."""
    return contention.describe([c.tally()])


def run(c: Contention, steps: int, use: float) -> None:
    for _ in range(steps):
        c.observe(0.1, 0.1 * use * c.now)


def test_a_quiet_machine_keeps_every_thread_and_tries_nothing() -> None:
    c, calls = scripted()
    run(c, 1000, 0.97)
    assert c.now == 2 and calls == [] and c.history == []
    assert c.fewer == 0 and end_line(c) is None          # a quiet run says nothing at its end


def test_a_contended_run_says_at_its_end_how_much_it_ran_on_fewer_threads(caplog) -> None:
    c, _ = scripted()
    with caplog.at_level("INFO", logger="specbatch.engine.contention"):
        run(c, WINDOW, 0.6)                             # drops at the window's end
        run(c, 96 - WINDOW, 0.6)                        # held, retried, dropped again
    assert c.steps == 96 and 0 < c.fewer < 96
    assert end_line(c) == (f"other processes held this machine's cores: decoded on 1 of 2 torch threads for "
                           f"{c.fewer / 96:.0%} of 96 decode steps and prefill forwards (README 'Throughput': "
                           "a busy machine; the text is the same either way)")
    c.fewer, c.steps = 1, 300                          # one step of 300 is not "0%"
    assert "for <1% of 300 decode steps and prefill forwards" in (end_line(c) or "")
    c.history.append((300, 3))                          # (as if 4 threads: 1 and 3 used)
    c.full = 4
    assert "decoded on 1-3 of 4 torch threads" in (end_line(c) or "")
    # the first drop is said once at INFO (a worker's log), not at every retry
    said = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert said == ["other processes hold this machine's cores: decoding on 1 of 2 torch threads, "
                    "trying all again now and then"], said


def test_a_window_off_the_cores_drops_threads_then_all_are_tried_again_less_often() -> None:
    c, calls = scripted()
    run(c, WINDOW - 1, 0.65)
    assert c.now == 2                                   # one window decides, not one step
    run(c, 1, 0.65)
    assert c.now == 1 and calls == [1]
    run(c, FIRST_HOLD - 1, 1.0)
    assert c.now == 1
    run(c, 1, 1.0)
    assert c.now == 2 and calls == [1, 2]               # after the hold: all of them again
    run(c, WINDOW, 0.6)                                 # still contended: back down, twice the wait
    assert c.now == 1 and c.hold == 2 * FIRST_HOLD
    for _ in range(10):                                 # ... up to MAX_HOLD
        run(c, c.hold, 1.0)
        run(c, WINDOW, 0.6)
    assert c.hold == MAX_HOLD and c.now == 1
    run(c, c.hold, 1.0)
    run(c, WINDOW, 0.98)                                # the other process ended: they stay
    assert c.now == 2 and c.hold == FIRST_HOLD
    run(c, 500, 0.98)
    assert c.now == 2
    run(c, WINDOW, 0.6)                                 # busy again later: the first hold, not twice it
    assert c.now == 1 and c.hold == FIRST_HOLD


def test_the_threads_follow_the_share_of_cores_measured() -> None:
    c, calls = scripted(8)
    run(c, WINDOW, 0.52)                                # about 4 of 8 on their cores
    assert c.now == 4 and calls == [4]
    c, calls = scripted(8)
    run(c, WINDOW, LOW - 0.01)                          # just under: one fewer at least
    assert c.now == 6
    c, calls = scripted(8)
    c.agrees = lambda n: n == 1                         # logits on 4 threads not those on 8: one thread
    run(c, WINDOW, 0.52)
    assert c.now == 1 and calls == [1]


def test_the_governor_starts_where_its_check_found_the_cores(load, monkeypatch) -> None:
    target = load("llama")
    monkeypatch.setattr(contention, "_SAME", {})
    assert contention._same(target, 2, 1)[0]            # the tiny llama: the same bits on 1 and 2 threads
    before = torch.get_num_threads()
    try:
        # (the check's second number: how many times faster all threads ran its forwards than one)
        monkeypatch.setattr(contention, "_same", lambda model, full, n: (True, 0.31))   # a busy core
        g = governor(target, 2)
        assert g is not None and g.now == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(contention, "_same", lambda model, full, n: (True, 1.74))   # quiet
        monkeypatch.setattr(contention, "_SAME", {})
        g = governor(target, 2)                         # a quiet start puts back what an earlier one left
        assert g is not None and g.now == 2 and torch.get_num_threads() == 2
        monkeypatch.setattr(contention, "_SAME", {})
        monkeypatch.setattr(contention, "_same", lambda model, full, n: (False, 1.0))
        assert governor(target, 2) is None              # logits that differ: the threads stay
    finally:
        torch.set_num_threads(before)


def test_an_engine_governs_only_default_threads_of_one_loop(load, monkeypatch) -> None:
    target = load("llama")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "_SET", [threads.Plan(2, 1, 2, True)])
        assert Engine(target)._contention(1) is not None
        torch.set_num_threads(1)       # an earlier engine's governor left one: the next still governs 2
        assert threads.adaptable_threads() == 2 and Engine(target)._contention(1).full == 2
        assert Engine(target)._contention(2) is None                   # lanes share the process's threads
        monkeypatch.setattr(threads, "_SET", [threads.Plan(2, 1, 2, False)])       # --threads 2: the user's
        watched = Engine(target)._contention(1)           # watched, never changed
        assert watched is not None and watched.watch_only and watched.full == 2
        monkeypatch.setattr(threads, "_SET", [threads.Plan(1, 1, 1, False)])       # --threads 1: nothing waits
        assert Engine(target)._contention(1) is None
        monkeypatch.setattr(threads, "_SET", [])                       # a library caller's own threads
        assert Engine(target)._contention(1) is None
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("drafts", [["llama-partial"], []])
def test_greedy_is_the_target_alone_while_the_threads_change_every_few_steps(load, monkeypatch, drafts) -> None:
    """Whatever the thread count at each step and prefill, the tokens are the target's."""
    target = load("llama")
    seen: set[int] = set()

    class Flipping(Contention):
        def observe(self, wall: float, cpu: float) -> None:
            seen.add(torch.get_num_threads())
            self.steps += 1
            if self.steps % 3 == 0:
                self.now = 1 if self.now == 2 else 2
                self.set_threads(self.now)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = Engine(target, [load(d) for d in drafts])
        engine.contention = Flipping(2)
        reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = dict(engine.generate_many(reqs, batch_size=3))
    finally:
        torch.set_num_threads(before)
    assert seen == {1, 2} and engine.contention.steps > 6
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i


def test_the_start_up_check_times_all_threads_against_one_not_their_cpu_time(load, monkeypatch) -> None:
    """Stop 50: on a quiet Xeon `specbatch run`'s check read a CPU-time sign of 0.78-0.80 (0.99 in a
    script of its own) and every run started on one thread: 20-25% of the default job lost. What
    taken cores do is make all threads no faster than one: that is what the check reads now.
    Here the clock says all threads ran twice as fast, while CPU time says they idled."""
    target = load("llama")
    now = [0.0]

    def clock() -> float:     # each read: 0.1 s on one thread, 0.05 s on two
        now[0] += 0.1 / torch.get_num_threads()
        return now[0]

    monkeypatch.setattr(contention, "_SAME", {})
    monkeypatch.setattr(contention.time, "perf_counter", clock)
    monkeypatch.setattr(contention.time, "process_time", lambda: 0.0)
    before = torch.get_num_threads()
    try:
        agree, speedup = contention._same(target, 2, 1)
        assert agree and speedup == pytest.approx(2.0)
        g = governor(target, 2)
        assert g is not None and g.now == 2 and g.history == []
    finally:
        torch.set_num_threads(before)


def test_the_end_line_over_several_decode_processes_counts_each_ones_steps() -> None:
    """`run --processes`: one line over every forked process's governor (worker/forked.py)."""
    from specbatch.engine.contention import Tally, describe

    quiet, busy = Tally(4, 100, 0, ()), Tally(4, 300, 150, (1, 2))
    assert describe([quiet, quiet]) is None
    assert describe([quiet, busy]) == ("other processes held this machine's cores: decoded on 1-2 of 4 torch threads "
                                       "for 38% of 400 decode steps and prefill forwards, in 1 of its 2 decode "
                                       "processes (README 'Throughput': a busy machine; the text is the same "
                                       "either way)")


def test_tallies_of_one_engine_add_up_slot_by_slot() -> None:
    """Each route forks its processes again with the same engine: one slot per process at a time."""
    from specbatch.engine.contention import Tally, by_slot

    a, b = Tally(2, 10, 5, (1,)), Tally(4, 20, 0, ())
    assert by_slot([a, b], [b]) == [Tally(4, 30, 5, (1,)), b]
    assert by_slot([a], [a, b]) == [Tally(2, 20, 10, (1,)), b]
    assert by_slot([], [a]) == [a] and by_slot([a], []) == [a] and by_slot() == []


def test_the_governor_reads_each_prefill_forward_not_the_admission_as_one(load, monkeypatch) -> None:
    """A fresh batch's prompts are cached in a few forwards of seconds each (one per run of
    similar lengths, engine/prefill.py). Read as one observation, a 32-row admission gave the
    governor no window to see another process take a core in (stop 52: 13.4 s against 4.5 s for
    one pass's admissions, its steps unchanged). Each forward is one observation now."""
    import specbatch.engine.decoder as decoder

    target = load("llama")
    observed, forwards, steps = [0], [0], [0]

    class Counting(Contention):
        def observe(self, wall: float, cpu: float) -> None:
            observed[0] += 1

    real_prefilled, real_step = decoder.prefilled, decoder.Decoder._step

    def prefilled(*args, **kwargs):   # noqa: ANN002, ANN003, ANN202
        cache, n = real_prefilled(*args, **kwargs)
        forwards[0] += n
        return cache, n

    def step(self):   # noqa: ANN001, ANN202
        steps[0] += 1
        return real_step(self)

    monkeypatch.setattr(decoder, "prefilled", prefilled)
    monkeypatch.setattr(decoder.Decoder, "_step", step)
    engine = Engine(target)
    engine.contention = Counting(1)
    prompts = ["Hi", "The quick brown fox " * 12, "Once upon a time " * 25, "A"]   # lengths far apart: several runs
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=4)) for p in prompts]
    got = dict(engine.generate_many(reqs, batch_size=2))
    assert len(got) == 4 and forwards[0] >= 3
    assert observed[0] == steps[0] + forwards[0], (observed, steps, forwards)


def test_a_prefill_no_governor_reads_reads_no_clock(load, monkeypatch) -> None:
    """Two clock reads a forward were taken for a governor that was not there (tidy53)."""
    import types

    import specbatch.engine.prefill as prefill

    def clock() -> float:
        raise AssertionError("a clock read with no governor")

    monkeypatch.setattr(prefill, "time", types.SimpleNamespace(perf_counter=clock, process_time=clock))
    engine = Engine(load("llama"))
    engine.contention = None
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=2)) for p in ("Hi", "Once upon " * 9)]
    assert len(dict(engine.generate_many(reqs, batch_size=2))) == 2


def test_threads_the_user_fixed_are_watched_never_changed_and_a_slowed_run_is_told() -> None:
    """--threads 2 on a busy machine: every operator waits for a thread off its core, and the run
    said nothing of it (stop 51's leftover). The watching governor changes no thread count and
    tells at the end what leaving --threads unset would do; a few noisy windows tell nothing."""
    from specbatch.engine.contention import TOLD_TAKEN, describe, watching

    g = watching(2)
    calls: list[int] = []
    g.set_threads = calls.append
    for _ in range(10 * WINDOW):
        g.observe(0.1, 0.1 * 0.6 * 2)       # one of two threads off its core
    for _ in range(10 * WINDOW):
        g.observe(0.1, 0.1 * 1.0 * 2)       # quiet
    assert calls == [] and g.now == 2 and g.fewer == 0 and g.taken == 10 * WINDOW
    line = describe([g.tally()])
    assert line is not None and line.startswith("other processes held this machine's cores for 50% of 80 decode "
                                                "steps and prefill forwards: every operator waited for the 2 "
                                                "torch threads --threads fixed")
    quiet = watching(2)
    for i in range(40 * WINDOW):
        quiet.observe(0.1, 0.1 * (0.6 if i < WINDOW else 1.0) * 2)   # one slow window in 40
    assert quiet.taken / quiet.steps < TOLD_TAKEN and describe([quiet.tally()]) is None


def test_threads_fixed_past_the_cores_are_read_against_the_cores_not_blamed_on_other_processes(monkeypatch) -> None:
    """--threads 4 on 2 cores: the process's CPU time is at most 2 x its wall time, 0.5 of 4
    threads' with no other process running, and every run was told other processes held the cores.
    The watching governor reads the sign against the cores it may use; taken cores still tell."""
    from specbatch.engine.contention import describe, watching

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    quiet, busy = watching(4), watching(4)
    for _ in range(10 * WINDOW):
        quiet.observe(0.1, 0.1 * 2)         # both cores all the time, 4 threads on them
        busy.observe(0.1, 0.1 * 0.6 * 2)    # another process holds part of them
    assert quiet.taken == 0 and describe([quiet.tally()]) is None
    assert busy.taken == 10 * WINDOW and "waited for the 4 torch threads --threads fixed" in describe([busy.tally()])


def test_a_decode_on_fixed_threads_beside_taken_cores_keeps_them_and_says_so_at_its_end(load, monkeypatch) -> None:
    """The engine end to end: --threads 2 and a CPU-time sign of taken cores at every step (the
    process's CPU clock stands still): the thread count never moves, the tokens are the target's,
    and the run's end line says what leaving --threads unset would do."""
    import time as time_module

    target = load("llama")
    counts: set[int] = set()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "_SET", [threads.Plan(2, 1, 2, False)])
        monkeypatch.setattr(time_module, "process_time", lambda: 0.0)
        engine = Engine(target)
        real = engine._contention

        def contention(lanes: int):   # noqa: ANN202
            c = real(lanes)
            counts.add(torch.get_num_threads())
            return c

        monkeypatch.setattr(engine, "_contention", contention)
        reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = dict(engine.generate_many(reqs, batch_size=3))
        counts.add(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert counts == {2} and engine.contention is not None and engine.contention.watch_only
    line = engine.contention_line()
    assert line is not None and "--threads fixed" in line, line
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
