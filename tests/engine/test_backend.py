"""The target-backend seam (engine/backend.py): the decode loop runs over any backend.

A toy backend that shares no code with ``BatchCache`` (a second-order Markov chain over 16 tokens,
kept as plain per-row token lists) drives the real ``Decoder`` with the real drafters, trees,
verifiers and batching; its output must equal the toy target's own greedy decoding. Then the HF
backend's hidden states on request, as a drafter that declares ``needs_target_hidden`` gets them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specbatch.engine.backend import PrefixKV, TargetBackend
from specbatch.engine.decoder import Decoder
from specbatch.engine.drafters import Drafter, NgramDrafter, Proposal
from specbatch.engine.loading import LoadedModel
from specbatch.engine.policy import MeasuredPolicy
from specbatch.engine.prefix import PrefixStore
from specbatch.engine.types import GenerationParams

V = 16
TABLE = torch.randn(V, V, V, generator=torch.Generator().manual_seed(7)) * 3


def toy_logits(context: Sequence[int]) -> torch.Tensor:
    """The toy target: next-token logits from the last two tokens."""
    a = context[-2] if len(context) > 1 else context[-1]
    return TABLE[a, context[-1]]


def toy_greedy(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(toy_logits(ids).argmax()))
    return ids[len(prompt):]


class ToyBackend:
    """Per row: a list of [token, valid] entries; scores each fed token from its row's valid
    tokens and its ancestors in the feed."""

    def __init__(self, n_rows: int) -> None:
        self.entries: list[list[list[int]]] = [[] for _ in range(n_rows)]
        self.starts: list[int] = [0] * n_rows      # first entry of each row's last feed
        self.last_hidden: torch.Tensor | None = None
        self.forwards = 0
        self.feeds: list[list[int]] = []

    @property
    def n_rows(self) -> int:
        return len(self.entries)

    @property
    def n_valid(self) -> torch.Tensor:  # type: ignore[override]
        return torch.tensor([sum(v for _, v in e) for e in self.entries], dtype=torch.long)

    def forward(self, feeds, logits_to_keep, parents=None, *, hidden=False):
        self.forwards += 1
        self.feeds += [list(f) for f in feeds]
        out = torch.zeros(len(feeds), logits_to_keep, V)
        for b, feed in enumerate(feeds):
            valid = [t for t, v in self.entries[b] if v]
            par = parents[b] if parents is not None else [i - 1 for i in range(len(feed))]
            scores = []
            for i in range(len(feed)):
                chain, j = [], i
                while j >= 0:
                    chain.append(feed[j])
                    j = par[j]
                scores.append(toy_logits(valid + chain[::-1]))
            kept = scores[-logits_to_keep:]
            for c, s in enumerate(kept):
                out[b, logits_to_keep - len(kept) + c] = s
            self.starts[b] = len(self.entries[b])
            self.entries[b] += [[t, 1] for t in feed]
        return out

    def reject(self, rejected):
        for b, idx in enumerate(rejected):
            for i in idx:
                self.entries[b][self.starts[b] + i][1] = 0

    def drop_tail(self, n_drop):
        for b, n in enumerate(n_drop):
            for e in reversed(self.entries[b]):
                if n and e[1]:
                    e[1], n = 0, n - 1

    def select(self, rows):
        self.entries = [self.entries[i] for i in rows]
        self.starts = [self.starts[i] for i in rows]

    def fork(self, rows):
        self.entries = [[list(e) for e in self.entries[i]] for i in rows]
        self.starts = [self.starts[i] for i in rows]

    def extend(self, other):
        assert isinstance(other, ToyBackend)
        self.entries += other.entries
        self.starts += other.starts

    def export_prefix(self):
        tokens = [t for t, v in self.entries[0] if v]
        return PrefixKV(len(tokens), 8 * len(tokens), tokens)

    def load_prefix(self, kv):
        self.entries = [[[t, 1] for t in kv.data] for _ in self.entries]


class NoisyOracle(Drafter):
    """Proposes the toy target's own greedy continuation with every third token wrong."""

    def __init__(self) -> None:
        super().__init__("oracle")

    def propose(self, rows, k):
        self.last = []
        for r, kb in zip(rows, k):
            toks = toy_greedy(r.ids, kb)
            toks = [(t + 1) % V if (len(r.ids) + i) % 3 == 0 else t for i, t in enumerate(toks)]
            self.last.append(Proposal(toks) if toks else None)
        return list(self.last)


@pytest.fixture
def toy_target(load) -> LoadedModel:
    # the decoder reads only the tokenizer, stop ids and device of the target it is given
    tiny = load("llama")
    return LoadedModel("toy", None, tiny.tokenizer, torch.device("cpu"), frozenset(), None)


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 5, 6], [10, 11], [3, 3, 3, 3], [12, 13, 14]]


@pytest.mark.parametrize("pool", ["none", "ngram", "oracle", "pool"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decoder_over_a_second_backend_matches_the_toy_target(toy_target, pool, batch):
    drafters: list[Drafter] = {"none": [], "ngram": [NgramDrafter()], "oracle": [NoisyOracle()],
                               "pool": [NoisyOracle(), NgramDrafter()]}[pool]
    made: list[ToyBackend] = []

    def factory(n: int) -> TargetBackend:
        made.append(ToyBackend(n))
        return made[-1]

    decoder = Decoder(toy_target, drafters, MeasuredPolicy(batch, {}), default_gamma=4, backend=factory)
    params = GenerationParams(max_new_tokens=20, gamma=4, adaptive=False)
    with torch.inference_mode():
        out = dict(decoder.run([(i, list(p), params) for i, p in enumerate(PROMPTS)]))
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        assert out[i].token_ids == toy_greedy(p, 20), (pool, batch, i)
    assert sum(b.forwards for b in made) > 0          # the toy backend did the scoring
    if pool != "none":
        assert sum(o.stats.accepted_tokens for o in out.values()) > 0


@pytest.mark.parametrize("batch", [2, 8])
def test_forked_rows_over_a_second_backend(toy_target, batch):
    """Samples of one request (rows 0-3 fork from row 0, rows 5-6 from row 5): one prefill each
    group, forked by the backend, and every row still the toy target's greedy text."""
    made: list[ToyBackend] = []

    def factory(n: int) -> TargetBackend:
        made.append(ToyBackend(n))
        return made[-1]

    decoder = Decoder(toy_target, [NoisyOracle()], MeasuredPolicy(batch, {}), default_gamma=3, backend=factory)
    params = GenerationParams(max_new_tokens=12, gamma=3, adaptive=False)
    prompts = [PROMPTS[2]] * 4 + [PROMPTS[0]] + [PROMPTS[5]] * 2
    forks = {0: 0, 1: 0, 2: 0, 3: 0, 5: 5, 6: 5}
    with torch.inference_mode():
        out = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)], forks=forks))
    for i, p in enumerate(prompts):
        assert out[i].token_ids == toy_greedy(p, 12), (batch, i)
    if batch == 8:   # all joined at once: three distinct prompts prefilled in one forward (lengths
        # close enough for one run, engine/prefill.py), then forked; made[0] is the batch's backend
        assert sum(len(m.feeds) for m in made[1:]) == 3 and sum(m.forwards for m in made[1:]) == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_shared_prompt_prefixes_load_through_the_seam(toy_target, batch):
    made: list[ToyBackend] = []

    def factory(n: int) -> TargetBackend:
        made.append(ToyBackend(n))
        return made[-1]

    shared = [(3 * i) % V for i in range(20)]
    prompts = [shared + [1, 2], shared + [5], [4, 4, 4], shared + [7, 8, 9], shared[:18] + [0]]
    decoder = Decoder(toy_target, [NoisyOracle(), NgramDrafter()], MeasuredPolicy(batch, {}),
                      default_gamma=3, backend=factory, prefixes=PrefixStore(10**6))
    params = GenerationParams(max_new_tokens=12, gamma=3, adaptive=False)
    with torch.inference_mode():
        out = dict(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)]))
    for i, p in enumerate(prompts):
        assert out[i].token_ids == toy_greedy(p, 12), (batch, i)
    # four prompts share 18 tokens, three of them 20: the 18 serve more (the first computes them)
    assert [out[i].stats.cached_prompt_tokens for i in range(len(prompts))] == [0, 18, 0, 18, 18]
    # the prefix was fed once (computed alone), not once per row that starts with it
    assert sum(f[:18] == shared[:18] for b in made for f in b.feeds) == 1


class HiddenProbe(NgramDrafter):
    needs_target_hidden = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[list[int], list[int], torch.Tensor]] = []

    def observe(self, rows, accepted, hidden=None):
        assert hidden is not None
        for r, acc, h in zip(rows, accepted, hidden):
            # r.ids does not hold this step's tokens yet: the states that chose them follow it
            self.seen.append((list(r.ids), list(acc), h.clone()))
        super().observe(rows, accepted, hidden)


def test_a_drafter_that_needs_hidden_states_gets_the_targets_on_the_accepted_path(load):
    target = load("llama")
    probe = HiddenProbe()
    decoder = Decoder(target, [probe], MeasuredPolicy(2, {}), default_gamma=3)
    prompts = [target.tokenizer(p).input_ids for p in ["the fox the fox the fox", "for i in range(10):"]]
    params = GenerationParams(max_new_tokens=12, gamma=3, adaptive=False)
    with torch.inference_mode():
        list(decoder.run([(i, list(p), params) for i, p in enumerate(prompts)]))
    assert probe.seen, "the n-gram probe drafted at least once"
    with torch.inference_mode():
        for before, acc, h in probe.seen:
            full = torch.tensor([before + acc[:-1]])
            ref = target.model(input_ids=full, output_hidden_states=True).hidden_states[-1][0]
            assert h.shape == (len(acc), ref.shape[-1])
            # position len(before) - 1 + i chose acc[i]
            torch.testing.assert_close(h, ref[len(before) - 1:], atol=1e-4, rtol=1e-4)


def test_no_hidden_states_are_kept_unless_a_drafter_asks(load):
    target = load("llama")
    decoder = Decoder(target, [NgramDrafter()], MeasuredPolicy(1, {}), default_gamma=3)
    with torch.inference_mode():
        list(decoder.run([(0, target.tokenizer("the fox the fox").input_ids, GenerationParams(max_new_tokens=4))]))
    assert decoder.cache.last_hidden is None
