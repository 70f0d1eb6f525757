"""OpenAI batch lines in: every example of OpenAI's batch guide, every request field sorted into
honoured / no-op (one warning per job) / refused (``FILE:LINE: body.FIELD: why``)."""

from __future__ import annotations

import io
import json
import typing

import pytest

from specbatch.config import Settings
from specbatch.errors import IntakeError
from specbatch.jobs import intake, openai_fields

SETTINGS = Settings(database_url="sqlite://")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def line(body: dict, url: str = CHAT, cid: str = "r1") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def read(*lines: str, model_map: list[str] | None = None) -> intake.ParsedFile:
    data = ("\n".join(lines) + "\n").encode()
    return intake.read_stream(io.BytesIO(data), "batch.jsonl", {}, SETTINGS,
                              intake.parse_model_map(model_map or [], allow_remote=True))


def refused(*lines: str, **kw) -> list[str]:
    with pytest.raises(IntakeError) as e:
        read(*lines, **kw)
    return [str(x) for x in e.value.errors]


# ---------------------------------------------------------------- the field lists are OpenAI's own


def _type_fields(module: str) -> set[str]:
    import importlib

    m = importlib.import_module(module)
    return set(typing.get_type_hints(m.CompletionCreateParamsNonStreaming))


def test_every_openai_request_field_is_sorted():
    chat = _type_fields("openai.types.chat.completion_create_params")
    completions = _type_fields("openai.types.completion_create_params")
    assert "stream" in chat and "best_of" in completions
    assert openai_fields.CHAT_FIELDS == chat
    assert openai_fields.COMPLETION_FIELDS == completions


def test_message_keys_are_openais():
    import openai.types.chat as t

    for role, typ in (("system", t.ChatCompletionSystemMessageParam),
                      ("developer", t.ChatCompletionDeveloperMessageParam),
                      ("user", t.ChatCompletionUserMessageParam),
                      ("assistant", t.ChatCompletionAssistantMessageParam),
                      ("tool", t.ChatCompletionToolMessageParam)):
        assert set(openai_fields.MESSAGE_KEYS[role]) == set(typ.__annotations__), role
    assert set(openai_fields.TEXT_PART_KEYS) == set(t.ChatCompletionContentPartTextParam.__annotations__)


# ---------------------------------------------------------------- OpenAI's own examples

GUIDE_INPUT = [  # the batch guide's input file, and the API reference's request input object
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    '"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},'
    '{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
    '{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    '"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},'
    '{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
    '{"custom_id": "request-3", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    '"gpt-4o-mini", "messages": [{"role": "system", "content": "You are a helpful assistant."}, '
    '{"role": "user", "content": "What is 2+2?"}]}}',
]
GUIDE_OUTPUT = [  # the guide's output file, and a real output line (message.refusal: null)
    '{"id": "batch_req_123", "custom_id": "request-2", "response": {"status_code": 200, "request_id": '
    '"req_123", "body": {"id": "chatcmpl-123", "object": "chat.completion", "created": 1711652795, "model": '
    '"gpt-3.5-turbo-0125", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, '
    '"logprobs": null, "finish_reason": "stop"}], "usage": {"prompt_tokens": 22, "completion_tokens": 2, '
    '"total_tokens": 24}, "system_fingerprint": "fp_123"}}, "error": null}',
    '{"id": "batch_req_456", "custom_id": "request-1", "response": {"status_code": 200, "request_id": '
    '"req_789", "body": {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1711652789, "model": '
    '"gpt-3.5-turbo-0125", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How '
    'can I assist you today?"}, "logprobs": null, "finish_reason": "stop"}], "usage": {"prompt_tokens": 20, '
    '"completion_tokens": 9, "total_tokens": 29}, "system_fingerprint": "fp_3ba"}}, "error": null}',
    '{"custom_id": "request-1", "error": null, "id": "batch_req_403hYy7nMxrxXFWXiwvoLG1q", "response": '
    '{"body": {"choices": [{"finish_reason": "stop", "index": 0, "logprobs": null, "message": {"content": '
    '"2 + 2 equals 4.", "refusal": null, "role": "assistant"}}], "created": 1724858089, "id": '
    '"chatcmpl-A1Efhv97EZNQeHKSLPnTmZex20gf2", "model": "gpt-4o-mini-2024-07-18", "object": '
    '"chat.completion", "system_fingerprint": "fp_f33667828e", "usage": {"completion_tokens": 8, '
    '"prompt_tokens": 24, "total_tokens": 32}}, "request_id": "af0bac0d82530234e09bd6b5d9fbf5cf", '
    '"status_code": 200}}',
]


def test_the_guides_input_lines():
    got = read(*GUIDE_INPUT)
    r1, r2, r3 = got.requests
    assert [r.custom_id for r in got.requests] == ["request-1", "request-2", "request-3"]
    assert r1.kind == "chat" and r1.messages == [{"role": "system", "content": "You are a helpful assistant."},
                                                 {"role": "user", "content": "Hello world!"}]
    assert r1.params["max_new_tokens"] == 1000 and r3.params["max_new_tokens"] == 128     # the job default
    assert (r1.model, r3.model, r1.target) == ("gpt-3.5-turbo-0125", "gpt-4o-mini", None)
    assert got.noop_fields == {}
    assert got.warnings("smollm2-135m") == [
        "model is ignored without --model-map: gpt-3.5-turbo-0125 (2 lines), gpt-4o-mini (1 line); "
        "every request runs on smollm2-135m"]
    assert got.warnings("gpt-4o-mini") == [          # a line naming the target itself is no surprise
        "model is ignored without --model-map: gpt-3.5-turbo-0125 (2 lines); every request runs on gpt-4o-mini"]


def test_the_line_model_accepts_the_guides_output_lines():
    from tests.jobs.test_export import check_line

    for text in GUIDE_OUTPUT:
        check_line(json.loads(text))


def test_the_guides_other_endpoints_are_refused_per_line():
    emb = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": "text-embedding-3-small", "input": "hi"}})
    resp = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "gpt-4o-mini", "input": "hi"}})
    assert refused(GUIDE_INPUT[0], emb, resp) == [
        'batch.jsonl:2: url: must be one of /v1/chat/completions, /v1/completions (got "/v1/embeddings")',
        'batch.jsonl:3: url: must be one of /v1/chat/completions, /v1/completions (got "/v1/responses")']


# ---------------------------------------------------------------- no-op fields: accepted, one warning

NOOP = [
    (CHAT, "stream", False), (CHAT, "stream_options", {"include_usage": True}), (CHAT, "store", True),
    (CHAT, "service_tier", "flex"), (CHAT, "user", "u-42"), (CHAT, "parallel_tool_calls", True),
    (CHAT, "safety_identifier", "h123"), (CHAT, "prompt_cache_key", "k"),
    (CHAT, "prompt_cache_retention", "24h"), (CHAT, "prompt_cache_options", {"mode": "implicit"}),
    (CHAT, "prediction", {"type": "content", "content": "Hello"}),
    (CHAT, "tools", []), (CHAT, "tool_choice", "none"), (CHAT, "functions", []), (CHAT, "function_call", "none"),
    (CHAT, "modalities", ["text"]), (CHAT, "audio", None),
    (CHAT, "reasoning_effort", None), (CHAT, "verbosity", "medium"), (CHAT, "web_search_options", None),
    (CHAT, "moderation", None), (CHAT, "metadata", {"k": "v"}),
    (COMPLETIONS, "echo", False), (COMPLETIONS, "best_of", 1),
    (COMPLETIONS, "suffix", None), (COMPLETIONS, "stream", None),
    (COMPLETIONS, "user", "u"), (COMPLETIONS, "stream_options", None),
]


@pytest.mark.parametrize(("url", "field", "value"), NOOP, ids=[f"{u[4:]}-{f}-{v}" for u, f, v in NOOP])
def test_no_op_field_is_accepted_and_warned(url, field, value):
    body = {"model": "m", field: value, **({"messages": MSGS} if url == CHAT else {"prompt": "Hi"})}
    got = read(line(body, url), line(body, url, cid="r2"))
    assert got.noop_fields == {field: 2}
    warning = got.warnings("t")[0]
    assert warning.startswith(f"accepted with no effect on the generated text: {field} (2 lines)")
    plain = read(line({"model": "m", **({"messages": MSGS} if url == CHAT else {"prompt": "Hi"})}, url))
    assert got.requests[0].params == plain.requests[0].params         # no effect on generation


def test_the_issue_file_is_accepted_whole_with_one_warning():
    """The fields OpenAI's docs write that used to reject the whole file."""
    body = {"model": "gpt-4o-mini", "messages": MSGS, "presence_penalty": 0, "frequency_penalty": 0,
            "logprobs": False, "store": True, "metadata": {"run": "7"}, "stream_options": None,
            "service_tier": "auto", "max_completion_tokens": 16}
    comp = {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hi", "echo": False, "max_tokens": 5}
    got = read(line(body), line(comp, COMPLETIONS, cid="r2"))
    assert len(got.requests) == 2
    warnings = got.warnings("t")
    assert warnings[0] == ("accepted with no effect on the generated text: echo (1 line), "
                           "metadata (1 line), service_tier (1 line), store (1 line), stream_options (1 line); "
                           "metadata is kept and exported")
    assert got.requests[0].metadata == {"run": "7"} and got.requests[0].params["max_new_tokens"] == 16


# ---------------------------------------------------------------- refused fields: per line, with why

REFUSED = [
    (CHAT, "n", 129, "must be in [1, 128], got 129"),
    (COMPLETIONS, "n", 0, "must be in [1, 128], got 0"),
    (COMPLETIONS, "best_of", 3, "must be 1: specbatch returns every candidate it generates; ask for n samples "
                                "with logprobs and rank them (got 3)"),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}],
     "must be empty: tool calling is not supported: specbatch generates plain text"),
    (CHAT, "tool_choice", "required", "must be \"none\" or \"auto\": tool calling is not supported"),
    (CHAT, "functions", [{"name": "f"}], "must be empty: tool calling is not supported: specbatch generates "
                                         "plain text"),
    (CHAT, "function_call", {"name": "f"}, "must be \"none\" or \"auto\": tool calling is not supported"),
    (COMPLETIONS, "echo", True, "must be false: the output is the completion only, without the prompt"),
    (CHAT, "stream", True, "must be false: batch output is not streamed"),
    (COMPLETIONS, "suffix", "}", "must be empty: specbatch does not insert text between a prompt and a suffix"),
    (CHAT, "modalities", ["text", "audio"], "must be [\"text\"]: specbatch generates text only"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "must be null: specbatch generates text only"),
    (CHAT, "reasoning_effort", "low", "must be null: specbatch's models have no reasoning-effort control"),
    (CHAT, "verbosity", "low", "must be \"medium\" (the default): specbatch has no verbosity control (got 'low')"),
    (CHAT, "web_search_options", {}, "must be null: specbatch does not search the web"),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}, "must be null: specbatch does not run moderation"),
    (CHAT, "store", "yes", "must be a boolean, got a string"),
    (CHAT, "user", 5, "must be a string, got the number 5"),
    (CHAT, "n", "2", "must be an integer in [1, 128], got a string"),
    (CHAT, "prompt", "Hi", "a field of /v1/completions requests, not of /v1/chat/completions"),
    (COMPLETIONS, "max_completion_tokens_x", 1,
     'unknown field (did you mean "max_completion_tokens"?); not part of the OpenAI request body'),
    (COMPLETIONS, "frobnicate", 1, "unknown field; not part of the OpenAI request body"),
    (COMPLETIONS, "tools", [], "a field of /v1/chat/completions requests, not of /v1/completions"),
    (CHAT, "metadata", {"n": 1}, None),
]


@pytest.mark.parametrize(("url", "field", "value", "why"), REFUSED,
                         ids=[f"{u[4:]}-{f}-{json.dumps(v)[:20]}" for u, f, v, _ in REFUSED])
def test_refused_field_names_file_line_field_and_why(url, field, value, why):
    body = {"model": "m", **({"messages": MSGS} if url == CHAT else {"prompt": "Hi"})}
    bad = {**body, field: value}
    errors = refused(line(body, url, cid="ok"), line(bad, url, cid="bad"))
    if why is None:                # a nested field
        assert errors == [f"batch.jsonl:2: body.{field}.n: must be a string, got the number 1"]
    else:
        assert errors == [f"batch.jsonl:2: body.{field}: {why}"]



@pytest.mark.parametrize(("field", "value", "why"), [
    (f, v, w) for u, f, v, w in REFUSED if w is not None and not w.startswith(("a field of", "unknown field"))
    and (f in openai_fields.CHAT_NOOP or f in openai_fields.COMPLETION_NOOP)])
def test_a_native_line_gets_the_same_reason_as_a_body(field, value, why):
    """A native line with best_of 3 or tools got "unknown key; known keys: ..." where the same
    field in an OpenAI body says why it is refused."""
    key = "messages" if field in ("tools", "tool_choice", "functions", "function_call", "modalities") else "prompt"
    ok = {"custom_id": "ok", key: MSGS if key == "messages" else "Hi"}
    errors = refused(json.dumps(ok), json.dumps({**ok, "custom_id": "bad", field: value}))
    assert errors == [f"batch.jsonl:2: {field}: {why}"]


def test_a_native_line_with_a_no_op_field_is_accepted_and_warned():
    got = read(json.dumps({"prompt": "Hi", "best_of": 1}), json.dumps({"messages": MSGS, "tools": []}))
    assert len(got.requests) == 2 and got.noop_fields == {"best_of": 1, "tools": 1}
    assert got.warnings("t")[0] == "accepted with no effect on the generated text: best_of (1 line), tools (1 line)"


# ---------------------------------------------------------------- logit processors: honoured, ranges checked


def test_penalties_bias_and_min_p_are_stored_for_the_workers():
    body = {"model": "m", "messages": MSGS, "presence_penalty": 0.5, "frequency_penalty": -1,
            "logit_bias": {"50256": -100, "7": 2.5}, "min_p": 0.1, "repetition_penalty": 1.2}
    comp = {"model": "m", "prompt": "Hi", "presence_penalty": 2, "logit_bias": {}}
    got = read(line(body), line(comp, COMPLETIONS, cid="r2"))
    a, b = got.requests
    assert not got.noop_fields
    assert {k: a.params[k] for k in intake.PROCESSOR_KEYS} == {
        "presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {"7": 2.5, "50256": -100.0},
        "min_p": 0.1, "repetition_penalty": 1.2}
    assert a.generation_params().validate().logit_bias == ((7, 2.5), (50256, -100.0))
    assert b.params["presence_penalty"] == 2.0 and "logit_bias" not in b.params


BAD_PROCESSORS = [
    ("presence_penalty", 2.5, "body.presence_penalty: must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "body.frequency_penalty: must be in [-2, 2], got -3"),
    ("frequency_penalty", "1", "body.frequency_penalty: must be a number in [-2, 2], got a string"),
    ("min_p", 1.5, "body.min_p: must be in [0, 1], got 1.5"),
    ("repetition_penalty", 0, "body.repetition_penalty: must be > 0, got 0"),
    ("logit_bias", {"5": 101}, "body.logit_bias.5: must be in [-100, 100], got 101"),
    ("logit_bias", {"x": 1}, "body.logit_bias.x: 'x' is not a token id (a non-negative integer)"),
    ("logit_bias", {"-3": 1}, "body.logit_bias.-3: '-3' is not a token id (a non-negative integer)"),
    ("logit_bias", {"5": "a"}, "body.logit_bias.5: must be a number in [-100, 100], got a string"),
    ("logit_bias", [1, 2], "body.logit_bias: must be an object of token id -> bias, got an array"),
    # an array of [id, bias] pairs is the engine's own form, not OpenAI's: it passed, and a token
    # given twice ([[5, 1], [5, 2]]) kept the last bias silently, past the check for a repeated key
    ("logit_bias", [[5, 1], [5, 2]], "body.logit_bias: must be an object of token id -> bias, got an array"),
    ("logit_bias", [], "body.logit_bias: must be an object of token id -> bias, got an array"),
]


@pytest.mark.parametrize(("field", "value", "why"), BAD_PROCESSORS,
                         ids=[f"{f}-{json.dumps(v)}" for f, v, _ in BAD_PROCESSORS])
def test_bad_processor_values_name_file_line_field(field, value, why):
    body = {"model": "m", "messages": MSGS}
    assert refused(line(body, cid="ok"), line({**body, field: value}, cid="bad")) == [f"batch.jsonl:2: {why}"]


def test_every_bad_logit_bias_entry_is_its_own_line():
    body = {"model": "m", "messages": MSGS, "logit_bias": {"1": 200, "y": 0, "3": -1}}
    assert refused(line(body)) == ["batch.jsonl:1: body.logit_bias.1: must be in [-100, 100], got 200",
                                   "batch.jsonl:1: body.logit_bias.y: 'y' is not a token id (a non-negative integer)"]


# ---------------------------------------------------------------- log-probabilities


@pytest.mark.parametrize(("url", "fields", "want"), [
    (CHAT, {"logprobs": True, "top_logprobs": 5}, 5),
    (CHAT, {"logprobs": True}, 0),
    (CHAT, {"logprobs": True, "top_logprobs": 20}, 20),
    (CHAT, {"logprobs": False, "top_logprobs": 0}, None),
    (CHAT, {"logprobs": None}, None),
    (COMPLETIONS, {"logprobs": 5}, 5),
    (COMPLETIONS, {"logprobs": 0}, 0),
    (COMPLETIONS, {"logprobs": None}, None),
])
def test_logprobs_fields_set_the_top_alternatives(url, fields, want):
    body = {"model": "m", **({"messages": MSGS} if url == CHAT else {"prompt": "Hi"}), **fields}
    (r,) = read(line(body, url)).requests
    assert r.params.get("logprobs") == want
    assert r.generation_params().logprobs == want


@pytest.mark.parametrize(("url", "fields", "why"), [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "body.top_logprobs: must be in [0, 20], got 21"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "body.top_logprobs: must be in [0, 20], got -1"),
    (CHAT, {"top_logprobs": 3}, "body.top_logprobs: needs logprobs: true (got null)"),
    (CHAT, {"logprobs": 3}, "body.logprobs: must be a boolean, got the number 3"),
    (COMPLETIONS, {"logprobs": 6}, "body.logprobs: must be in [0, 5], got 6"),
    # (true is chat's form: qa55 asked that the message say so)
    (COMPLETIONS, {"logprobs": True}, "body.logprobs: must be an integer in [0, 5], got a boolean (true is a "
                                      "chat line's form, with top_logprobs)"),
])
def test_bad_logprobs_fields(url, fields, why):
    body = {"model": "m", **({"messages": MSGS} if url == CHAT else {"prompt": "Hi"}), **fields}
    assert refused(line(body, url)) == [f"batch.jsonl:1: {why}"]


def test_native_lines_take_the_logprobs_fields_of_their_kind():
    native = [json.dumps({"custom_id": "a", "prompt": "Hi", "logprobs": 3}),
              json.dumps({"custom_id": "b", "messages": MSGS, "logprobs": True, "top_logprobs": 4})]
    a, b = read(*native).requests
    assert (a.params["logprobs"], b.params["logprobs"]) == (3, 4)
    assert refused(json.dumps({"prompt": "Hi", "top_logprobs": 2})) == [
        "batch.jsonl:1: top_logprobs: a prompt line takes logprobs (0..5), as /v1/completions"]
    assert refused(json.dumps({"prompt": "Hi", "logprobs": True})) == [
        "batch.jsonl:1: logprobs: must be an integer in [0, 5], got a boolean (true is a messages line's form, "
        "with top_logprobs)"]


# ---------------------------------------------------------------- also accepted


def test_content_parts_developer_role_names_and_max_completion_tokens():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b",
                                                         "prompt_cache_breakpoint": {"mode": "explicit"}}]},
            {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            {"role": "user", "content": "again"}]
    (r,) = read(line({"model": "m", "messages": msgs, "max_completion_tokens": 7})).requests
    assert r.messages == [{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": "a\nb", "name": "ann"},
                          {"role": "assistant", "content": "ok"},
                          {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                          {"role": "user", "content": "again"}]
    assert r.params["max_new_tokens"] == 7


@pytest.mark.parametrize(("prompt", "text", "ids"), [
    ([1, 2, 3], None, [1, 2, 3]), ([[4, 5]], None, [4, 5]), (["one"], "one", None), ("two", "two", None)])
def test_completion_prompt_forms(prompt, text, ids):
    (r,) = read(line({"model": "m", "prompt": prompt}, COMPLETIONS)).requests
    assert (r.kind, r.prompt, r.prompt_ids) == ("completion", text, ids)


@pytest.mark.parametrize(("prompt", "why"), [
    (["a", "b"], "holds 2 prompts; give one prompt per line"),
    ([[1], [2]], "holds 2 prompts; give one prompt per line"),
    ([1, -2], "token ids must be >= 0"), ([], "must not be empty"),
    ([1, "a"], "must be a string or an array of token ids, got an array")])
def test_bad_completion_prompts(prompt, why):
    assert refused(line({"model": "m", "prompt": prompt}, COMPLETIONS)) == [f"batch.jsonl:1: body.prompt: {why}"]


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
     "messages[0].content[0]: image parts need a vision model; specbatch generates from text only"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
     "messages[0].content[0]: audio parts are not supported; specbatch generates from text only"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
     "messages[0].tool_calls: must be null or empty: tool calling is not supported: specbatch generates "
     "plain text"),
    ({"role": "assistant", "content": "x", "refusal": "no"},
     "messages[0].refusal: must be null: give the assistant's text as content"),
    ({"role": "function", "content": "x", "name": "f"},
     'messages[0].role: must be one of system, developer, user, assistant, tool (got "function")'),
    ({"role": "user", "content": "x", "tool_call_id": "c"},
     "messages[0].tool_call_id: unknown key for a user message; known keys: role, content, name"),
    ({"role": "user", "content": "x", "name": 3}, "messages[0].name: must be a string, got the number 3"),
])
def test_refused_messages(message, error):
    assert refused(line({"model": "m", "messages": [message]})) == [f"batch.jsonl:1: body.{error}"]


def test_null_parameters_are_not_given():
    (r,) = read(line({"model": "m", "messages": MSGS, "temperature": None, "top_p": None, "seed": None,
                      "stop": None, "max_tokens": None})).requests
    assert r.params == intake.job_params({})


# ---------------------------------------------------------------- body.model routing


def test_model_map_routes_by_body_model():
    got = read(line({"model": "small", "messages": MSGS}, cid="a"),
               line({"model": "big", "prompt": "x"}, COMPLETIONS, cid="b"),
               json.dumps({"custom_id": "c", "prompt": "plain line"}),
               model_map=["small=tgt-s,d1,d2", "big=tgt-b"])
    a, b, c = got.requests
    assert (a.model, a.target, a.drafts) == ("small", "tgt-s", ["d1", "d2"])
    assert (b.model, b.target, b.drafts) == ("big", "tgt-b", [])
    assert (c.model, c.target, c.drafts) == (None, None, None)          # the job's pair
    assert got.warnings("t") == []                                      # the model is not ignored


def test_a_route_draft_may_be_written_as_a_model_spec():
    # --draft's "model:NAME" form names the same model on a route ("model:d1" was a model of that name)
    assert intake.parse_model_map(["a=t,model:d1,d2"], allow_remote=True) == {"a": ("t", ["d1", "d2"])}


def test_unmapped_model_is_refused_per_line():
    assert refused(line({"model": "small", "messages": MSGS}, cid="a"),
                   line({"model": "gpt-4o", "messages": MSGS}, cid="b"), model_map=["small=t"]) == [
        'batch.jsonl:2: body.model: "gpt-4o" is not a mapped model (--model-map, or an API batch\'s '
        'specbatch_model_map metadata; mapped: small)']


@pytest.mark.parametrize(("spec", "why"), [
    ("small", "'small': expected NAME=TARGET or NAME=TARGET,DRAFT[,DRAFT...]"),
    ("=t", "'=t': expected NAME=TARGET or NAME=TARGET,DRAFT[,DRAFT...]"),
    ("a=t,", "'a=t,': expected NAME=TARGET or NAME=TARGET,DRAFT[,DRAFT...]"),
    # a drafter that loads no model is the job's, for every route: it was "model 'ngram' not found" (qa55)
    ("a=t,ngram", "'a=t,ngram': ngram loads no model: it drafts for every route of the job (--ngram, "
                  "or the specbatch_ngram metadata of an API batch)"),
    # a drafter kind, read as a drafter: it was "model 'eagle:h' not found"
    ("a=t,eagle:h", "'a=t,eagle:h': drafter 'eagle:h': EAGLE heads need the target's hidden states per step; "
                    "not available yet")])
def test_bad_model_map(spec, why):
    with pytest.raises(IntakeError) as e:
        intake.parse_model_map([spec])
    assert str(e.value.errors[0]) == f"--model-map: {why}"
    with pytest.raises(IntakeError, match="'a' is mapped twice"):
        intake.parse_model_map(["a=t", "a=u"], allow_remote=True)


def test_the_example_openai_batch_file():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "openai_batch.jsonl"
    got = intake.read_file(path, {}, SETTINGS)
    assert [(r.custom_id, r.kind, r.model) for r in got.requests] == [
        ("request-1", "chat", "gpt-4o-mini"), ("request-2", "chat", "gpt-4o-mini"),
        ("request-3", "completion", "gpt-3.5-turbo-instruct"), ("request-4", "completion", "gpt-3.5-turbo-instruct")]
    assert got.requests[1].metadata == {"topic": "physics", "split": "train"}
    assert got.requests[3].prompt_ids == [504, 2062, 6715]
    assert set(got.noop_fields) == {"store", "service_tier", "metadata", "echo"}
    assert len(got.warnings("t")) == 2


def test_the_example_chat_batch_file_runs_on_one_endpoint():
    """The README's HTTP API example uploads it with endpoint /v1/chat/completions."""
    from pathlib import Path

    from specbatch.jobs.batches import endpoint_mismatches

    got = intake.read_file(Path(__file__).resolve().parents[2] / "examples" / "openai_chat_batch.jsonl", {}, SETTINGS)
    assert len(got.requests) == 4 and {r.kind for r in got.requests} == {"chat"}
    assert endpoint_mismatches(got.requests, "/v1/chat/completions") == []
    assert [e["line"] for e in endpoint_mismatches(got.requests, "/v1/completions")] == [1, 2, 3, 4]


def test_top_p_zero_is_greedy():
    """OpenAI accepts top_p 0 (only the most likely token remains): greedy, whatever the temperature."""
    (r,) = read(line({"model": "m", "messages": MSGS, "top_p": 0, "temperature": 0.8, "seed": 3})).requests
    assert (r.params["temperature"], r.params["top_p"], r.params["seed"]) == (0.0, 1.0, 3)
    assert refused(line({"model": "m", "messages": MSGS, "top_p": -0.5})) == [
        "batch.jsonl:1: body.top_p: must be in [0, 1] (0: the most likely token only), got -0.5"]
    # a native line reads it the same way (one file may hold both kinds; docs/FORMATS.md, one table)
    (n,) = read(json.dumps({"custom_id": "x", "prompt": "p", "top_p": 0, "temperature": 0.8})).requests
    assert (n.params["temperature"], n.params["top_p"]) == (0.0, 1.0)


def test_a_near_miss_of_a_known_model_name_is_refused_with_the_name_it_meant(tmp_path, monkeypatch):
    from specbatch.engine.known_models import misspelt

    assert misspelt("smolm2-135m") == "smollm2-135m" and misspelt("qwen2.5-coder-1.5") == "qwen2.5-coder-1.5b"
    assert misspelt("s" * 300) is None            # longer than a file name may be: no OSError
    for fine in ("smollm2-135m", "big", "org/smolm2-135m", "./smolm2-135m", "smolm2-135m.gguf"):
        assert misspelt(fine) is None, fine
    (tmp_path / "smolm2-135m").mkdir()          # a directory of that name here is a model directory
    monkeypatch.chdir(tmp_path)
    assert misspelt("smolm2-135m") is None
    with pytest.raises(IntakeError) as e:
        intake.parse_model_map(["gpt-4o=org/big,smollm2-135m-int9"])
    assert "did you mean smollm2-135m-int8?" in str(e.value.errors[0])


def test_a_null_field_of_the_other_url_is_not_given(tmp_path):
    """Batch lines of both URLs in one table, written by ``datasets.Dataset.to_json``: each body
    gets the other URL's fields as null (a chat body ``"prompt": null``); null is "not given"
    there as everywhere in a body, while a value of the other URL is still refused."""
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                     "prompt": None, "echo": None, "suffix": None}}
    comp = {"custom_id": "p", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "The capital", "max_tokens": 4, "logprobs": 1, "messages": None,
                     "top_logprobs": None, "response_format": None}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(chat) + "\n" + json.dumps(comp) + "\n")
    a, b = intake.parse_file(path, None, Settings(database_url="sqlite://"))
    assert (a.kind, a.messages, b.kind, b.prompt, b.params["logprobs"]) == (
        "chat", [{"role": "user", "content": "Hi"}], "completion", "The capital", 1)
    chat["body"]["prompt"] = "x"
    path.write_text(json.dumps(chat) + "\n")
    with pytest.raises(IntakeError) as e:
        intake.parse_file(path, None, Settings(database_url="sqlite://"))
    assert [str(err) for err in e.value.errors] == [
        f"{path}:1: body.prompt: a field of /v1/completions requests, not of /v1/chat/completions"]


def test_a_chat_body_without_messages_reads_logprobs_as_chat():
    """The URL says which API a body is: a chat body missing ``messages`` is that one error, its
    ``logprobs: true`` (chat's boolean) not a second one about completions' integer."""
    with pytest.raises(IntakeError) as e:
        read(line({"model": "m", "logprobs": True, "top_logprobs": 2}))
    assert [str(err) for err in e.value.errors] == [
        "batch.jsonl:1: body.messages: is required for /v1/chat/completions"]
