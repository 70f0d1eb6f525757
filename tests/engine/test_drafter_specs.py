"""Drafters as values: one parser, one registry; a new kind is one registry entry and its module."""

from __future__ import annotations

import hashlib

import pytest

from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.drafter_specs import (
    KINDS,
    NGRAM,
    DrafterSpec,
    Kind,
    parse_drafters,
    pool_fields,
)
from specbatch.engine.drafters import Drafter, NgramDrafter, Proposal
from specbatch.errors import ModelLoadError
from specbatch.worker.queues import queue_name
from tests.engine.test_batch import LENGTHS, PROMPTS
from tests.engine.test_greedy_exact import target_greedy


@pytest.mark.parametrize(("text", "kind", "arg"), [
    ("ngram", "ngram", ""),
    (" ngram ", "ngram", ""),
    ("model:smollm2-135m-int8", "model", "smollm2-135m-int8"),
    ("smollm2-135m-int8", "model", "smollm2-135m-int8"),       # a bare name means model:
    ("/abs/dir", "model", "/abs/dir"),
    ("org/name", "model", "org/name"),
    ("model:ngram", "model", "ngram"),                           # a model directory named ngram
    ("C:\\models\\d", "model", "C:\\models\\d"),                 # not a kind before the colon
])
def test_parse_and_round_trip(text, kind, arg):
    spec = DrafterSpec.parse(text)
    assert (spec.kind, spec.arg) == (kind, arg)
    assert DrafterSpec.parse(str(spec)) == spec


def test_a_model_keeps_its_bare_name_as_before_specs():
    """What the database and queue names held before specs: the model's name, as given."""
    assert str(DrafterSpec.parse("model:d1")) == "d1" and str(NGRAM) == "ngram"


@pytest.mark.parametrize(("text", "says"), [
    ("eagle:/heads", "not available yet"),
    ("suffix", "not available yet"),
    ("grammar", "already draft the tokens their grammar forces"),
    ("model:", "model takes a model name"),
    ("model", "model takes a model name"),
    ("ngram:3", "ngram takes no argument"),
    ("ngram,smollm2-135m-int8", r"for a pool give each its own \(--draft ngram --draft smollm2-135m-int8\)"),
])
def test_unavailable_or_malformed_specs_are_refused_by_name(text, says):
    with pytest.raises(ModelLoadError, match=says) as e:
        DrafterSpec.parse(text)
    assert repr(text) in str(e.value)


def test_a_pool_normalizes_to_one_tuple():
    a = parse_drafters(["ngram", "d1", "d2", "d1"])
    assert a == parse_drafters(["d1", "d2", "ngram"]) == (DrafterSpec("model", "d1"), DrafterSpec("model", "d2"), NGRAM)
    assert parse_drafters(["d2", "d1"]) != parse_drafters(["d1", "d2"])     # a pool's order is its own
    assert pool_fields(["d1", "ngram"]) == {"drafts": ["d1"], "ngram": True, "drafters": ["d1", "ngram"]}


def test_queue_names_are_those_of_the_pair_and_flag(tmp_path):
    """A pool hashes as drafts + the ngram flag did (specbatch.worker.queues before specs), so jobs
    queued before an upgrade still reach workers started after it; --draft ngram and --ngram agree."""
    (tmp_path / "t").mkdir()
    target = str(tmp_path / "t")
    old = hashlib.sha256("\0".join([target, "d1", "ngram"]).encode()).hexdigest()[:10]
    assert queue_name(target, ["d1", "ngram"]) == f"specbatch.t+d1+ngram.{old}"
    assert queue_name(target, ["ngram", "d1"]) == queue_name(target, [DrafterSpec.parse("d1"), NGRAM])
    plain = hashlib.sha256("\0".join([target, "d1"]).encode()).hexdigest()[:10]
    assert queue_name(target + "/", ["model:d1"]) == f"specbatch.t+d1.{plain}"


class Echo(Drafter):
    """A new kind, as a contributor would add one: proposes the last token again."""

    def __init__(self, n: int) -> None:
        super().__init__(f"echo:{n}")
        self.n = n

    def propose(self, rows, k):
        self.last = [Proposal([r.ids[-1]] * min(self.n, kb)) if kb else None for r, kb in zip(rows, k)]
        return list(self.last)


def test_a_new_kind_is_one_registry_entry(monkeypatch, load):
    """Registered in KINDS alone, a kind parses, builds into the engine's pool beside the others,
    names itself in the results, and decoding stays the target's own greedy text."""
    monkeypatch.setitem(KINDS, "echo", Kind(lambda spec, draft, vocab: Echo(int(spec.arg)), argument="a length"))
    target = load("llama")
    engine = Engine(target, [load("llama-partial"), DrafterSpec.parse("echo:2"), NGRAM])
    pool = engine.new_drafters()
    assert [type(d).__name__ for d in pool] == ["ModelDrafter", "Echo", "NgramDrafter"]
    assert engine.drafter_names == [load("llama-partial").name, "echo:2", "ngram"]
    reqs = [EngineRequest(prompt=p, params=GenerationParams(max_new_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
    for i, out in engine.generate_many(reqs, batch_size=3):
        assert out.token_ids == target_greedy(target, PROMPTS[i], LENGTHS[i]), i


def test_new_drafters_are_fresh_per_decode(load):
    engine = Engine(load("llama"), [NGRAM])
    a, b = engine.new_drafters(), engine.new_drafters()
    assert isinstance(a[0], NgramDrafter) and a[0] is not b[0] and engine.speculates


def test_an_unloaded_model_spec_is_refused(load):
    with pytest.raises(ValueError, match="load a model"):
        Engine(load("llama"), [DrafterSpec.parse("llama-partial")])
