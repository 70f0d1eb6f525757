"""Timing device work (engine/clock.py): every measured interval ends after the device's queued
work, so on CUDA the autopilot, gamma and compile's auto decision see what a forward costs, not
what launching it costs. CPU-runnable: ``torch.cuda.synchronize`` and the clock's wait are
replaced by recorders."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams, clock
from specbatch.engine.compile.warmup import time_steps
from specbatch.engine.drafter_specs import NGRAM
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_policy import Recording


def test_synchronize_waits_for_cuda_only(monkeypatch):
    seen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", seen.append)
    clock.synchronize("cpu")
    clock.synchronize(torch.device("cpu"))
    assert seen == []
    clock.synchronize("cuda:1")
    clock.now(torch.device("cuda", 0))
    assert seen == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_compile_timings_wait_for_the_device(monkeypatch):
    """``time_steps`` (compiled against eager, frozen against not: what auto compiles by) waits for
    the device before and after each step: CUDA graphs launch in microseconds, eager kernels in
    milliseconds, and unsynchronized the ratio was of launches."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev: events.append("sync"))

    class Cache:
        def crop(self, n: int) -> None:
            events.append("crop")

    time_steps({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, Cache(), 1, 2,
               torch.device("cuda"))
    assert events == ["sync", "a", "sync", "crop", "sync", "b", "sync", "crop"] * 2


def _events(model: torch.nn.Module, log: list[str]):
    return model.register_forward_hook(lambda *_: log.append("forward"))


@pytest.mark.parametrize("drafts", ["llama-partial", "ngram"])
def test_every_measured_step_ends_after_its_forwards(load, monkeypatch, drafts):
    """What the policy is told a step or a prefill cost is read after the device finished its
    forwards: between a report and the last forward before it the clock waited."""
    log: list[str] = []
    monkeypatch.setattr(clock, "synchronize", lambda dev: log.append("sync"))
    target = load("llama")
    pool = [load(drafts)] if drafts != "ngram" else [NGRAM]

    class Logged(Recording):
        def observe(self, report):
            log.append("observe")
            super().observe(report)

    engine = Engine(target, pool)
    policy = Logged(limit=2, cap=None)
    hooks = [_events(target.model, log)] + [_events(d.model, log) for d in pool if d is not NGRAM]
    try:
        reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
        assert all(not isinstance(o, Exception) for _, o in engine.generate_many(reqs, policy=policy))
    finally:
        for h in hooks:
            h.remove()
    assert log.count("observe") >= 3
    for i, e in enumerate(log):
        if e == "observe":
            before = [x for x in log[:i] if x in ("forward", "sync")]
            assert before[-1] == "sync", f"event {i}: read before the device finished: {log[max(0, i - 6):i + 1]}"
    # each interval starts with a wait too: the first forward of the run comes after one
    assert log.index("sync") < log.index("forward")
