"""Decode lanes (engine/lanes.py): an automatic batch split over decode loops on threads of one
process decodes what one loop decodes (greedy: the target alone), each lane really on its own
thread; a lane's error, a stop, and a closed iterator end every lane; work is dealt by tokens."""

from __future__ import annotations

import copy
import dataclasses
import sys
import threading

import pytest

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.autopilot import Autopilot
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.int8 import quantize_linears
from specbatch.engine.lanes import deal
from specbatch.engine.threads import plan
from specbatch.worker.interrupt import Interrupted, StopRequest, interruptible
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_greedy_exact import target_greedy


def requests(params: dict | None = None) -> list[EngineRequest]:
    return [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n, **(params or {})))
            for p, n in zip(PROMPTS, LENGTHS)]


def lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("specbatch-lane")]


@pytest.fixture
def forward_threads(load):
    """The names of the threads the tiny target's forwards ran on."""
    names: set[str] = set()
    handle = load("llama").model.register_forward_pre_hook(lambda *_: names.add(threading.current_thread().name))
    yield names
    handle.remove()


@pytest.mark.parametrize("drafts,ngram", [(["llama-partial"], False), ([], True), ([], False)])
def test_two_lanes_decode_the_target_alone_each_on_its_own_thread(load, forward_threads, drafts, ngram):
    target = load("llama")
    engine = Engine(target, [load(d) for d in drafts] + [NGRAM] * ngram, lanes=2)
    got = dict(engine.generate_many(requests()))
    assert forward_threads == {"specbatch-lane-0", "specbatch-lane-1"}
    assert engine.lanes_used == 2 and engine.batch_report()["lanes"] == 2
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
    assert lane_threads() == []


def test_two_lanes_share_an_int8_draft_and_decode_the_target_alone(load, count_products, monkeypatch):
    """The int8 draft's shared q/k/v and gate/up products (engine/int8.py) are held per thread:
    both lanes call the same modules, each its own product per layer (every step speculates)."""
    monkeypatch.setattr(Autopilot, "speculate", lambda self, rows: True)
    target, partial = load("llama"), load("llama-partial")
    draft = dataclasses.replace(partial, model=quantize_linears(copy.deepcopy(partial.model)))
    engine = Engine(target, [draft], lanes=2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)      # the lanes' Python taken in turns often: their calls interleave
    try:
        got = dict(engine.generate_many(requests()))
    finally:
        sys.setswitchinterval(interval)
    assert engine.lanes_used == 2
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
    # a layer's products: q|k|v, o, gate|up, down (never one more for a sibling); the head: 1
    layers = partial.model.config.num_hidden_layers
    assert count_products and len(count_products) % (4 * layers + 1) == 0


def test_seeded_samples_and_stop_strings_are_the_same_in_two_lanes_as_in_one(load):
    target, draft = load("llama"), load("llama-partial")
    params = {"temperature": 0.9, "seed": 7, "n": 2, "stop": ["e t"]}
    one = dict(Engine(target, [draft], lanes=1).generate_many(requests(params)))
    two = dict(Engine(target, [draft], lanes=2).generate_many(requests(params)))
    assert {i: [o.token_ids, *(s.token_ids for s in o.siblings)] for i, o in two.items()} == \
        {i: [o.token_ids, *(s.token_ids for s in o.siblings)] for i, o in one.items()}
    assert {i: o.text for i, o in two.items()} == {i: o.text for i, o in one.items()}


def test_lanes_refill_from_the_caller_and_start_each_request_once(load, forward_threads):
    target = load("llama")
    reqs = requests()
    first, rest = reqs[:2], list(reqs[2:])
    started: list[int] = []
    asked: list[str] = []

    def more(room: int) -> list[EngineRequest]:
        asked.append(threading.current_thread().name)
        taken = rest[:room]
        del rest[:room]
        return taken

    got = dict(Engine(target, lanes=2).generate_many(first, on_start=started.extend, more=more))
    assert sorted(got) == list(range(len(reqs))) and sorted(started) == sorted(set(started)) == sorted(got)
    assert set(asked) <= {"specbatch-lane-0", "specbatch-lane-1"} and asked
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i


def test_no_callback_runs_while_the_caller_handles_an_output(load):
    """``on_start`` and ``more`` run on the lanes' threads, but never while the caller's own code
    runs between two outputs: a worker's chunk stores results and resolves its result cache's
    duplicates there, which its claims in ``more`` read and write too (worker/chunk.py)."""
    target = load("llama")
    reqs = requests()
    first, rest = reqs[:2], list(reqs[2:])
    busy, overlapped = [False], threading.Event()

    def seen() -> None:
        if busy[0]:
            overlapped.set()

    def more(room: int) -> list[EngineRequest]:
        seen()
        taken = rest[:room]
        del rest[:room]
        return taken

    got = {}
    for i, out in Engine(target, lanes=2).generate_many(first, on_start=lambda _: seen(), more=more):
        busy[0] = True
        if not got:         # the first output: the other lane decodes on, this one has room
            overlapped.wait(timeout=2)
        got[i] = out
        busy[0] = False
    assert not overlapped.is_set()
    assert sorted(got) == list(range(len(reqs)))
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i


def test_a_lane_error_is_raised_to_the_caller_and_every_lane_ends(load):
    target = load("llama")
    calls = [0]

    def fail(*_):
        if threading.current_thread().name == "specbatch-lane-1":
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("lane 1 broke")

    handle = target.model.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="lane 1 broke"):
            dict(Engine(target, lanes=2).generate_many(requests()))
    finally:
        handle.remove()
    assert lane_threads() == []


def test_a_stop_interrupts_every_lane(load):
    target = load("llama")
    engine = Engine(target, lanes=2)
    stop = StopRequest()
    with interruptible(engine, stop):
        it = engine.generate_many([EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=200))
                                   for p in PROMPTS])
        stop.event.set()
        with pytest.raises(Interrupted):
            dict(it)
    assert lane_threads() == []


def test_closing_the_iterator_stops_the_lanes(load):
    target = load("llama")
    it = Engine(target, lanes=2).generate_many(requests())
    next(it)
    it.close()
    assert lane_threads() == []


def test_one_lane_where_lanes_cannot_apply(load, forward_threads):
    target = load("llama")
    for engine, reqs in ((Engine(target, lanes=2, batch_size=4), requests()),    # a fixed batch size
                         (Engine(target, lanes=2), requests()[:1])):             # one request
        dict(engine.generate_many(reqs))
        assert engine.lanes_used == 1
    assert forward_threads == {threading.current_thread().name}


def test_deal_balances_tokens_and_keeps_groups_together():
    def req(i: int, n: int) -> tuple[int, list[int], GenerationParams]:
        return (i, [1, 2], GenerationParams(max_new_tokens=n))

    groups = [[req(0, 100)], [req(1, 60), req(2, 60)], [req(3, 50)], [req(4, 40)], [req(5, 10)]]
    parts = deal(groups, 2)
    assert sorted(i for p in parts for i, _, _ in p) == list(range(6))
    assert any({1, 2} <= {i for i, _, _ in p} for p in parts)
    loads = sorted(sum(r[2].max_new_tokens for r in p) for p in parts)
    assert loads == [160, 160]


def test_plan_divides_the_cores_among_the_lanes_asked_for(monkeypatch):
    monkeypatch.setattr("specbatch.engine.threads.usable_cores", lambda: 2)
    assert plan(None) == (2, 1)                 # the default: one loop of every core
    assert plan(None, lanes=2) == (1, 2)
    assert plan(2, lanes=2) == (2, 2) and plan(1) == (1, 1)
    assert plan(None, lanes=2, local_workers=2) == (1, 2)
    monkeypatch.setattr("specbatch.engine.threads.usable_cores", lambda: 16)
    assert plan(None, lanes=2) == (8, 2)


def test_engine_load_takes_the_lanes_the_process_configured(monkeypatch, tiny_models):
    from specbatch.engine import threads

    monkeypatch.setattr(threads, "_SET", [threads.Plan(1, 2, 1, True)])
    assert Engine.load(str(tiny_models / "llama")).lanes == 2
    monkeypatch.setattr(threads, "_SET", [])
    assert Engine.load(str(tiny_models / "llama")).lanes == 1


def test_a_target_whose_compiled_forward_failed_decodes_in_lanes_over_growing_caches(tiny_models):
    """After a compiler failure the target decodes eagerly for good (``Graphs.fail``): the engine
    schedules it as eager again (lanes) and lays its caches out as eager ones (growing in place),
    where before it kept a failed forward's single loop and concatenating caches."""
    from specbatch.engine.cache import BatchCache
    from specbatch.engine.compile.forward import install
    from specbatch.engine.hf_cache import GrowingLayer, kv_layers
    from specbatch.engine.loading import load_model

    target = load_model(str(tiny_models / "llama"))
    compiled = install(target)
    assert compiled is not None
    compiled.eager_classes = {(rows, tokens) for rows in (False, True) for tokens in (False, True)}  # nothing compiles
    engine = Engine(target, lanes=2)
    assert not engine._eager()
    compiled.fail(RuntimeError("inductor fell over"))
    assert engine._eager()
    cache = BatchCache(target, 1)
    cache.forward([[3, 4, 5]], 1)
    assert all(isinstance(layer, GrowingLayer) for layer in kv_layers(cache.cache))
    got = dict(engine.generate_many(requests()))
    assert engine.lanes_used == 2
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert got[i].token_ids == target_greedy(target, p, n), i
