"""Prompt files in: read and validate every JSONL line before anything is written.

Three line forms (docs/FORMATS.md):

    {"custom_id": "q1", "prompt": "Write a haiku", "max_tokens": 64}
    {"custom_id": "q2", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7}
    {"custom_id": "q3", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

The third is an OpenAI batch line; what each of its body fields does is in
specbatch.jobs.openai_fields. ``read_file`` / ``read_stream`` return every request with the
job's warnings (``parse_file``: the requests only) or raise one IntakeError
listing every problem as ``FILE:LINE: field: what is wrong``. Blank lines, a UTF-8 BOM and CRLF
line ends are fine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from specbatch.config import Settings
from specbatch.engine import rules
from specbatch.engine.drafter_specs import DrafterSpec
from specbatch.engine.known_models import name_problem, tokenizer_mismatch
from specbatch.engine.types import GenerationParams
from specbatch.errors import InputError, IntakeError, ModelLoadError, RequestError
from specbatch.jobs import openai_fields, structured
from specbatch.jobs.context import ContextCheck
from specbatch.jobs.openai_fields import json_type
from specbatch.jobs.structured import unreadable
from specbatch.plural import plural

logger = logging.getLogger(__name__)

PARAM_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# logit processors (specbatch.engine.processors): stored in a request's params only when given
PROCESSOR_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p")
# samples per line (GenerationParams.n): stored in a request's params only when given
SAMPLE_KEYS = ("n",)
MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens", "max_completion_tokens")
LINE_KEYS = ("custom_id", "prompt", "messages", *MAX_TOKENS_KEYS, "temperature", "top_p",
             "top_k", "seed", "stop", *PROCESSOR_KEYS, *SAMPLE_KEYS, "logprobs", "top_logprobs",
             "model", "metadata", *structured.FIELDS)
BATCH_KEYS = ("custom_id", "method", "url", "body")
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}   # url -> the line kind it runs
ROLES = openai_fields.ROLES
MAX_CUSTOM_ID = 512
MAX_SEED = rules.MAX_SEED
KEPT_ERRORS = 1000          # errors kept in memory; the total is always counted
BOM = b"\xef\xbb\xbf"
_MISSING = object()

Route = tuple[str, list[str]]       # (target, drafts) a --model-map entry sends a body.model to


@dataclass(frozen=True)
class ParsedRequest:
    """One valid line. ``params`` holds every GenerationParams field of PARAM_KEYS, resolved, and
    those of PROCESSOR_KEYS the line gives (``logit_bias`` as {"token id": bias})."""

    line_no: int
    custom_id: str
    kind: str                                   # "completion" | "chat"
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    model: str | None = None                    # body.model as given
    target: str | None = None                   # where --model-map routed it; None: the job's pair
    drafts: list[str] | None = None
    metadata: dict[str, str] | None = None      # body.metadata, kept and exported
    prompt_ids: list[int] | None = None         # a completions prompt given as token ids
    openai: bool = False                        # an OpenAI batch line (its fields are body.*)

    def generation_params(self) -> GenerationParams:
        return params_from_dict(self.params)


@dataclass
class ParsedFile:
    """A valid file: its requests, and what the job's warning says about it."""

    requests: list[ParsedRequest]
    noop_fields: dict[str, int] = dataclasses.field(default_factory=dict)   # accepted, cannot change the text -> lines
    models: dict[str, int] = dataclasses.field(default_factory=dict)        # body.model -> lines
    model_map: dict[str, Route] | None = None
    unused_defaults: list[str] = dataclasses.field(default_factory=list)    # job options every line overrides

    def warnings(self, target: str) -> list[str]:
        """One line per kind of thing the user may not expect (``target``: the job's target)."""
        out = []
        if self.noop_fields:
            listed = ", ".join(f"{k} ({n} line{'s' if n > 1 else ''})" for k, n in sorted(self.noop_fields.items()))
            kept = "; metadata is kept and exported" if "metadata" in self.noop_fields else ""
            out.append(f"accepted with no effect on the generated text: {listed}{kept}")
        others = {k: n for k, n in self.models.items() if k != target}   # naming the target is no surprise
        if others and self.model_map is None:
            listed = ", ".join(f"{k} ({n} line{'s' if n > 1 else ''})" for k, n in sorted(others.items()))
            out.append(f"model is ignored without --model-map: {listed}; every request runs on {target}")
        for key in self.unused_defaults:     # `--temperature 0` meant as "all greedy" changed nothing
            field = "max_tokens" if key == "max_new_tokens" else key
            out.append(f"--{key.replace('_', '-')} applies to no line: every line sets its own {field}, "
                       "which wins over the option")
        return out


def _route_drafts(texts: list[str]) -> list[str] | str:
    """A route's draft models (``model:`` written or implied), or why one of them cannot be a
    route's: a drafter that loads no model drafts for every route of the job."""
    drafts = []
    for text in texts:
        try:
            spec = DrafterSpec.parse(text)
        except ModelLoadError as e:
            return str(e)
        if not spec.loads_model:
            return (f"{spec} loads no model: it drafts for every route of the job (--ngram, or the "
                    "specbatch_ngram metadata of an API batch)")
        drafts.append(spec.arg)
    return drafts


def parse_model_map(specs: list[str] | tuple[str, ...], *, allow_remote: bool = False
                    ) -> dict[str, Route] | None:
    """``NAME=TARGET[,DRAFT...]`` options into {NAME: (TARGET, [DRAFT, ...])}; None for no option.
    A NAME without drafts uses none (plain decoding, plus the job's drafters that load no model:
    --ngram). A model that is no model on this machine (``known_models.name_problem``) is refused
    unless ``allow_remote``."""
    if not specs:
        return None
    out: dict[str, Route] = {}
    errors: list[InputError] = []
    for spec in specs:
        name, sep, pair = spec.partition("=")
        models = [m.strip() for m in pair.split(",")]
        if not sep or not name.strip() or not all(models):
            errors.append(InputError(f"{spec!r}: expected NAME=TARGET or NAME=TARGET,DRAFT[,DRAFT...]",
                                     field="--model-map"))
        elif name.strip() in out:
            errors.append(InputError(f"{name.strip()!r} is mapped twice", field="--model-map"))
        elif isinstance(drafts := _route_drafts(models[1:]), str):
            errors.append(InputError(f"{spec!r}: {drafts}", field="--model-map"))
        elif not allow_remote and (bad := [p for p in map(name_problem, [models[0], *drafts]) if p]):
            errors.append(InputError(f"{spec!r}: {bad[0]}", field="--model-map"))
        elif mismatch := tokenizer_mismatch(models[0], drafts):
            errors.append(InputError(f"{spec!r}: {mismatch}", field="--model-map"))
        else:
            out[name.strip()] = (models[0], drafts)
    if errors:
        raise IntakeError(errors)
    return out


_GENERATION_FIELDS = frozenset(f.name for f in fields(GenerationParams))


def params_from_dict(params: dict[str, Any]) -> GenerationParams:
    """GenerationParams from a stored params dict (``stop`` is a JSON list there)."""
    values = {k: v for k, v in params.items() if k in _GENERATION_FIELDS}
    if "stop" in values:
        values["stop"] = tuple(values["stop"] or ())
    return GenerationParams(**values)


class _Problems(Exception):
    """Raised inside a line's checks; carries (field, message) pairs."""

    def __init__(self, problems: list[tuple[str | None, str]]) -> None:
        self.problems = problems




def _is_number(v: Any) -> bool:
    return rules.is_number(v)


def _is_int(v: Any) -> bool:
    return rules.is_int(v)


def _check_param(name: str, v: Any) -> tuple[Any, str | None]:
    """(normalised value, problem or None) for one generation parameter: the rule table of
    specbatch.engine.rules, which GenerationParams.validate applies too."""
    if name in MAX_TOKENS_KEYS:
        return rules.check("max_new_tokens", v)
    if name == "stop":
        if isinstance(v, list) and not v:    # given, and empty: README says non-empty (null: no stop)
            return v, "must not be an empty list; leave stop out (or null) for no stop string"
        return rules.check_stop(v)
    return rules.check(name, v)


def _check_logit_bias(v: Any, field: str) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """{"token id": bias}, as stored (JSON keys are strings); every bad entry is one problem."""
    bias, problems = rules.check_logit_bias(v)
    return {str(k): b for k, b in sorted(bias.items())}, [(field + where, why) for where, why in problems]


def _check_logprobs(fields_: dict[str, Any], prefix: str, chat: bool) -> tuple[int | None, list[tuple[str, str]]]:
    """(top alternatives per token or None, problems), as OpenAI reads the fields: chat takes
    ``logprobs: true`` and ``top_logprobs`` 0..20; completions take ``logprobs`` 0..5."""
    lp = fields_.get("logprobs")
    if not chat:
        if lp is None or lp is False:
            return None, []
        value, why = rules.COMPLETION_LOGPROBS.check(lp)
        if why and lp is True:       # the other kind's form: say which
            why += f" (true is a {'chat' if prefix else 'messages'} line's form, with top_logprobs)"
        return (None, [(prefix + "logprobs", why)]) if why else (value, [])
    problems: list[tuple[str, str]] = []
    if lp is not None and not isinstance(lp, bool):
        problems.append((prefix + "logprobs", f"must be a boolean, got {json_type(lp)}"))
    top, why = rules.check("logprobs", fields_.get("top_logprobs"))
    if why:
        problems.append((prefix + "top_logprobs", why))
    elif top and lp is not True:
        problems.append((prefix + "top_logprobs", f"needs logprobs: true (got {json.dumps(lp)})"))
    return ((top or 0) if lp is True and not problems else None), problems


def job_params(defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The job's default parameters: GenerationParams defaults overridden by the non-None ``defaults``.

    ``defaults`` holds command-line options (``max_new_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``seed``, ``stop``). Raises IntakeError naming the option if one is invalid.
    """
    base = GenerationParams()
    params: dict[str, Any] = {k: getattr(base, k) for k in PARAM_KEYS}
    params["stop"] = list(params["stop"])
    problems: list[InputError] = []
    for key, value in (defaults or {}).items():
        if key not in PARAM_KEYS:
            raise ValueError(f"unknown default {key!r}; expected one of {PARAM_KEYS}")
        if value is None or (key == "stop" and value == ()):
            continue
        value, problem = _check_param(key, value)
        if problem:
            problems.append(InputError(problem, field="--" + key.replace("_", "-")))
        params[key] = value
    if problems:
        raise IntakeError(problems)
    return params


def _check_text_content(content: Any, where: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A message's content: a string, or OpenAI content parts of which only text parts are supported
    (joined with newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        got = "missing" if content is _MISSING else f"got {json_type(content)}"
        return None, [(f"{where}.content", f"must be a string or an array of text parts ({got})")]
    problems: list[tuple[str, str]] = []
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in openai_fields.UNSUPPORTED_PARTS:
            problems.append((at, openai_fields.UNSUPPORTED_PARTS[kind]))
        elif kind != "text" or not isinstance(part.get("text"), str):
            problems.append((at, 'must be a {"type": "text", "text": ...} part'))
        else:
            problems += [(f"{at}.{k}", f"unknown key; known keys: {', '.join(openai_fields.TEXT_PART_KEYS)}")
                         for k in part if k not in openai_fields.TEXT_PART_KEYS]
            texts.append(part["text"])
    return "\n".join(texts), problems


def _check_messages(v: Any, field: str) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """OpenAI chat messages (per-role keys of openai.types.chat), normalised to
    ``{"role", "content": str, ["name"], ["tool_call_id"]}``."""
    problems: list[tuple[str, str]] = []
    if not isinstance(v, list):
        return v, [(field, f"must be an array of {{\"role\", \"content\"}} objects, got {json_type(v)}")]
    if not v:
        return v, [(field, "must not be empty")]
    out: list[dict[str, Any]] = []
    for i, m in enumerate(v):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            problems.append((where, f"must be an object with \"role\" and \"content\", got {json_type(m)}"))
            continue
        role = m.get("role")
        if role not in ROLES:
            got = "missing" if "role" not in m else f"got {json.dumps(role)}"
            problems.append((f"{where}.role", f"must be one of {', '.join(ROLES)} ({got})"))
            continue
        known = openai_fields.MESSAGE_KEYS[role]
        for k in m:
            if k not in known:
                problems.append((f"{where}.{k}", f"unknown key for a {role} message; known keys: {', '.join(known)}"))
            elif k in openai_fields.ASSISTANT_NULL_KEYS and m[k] not in (None, []):
                problems.append((f"{where}.{k}", openai_fields.ASSISTANT_NULL_KEYS[k]))
        content = m.get("content", _MISSING)
        if role == "assistant" and content is None:     # OpenAI allows it beside tool calls (refused)
            content = ""
        content, more = _check_text_content(content, where)
        problems += more
        msg: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if key in m and key in known:
                if not isinstance(m[key], str):
                    problems.append((f"{where}.{key}", f"must be a string, got {json_type(m[key])}"))
                msg[key] = m[key]
        out.append(msg)
    return out, problems


def _check_prompt(v: Any, field: str) -> tuple[str | None, list[int] | None, list[tuple[str, str]]]:
    """A completions prompt: a string, a token-id array, or a one-element array of either
    (OpenAI also takes several prompts per request; specbatch wants one line per prompt)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        return (v, None, []) if v else (None, None, [(field, "must not be empty")])
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        if any(t < 0 for t in v):
            return None, None, [(field, "token ids must be >= 0")]
        return None, list(v), []
    if isinstance(v, list) and len(v) > 1 and all(isinstance(x, (str, list)) for x in v):
        return None, None, [(field, f"holds {len(v)} prompts; give one prompt per line")]
    if isinstance(v, list) and not v:
        return None, None, [(field, "must not be empty")]
    return None, None, [(field, f"must be a string or an array of token ids, got {json_type(v)}")]


def _check_metadata(v: Any, field: str) -> tuple[dict[str, str] | None, list[tuple[str, str]]]:
    if v is None:
        return None, []
    if not isinstance(v, dict):
        return None, [(field, f"must be an object of strings, got {json_type(v)}")]
    bad = [(f"{field}.{k}", f"must be a string, got {json_type(x)}") for k, x in v.items() if not isinstance(x, str)]
    return (None, bad) if bad else (dict(v), [])


def _unknown(obj: dict[str, Any], known: tuple[str, ...], prefix: str) -> list[tuple[str, str]]:
    return [(prefix + k, f"unknown key{_did_you_mean(k, known)}; known keys: {', '.join(known)}")
            for k in obj if k not in known]


# OpenAI's fields that specbatch accepts only where they cannot change the text (best_of 1, no
# tools, ...): a native line giving one is checked as a body is, for the same reason when refused
OPENAI_NOOP_CHECKS = {**openai_fields.CHAT_NOOP, **openai_fields.COMPLETION_NOOP}


def _check_native_keys(obj: dict[str, Any], noop: set[str]) -> list[tuple[str | None, str]]:
    """A native line's keys: its own, an OpenAI no-op field (accepted into ``noop``, or refused
    with why: "best_of: must be 1: ..."; before, "unknown key"), else unknown."""
    problems: list[tuple[str | None, str]] = []
    for k, v in obj.items():
        if k in LINE_KEYS:
            continue
        if (check := OPENAI_NOOP_CHECKS.get(k)) is None:
            problems += _unknown({k: v}, LINE_KEYS, "")
        elif why := check(v):
            problems.append((k, why))
        else:
            noop.add(k)
    return problems


def _did_you_mean(key: str, known: tuple[str, ...]) -> str:
    """' (did you mean "max_tokens"?)' for a key a typo away from a known one (``max_tokns``), else ""."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _check_body(body: dict[str, Any], kind: str | None, noop: set[str]) -> list[tuple[str | None, str]]:
    """The body's fields against OpenAI's lists for its URL; accepted no-op fields go to ``noop``."""
    problems: list[tuple[str | None, str]] = []
    if kind == "chat":
        fields_, checks, other, api = (openai_fields.CHAT_FIELDS, openai_fields.CHAT_NOOP,
                                       openai_fields.COMPLETION_FIELDS, "/v1/completions")
    else:
        fields_, checks, other, api = (openai_fields.COMPLETION_FIELDS, openai_fields.COMPLETION_NOOP,
                                       openai_fields.CHAT_FIELDS, "/v1/chat/completions")
    allowed = fields_ | set(openai_fields.EXTENSIONS) | {"max_completion_tokens"}
    for k, v in body.items():
        if kind is None or (v is None and k in other and k not in allowed):
            continue      # null is "not given": a table of both URLs' lines has the other's fields null
        if k not in allowed:
            why = (f"a field of {api} requests, not of {next(u for u, x in BATCH_URLS.items() if x == kind)}"
                   if k in other else
                   f"unknown field{_did_you_mean(k, tuple(sorted(allowed)))}; not part of the OpenAI request body")
            problems.append(("body." + k, why))
        elif k in checks:
            problem = checks[k](v)
            if problem:
                problems.append(("body." + k, problem))
            else:
                noop.add(k)
    return problems


def _parse_object(obj: dict[str, Any], base_params: dict[str, Any],
                  model_map: dict[str, Route] | None = None, job_temperature: bool = False) -> dict[str, Any]:
    """Validate one decoded line; returns the ParsedRequest fields (custom_id may be None) and
    ``noop``, the accepted fields that cannot change the text. ``job_temperature``: the job's
    options set a temperature (``--temperature``) for the lines that set none."""
    problems: list[tuple[str | None, str]] = []
    noop: set[str] = set()
    route = None
    if any(k in obj for k in ("method", "url", "body")):      # an OpenAI Batch API line
        problems += _unknown(obj, BATCH_KEYS, "")
        if obj.get("method", "POST") != "POST":
            problems.append(("method", f"must be \"POST\", got {json.dumps(obj.get('method'))}"))
        url = obj.get("url")
        kind = BATCH_URLS.get(url) if isinstance(url, str) else None
        if kind is None:
            problems.append(("url", f"must be one of {', '.join(BATCH_URLS)} (got {json.dumps(url)})"))
        body = obj.get("body")
        if not isinstance(body, dict):
            problems.append(("body", f"must be an object, got {json_type(body)}"
                             if "body" in obj else "is required"))
            raise _Problems(problems)
        problems += _check_body(body, kind, noop)
        fields_, prefix = body, "body."
        has_prompt = kind != "chat" and "prompt" in body        # the other URL's key: refused above
        has_messages = kind != "completion" and "messages" in body
        if kind == "chat" and "messages" not in body:
            problems.append(("body.messages", "is required for /v1/chat/completions"))
        if kind == "completion" and "prompt" not in body:
            problems.append(("body.prompt", "is required for /v1/completions"))
    else:
        problems += _check_native_keys(obj, noop)
        fields_, prefix = obj, ""
        # null is "not given", as for every other field: a table of chat and completion rows
        # (datasets' to_json, pandas') writes the column a row does not use as null
        has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    # model and metadata, as OpenAI's body has them: a native line may give them too
    model = fields_.get("model")
    if model is not None and not isinstance(model, str):
        problems.append((prefix + "model", f"must be a string, got {json_type(model)}"))
        model = None
    if model_map is not None and model is not None:
        route = model_map.get(model)
        if route is None:
            # (one wording for both edges: intake cannot tell the CLI's option from the API's key)
            problems.append((prefix + "model", f"{json.dumps(model)} is not a mapped model (--model-map, or an "
                                               f"API batch's specbatch_model_map metadata; mapped: "
                                               f"{', '.join(sorted(model_map))})"))
    metadata, more = _check_metadata(fields_.get("metadata"), prefix + "metadata")
    problems += more
    if "metadata" in fields_:
        noop.add("metadata")
    if has_prompt and has_messages:
        problems.append((prefix + "prompt", "give \"prompt\" or \"messages\", not both"))
    elif not has_prompt and not has_messages and not prefix:
        problems.append(("prompt", "is required (or \"messages\")"))

    custom_id = obj.get("custom_id")      # null: not given, as for every field (a table's empty cell)
    if custom_id is not None and (why := _custom_id_problem(custom_id)):
        problems.append(("custom_id", why))

    prompt = messages = prompt_ids = None
    if has_prompt:
        prompt, prompt_ids, more = _check_prompt(fields_["prompt"], prefix + "prompt")
        problems += more
    if has_messages:
        messages, more = _check_messages(fields_["messages"], prefix + "messages")
        problems += more

    params = dict(base_params)
    given = [k for k in MAX_TOKENS_KEYS if fields_.get(k) is not None]
    if len(given) > 1 and len({json.dumps(fields_[k]) for k in given}) > 1:
        problems.append((prefix + given[1], f"conflicts with {prefix}{given[0]}; give one of them"))
    # OpenAI takes top_p 0: the nucleus shrinks to the most likely token, which is greedy decoding
    # (a native line too: one file may mix both kinds, and docs/FORMATS.md gives one table)
    top_p_zero = _is_number(fields_.get("top_p")) and fields_["top_p"] == 0
    for key in (*MAX_TOKENS_KEYS, *PARAM_KEYS[1:]):
        if fields_.get(key) is None or (key == "top_p" and top_p_zero):
            continue      # null is "not given", as OpenAI reads it
        value, problem = _check_param(key, fields_[key])
        if problem:
            if key == "top_p":     # the rule's (0, 1] is the engine's; a line also takes 0
                problem = problem.replace("(0, 1]", "[0, 1] (0: the most likely token only)")
            problems.append((prefix + key, problem))
        params["max_new_tokens" if key in MAX_TOKENS_KEYS else key] = value
    if top_p_zero:
        params.update(temperature=0.0, top_p=1.0)
    # the job's defaults this line does not take
    own = {"max_new_tokens" if k in MAX_TOKENS_KEYS else k for k in (*MAX_TOKENS_KEYS, *PARAM_KEYS[1:])
           if fields_.get(k) is not None} | ({"temperature", "top_p"} if top_p_zero else set())
    # a body's URL says which API it is (a chat body missing messages is that one error); a native
    # line is chat when it gives messages
    n_logprobs, more = _check_logprobs(fields_, prefix, chat=kind == "chat" if prefix else has_messages)
    problems += more
    if n_logprobs is not None:
        params["logprobs"] = n_logprobs
    if fields_.get("top_logprobs") is not None and not has_messages and not prefix:
        problems.append(("top_logprobs", "a prompt line takes logprobs (0..5), as /v1/completions"))
    for key in (*PROCESSOR_KEYS, *SAMPLE_KEYS):
        if fields_.get(key) is None:
            continue
        if key == "logit_bias":
            value, more = _check_logit_bias(fields_[key], prefix + key)
            problems += more
            if value:
                params[key] = value
            continue
        value, problem = _check_param(key, fields_[key])
        if problem:
            problems.append((prefix + key, problem))
        params[key] = value
    problems += _check_structured(fields_, prefix, kind if prefix else None, params)
    n = params.get("n")
    if isinstance(n, int) and n > 1 and params["temperature"] == 0 and "temperature" not in own and not job_temperature \
            and all(f != prefix + "n" for f, _ in problems):
        # greedy where nothing sets a temperature (OpenAI's default is 1): n copies of one text,
        # n times the compute, which a batch ported from OpenAI met with no word
        # (one wording for both edges, as the model map's: intake cannot tell --temperature from
        # an API batch's specbatch_temperature, and an API user never gave the CLI's option)
        problems.append((prefix + "n", f"{n} samples at temperature 0 are {n} copies of one text: a line "
                                       "that sets no temperature decodes greedily here (OpenAI samples at 1); "
                                       "set temperature (or the job's: --temperature, or an API batch's "
                                       "specbatch_temperature metadata), or n 1"))
    if not problems:
        try:    # the engine's own check, as a backstop
            params_from_dict(params).validate()
        except RequestError as e:
            problems.append((prefix + (e.field or ""), e.reason))
    if problems:
        raise _Problems(problems)
    return {"custom_id": custom_id, "kind": "completion" if has_prompt else "chat", "prompt": prompt,
            "messages": messages, "params": params, "model": model,
            "target": route[0] if route else None, "drafts": list(route[1]) if route else None,
            "metadata": metadata, "prompt_ids": prompt_ids, "noop": noop, "own": own, "openai": bool(prefix)}


def _check_structured(fields_: dict[str, Any], prefix: str, kind: str | None,
                      params: dict[str, Any]) -> list[tuple[str | None, str]]:
    """The line's output constraint (specbatch.jobs.structured) into ``params["structured"]``.
    response_format is a chat field: on /v1/completions _check_body has refused it already."""
    given = {k: fields_[k] for k in structured.FIELDS if k in fields_}
    if kind == "completion":
        given.pop("response_format", None)
    spec, problems = structured.parse(given, prefix)
    if spec is not None:
        params["structured"] = spec
    return list(problems)


def _read_lines(fp: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line_no, content without line end, size); content is None when the line is over ``limit``."""
    line_no = 0
    while True:
        raw = fp.readline(limit + 3)
        if not raw:
            return
        line_no += 1
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
            if not raw:
                return         # a BOM alone: an empty file, not a blank line
        content = raw.rstrip(b"\n").rstrip(b"\r")
        size = len(content)
        if size > limit:
            while not raw.endswith(b"\n"):     # skip the rest of the line without holding it
                raw = fp.readline(1 << 20)
                if not raw:
                    break
                size += len(raw.rstrip(b"\r\n"))
            yield line_no, None, size
        else:
            yield line_no, content, size


NOT_TEXT = "the file is not UTF-8 text"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
LOOKS_UTF16 = "it looks like UTF-16 (it starts with a UTF-16 byte-order mark)"


def _not_text(line_no: int, content: bytes) -> str | None:
    """Why a line shows its file is not UTF-8 text (UTF-16, a binary), or None."""
    if line_no == 1 and content.startswith(UTF16_BOMS):
        return LOOKS_UTF16
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte 0x{content[e.start]:02x} at byte {e.start + 1} of this line is not UTF-8"
    if b"\0" in content:      # no JSON text holds one: UTF-16 without a byte-order mark, or a binary
        return "this line holds a NUL byte (UTF-16 without a byte-order mark, or binary data)"
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {json.dumps(k)}")
        out[k] = v
    return out


def _bad_text(value: Any, where: str = "") -> Iterator[tuple[str | None, str]]:
    """(field, problem) for every string in ``value`` that no database or tokenizer takes as text:
    a NUL (PostgreSQL text cannot hold it; refused on SQLite too, so both behave the same) or a
    lone surrogate escape such as \\ud800 (not encodable as UTF-8)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _bad_text(k, where)
            yield from _bad_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _bad_text(v, f"{where}[{i}]")
    elif isinstance(value, str):
        if "\x00" in value:
            yield where or None, "contains a NUL character (\\u0000), which text cannot hold"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            yield where or None, (f"contains a lone surrogate \\u{ord(value[e.start]):04x} at character "
                                  f"{e.start + 1}, which is not valid text")


def _given_id(obj: dict[str, Any]) -> Any:
    """The line's custom_id for the duplicate check: the string, None when the key is absent (the
    line gets the line-N default; null too), _MISSING when the value is itself invalid (reported on
    its own; an id that is not valid cannot collide)."""
    if obj.get("custom_id") is None:
        return None
    cid = obj["custom_id"]
    if _custom_id_problem(cid) or any(_bad_text(cid)):
        return _MISSING
    return cid


def _custom_id_problem(cid: Any) -> str | None:
    """Why a given custom_id is not valid, or None."""
    if not isinstance(cid, str):
        return f"must be a non-empty string, got {json_type(cid)}"
    if not cid:
        return "must not be empty"
    if len(cid) > MAX_CUSTOM_ID:
        return f"is {len(cid)} characters; the limit is {MAX_CUSTOM_ID}"
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # Python reads 1e400 as infinity, which a field's message then echoed as "the number inf"
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is beyond a float's range (about 1.8e308)")
    return value


def _not_jsonl(first: str) -> str | None:
    """Why a file whose first non-blank line is ``first`` is plain JSON rather than JSON Lines, or
    None. Such a file fails on nearly every line, so this one hint stands for all those errors."""
    first = first.strip()
    if first.startswith("["):
        return ("this looks like a JSON array; the file must be JSON Lines: one JSON object per line "
                "(`jq -c '.[]'` converts an array)")
    if first == "{":
        return ("this looks like pretty-printed JSON; the file must be JSON Lines: one JSON object per "
                "line (`jq -c .` converts it)")
    return None


def _clip(text: str, limit: int) -> str:
    """A line error quotes what it refuses (a key, a role, a URL): past ``limit`` characters its
    middle is cut, keeping where it starts and what is expected at its end (a 50 kB key, a prompt
    written as a key, made a 50 kB error line and errors.data entry)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} ... {text[-(limit - head - 5):]}"


def read_stream(fp: BinaryIO, name: str, defaults: dict[str, Any] | None, settings: Settings,
                model_map: dict[str, Route] | None = None, limits: ContextCheck | None = None,
                vocab_of: Callable[[str | None], int | None] | None = None) -> ParsedFile:
    """Like read_file, reading an open binary stream; ``name`` is used in messages."""
    base = job_params(defaults)
    given = [k for k, v in (defaults or {}).items() if v not in (None, (), [])]
    defaulted: dict[str, int] = {}      # a job option given -> the lines that take it
    noop_fields: dict[str, int] = {}
    models: dict[str, int] = {}
    errors: list[InputError] = []
    total_errors = 0

    def err(line_no: int | None, field: str | None, message: str) -> None:
        nonlocal total_errors
        total_errors += 1
        if len(errors) < KEPT_ERRORS:
            errors.append(InputError(_clip(message, 600), path=name, line_no=line_no,
                                     field=None if field is None else _clip(field, 120)))

    parsed: list[tuple[int, dict[str, Any]]] = []
    ids: list[tuple[int, Any]] = []     # (line_no, _given_id) of every JSON-object line, bad lines too
    n_requests = blank_lines = 0
    not_jsonl: InputError | None = None
    for line_no, content, size in _read_lines(fp, settings.max_line_bytes):
        if content is None:
            n_requests += 1
            err(line_no, None, f"line is {size} bytes; the limit is {settings.max_line_bytes} "
                               "(SPECBATCH_MAX_LINE_BYTES)")
            continue
        if why := _not_text(line_no, content):
            # one error for the file, as the API's upload gives: a UTF-16 or binary file decoded
            # line by line gave "invalid UTF-8" then "invalid JSON" for every line after it
            n_requests += 1
            err(line_no, None, f"{NOT_TEXT}: {why}; save it as UTF-8 (the lines after it were not read)")
            break
        text = content.decode("utf-8")
        if not text.strip():
            blank_lines += 1
            continue
        n_requests += 1
        if n_requests == 1 and (hint := _not_jsonl(text)):
            not_jsonl = InputError(hint, path=name, line_no=line_no)
        if n_requests > settings.max_requests:
            continue      # counted, not parsed: the file is rejected as a whole below
        try:
            obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant,
                             parse_float=_finite_float)
        except (ValueError, RecursionError) as e:    # (the hooks' own refusals are ValueErrors too)
            err(line_no, None, f"invalid JSON: {unreadable(e)}")
            continue
        if not isinstance(obj, dict):
            err(line_no, None, f"must be a JSON object, got {json_type(obj)}")
            continue
        # recorded before the line's own checks, so a duplicate is listed beside its other errors
        ids.append((line_no, _given_id(obj)))
        bad_text = list(_bad_text(obj))
        for field, message in bad_text:
            err(line_no, field, message)
        if bad_text:
            continue
        try:
            fields_ = _parse_object(obj, base, model_map, "temperature" in given)
        except _Problems as bad:
            for field, message in bad.problems:
                err(line_no, field, message)
            continue
        if limits is not None:
            prefix = "body." if "body" in obj else ""
            src: dict[str, Any] = obj["body"] if prefix else obj    # (a body is an object by now)
            key = next((k for k in MAX_TOKENS_KEYS if k in src), None)
            if over := limits.problem(fields_, prefix + key if key else None):
                err(line_no, over.field or prefix + ("prompt" if fields_["kind"] == "completion" else "messages"),
                    over.message)
                continue
        if vocab_of is not None and (bias_problems := _vocab_problems(fields_, vocab_of)):
            for field, message in bias_problems:     # beside the file's other errors, not after them
                err(line_no, field, message)
            continue
        for k in fields_.pop("noop"):
            noop_fields[k] = noop_fields.get(k, 0) + 1
        own = fields_.pop("own")
        for k in given:
            if k not in own:
                defaulted[k] = defaulted.get(k, 0) + 1
        if fields_["model"] is not None:
            models[fields_["model"]] = models.get(fields_["model"], 0) + 1
        parsed.append((line_no, fields_))

    if n_requests == 0:
        what = f"{plural(blank_lines, 'line')}, all blank" if blank_lines else "the file is empty"
        err(None, None, f"no requests ({what}); one JSON object per line is expected")
    if n_requests > settings.max_requests:
        err(None, None, f"{n_requests} requests; the limit is {settings.max_requests} per file "
                        "(SPECBATCH_MAX_REQUESTS): split the file")

    # custom_ids: explicit ones first, then the line-N defaults, which must not collide. Every
    # line that decoded to an object takes part, valid or not, so each line's errors are complete.
    first_line: dict[str, int] = {}
    for line_no, cid in ids:
        if not isinstance(cid, str):
            continue
        if cid in first_line:
            err(line_no, "custom_id", f"duplicate {json.dumps(cid)} (first on line {first_line[cid]})")
        else:
            first_line[cid] = line_no
    for line_no, cid in ids:
        if cid is None:
            default = f"line-{line_no}"
            if default in first_line:
                err(line_no, "custom_id", f"missing, and the default {json.dumps(default)} is taken by line "
                                          f"{first_line[default]}; give this line a custom_id")
            else:
                first_line[default] = line_no
    requests = [ParsedRequest(line_no=line_no, **{**p, "custom_id": p["custom_id"] or f"line-{line_no}"})
                for line_no, p in parsed]

    if not_jsonl is not None:
        # such a first line is never valid JSONL, so the file fails anyway; the per-line errors of
        # a JSON array or pretty-printed object would only bury the one thing to fix
        raise IntakeError([not_jsonl])
    if total_errors:
        errors.sort(key=lambda e: (e.line_no or 0))
        raise IntakeError(errors, total=total_errors)
    return ParsedFile(requests, noop_fields, models, model_map, [k for k in given if not defaulted.get(k)])


def _vocab_problems(fields_: dict[str, Any], vocab_of: Callable[[str | None], int | None]
                    ) -> list[tuple[str, str]]:
    """[(field, why)] for the line's token ids (logit_bias keys, a prompt given as ids) outside
    its target's vocabulary (if known here)."""
    return _outside_vocab(fields_["params"].get("logit_bias"), fields_.get("prompt_ids"),
                          bool(fields_.get("openai")), lambda: vocab_of(fields_.get("target")))


def _outside_vocab(bias: Any, prompt_ids: list[int] | None, openai: bool, vocab: Callable[[], int | None]
                   ) -> list[tuple[str, str]]:
    """[(field, why)]: logit_bias keys and prompt token ids at or past the vocabulary size, which
    ``vocab()`` gives (None: not known here, the worker refuses them)."""
    if (not bias and not prompt_ids) or (size := vocab()) is None:
        return []
    prefix = "body." if openai else ""
    problems = [(prefix + "logit_bias" + where, why) for where, why in rules.check_logit_bias(bias, size)[1]]
    if prompt_ids and (bad := next((i for i, t in enumerate(prompt_ids) if t >= size), None)) is not None:
        problems.append((prefix + "prompt", f"token ids must be below the target's vocabulary size {size}; "
                                            f"item {bad} is {rules.shown(prompt_ids[bad])}"))
    return problems


def check_token_ids(parsed: ParsedFile, name: str, vocab_of: Callable[[str | None], int | None]) -> None:
    """Once a target's vocabulary is known (``specbatch run`` loads the target before writing the
    job; ``submit`` reads a local model's config): every logit_bias key and prompt token id must be
    below ``vocab_of(request's route target)`` (None: the job's own target; a None answer: not
    known here, the worker checks). Raises one IntakeError listing each bad one as
    ``FILE:LINE: body.logit_bias.ID: why`` / ``FILE:LINE: body.prompt: why``."""
    errors = []
    for r in parsed.requests:
        for field, why in _outside_vocab(r.params.get("logit_bias"), r.prompt_ids, r.openai,
                                         functools.partial(vocab_of, r.target)):
            errors.append(InputError(why, path=name, line_no=r.line_no, field=field))
    if errors:
        raise IntakeError(errors)


def local_vocab_size(model: str, cache_dir: str) -> int | None:
    """A model's vocabulary size from its files on this machine (a directory's config.json, a GGUF
    file's metadata), without loading it; None when its files are not here (the worker checks
    then, failing the request)."""
    from specbatch.engine.model_files import local_files, vocab_size

    try:
        files = local_files(model, cache_dir)
        return vocab_size(files) if files is not None else None
    except Exception as e:  # noqa: BLE001 - an unreadable file: the worker's check remains
        logger.info("cannot read the vocabulary size of %s (%s); logit_bias keys not checked here", model, e)
        return None


def vocab_lookup(cache_dir: str, target: str) -> Callable[[str | None], int | None]:
    """``vocab_of`` for read_stream: each route target's local vocabulary size, read once."""
    sizes: dict[str, int | None] = {}

    def vocab_of(route_target: str | None) -> int | None:
        name = route_target or target
        if name not in sizes:
            sizes[name] = local_vocab_size(name, cache_dir)
        return sizes[name]
    return vocab_of


def parse_file(path: str | Path, defaults: dict[str, Any] | None, settings: Settings) -> list[ParsedRequest]:
    """Every request of a JSONL prompt file, or IntakeError listing every problem found."""
    return read_file(path, defaults, settings).requests


def read_file(path: str | Path, defaults: dict[str, Any] | None, settings: Settings,
              model_map: dict[str, Route] | None = None, limits: ContextCheck | None = None,
              vocab_of: Callable[[str | None], int | None] | None = None) -> ParsedFile:
    """Every request of a JSONL prompt file with the job's warnings, or IntakeError listing every
    problem found. ``model_map`` (from parse_model_map) routes lines by their model (body.model);
    ``limits`` refuses a line whose prompt and max_new_tokens exceed its pair's context;
    ``vocab_of(route target)`` (None: the job's target) a logit_bias key outside the vocabulary
    (``vocab_lookup``; an unknown size is left to ``check_token_ids`` or the worker)."""
    name = str(path)
    p = Path(path)
    if not p.exists():
        raise IntakeError([InputError("no such file", path=name)])
    if p.is_dir():
        raise IntakeError([InputError("is a directory, not a JSONL file", path=name)])
    try:
        with p.open("rb") as fp:
            return read_stream(fp, name, defaults, settings, model_map, limits, vocab_of)
    except PermissionError as e:
        raise IntakeError([InputError(f"cannot read: {e.strerror}", path=name)]) from e
