"""Structured outputs at intake (specbatch.jobs.structured): OpenAI's response_format and the
structured_outputs extension become params["structured"]; bad ones are refused per line with
FILE:LINE and the field, nothing written."""

from __future__ import annotations

import io
import json

import pytest

from specbatch.config import Settings
from specbatch.engine.grammar_spec import GrammarSpec
from specbatch.errors import IntakeError
from specbatch.jobs import intake

SETTINGS = Settings(database_url="sqlite://")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def line(body: dict, url: str = CHAT, cid: str = "r1") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def chat(**fields) -> str:
    return line({"model": "m", "messages": MSGS, **fields})


def read(*lines: str) -> intake.ParsedFile:
    data = ("\n".join(lines) + "\n").encode()
    return intake.read_stream(io.BytesIO(data), "batch.jsonl", {}, SETTINGS)


def refused(*lines: str) -> list[str]:
    with pytest.raises(IntakeError) as e:
        read(*lines)
    return [str(x) for x in e.value.errors]


def spec_of(text: str) -> GrammarSpec | None:
    req = read(text).requests[0]
    return req.generation_params().structured


@pytest.mark.parametrize("text, want", [
    (chat(response_format={"type": "json_object"}), GrammarSpec.json_schema({"type": "object"})),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                  "strict": True}}),
     GrammarSpec.json_schema(PERSON)),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                  "strict": False}}),
     GrammarSpec.json_schema(PERSON, strict=False)),
    (chat(structured_outputs={"json": PERSON}), GrammarSpec.json_schema(PERSON)),
    (chat(structured_outputs={"json": json.dumps(PERSON)}), GrammarSpec.json_schema(PERSON)),
    (chat(structured_outputs={"regex": "[0-9]{3}"}), GrammarSpec("regex", "[0-9]{3}")),
    (chat(structured_outputs={"choice": ["yes", "no"]}), GrammarSpec.choice(["yes", "no"])),
    (chat(structured_outputs={"grammar": 'start: "a"+'}), GrammarSpec("grammar", 'start: "a"+')),
    (chat(structured_outputs={"json_object": True}), GrammarSpec.json_schema({"type": "object"})),
    (line({"model": "m", "prompt": "Hi", "structured_outputs": {"choice": ["a", "b"]}}, COMPLETIONS),
     GrammarSpec.choice(["a", "b"])),
    (json.dumps({"prompt": "Hi", "response_format": {"type": "json_object"}}),
     GrammarSpec.json_schema({"type": "object"})),
    (json.dumps({"prompt": "Hi", "structured_outputs": {"regex": "x+"}}), GrammarSpec("regex", "x+")),
    (chat(response_format={"type": "text"}), None),
    (chat(guided_json=PERSON), GrammarSpec.json_schema(PERSON)),
    (chat(guided_regex="[0-9]{3}"), GrammarSpec("regex", "[0-9]{3}")),
    (chat(guided_choice=["yes", "no"]), GrammarSpec.choice(["yes", "no"])),
    (chat(guided_grammar='start: "a"+'), GrammarSpec("grammar", 'start: "a"+')),
    (chat(response_format={"type": "text"}, guided_choice=["a", "b"]), GrammarSpec.choice(["a", "b"])),
    (json.dumps({"prompt": "Hi", "guided_regex": "x+"}), GrammarSpec("regex", "x+")),
    (line({"model": "m", "prompt": "Hi", "guided_choice": ["a", "b"]}, COMPLETIONS), GrammarSpec.choice(["a", "b"])),
    (chat(), None),
])
def test_constraints_are_read_into_the_params(text, want):
    assert spec_of(text) == want


def test_the_spec_survives_the_stored_params():
    req = read(chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    stored = json.loads(json.dumps(req.requests[0].params))          # as the database keeps it
    assert intake.params_from_dict(stored).structured == GrammarSpec.json_schema(PERSON)


def test_schema_key_order_is_kept():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}}}
    got = spec_of(chat(structured_outputs={"json": schema}))
    assert got is not None and list(json.loads(got.source)["properties"]) == ["z", "a"]


@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "yaml"}},
     'body.response_format.type: must be one of "text", "json_object", "json_schema" (got "yaml")'),
    ({"response_format": "json"}, "body.response_format: must be an object, got a string"),
    ({"response_format": {"type": "json_schema"}}, "body.response_format.json_schema: is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "body.response_format.json_schema.schema: must be a JSON schema object, got an array"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "body.response_format.json_schema.schema: the grammar library refuses it: Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON, "strict": "yes"}}},
     "body.response_format.json_schema.strict: must be a boolean, got a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON, "shema": {}}}},
     "body.response_format.json_schema.shema: unknown field; expected name, schema, strict, description"),
    ({"response_format": {"type": "json_object", "schema": PERSON}},
     'body.response_format.schema: unknown field for type "json_object"'),
    ({"structured_outputs": {"regex": "a(b"}}, "body.structured_outputs.regex: the grammar library refuses it"),
    ({"structured_outputs": {"choice": []}}, "body.structured_outputs.choice: must be a non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", 1]}},
     "body.structured_outputs.choice: every choice must be a non-empty string"),
    ({"structured_outputs": {"grammar": "start: nowhere"}},
     "body.structured_outputs.grammar: the grammar library refuses it"),
    ({"structured_outputs": {"json": "{not json"}}, "body.structured_outputs.json: is a string but not JSON"),
    ({"structured_outputs": {"json": 3}}, "body.structured_outputs.json: must be a JSON schema object, got the number 3"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "body.structured_outputs: gives regex and choice; give one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {}}, "body.structured_outputs: needs one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"json_object": False}}, "body.structured_outputs.json_object: must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "body.structured_outputs.whitespace_pattern: not supported"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "body.structured_outputs: give one of response_format, structured_outputs, not several"),
    ({"guided_json": PERSON, "structured_outputs": {"regex": "a"}},
     "body.guided_json: give one of structured_outputs, guided_json, not several"),
    ({"guided_regex": "a(b"}, "body.guided_regex: the grammar library refuses it"),
    ({"guided_choice": "yes"}, "body.guided_choice: must be a list of strings, got a string"),
    ({"guided_json": [1]}, "body.guided_json: must be a JSON schema object, got an array"),
    ({"guided_grammar": ""}, "body.guided_grammar: must not be empty"),
    ({"response_format": {"type": "text", "x": 1}, "guided_regex": "a"},
     'body.response_format.x: unknown field for type "text"'),
])
def test_bad_constraints_are_refused_per_line(fields, want):
    errors = refused(chat(), chat(**fields) .replace('"r1"', '"r2"'))
    assert len(errors) == 1 and errors[0].startswith("batch.jsonl:2: " + want), errors
    assert "\n" not in errors[0]      # one problem, one line (the library's caret diagram left out)


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("fields, want", [
    (_schema({"enum": []}), "body.response_format.json_schema.schema.enum: is an empty list, so no JSON value "
                            "matches the schema; list at least one value"),
    (_schema({"allOf": [{"type": "string"}, {"type": []}]}),
     "body.response_format.json_schema.schema.allOf[1].type: is an empty list, so no JSON value matches the "
     "schema; list at least one type"),
    (_schema({"$defs": {"colour": {"enum": []}}, "$ref": "#/$defs/colour"}),
     "body.response_format.json_schema.schema.$defs.colour.enum: is an empty list"),
    ({"structured_outputs": {"json": {"oneOf": [{"oneOf": []}]}}},
     "body.structured_outputs.json.oneOf[0].oneOf: is an empty list, so no JSON value matches the schema; list "
     "at least one schema"),
    (_schema({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}),
     "body.response_format.json_schema.schema: no JSON value matches this schema: required property 'a' is "
     "unsatisfiable"),
    (_schema({"type": "string", "const": 1}),
     'body.response_format.json_schema.schema: no JSON value matches this schema: its "type" contradicts a '
     '"const", "enum" or "allOf" part of it'),
    (_schema({"type": "integer", "minimum": 5, "maximum": 3}),
     "body.response_format.json_schema.schema: no JSON value matches this schema: minimum (5) is greater than "
     "maximum (3)"),
    # llguidance said "Regex is empty:  (And (SearchRegex /^a$/) (Regex /(?s:.{5,})/))" (qa55)
    (_schema({"type": "string", "pattern": "^a$", "minLength": 5}),
     "body.response_format.json_schema.schema: no JSON value matches this schema: no string meets its "
     "pattern, format, minLength and maxLength together"),
])
def test_a_schema_no_value_matches_is_refused_in_words_not_the_librarys(fields, want):
    """{"enum": []} was refused as "the grammar library refuses it: Unsatisfiable schema: anyOf is
    empty": a dataset builder never wrote an anyOf (tidy53). An empty list is named where it is."""
    errors = refused(chat(**fields))
    assert len(errors) == 1 and errors[0].startswith("batch.jsonl:1: " + want), errors
    assert "anyOf is empty" not in errors[0] and "Unsatisfiable" not in errors[0], errors
    assert "Regex" not in errors[0], errors


@pytest.mark.parametrize("schema, want", [
    ({"$defs": {"unused": {"enum": []}}, "oneOf": []}, ["oneOf"]),
    ({"type": "object", "properties": {"a": {"enum": []}}, "oneOf": []}, ["oneOf"]),
    ({"$defs": {"u": {"enum": []}, "v": {"type": []}}, "$ref": "#/$defs/v"}, ["$defs.v.type"]),
    ({"anyOf": [{"type": "string", "enum": []}, {"type": []}], "$defs": {"u": {"oneOf": []}}},
     ["anyOf[0].enum", "anyOf[1].type"]),
    ({"enum": [], "oneOf": []}, ["enum", "oneOf"]),
])
def test_the_empty_lists_named_are_those_that_empty_the_schema(schema, want):
    """The first empty list depth first was named: an unused $defs entry's "enum": [] (or an
    optional property's) before the "oneOf": [] that leaves no value (tidy54). Named now: the
    empty lists that matter, each its own problem, in the schema's order."""
    errors = refused(chat(**_schema(schema)))
    where = "batch.jsonl:1: body.response_format.json_schema.schema."
    assert [e[len(where):].split(":")[0] for e in errors] == want, errors
    assert all(e.startswith(where) and ": is an empty list, so no JSON value matches" in e for e in errors), errors


@pytest.mark.parametrize("fields", [{"guided_regex": "x" * 100_000 + "(("},
                                    {"structured_outputs": {"regex": "(" * 100_000}}])
def test_the_librarys_message_does_not_echo_a_long_source(fields):
    """llguidance quotes the whole regex in its message: a 100 kB regex made a 100 kB error line
    (a terminal flooded, an API batch's errors.data that size). The source is shortened, the
    library's reason kept."""
    [error] = refused(chat(**fields))
    assert len(error) < 400 and error.endswith("unclosed group"), error[:500]


def test_every_problem_of_a_file_is_listed_and_nothing_parsed():
    errors = refused(chat(structured_outputs={"choice": []}),
                     chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}})
                     .replace('"r1"', '"r2"'))
    assert [e.split(":")[1] for e in errors] == ["1", "2"]


def test_response_format_stays_a_chat_field():
    errors = refused(line({"model": "m", "prompt": "Hi", "response_format": {"type": "json_object"}},
                          COMPLETIONS))
    assert errors == ["batch.jsonl:1: body.response_format: a field of /v1/chat/completions requests, "
                      "not of /v1/completions"]


def test_the_result_cache_keys_the_constraint():
    from specbatch.engine.types import GenerationParams
    from specbatch.jobs.result_cache import cache_key

    free = GenerationParams()
    a = GenerationParams(structured=GrammarSpec.choice(["a", "b"]))
    b = GenerationParams(structured=GrammarSpec.choice(["a", "c"]))
    keys = {cache_key("T", [1, 2], p) for p in (free, a, b)}
    assert len(keys) == 3
