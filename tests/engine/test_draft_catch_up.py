"""A draft model catching up on ragged backlogs (ModelDrafter._catch_up): in runs of similar
length, not one forward padded to the longest; the same proposals, outputs still the target's.

Speculation turning on over rows that decoded plainly feeds the draft each row's whole context
(prompt and generated tokens); so does the first proposal of a fresh batch not prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specbatch.engine import drafters
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafters import ModelDrafter
from specbatch.engine.policy import MeasuredPolicy, StepReport
from specbatch.engine.types import GenerationParams
from tests.engine.test_prefill import LENGTHS, RecordingDraft, greedy
from tests.engine.test_prefix import corpus_ids


@dataclass
class GreedyRow:
    ids: list[int]
    warp: None = None
    noise: None = None
    procs: None = None
    grammar: None = None


def test_ragged_backlogs_are_fed_in_runs_and_propose_the_same(load, monkeypatch):
    target, draft = load("llama"), load("llama-partial")
    rows = [GreedyRow(corpus_ids(target, n, skip=37 * i)) for i, n in enumerate(LENGTHS)]
    monkeypatch.setattr(drafters, "BatchCache", RecordingDraft)
    RecordingDraft.pads = []
    batch = ModelDrafter(draft, target.vocab_size)
    with torch.inference_mode():
        batch.admit(rows, prefill=False)          # the first proposal feeds every prompt
        got = batch.propose(rows, [3] * len(rows))
        # one forward padded to the longest (95) feeds 392 pads; runs of 3-6 and 80-95 tokens 36
        assert sum(RecordingDraft.pads) <= 40, RecordingDraft.pads
        for r, p in zip(rows, got):             # each row drafted alone: no pads, no neighbours
            alone = ModelDrafter(draft, target.vocab_size)
            alone.admit([r], prefill=False)
            [want] = alone.propose([r], [3])
            assert p is not None and want is not None and p.tokens == want.tokens
    assert batch.cache.n_valid.tolist() == [len(r.ids) + 2 for r in rows]   # (the last draft is not fed)


@dataclass
class PlainFirst(MeasuredPolicy):
    """Plain decoding for the first steps, then speculation: the autopilot's trial, in short."""

    plain_steps: int = 3
    steps: int = 0

    def gamma_cap(self, n_rows: int) -> int | None:
        return 0 if self.steps < self.plain_steps else super().gamma_cap(n_rows)

    def observe(self, report: StepReport) -> None:
        self.steps += not report.prefill
        super().observe(report)


def test_speculation_turned_on_late_catches_up_in_runs_and_decodes_as_the_target(load, monkeypatch):
    target = load("llama")
    prompts = [corpus_ids(target, n, skip=37 * i) for i, n in enumerate(LENGTHS)]
    monkeypatch.setattr(drafters, "BatchCache", RecordingDraft)
    RecordingDraft.pads = []
    decoder = Decoder(target, [ModelDrafter(load("llama-partial"), target.vocab_size)], PlainFirst(8))
    with torch.inference_mode():
        got = dict(decoder.run([(i, p, GenerationParams(max_new_tokens=10)) for i, p in enumerate(prompts)]))
    for i, p in enumerate(prompts):
        assert got[i].token_ids == greedy(target, p, 10), i
    assert RecordingDraft.pads, "the draft caught up and drafted"
    # (one catch-up forward padded to the longest backlog feeds ~390 pads)
    assert max(RecordingDraft.pads) <= 40, RecordingDraft.pads


def _one_block_short(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return parts[:-1]


def _one_row_extra(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([parts[0], parts[0][:1]]), *parts[1:]]


@pytest.mark.parametrize("wrong", [_one_block_short, _one_row_extra])
def test_catch_up_refuses_logits_that_do_not_match_its_runs(load, monkeypatch, wrong):
    """_catch_up joins one logits block per run, in row order: a block missing (a run fed nothing)
    or a row extra would give rows another row's logits (the extra row: silently) and the draft
    would propose from them. It says so instead."""
    target, draft = load("llama"), load("llama-partial")
    rows = [GreedyRow(corpus_ids(target, n, skip=37 * i)) for i, n in enumerate(LENGTHS)]
    real = drafters.forward_in_runs
    monkeypatch.setattr(drafters, "forward_in_runs", lambda *a: wrong(real(*a)))
    batch = ModelDrafter(draft, target.vocab_size)
    with torch.inference_mode():
        batch.admit(rows, prefill=False)          # ragged backlogs: more than one run
        with pytest.raises(AssertionError, match=r"forward_in_runs gave logits of .* rows for runs of"):
            batch.propose(rows, [3] * len(rows))
