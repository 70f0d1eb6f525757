"""Every field of OpenAI's Chat Completions and Completions request bodies, and what intake does
with it (docs/FORMATS.md, "OpenAI batch lines").

The field lists follow the ``openai`` package's request types (``openai.types.chat.
completion_create_params`` and ``openai.types.completion_create_params``); tests/jobs/
test_openai_intake.py fails when the package gains a field that is not sorted here.

Three kinds of field:
  - honoured: the generation parameters (penalties and ``logit_bias`` included, exact under
    speculation: specbatch.engine.processors), ``n`` (samples sharing one prefill), ``logprobs``, the prompt, ``model`` (routing),
    ``metadata`` (kept) and ``response_format`` (structured outputs, specbatch.jobs.structured);
  - no-op: accepted when its value cannot change the generated text (``best_of`` 1, ``store``,
    ``service_tier``, ...); the job warns once, listing them;
  - refused: a value specbatch cannot honour (``best_of`` > 1, tools, ...), reported
    per line as ``FILE:LINE: body.FIELD: why``.
A no-op field's check returns None when the value is accepted, else the reason it is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specbatch.engine.rules import json_type

__all__ = ["json_type"]   # re-exported: intake's messages use it too

Check = Callable[[Any], "str | None"]

# honoured by intake itself (see specbatch.jobs.intake): prompt/messages, parameters, model, metadata
PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias")
CHAT_HONOURED = ("messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                 "stop", "metadata", *PROCESSOR_FIELDS, "logprobs", "top_logprobs", "n",
                 "response_format")   # response_format: specbatch.jobs.structured
COMPLETION_HONOURED = ("prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stop", *PROCESSOR_FIELDS,
                       "logprobs", "n")
# not OpenAI's, accepted on both URLs (vLLM has top_k, min_p, repetition_penalty, structured_outputs and
# its older guided_json/_regex/_choice/_grammar; max_new_tokens is specbatch's own alias)
EXTENSIONS = ("top_k", "max_new_tokens", "min_p", "repetition_penalty", "structured_outputs",
              "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _any_of(*types: type, what: str) -> Check:
    """Accepted (no effect on the text) whenever it has the documented type, or is null."""
    def check(v: Any) -> str | None:
        if v is None or isinstance(v, types):
            return None
        return f"must be {what}, got {json_type(v)}"
    return check


def _one(what: str) -> Check:
    def check(v: Any) -> str | None:
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            return None
        if not (isinstance(v, int) and not isinstance(v, bool)):
            return f"must be 1, got {json_type(v)}"
        return f"must be 1: {what} (got {v})"
    return check


def _false(why: str) -> Check:
    def check(v: Any) -> str | None:
        if v is None or v is False:
            return None
        return f"must be false: {why}" if v is True else f"must be false, got {json_type(v)}"
    return check


def _empty(why: str, container: type) -> Check:
    def check(v: Any) -> str | None:
        if v is None or (isinstance(v, container) and not v):
            return None
        return f"{why}" if isinstance(v, container) else f"must be {json_type(container())}, got {json_type(v)}"
    return check


def _tool_choice(v: Any) -> str | None:
    if v is None or v in ("none", "auto"):      # "auto" with no tools: nothing to call
        return None
    return "must be \"none\" or \"auto\": tool calling is not supported"


def _modalities(v: Any) -> str | None:
    if v is None or v == ["text"]:
        return None
    return 'must be ["text"]: specbatch generates text only'


def _verbosity(v: Any) -> str | None:
    if v is None or v == "medium":              # OpenAI's default
        return None
    return f'must be "medium" (the default): specbatch has no verbosity control (got {v!r})'


def _null(why: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v is None else why
    return check


def _suffix(v: Any) -> str | None:
    if v is None or v == "":
        return None
    return "must be empty: specbatch does not insert text between a prompt and a suffix"


_STR = _any_of(str, what="a string")
_BOOL = _any_of(bool, what="a boolean")
_OBJ = _any_of(dict, what="an object")
_NO_TOOLS = "tool calling is not supported: specbatch generates plain text"

CHAT_NOOP: dict[str, Check] = {
    "stream": _false("batch output is not streamed"),
    "stream_options": _OBJ,
    "tools": _empty(f"must be empty: {_NO_TOOLS}", list),
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _BOOL,
    "functions": _empty(f"must be empty: {_NO_TOOLS}", list),
    "function_call": _tool_choice,
    "store": _BOOL,
    "service_tier": _STR,
    "user": _STR,
    "safety_identifier": _STR,
    "prompt_cache_key": _STR,
    "prompt_cache_retention": _STR,
    "prompt_cache_options": _OBJ,
    "prediction": _OBJ,          # a predicted output changes latency, never the text
    "modalities": _modalities,
    "audio": _null("must be null: specbatch generates text only"),
    "reasoning_effort": _null("must be null: specbatch's models have no reasoning-effort control"),
    "verbosity": _verbosity,
    "web_search_options": _null("must be null: specbatch does not search the web"),
    "moderation": _null("must be null: specbatch does not run moderation"),
}

COMPLETION_NOOP: dict[str, Check] = {
    # best_of > 1 ranks candidates by mean log-probability and drops some: not implemented;
    # n samples with logprobs give the same candidates to rank
    "best_of": _one("specbatch returns every candidate it generates; ask for n samples with "
                    "logprobs and rank them"),
    "stream": _false("batch output is not streamed"),
    "stream_options": _OBJ,
    "echo": _false("the output is the completion only, without the prompt"),
    "suffix": _suffix,
    "user": _STR,
}

# every field OpenAI documents for each URL: tests compare these with the openai package's types
CHAT_FIELDS = frozenset((*CHAT_HONOURED, *CHAT_NOOP, "stream"))
COMPLETION_FIELDS = frozenset((*COMPLETION_HONOURED, *COMPLETION_NOOP))

# message keys per role (openai.types.chat.ChatCompletion*MessageParam); None: no-op when null/empty
MESSAGE_KEYS: dict[str, tuple[str, ...]] = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "refusal", "tool_calls", "function_call", "audio"),
    "tool": ("role", "content", "tool_call_id"),
}
ROLES = tuple(MESSAGE_KEYS)
# assistant keys accepted only when null or empty (earlier tool calls cannot be replayed without tools)
ASSISTANT_NULL_KEYS = {
    "refusal": "must be null: give the assistant's text as content",
    "tool_calls": f"must be null or empty: {_NO_TOOLS}",
    "function_call": f"must be null: {_NO_TOOLS}",
    "audio": "must be null: specbatch generates text only",
}
TEXT_PART_KEYS = ("type", "text", "prompt_cache_breakpoint")
UNSUPPORTED_PARTS = {
    "image_url": "image parts need a vision model; specbatch generates from text only",
    "input_audio": "audio parts are not supported; specbatch generates from text only",
    "file": "file parts are not supported; give the file's text as a text part",
    "refusal": "refusal parts are not supported; give the assistant's text as a text part",
}
