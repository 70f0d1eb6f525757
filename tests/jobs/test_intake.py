"""Intake: every bad line is reported as FILE:LINE: field: problem, and nothing is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select

from specbatch import db
from specbatch.config import Settings
from specbatch.db.models import Job, Request, Result
from specbatch.errors import IntakeError
from specbatch.jobs import intake, store
from specbatch.jobs.structured import TOO_DEEP

BOM = b"\xef\xbb\xbf"
KNOWN_LINE_KEYS = "custom_id, prompt, messages, max_tokens, max_new_tokens, max_completion_tokens, temperature, top_p, top_k, seed, stop"


def submit(settings: Settings, path: Path | str, defaults: dict | None = None) -> str:
    """What `specbatch submit` does with the store: validate everything, then write in one transaction."""
    parsed = intake.parse_file(path, defaults or {}, settings)
    with db.session_factory(settings.database_url).begin() as s:
        return store.create_job(s, target="t", drafts=["d"], params=intake.job_params(defaults),
                                requests=parsed, queue="q", source=str(path)).id


def snapshot(url: str) -> tuple:
    with db.session_factory(url).begin() as s:
        return tuple(s.scalar(select(func.count()).select_from(t)) for t in (Job, Request, Result)) + (
            tuple(s.scalars(select(Request.custom_id).order_by(Request.id))),)


@pytest.fixture(scope="module")
def seeded_url(tmp_path_factory) -> str:
    """A SQLite store that already holds one job, so "unchanged" is not just "empty"."""
    url = f"sqlite:///{tmp_path_factory.mktemp('intake') / 'store.db'}"
    p = tmp_path_factory.mktemp("seed") / "seed.jsonl"
    p.write_text('{"custom_id": "seed", "prompt": "already here"}\n')
    submit(Settings(database_url=url), p)
    yield url
    db.forget_engines()


def L(**obj) -> bytes:  # noqa: N802 - one JSONL line
    return (json.dumps(obj) + "\n").encode()


GOOD = L(custom_id="ok", prompt="fine")
BAD_CASES = {
    "invalid_json": (GOOD + b'{"prompt": "b",}\n',
                     ["2: invalid JSON: Expecting property name enclosed in double quotes (column 16)"]),
    "not_an_object_array": (GOOD + b'["a", "b"]\n', ["2: must be a JSON object, got an array"]),
    "not_an_object_string": (GOOD + b'"hello"\n', ["2: must be a JSON object, got a string"]),
    "not_an_object_null": (b"null\n", ["1: must be a JSON object, got null"]),
    "neither_prompt_nor_messages": (L(custom_id="x", max_tokens=5), ['1: prompt: is required (or "messages")']),
    "both_prompt_and_messages": (L(prompt="a", messages=[{"role": "user", "content": "b"}]),
                                 ['1: prompt: give "prompt" or "messages", not both']),
    "prompt_wrong_type": (L(prompt=5), ["1: prompt: must be a string or an array of token ids, got the number 5"]),
    "prompt_empty": (L(prompt=""), ["1: prompt: must not be empty"]),
    "messages_wrong_type": (L(messages="hi"),
                            ['1: messages: must be an array of {"role", "content"} objects, got a string']),
    "messages_empty": (L(messages=[]), ["1: messages: must not be empty"]),
    "message_not_object": (L(messages=["hi"]),
                           ['1: messages[0]: must be an object with "role" and "content", got a string']),
    "message_bad_role": (L(messages=[{"role": "robot", "content": "x"}]),
                         ['1: messages[0].role: must be one of system, developer, user, assistant, tool '
                          '(got "robot")']),
    "message_missing_content": (L(messages=[{"role": "user"}]),
                                ["1: messages[0].content: must be a string or an array of text parts (missing)"]),
    "message_unknown_key": (L(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
                            ["1: messages[0].tool_calls: unknown key for a user message; known keys: role, "
                             "content, name"]),
    "message_image_part": (L(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                           ["1: messages[0].content[0]: image parts need a vision model; specbatch generates from "
                            "text only"]),
    "max_tokens_string": (L(prompt="a", max_tokens="64"), ["1: max_tokens: must be an integer >= 1, got a string"]),
    "max_tokens_boolean": (L(prompt="a", max_tokens=True), ["1: max_tokens: must be an integer >= 1, got a boolean"]),
    "max_tokens_float": (L(prompt="a", max_tokens=64.5), ["1: max_tokens: must be an integer >= 1, got the number 64.5"]),
    "temperature_string": (L(prompt="a", temperature="hot"),
                           ["1: temperature: must be a number in [0, 2] (OpenAI's range), got a string"]),
    "top_k_float": (L(prompt="a", top_k=1.5), ["1: top_k: must be an integer >= 0 (0: no top-k), got the number 1.5"]),
    "seed_string": (L(prompt="a", seed="1"), ["1: seed: must be an integer, got a string"]),
    "stop_number": (L(prompt="a", stop=5), ["1: stop: must be a string or a list of strings, got the number 5"]),
    "stop_empty_string": (L(prompt="a", stop=["ok", ""]), ["1: stop: stop strings must not be empty"]),
    # a JSON integer too big for a float: OverflowError, a 500 from the API (walk8); not echoed whole
    "temperature_huge_integer": (L(prompt="a", temperature=10**400),
                                 ["1: temperature: must be in [0, 2] (OpenAI's range), got 1000000000... (401 digits)"]),
    "logit_bias_huge_integer": (L(prompt="a", logit_bias={"5": -10**400}),
                                ["1: logit_bias.5: must be in [-100, 100], got -1000000000... (401 digits)"]),
    # n samples where nothing sets a temperature: greedy here (OpenAI samples at 1), n copies of one text
    "n_at_the_default_temperature": (L(prompt="a", n=3, seed=1),
                                     ["1: n: 3 samples at temperature 0 are 3 copies of one text: a line that "
                                      "sets no temperature decodes greedily here (OpenAI samples at 1); set "
                                      "temperature (or the job's: --temperature, or an API batch's "
                                      "specbatch_temperature metadata), or n 1"]),
    # one token named twice: which bias held was the dict's order, silently
    "logit_bias_same_token_twice": (L(prompt="a", logit_bias={"21285": 5, "021285": -5}),
                                    ["1: logit_bias.021285: token id 21285 is given twice ('21285' and '021285')"]),
    # the element at fault, not "got an array" for an array (walk8)
    "stop_list_number": (L(prompt="a", stop=["ok", 1]),
                         ["1: stop: must be a string or a list of strings; item 1 is the number 1"]),
    # README: stop must be non-empty (walk3 QA: [] was taken)
    "stop_empty_list": (L(prompt="a", stop=[]),
                        ["1: stop: must not be an empty list; leave stop out (or null) for no stop string"]),
    "custom_id_number": (L(custom_id=7, prompt="a"), ["1: custom_id: must be a non-empty string, got the number 7"]),
    "custom_id_empty": (L(custom_id="", prompt="a"), ["1: custom_id: must not be empty"]),
    "custom_id_too_long": (L(custom_id="x" * 513, prompt="a"),
                           ["1: custom_id: is 513 characters; the limit is 512"]),
    "temperature_negative": (L(prompt="a", temperature=-1), ["1: temperature: must be in [0, 2] (OpenAI's range), got -1"]),
    "temperature_over_two": (L(prompt="a", temperature=5.0),
                             ["1: temperature: must be in [0, 2] (OpenAI's range), got 5.0"]),
    "top_p_negative": (L(prompt="a", top_p=-0.1),
                       ["1: top_p: must be in [0, 1] (0: the most likely token only), got -0.1"]),
    "top_p_above_one": (L(prompt="a", top_p=1.5),
                        ["1: top_p: must be in [0, 1] (0: the most likely token only), got 1.5"]),
    "top_k_negative": (L(prompt="a", top_k=-1), ["1: top_k: must be >= 0, got -1"]),
    "max_tokens_zero": (L(prompt="a", max_tokens=0), ["1: max_tokens: must be >= 1, got 0"]),
    "max_new_tokens_negative": (L(prompt="a", max_new_tokens=-3), ["1: max_new_tokens: must be >= 1, got -3"]),
    "seed_negative": (L(prompt="a", seed=-1), ["1: seed: must be in [0, 2**63 - 1], got -1"]),
    "seed_too_big": (L(prompt="a", seed=2**64), [f"1: seed: must be in [0, 2**63 - 1], got {2**64}"]),
    "nan_temperature": (b'{"prompt": "a", "temperature": NaN}\n', ["1: invalid JSON: NaN is not valid JSON"]),
    # Python reads 1e400 as infinity: the message said "got the number inf" (qa55)
    "max_tokens_past_a_float": (b'{"prompt": "a", "max_tokens": 1e400}\n',
                                ["1: invalid JSON: the number 1e400 is beyond a float's range (about 1.8e308)"]),
    "duplicate_json_key": (b'{"prompt": "a", "prompt": "b"}\n', ['1: invalid JSON: duplicate key "prompt"']),
    "max_tokens_conflict": (L(prompt="a", max_tokens=5, max_new_tokens=6),
                            ["1: max_new_tokens: conflicts with max_tokens; give one of them"]),
    "duplicate_custom_id": (L(custom_id="q1", prompt="a") + L(custom_id="q2", prompt="b")
                            + L(custom_id="q1", prompt="c"),
                            ['3: custom_id: duplicate "q1" (first on line 1)']),
    "default_custom_id_taken": (L(custom_id="line-2", prompt="a") + L(prompt="b"),
                                ['2: custom_id: missing, and the default "line-2" is taken by line 1; '
                                 "give this line a custom_id"]),
    "unknown_key": (L(prompt="a", temprature=0.5),
                    [f'1: temprature: unknown key (did you mean "temperature"?); known keys: {KNOWN_LINE_KEYS}']),
    "unknown_key_typo": (L(prompt="a", max_tokns=8),
                         [f'1: max_tokns: unknown key (did you mean "max_tokens"?); known keys: {KNOWN_LINE_KEYS}']),
    "unknown_key_unlike_any": (L(prompt="a", colour="red"), [f"1: colour: unknown key; known keys: {KNOWN_LINE_KEYS}"]),
    "invalid_utf8": (GOOD + b'{"prompt": "caf\xe9"}\n',
                     ["2: the file is not UTF-8 text: byte 0xe9 at byte 16 of this line is not UTF-8; save it as "
                      "UTF-8 (the lines after it were not read)"]),
    # one error for the file, not "invalid UTF-8" then "invalid JSON" for each line (as the API's one 400)
    "utf16_with_bom": ((GOOD + L(prompt="b") + L(prompt="c")).decode().encode("utf-16"),
                       ["1: the file is not UTF-8 text: it looks like UTF-16 (it starts with a UTF-16 "
                        "byte-order mark); save it as UTF-8 (the lines after it were not read)"]),
    "utf16_without_bom": ((GOOD + L(prompt="b") + L(prompt="c")).decode().encode("utf-16-le"),
                          ["1: the file is not UTF-8 text: this line holds a NUL byte (UTF-16 without a "
                           "byte-order mark, or binary data); save it as UTF-8 (the lines after it were not read)"]),
    "binary": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\n\xff\xd8\n",
               ["1: the file is not UTF-8 text: byte 0x89 at byte 1 of this line is not UTF-8; save it as "
                "UTF-8 (the lines after it were not read)"]),
    "over_long_line": (GOOD + L(prompt="x" * 2000) + GOOD.replace(b"ok", b"ok2"),
                       ["2: line is 2014 bytes; the limit is 1000 (SPECBATCH_MAX_LINE_BYTES)"]),
    "batch_method": (L(method="GET", url="/v1/chat/completions", body={"messages": [{"role": "user",
                                                                                     "content": "x"}]}),
                     ['1: method: must be "POST", got "GET"']),
    "batch_url": (L(method="POST", url="/v1/embeddings", body={"prompt": "x"}),
                  ['1: url: must be one of /v1/chat/completions, /v1/completions (got "/v1/embeddings")']),
    "batch_body_not_object": (L(method="POST", url="/v1/completions", body="x"),
                              ["1: body: must be an object, got a string"]),
    "batch_body_missing": (L(method="POST", url="/v1/completions"), ["1: body: is required"]),
    "batch_chat_without_messages": (L(method="POST", url="/v1/chat/completions", body={"model": "m"}),
                                    ["1: body.messages: is required for /v1/chat/completions"]),
    "batch_unknown_body_key": (L(method="POST", url="/v1/completions", body={"prompt": "x",
                                                                             "temprature": 1}),
                               ["1: body.temprature: unknown field (did you mean \"temperature\"?); not part of the "
                                "OpenAI request body"]),
    "batch_n": (L(method="POST", url="/v1/completions", body={"prompt": "x", "n": 129}),
                ["1: body.n: must be in [1, 128], got 129"]),
    "line_n": (L(prompt="x", n=0), ["1: n: must be in [1, 128], got 0"]),
    "batch_stream": (L(method="POST", url="/v1/completions", body={"prompt": "x", "stream": True}),
                     ["1: body.stream: must be false"]),
    "batch_top_level_param": (L(method="POST", url="/v1/completions", body={"prompt": "x"}, max_tokens=4),
                              ["1: max_tokens: unknown key; known keys: custom_id, method, url, body"]),
    "batch_prompt_list": (L(method="POST", url="/v1/completions", body={"prompt": ["a", "b"]}),
                          ["1: body.prompt: holds 2 prompts; give one prompt per line"]),
    "batch_bad_temperature": (L(method="POST", url="/v1/completions", body={"prompt": "x", "temperature": -2}),
                              ["1: body.temperature: must be in [0, 2] (OpenAI's range), got -2"]),
    "too_many_requests": (GOOD + L(prompt="b") + b"\n" + L(prompt="c") + L(prompt="d"),
                          [": 4 requests; the limit is 3 per file (SPECBATCH_MAX_REQUESTS): split the file"]),
    "empty_file": (b"", [": no requests (the file is empty); one JSON object per line is expected"]),
    "blank_lines_only": (b"\n   \r\n\n", [": no requests (3 lines, all blank)"]),
    "bom_only": (BOM, [": no requests (the file is empty)"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_is_reported_and_nothing_is_written(case, seeded_url, tmp_path):
    content, expected = BAD_CASES[case]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    settings = Settings(database_url=seeded_url, max_requests=3, max_line_bytes=1000)
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(settings, path)
    message = str(e.value)
    assert message.splitlines()[0] == "1 error; nothing was written:"
    for want in expected:       # "N: ..." for a line, ": ..." for the whole file
        assert f"{path}{':' if want[0].isdigit() else ''}{want}" in message, message
    assert snapshot(seeded_url) == before


def test_json_nested_too_deeply_is_a_line_error(seeded_url, tmp_path):
    """Python's JSON parser raises RecursionError past ~1000 levels: a line's own, or a vLLM
    guided_json schema given as JSON text. It was an 'unexpected error' (run/submit) and a 500
    with a traceback in the server's log (POST /v1/batches); now the line's error, nothing written."""
    deep = "[" * 5000 + "]" * 5000
    lines = [json.dumps({"prompt": "a"}), '{"prompt": "a", "stop": ' + deep + "}",
             json.dumps({"prompt": "a", "guided_json": deep})]
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(lines) + "\n")
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    assert str(e.value).splitlines()[1:] == [
        f"{path}:2: invalid JSON: {TOO_DEEP}",
        f"{path}:3: guided_json: is a string but not JSON: {TOO_DEEP}"]
    assert snapshot(seeded_url) == before


def test_a_number_past_pythons_digit_limit_is_a_line_error(seeded_url, tmp_path):
    """Python's JSON reader refuses an integer of more than 4300 digits with advice to call
    sys.set_int_max_str_digits(), which a user cannot take; in a guided_json schema given as JSON
    text the ValueError was an 'unexpected error'. Now each is the line's error in the words the
    API uses for a body, nothing written."""
    big = "9" * 5000
    lines = [json.dumps({"prompt": "a"}), '{"prompt": "a", "max_tokens": ' + big + "}",
             json.dumps({"prompt": "a", "guided_json": '{"type": "string", "maxLength": ' + big + "}"})]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    digits = f"a number has more than {sys.get_int_max_str_digits()} digits"
    assert str(e.value).splitlines()[1:] == [
        f"{path}:2: invalid JSON: {digits}",
        f"{path}:3: guided_json: is a string but not JSON: {digits}"]
    assert snapshot(seeded_url) == before


def test_a_long_key_or_value_is_not_echoed_whole(seeded_url, tmp_path):
    """A line error quotes what it refuses: a 50 kB key (a prompt written as a key) or role made a
    50 kB error line, in the terminal and in an API batch's errors.data. The middle is cut; the
    start (where) and the end (what is expected) stay."""
    big = "z" * 50_000
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "a", big: 1}) + "\n"
                    + json.dumps({"messages": [{"role": big, "content": "x"}]}) + "\n")
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    first, second = e.value.errors
    assert all(len(str(x)) < 1000 for x in e.value.errors), [len(str(x)) for x in e.value.errors]
    assert first.field.startswith("zzz") and " ... " in first.field and first.reason.startswith("unknown key")
    assert second.field == "messages[0].role" and second.reason.startswith("must be one of system, ")
    assert " ... " in second.reason and second.reason.endswith('zzz")')


ARRAY_HINT = ("this looks like a JSON array; the file must be JSON Lines: one JSON object per line "
              "(`jq -c '.[]'` converts an array)")
PRETTY_HINT = ("this looks like pretty-printed JSON; the file must be JSON Lines: one JSON object per line "
               "(`jq -c .` converts it)")
PROMPTS = [{"custom_id": f"q{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(30)]


@pytest.mark.parametrize("content, line_no, hint", [
    (json.dumps(PROMPTS, indent=2), 1, ARRAY_HINT),                  # a JSON array, pretty-printed
    ("\n  \n" + json.dumps(PROMPTS), 3, ARRAY_HINT),                 # on one line, after blank lines
    (json.dumps(PROMPTS[0], indent=2) + "\n" + json.dumps(PROMPTS[1], indent=2), 1, PRETTY_HINT),
], ids=["array", "one-line-array", "pretty-printed-objects"])
def test_plain_json_gets_one_hint_instead_of_an_error_per_line(content, line_no, hint, seeded_url, tmp_path):
    path = tmp_path / "array.json"
    path.write_text(content)
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    assert str(e.value).splitlines() == ["1 error; nothing was written:", f"{path}:{line_no}: {hint}"]
    assert snapshot(seeded_url) == before


def test_an_object_opening_a_line_of_its_own_later_in_the_file_gets_no_hint(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + b"{\n")
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, {}, Settings(database_url="sqlite://"))
    assert str(e.value).splitlines()[1].startswith(f"{path}:2: invalid JSON")


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_missing_file_or_directory(kind, seeded_url, tmp_path):
    path = tmp_path / "nope.jsonl"
    if kind == "directory":
        path.mkdir()
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    want = "no such file" if kind == "missing" else "is a directory, not a JSONL file"
    assert str(e.value).splitlines()[1] == f"{path}: {want}"
    assert snapshot(seeded_url) == before


def test_every_error_of_every_line_is_listed_in_line_order(seeded_url, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="a", prompt="x") + b"{oops\n" + GOOD
                     + L(custom_id="a", prompt="y", temperature=-1, top_p=2) + L(custom_id="a", prompt="z"))
    before = snapshot(seeded_url)
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url), path)
    lines = str(e.value).splitlines()
    assert lines[0] == "5 errors; nothing was written:"
    assert lines[1].startswith(f"{path}:2: invalid JSON")
    assert lines[2:] == [f"{path}:4: temperature: must be in [0, 2] (OpenAI's range), got -1", f"{path}:4: top_p: must be in [0, 1] (0: the most likely token only), got 2",
                         f'{path}:4: custom_id: duplicate "a" (first on line 1)',
                         f'{path}:5: custom_id: duplicate "a" (first on line 1)']
    assert snapshot(seeded_url) == before


@pytest.mark.parametrize("line, other_error", [
    (L(custom_id="a", prompt="y", top_k=-1), "top_k: must be >= 0, got -1"),
    (L(custom_id="a"), 'prompt: is required (or "messages")'),
    (L(custom_id="a", prompt="y\u0000"), "prompt: contains a NUL character (\\u0000), which text cannot hold"),
    (L(custom_id="a", method="POST", url="/v1/embeddings", body={"input": "x"}), "url: must be one of"),
])
def test_a_duplicate_custom_id_is_listed_beside_the_lines_other_errors(line, other_error, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="a", prompt="x") + line)
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, {}, Settings(database_url="sqlite://"))
    lines = str(e.value).splitlines()[1:]
    assert any(x.startswith(f"{path}:2: {other_error}") for x in lines), lines
    assert f'{path}:2: custom_id: duplicate "a" (first on line 1)' in lines


def test_a_taken_default_custom_id_is_listed_beside_the_lines_other_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="line-2", prompt="x") + L(prompt="y", temperature=-1))
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, {}, Settings(database_url="sqlite://"))
    assert str(e.value).splitlines()[1:] == [
        f"{path}:2: temperature: must be in [0, 2] (OpenAI's range), got -1",
        f'{path}:2: custom_id: missing, and the default "line-2" is taken by line 1; give this line a custom_id']


def test_an_invalid_custom_id_is_reported_once_not_as_a_duplicate(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="", prompt="x") + L(custom_id="", prompt="y"))
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, {}, Settings(database_url="sqlite://"))
    assert str(e.value).splitlines()[1:] == [f"{path}:1: custom_id: must not be empty",
                                             f"{path}:2: custom_id: must not be empty"]


def test_error_list_is_capped_with_the_total(seeded_url, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"".join(L(prompt="a", top_k=-1) for _ in range(120)))
    with pytest.raises(IntakeError) as e:
        submit(Settings(database_url=seeded_url, max_requests=1000), path)
    lines = str(e.value).splitlines()
    assert lines[0] == "120 errors; nothing was written:"
    assert lines[1] == f"{path}:1: top_k: must be >= 0, got -1"
    assert lines[50] == f"{path}:50: top_k: must be >= 0, got -1"
    assert lines[51:] == ["... and 70 more"]
    assert e.value.total == 120


def test_bad_job_defaults_name_the_option(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD)
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, {"temperature": -1.0, "top_p": 0.5}, Settings(database_url="sqlite://"))
    assert str(e.value).splitlines()[1:] == ["--temperature: must be in [0, 2] (OpenAI's range), got -1.0"]


# ---------------------------------------------------------------- valid files


def test_three_forms_bom_crlf_blank_lines_and_default_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        BOM + L(custom_id="q1", prompt="Write a haiku about queues").rstrip(b"\n"),
        b"",
        L(messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}],
          max_tokens=64, temperature=0.7, seed=1).rstrip(b"\n"),
        L(custom_id="q3", method="POST", url="/v1/chat/completions",
          body={"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}],
                "max_completion_tokens": 9, "stop": "END"}).rstrip(b"\n"),
        L(custom_id="q4", method="POST", url="/v1/completions", body={"prompt": "def f(", "top_k": 5}).rstrip(b"\n"),
        b"   ",
    ]
    path.write_bytes(b"\r\n".join(lines) + b"\r\n")
    got = intake.parse_file(path, {"max_new_tokens": 32, "top_p": 0.9, "stop": None},
                            Settings(database_url="sqlite://"))
    assert [(r.line_no, r.custom_id, r.kind) for r in got] == [
        (1, "q1", "completion"), (3, "line-3", "chat"), (4, "q3", "chat"), (5, "q4", "completion")]
    q1, line3, q3, q4 = got
    assert q1.prompt == "Write a haiku about queues" and q1.messages is None
    assert q1.params == {"max_new_tokens": 32, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": None,
                         "stop": []}
    assert line3.messages == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert line3.params == {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 1,
                            "stop": []}
    assert q3.messages == [{"role": "user", "content": "a\nb"}]
    assert q3.params["max_new_tokens"] == 9 and q3.params["stop"] == ["END"]
    assert q4.prompt == "def f(" and q4.params["top_k"] == 5 and q4.params["max_new_tokens"] == 32
    gp = q3.generation_params()
    assert gp.stop == ("END",) and gp.max_new_tokens == 9 and gp.top_p == 0.9


def test_job_defaults_and_line_overrides(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(prompt="a") + L(prompt="b", temperature=0, stop=["x", "y"], max_new_tokens=3))
    defaults = {"max_new_tokens": 16, "temperature": 0.5, "top_k": 40, "seed": 7, "stop": ("###",)}
    a, b = intake.parse_file(path, defaults, Settings(database_url="sqlite://"))
    assert a.params == {"max_new_tokens": 16, "temperature": 0.5, "top_p": 1.0, "top_k": 40, "seed": 7,
                        "stop": ["###"]}
    assert b.params == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "seed": 7,
                        "stop": ["x", "y"]}
    assert intake.job_params(defaults)["stop"] == ["###"]


def test_a_job_option_that_every_line_overrides_is_warned_about(tmp_path):
    """`--temperature 0` meant as "all greedy" over lines that each set a temperature changes
    nothing: the warning names the option. One line taking it is enough to say nothing."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(prompt="a", max_tokens=5, temperature=0.7)
                     + L(method="POST", url="/v1/completions", body={"prompt": "b", "max_completion_tokens": 4,
                                                                     "top_p": 0}))   # top_p 0: greedy, its own
    defaults = {"max_new_tokens": 16, "temperature": 0.0, "top_p": 0.9, "seed": 3, "stop": ()}
    got = intake.read_file(path, defaults, Settings(database_url="sqlite://"))
    assert got.warnings("t") == [
        "--max-new-tokens applies to no line: every line sets its own max_tokens, which wins over the option",
        "--temperature applies to no line: every line sets its own temperature, which wins over the option"]
    path.write_bytes(path.read_bytes() + L(prompt="c"))
    assert intake.read_file(path, defaults, Settings(database_url="sqlite://")).warnings("t") == []


def test_a_line_at_the_byte_limit_is_accepted(tmp_path):
    line = L(prompt="x" * 86).rstrip(b"\n")
    assert len(line) == 100
    path = tmp_path / "p.jsonl"
    path.write_bytes(line + b"\r\n" + line.replace(b'"x', b'"y'))        # CRLF, no final newline
    got = intake.parse_file(path, {}, Settings(database_url="sqlite://", max_line_bytes=100))
    assert [r.custom_id for r in got] == ["line-1", "line-2"]


def test_valid_file_lands_in_the_store(db_url, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="a", prompt="x", seed=3) + L(messages=[{"role": "user", "content": "hi"}]))
    job_id = submit(Settings(database_url=db_url), path, {"max_new_tokens": 8})
    with db.session_factory(db_url).begin() as s:
        rows = s.execute(select(Request.custom_id, Request.line_no, Request.kind, Request.prompt,
                                Request.messages, Request.params, Request.status)
                         .where(Request.job_id == job_id).order_by(Request.line_no)).all()
        job = store.get_job(s, job_id)
        assert (job.total, job.pending, job.status.value, job.params["max_new_tokens"]) == (2, 2, "queued", 8)
    assert [tuple(r)[:5] for r in rows] == [("a", 1, "completion", "x", None),
                                            ("line-2", 2, "chat", None, [{"role": "user", "content": "hi"}])]
    assert rows[0].params["seed"] == 3 and rows[1].params["max_new_tokens"] == 8
    assert {r.status.value for r in rows} == {"pending"}


def test_temperature_is_openais_range_everywhere_params_are_checked() -> None:
    """[0, 2]: a line, a job default (CLI option, API metadata), and the engine's own check."""
    from click.testing import CliRunner

    from specbatch.api.metadata import job_options
    from specbatch.cli.main import cli
    from specbatch.engine.types import GenerationParams
    from specbatch.errors import InputError, RequestError

    assert intake.job_params({"temperature": 2})["temperature"] == 2.0
    with pytest.raises(IntakeError, match="temperature.*got 2.5"):
        intake.job_params({"temperature": 2.5})
    GenerationParams(temperature=2.0).validate()
    with pytest.raises(RequestError, match=r"must be in \[0, 2\]"):
        GenerationParams(temperature=5.0).validate()
    settings = Settings.from_env({"SPECBATCH_DEFAULT_TARGET": "org/t", "SPECBATCH_DEFAULT_DRAFT": "org/d"})
    with pytest.raises(InputError) as e:
        job_options({"specbatch_temperature": "5"}, settings)
    assert e.value.field == "metadata.specbatch_temperature" and "[0, 2]" in e.value.reason
    for command in (["generate", "--prompt", "x"], ["run", "nothing.jsonl"]):
        result = CliRunner().invoke(cli, [*command, "--temperature", "5"])
        assert result.exit_code == 2 and "--temperature" in result.output, result.output


def test_a_native_line_takes_the_openai_aliases_model_and_metadata(tmp_path):
    """README's per-line parameters name ``max_completion_tokens`` an alias, and ``model`` and
    ``metadata`` as supported: a native line takes them as an OpenAI body does."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="a", prompt="x", max_completion_tokens=7, model="small", metadata={"k": "v"})
                     + L(custom_id="b", messages=[{"role": "user", "content": "y"}], model="big"))
    settings = Settings(database_url="sqlite://")
    parsed = intake.read_file(path, None, settings, model_map={"small": ("t1", ["d1"]), "big": ("t2", [])})
    a, b = parsed.requests
    assert a.params["max_new_tokens"] == 7 and a.metadata == {"k": "v"} and a.model == "small"
    assert (a.target, a.drafts, b.target, b.drafts) == ("t1", ["d1"], "t2", [])
    path.write_bytes(L(prompt="x", model=3, metadata={"k": 1}, max_tokens=4, max_completion_tokens=5))
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, None, settings)
    fields = {err.field for err in e.value.errors}
    assert {"model", "metadata.k", "max_completion_tokens"} <= fields, fields
    # every key that is not a string, not the first alone (tidy54)
    path.write_bytes(L(prompt="x", metadata={"a": 1, "ok": "v", "b": [2]}))
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, None, settings)
    assert [(err.field, err.reason) for err in e.value.errors] == [
        ("metadata.a", "must be a string, got the number 1"), ("metadata.b", "must be a string, got an array")]


def test_a_null_prompt_or_messages_is_not_given(tmp_path):
    """A table of chat and completion rows written by ``datasets.Dataset.to_json`` (or pandas'
    ``to_json(orient="records", lines=True)``) gives every row both columns, the unused one null:
    null is "not given" there, as for the other fields, so the row is the kind of the other."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="c", prompt=None, messages=[{"role": "user", "content": "Hi"}], logprobs=None,
                       n=2, temperature=0.7, seed=1)
                     + L(custom_id="p", prompt="The capital of France is", messages=None, logprobs=2, n=None))
    chat, comp = intake.parse_file(path, None, Settings(database_url="sqlite://"))
    assert (chat.kind, chat.prompt, chat.messages) == ("chat", None, [{"role": "user", "content": "Hi"}])
    assert (comp.kind, comp.prompt, comp.messages) == ("completion", "The capital of France is", None)
    assert comp.params["logprobs"] == 2
    path.write_bytes(L(custom_id=None, prompt="a") + L(custom_id="q", prompt="b") + L(custom_id=None, prompt="c"))
    assert [r.custom_id for r in intake.parse_file(path, None, Settings(database_url="sqlite://"))] == \
        ["line-1", "q", "line-3"]                       # a null custom_id: the line-N default, as a missing one
    path.write_bytes(L(custom_id="x", prompt=None, messages=None))
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, None, Settings(database_url="sqlite://"))
    assert [str(err) for err in e.value.errors] == [f'{path}:1: prompt: is required (or "messages")']


def test_whole_numbers_written_as_floats_are_integers(tmp_path):
    """pandas writes an integer column that holds nulls as floats (`"seed": 1.0`): taken as the
    integers they are; a fraction, or a float past 2**53 (which no longer holds every integer),
    is still refused."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(prompt="a", seed=1.0, max_tokens=16.0, top_k=5.0, temperature=0.5, n=2.0)
                     + L(prompt="b", seed=None, max_tokens=8))
    a, b = intake.parse_file(path, {}, Settings(database_url="sqlite://"))
    assert a.params["seed"] == 1 and type(a.params["seed"]) is int
    assert a.params["max_new_tokens"] == 16 and a.params["top_k"] == 5 and a.generation_params().n == 2
    assert b.params["seed"] is None
    for bad, words in [(dict(seed=1.5), "seed: must be an integer"), (dict(seed=2.0 ** 60), "seed: must be an integer")]:
        path.write_bytes(L(prompt="a", **bad))
        with pytest.raises(IntakeError, match=words):
            intake.parse_file(path, {}, Settings(database_url="sqlite://"))


def test_validate_keeps_whole_floats_as_the_integers_they_are():
    """The library's GenerationParams.validate: 1.0 passes its rule as 1, so the engine must get 1
    (a float seed hashed its samples differently: "seed:1.0:1"; a float n or top_k is a TypeError)."""
    from specbatch.engine.types import GenerationParams

    p = GenerationParams(seed=1.0, n=2.0, top_k=5.0, max_new_tokens=4.0, logprobs=2.0).validate()
    assert [(v, type(v)) for v in (p.seed, p.n, p.top_k, p.max_new_tokens, p.logprobs)] == [
        (1, int), (2, int), (5, int), (4, int), (2, int)]
    assert GenerationParams(seed=None).validate().seed is None


def test_n_samples_greedy_only_where_a_temperature_asks_for_it(tmp_path):
    """n > 1 where nothing sets a temperature is refused (n copies of one text: OpenAI's default
    is 1, specbatch's greedy); a line's own temperature 0, its top_p 0, or the job's --temperature
    (0 included: asked for) is taken."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(L(custom_id="own", prompt="a", n=2, temperature=0)
                     + L(custom_id="top_p", prompt="a", n=2, top_p=0)
                     + L(custom_id="sampled", prompt="a", n=2, temperature=0.8, seed=1))
    got = intake.read_file(path, None, Settings(database_url="sqlite://")).requests
    assert [r.params["n"] for r in got] == [2, 2, 2]
    path.write_bytes(L(prompt="a", n=2))
    with pytest.raises(IntakeError, match="n: 2 samples at temperature 0 are 2 copies"):
        intake.read_file(path, None, Settings(database_url="sqlite://"))
    for job_temperature in (0.0, 0.7):
        got = intake.read_file(path, {"temperature": job_temperature}, Settings(database_url="sqlite://")).requests
        assert got[0].params["n"] == 2 and got[0].params["temperature"] == job_temperature
