"""``interruptible``: once a stop (a cancel, Ctrl-C) is set, no more model work runs, the drafts'
included. Main checked only before each target forward: between two of them a batch's drafts
prefill joining rows, catch up and propose gamma tokens each, seconds on a busy CPU at batch 16-24,
and a cancel waited all of that. Real tiny models; counted, not timed."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.loading import load_model
from specbatch.worker.interrupt import Interrupted, StopRequest, interruptible

# sampled, seeded, gamma fixed at 4: every step runs four draft forwards before the verify
PARAMS = GenerationParams(max_new_tokens=40, temperature=0.8, seed=1, gamma=4, adaptive=False, logprobs=2,
                          presence_penalty=0.5)


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:  # noqa: ANN001
    return Engine(load_model(str(tiny_models / "llama")), [load_model(str(tiny_models / "llama-partial"))],
                  batch_size=4)


def _decode(engine: Engine, stop: StopRequest) -> None:
    reqs = [EngineRequest(prompt=f"Tell a long story {i}", params=PARAMS) for i in range(4)]
    with interruptible(engine, stop), pytest.raises(Interrupted):
        for _ in engine.generate_many(reqs):
            pass


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]


def test_a_stop_set_during_drafting_runs_no_further_forward(engine: Engine) -> None:
    """The stop comes in while the draft proposes (the first draft forward ends): not one more
    forward of either model starts; main ran the other three draft forwards of the step first."""
    stop = StopRequest()
    started_after: list[str] = []
    draft, target = engine.drafts[0].model, engine.target.model
    stopper = draft.register_forward_hook(lambda *_: stop.event.set())
    with interruptible(engine, stop):
        # registered after interruptible's checks: counts only the forwards those let through
        counters = [m.register_forward_pre_hook(lambda *_, name=name: started_after.append(name)
                                                if stop() else None)
                    for name, m in (("draft", draft), ("target", target))]
        try:
            _decode(engine, stop)
        finally:
            for h in (stopper, *counters):
                h.remove()
    assert stop() and started_after == [], started_after


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_stop_set_within_a_forward_ends_it_at_the_next_layer(engine: Engine, which: str) -> None:
    """A forward can be long (a prefill of many rows' prompts): a stop set while its first
    layer runs stops it before the second; main ran every remaining layer (and main's drafts
    were never checked at all)."""
    stop = StopRequest()
    model = engine.target.model if which == "target" else engine.drafts[0].model
    layers = _layers(model)
    assert len(layers) >= 2
    stopper = layers[0].register_forward_hook(lambda *_: stop.event.set())
    ran_after: list[int] = []
    with interruptible(engine, stop):
        counters = [m.register_forward_pre_hook(lambda *_, i=i: ran_after.append(i) if stop() else None)
                    for i, m in enumerate(layers)]
        try:
            _decode(engine, stop)
        finally:
            for h in (stopper, *counters):
                h.remove()
    assert stop() and ran_after == [], ran_after

