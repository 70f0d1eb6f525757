"""The grammar wrapper (specbatch.engine.grammar) on llguidance with real tokenizers: the tiny
models' byte-level BPE (384 tokens) and, marked slow, SmolLM2's (49,152)."""

from __future__ import annotations

import json

import pytest
import torch

from specbatch.engine.grammar import GrammarSpec, Matcher, vocab_for

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tok(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models / "tok")


@pytest.fixture(scope="module")
def vocab(tok):
    return vocab_for(tok, len(tok), (tok.eos_token_id,))


def _walk_mask(m: Matcher, path: list[int]) -> torch.Tensor:
    """The mask after ``path``, by advancing and rolling back (the reference for tree_masks)."""
    n = m.allows(path)
    if n < len(path):
        return torch.ones(m.vocab.size, dtype=torch.bool)
    m.advance(path)
    out = m.mask()
    m.rollback(len(path))
    return out


@pytest.mark.parametrize("spec", [
    GrammarSpec.json_schema(PERSON), GrammarSpec.json_schema({"type": "object"}),
    GrammarSpec("regex", r"[0-9]{3}-[a-z]+"), GrammarSpec.choice(["yes", "no"]),
    GrammarSpec("grammar", 'start: "a" b\nb: "b"+'),
    GrammarSpec("grammar", 'root ::= "x" [0-9]+'),          # GBNF, as llama.cpp writes it
])
def test_good_specs_have_no_problem(spec):
    assert spec.problem() is None


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("regex", "a(b"), "unclosed group"),
    (GrammarSpec.json_schema({"type": "foo"}), "foo"),
    (GrammarSpec.json_schema({"type": "string", "if": {}}), "Unimplemented"),
    (GrammarSpec.choice([]), "at least one"),
    (GrammarSpec.choice(["a", ""]), "non-empty"),
    (GrammarSpec("grammar", "start: missing_rule"), "missing_rule"),
    (GrammarSpec("cfg", "x"), "unknown grammar kind"),
])
def test_bad_specs_say_why(spec, words):
    problem = spec.problem()
    assert problem is not None and words in problem


def test_non_strict_schema_ignores_unknown_keywords():
    assert GrammarSpec.json_schema({"type": "string", "if": {}}, strict=False).problem() is None


def test_spec_round_trips_through_a_dict():
    spec = GrammarSpec.json_schema(PERSON, strict=False)
    assert GrammarSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_regex_mask_is_exactly_the_tokens_that_fit(tok, vocab):
    m = Matcher(vocab, GrammarSpec("regex", "[0-9]{3}"))
    allowed = m.mask()
    want = torch.zeros(len(tok), dtype=torch.bool)
    for t in range(len(tok)):
        s = tok.decode([t])
        want[t] = t not in tok.all_special_ids and 0 < len(s) <= 3 and s.isdigit() and s.isascii()
    assert want.any()
    assert torch.equal(allowed, want)


def test_complete_grammar_allows_only_eos(tok, vocab):
    m = Matcher(vocab, GrammarSpec("regex", "[0-9]{3}"))
    assert m.advance(tok.encode("123"))
    assert m.stopped and m.accepting
    assert m.mask().nonzero().flatten().tolist() == [tok.eos_token_id]


def test_eos_is_allowed_only_where_the_output_may_end(tok, vocab):
    m = Matcher(vocab, GrammarSpec("regex", "[0-9]+"))
    assert not m.mask()[tok.eos_token_id]
    m.advance(tok.encode("7"))
    assert m.accepting and not m.stopped and m.mask()[tok.eos_token_id]


def test_rollback_restores_the_state(tok, vocab):
    m = Matcher(vocab, GrammarSpec.json_schema(PERSON))
    before = m.mask()
    ids = tok.encode('{"name": "Bo')
    assert m.advance(ids) and m.consumed == len(ids)
    assert not torch.equal(m.mask(), before)
    m.rollback(len(ids))
    assert m.consumed == 0 and torch.equal(m.mask(), before)
    with pytest.raises(ValueError):
        m.rollback(1)


def test_a_refused_token_is_an_error_as_data(tok, vocab):
    m = Matcher(vocab, GrammarSpec("regex", "[0-9]+"))
    assert m.error is None
    assert m.allows(tok.encode("1a")) == 1
    assert not m.advance(tok.encode("x"))
    assert m.error


def test_forced_tokens_spell_the_forced_text(tok, vocab):
    m = Matcher(vocab, GrammarSpec.json_schema(PERSON))
    m.advance(tok.encode("{"))
    forced = m.forced()
    assert forced, "after '{' the key of the first required property is forced"
    assert '"name": "'.startswith(tok.decode(forced))
    assert m.allows(forced) == len(forced)
    # a real choice: nothing forced
    assert Matcher(vocab, GrammarSpec.choice(["yes", "no"])).forced() == []


def test_tree_masks_match_each_path_walked_alone(tok, vocab):
    m = Matcher(vocab, GrammarSpec.json_schema(PERSON))
    m.advance(tok.encode('{"name": "'))
    start = m.mask()
    a, b, quote, x = (tok.encode(s)[0] for s in ("A", "B", '"', "x"))
    comma = tok.encode(", ")
    #            1  2      3  4    5  6   7 (a child of a refused token)
    tokens = [a, quote, b, quote, x, x, a]
    parents = [0, 1, 0, 3, 4, 2, 6]
    # node 5: 'x' after 'B"' is refused (a comma or '}' must follow the string)
    assert m.allows([b, quote, x]) == 2 and comma
    masks = m.tree_masks(tokens, parents)
    assert masks.shape == (8, len(tok))
    for j in range(8):
        path, node = [], j
        while node:
            path.insert(0, tokens[node - 1])
            node = parents[node - 1]
        assert torch.equal(masks[j], _walk_mask(m, path)), j
    assert masks[5].all() and masks[7].all() and not masks[4].all()   # refused, and below it
    assert m.consumed == len(tok.encode('{"name": "')) and torch.equal(m.mask(), start)


def test_tokens_past_the_tokenizer_are_never_allowed(tok):
    wide = vocab_for(tok, len(tok) + 40, (tok.eos_token_id,))
    mask = Matcher(wide, GrammarSpec.json_schema({"type": "object"})).mask()
    assert mask.shape == (len(tok) + 40,) and mask.any() and not mask[len(tok):].any()


def test_every_eos_id_may_end_the_output(tok):
    other = tok.convert_tokens_to_ids("<|im_start|>")
    v = vocab_for(tok, len(tok), (tok.eos_token_id, other))
    m = Matcher(v, GrammarSpec("regex", "a"))
    m.advance(tok.encode("a"))
    assert set(m.mask().nonzero().flatten().tolist()) == {tok.eos_token_id, other}


@pytest.mark.slow
def test_smollm2_tokenizer_walks_a_schema_output():
    from specbatch.engine.loading import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    v = vocab_for(tok, len(tok), (tok.eos_token_id,))
    m = Matcher(v, GrammarSpec.json_schema(PERSON))
    text = json.dumps({"name": "Ada Lovelace", "age": 36})
    for t in tok.encode(text, add_special_tokens=False):
        assert m.mask()[t], tok.decode([t])
        assert m.advance([t])
    assert m.stopped and m.mask().nonzero().flatten().tolist() == [tok.eos_token_id]
