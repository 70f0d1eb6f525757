"""Prompts prefilled in runs of similar length (engine/prefill.py): few pads, outputs unchanged.

The cut minimizes padded positions plus a cost per forward; a ragged batch (short and long
prompts, fresh and joining mid-batch, the target's and a draft model's caches) feeds almost no pad
positions, and every row still equals the target's own greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import drafters
from specbatch.engine.autopilot import Autopilot, AutopilotPolicy
from specbatch.engine.backend import PrefixKV
from specbatch.engine.cache import BatchCache
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafters import ModelDrafter
from specbatch.engine.policy import MeasuredPolicy
from specbatch.engine.prefill import feed_lengths, length_runs
from specbatch.engine.types import GenerationParams
from tests.engine.test_prefix import corpus_ids


def test_equal_lengths_are_one_run():
    assert length_runs([7] * 12) == [12]
    assert length_runs([]) == []


def test_short_and_long_prompts_are_cut_apart():
    assert length_runs([10] * 16 + [100] * 16, overhead=32) == [16, 16]
    assert length_runs([5, 100], overhead=32) == [1, 1]


def test_a_cut_that_saves_less_than_a_forward_is_not_made():
    # (splitting off the 3-token row saves 8 - 3 = 5 padded positions, a forward costs 32)
    assert length_runs([3, 8, 8], overhead=32) == [3]
    assert length_runs([3, 8, 8], overhead=4) == [1, 2]


def test_a_row_feeds_its_ids_less_its_prefix_and_its_last_token():
    prefix = PrefixKV(n_tokens=4, nbytes=0, data=None)
    assert feed_lengths([[1] * 10, [1] * 10, [1]], [None, prefix, None]) == [9, 5, 0]


def test_the_cut_is_the_cheapest():
    lengths = [2, 3, 9, 10, 11, 30, 31, 60]
    runs = length_runs(lengths, overhead=6)

    def cost(sizes: list[int]) -> int:
        out, start = 0, 0
        for n in sizes:
            out += n * max(lengths[start: start + n]) + 6
            start += n
        return out

    every = [[1] * 8]                       # each composition of 8 into runs
    for mask in range(1 << 7):
        sizes, n = [], 1
        for i in range(7):
            if mask >> i & 1:
                sizes.append(n)
                n = 1
            else:
                n += 1
        every.append([*sizes, n])
    assert cost(runs) == min(cost(s) for s in every)


class Recording(BatchCache):
    """A cache recording the pad positions of every forward."""

    pads: list[int] = []

    def forward(self, feeds, logits_to_keep, parents=None, *, hidden=False):
        width = max(len(f) for f in feeds)
        type(self).pads.append(sum(width - len(f) for f in feeds))
        return super().forward(feeds, logits_to_keep, parents, hidden=hidden)


class RecordingDraft(Recording):
    pads: list[int] = []


# short and long prompts alternating; at 4 rows the first four finish together and the last four,
# as ragged, join the running batch at once
LENGTHS = [4, 90, 6, 80, 5, 95, 3, 85]
NEW = [6, 6, 6, 6, 3, 3, 3, 3]


def greedy(target, p: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(p):].tolist()


@pytest.mark.parametrize("batch", [8, 4])
def test_a_ragged_batch_feeds_few_pads_and_decodes_as_the_target(load, batch):
    """8 rows: one fresh admission of every prompt; 4 rows: four more join the running batch."""
    target = load("llama")
    prompts = [corpus_ids(target, n, skip=37 * i) for i, n in enumerate(LENGTHS)]
    Recording.pads = []
    decoder = Decoder(target, [], MeasuredPolicy(batch, {}), backend=lambda n: Recording(target, n))
    with torch.inference_mode():
        got = dict(decoder.run([(i, p, GenerationParams(max_new_tokens=n, adaptive=False))
                                for i, (p, n) in enumerate(zip(prompts, NEW))]))
    for i, (p, n) in enumerate(zip(prompts, NEW)):
        assert got[i].token_ids == greedy(target, p, n), i
    # one forward padded to the longest feeds ~85 pads for each short row; the long run (79-94
    # tokens, not worth a second forward) 30
    assert max(Recording.pads) <= 40, Recording.pads


def test_a_draft_model_prefills_in_runs_too(load, monkeypatch):
    target = load("llama")
    prompts = [corpus_ids(target, n, skip=37 * i) for i, n in enumerate(LENGTHS)]
    monkeypatch.setattr(drafters, "BatchCache", RecordingDraft)
    RecordingDraft.pads = []
    decoder = Decoder(target, [ModelDrafter(load("llama-partial"), target.vocab_size)], MeasuredPolicy(4, {}))
    with torch.inference_mode():
        got = dict(decoder.run([(i, p, GenerationParams(max_new_tokens=n, gamma=3, adaptive=False))
                                for i, (p, n) in enumerate(zip(prompts, NEW))]))
    for i, (p, n) in enumerate(zip(prompts, NEW)):
        assert got[i].token_ids == greedy(target, p, n), i
    # (a proposal's catch-up feeds up to gamma + 1 tokens a row: a few pads)
    assert max(RecordingDraft.pads) <= 40, RecordingDraft.pads


def test_a_fresh_batch_prefilled_at_admission_still_tells_the_autopilot_its_cost(load):
    """Where its first step no longer caches the prompts (they came in runs), the admission
    reports the prefill: the autopilot prices a speculation trial's draft catch-up from it (unpriced,
    it started one at once on the default job). A guard for the seam moved, so it passes on main."""
    target = load("llama")
    prompts = [corpus_ids(target, n, skip=37 * i) for i, n in enumerate(LENGTHS)]
    pilot = Autopilot(speculation=False)
    decoder = Decoder(target, [], AutopilotPolicy(limit=8, pilot=pilot))
    with torch.inference_mode():
        dict(decoder.run([(i, p, GenerationParams(max_new_tokens=2)) for i, p in enumerate(prompts)]))
    assert pilot.prefill_per_row is not None and pilot.prefill_seconds > 0
