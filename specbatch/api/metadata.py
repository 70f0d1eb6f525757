"""Reserved metadata keys of ``POST /v1/batches``: the model pair and job defaults of the batch's job.

OpenAI metadata is at most 16 string pairs (keys <= 64, values <= 512 characters); keys starting
with ``specbatch_`` are ours (README, "HTTP API"), every other key is the client's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specbatch.config import Settings
from specbatch.engine.drafter_specs import model_names
from specbatch.engine.known_models import missing_weights, name_problem
from specbatch.errors import InputError, InputErrors, IntakeError, ModelLoadError, input_error
from specbatch.jobs import intake
from specbatch.jobs.structured import unreadable
from specbatch.worker.submission import Pair

RESERVED_PREFIX = "specbatch_"
# reserved key -> (job default it sets, its type); values are strings, as all OpenAI metadata values
DEFAULT_KEYS: dict[str, tuple[str, type]] = {
    "specbatch_max_tokens": ("max_new_tokens", int), "specbatch_temperature": ("temperature", float),
    "specbatch_top_p": ("top_p", float), "specbatch_top_k": ("top_k", int), "specbatch_seed": ("seed", int),
    "specbatch_stop": ("stop", str)}
PAIR_KEYS = ("specbatch_target", "specbatch_draft", "specbatch_ngram", "specbatch_model_map")
RESERVED_KEYS = (*PAIR_KEYS, *DEFAULT_KEYS)
MAX_METADATA = 16
MAX_KEY, MAX_VALUE = 64, 512


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata rules; raises InputError naming the key (every bad key, in one error)."""
    problems, good = _bounds(metadata)
    if problems:
        raise input_error(problems, "metadata")
    return good


def batch_options(metadata: Any, settings: Settings) -> tuple[dict[str, str], JobOptions]:
    """``check_metadata`` and ``job_options`` of a batch's metadata, every bad key of both named
    in one error (a value past 512 characters and a misspelt reserved key: both)."""
    problems, good = _bounds(metadata)
    try:
        options = job_options(good, settings)
    except InputError as e:
        problems += e.problems if isinstance(e, InputErrors) else [(str(e.field), e.reason)]
    if problems:
        raise input_error(_in_order(problems, list(metadata)), "metadata")
    return good, options


def _bounds(metadata: Any) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(a problem of each bad key, the good keys): OpenAI's bounds; raises for the whole object."""
    if metadata is None:
        return [], {}
    if not isinstance(metadata, dict):
        raise InputError("must be an object of string keys and values", field="metadata")
    if len(metadata) > MAX_METADATA:
        raise InputError(f"has {len(metadata)} keys; the limit is {MAX_METADATA}", field="metadata")
    problems, good = [], {}
    for k, v in metadata.items():
        if (problem := _key_problem(k, v)) is not None:
            problems.append(problem)
        else:
            good[k] = v
    return problems, good


def _in_order(problems: list[tuple[str, str]], keys: list[str]) -> list[tuple[str, str]]:
    """The problems in the order their keys were given (a key not echoed, last)."""
    def place(problem: tuple[str, str]) -> int:
        key = problem[0].removeprefix("metadata.")
        return keys.index(key) if problem[0] != "metadata" and key in keys else len(keys)
    return sorted(problems, key=place)


def _key_problem(k: str, v: Any) -> tuple[str, str] | None:
    if "\x00" in k:     # PostgreSQL text cannot hold a NUL; the key is not echoed
        return "metadata", "a key contains a NUL character (\\u0000), which text cannot hold"
    if not isinstance(v, str):
        return f"metadata.{k}", "must be a string"
    if "\x00" in v:
        return f"metadata.{k}", "contains a NUL character (\\u0000), which text cannot hold"
    if len(k) > MAX_KEY or len(v) > MAX_VALUE:
        return f"metadata.{k}", f"keys are at most {MAX_KEY} characters and values at most {MAX_VALUE}"
    return None


def _flag(value: str, key: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise InputError(f"must be true or false, got {value!r}", field=f"metadata.{key}")


def _value(key: str, raw: str, kind: type) -> Any:
    if kind is str:      # specbatch_stop
        if not raw.lstrip().startswith("["):
            return raw
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise InputError(f"must be a string or a JSON array of strings ({unreadable(e)})",
                             field=f"metadata.{key}") from e
    try:
        return kind(raw)
    except ValueError as e:
        raise InputError(f"must be {'an integer' if kind is int else 'a number'}, got {raw!r}",
                         field=f"metadata.{key}") from e


@dataclass(frozen=True)
class JobOptions:
    pair: Pair
    defaults: dict[str, Any]
    model_map: dict[str, Any] | None = None     # intake.parse_model_map: body.model -> (target, drafts)


def job_options(metadata: dict[str, str], settings: Settings) -> JobOptions:
    """The pair, job defaults and model map the reserved keys choose; no model key: the default pair.

    ``specbatch_target``, ``specbatch_draft`` (comma-separated: a draft pool, drafter specs as --draft), ``specbatch_ngram``
    (true/false), ``specbatch_model_map`` (``NAME=TARGET[,DRAFT...]``, ``;``-separated: lines whose
    body.model is NAME run on that pair, as ``--model-map``); ``specbatch_max_tokens``,
    ``specbatch_temperature``, ``specbatch_top_p``, ``specbatch_top_k``, ``specbatch_seed``,
    ``specbatch_stop`` (a string or a JSON array).
    """
    # every bad key is named, in one error: a client told of the first fixed it and met the next
    problems: list[tuple[str, str]] = [
        (f"metadata.{key}", f"unknown reserved key (known: {', '.join(RESERVED_KEYS)})")
        for key in metadata if key.startswith(RESERVED_PREFIX) and key not in RESERVED_KEYS]
    target = metadata.get("specbatch_target", "").strip() or None
    drafts = [d.strip() for d in metadata.get("specbatch_draft", "").split(",") if d.strip()]
    no_draft = not drafts and metadata.get("specbatch_draft", "").strip() != ""   # ",": a typo, not the default pair
    if no_draft:
        problems.append(("metadata.specbatch_draft", "names no draft: give drafter specs, comma-separated (as "
                                                     "--draft), or leave the key out for the default pair"))
    pair = None
    try:
        ngram = _flag(metadata.get("specbatch_ngram", ""), "specbatch_ngram")    # sugar, as --ngram
        if not no_draft:
            pair = Pair.resolve(settings, target, drafts, ["ngram"] if ngram else [])
    except InputError as e:
        problems.append((str(e.field), e.reason))
    except ModelLoadError as e:    # no model by that name: the batch would wait for a worker forever
        key = "specbatch_target" if target is not None and name_problem(target) else "specbatch_draft"
        problems.append((f"metadata.{key}", str(e)))
    defaults: dict[str, Any] = {}
    for key, (name, kind) in DEFAULT_KEYS.items():
        try:
            if key in metadata:
                defaults[name] = _value(key, metadata[key], kind)
        except InputError as e:
            problems.append((str(e.field), e.reason))
    try:
        intake.job_params(defaults)
    except IntakeError as e:    # fields come back as CLI options (--max-new-tokens): name our key
        for error in e.errors:
            name = (error.field or "").lstrip("-").replace("-", "_")
            key = next((k for k, (n, _) in DEFAULT_KEYS.items() if n == name), "")
            problems.append((f"metadata.{key}" if key else "metadata", error.reason))
    specs = [x.strip() for x in metadata.get("specbatch_model_map", "").split(";") if x.strip()]
    model_map = None
    try:
        model_map = intake.parse_model_map(specs, allow_remote=settings.allow_remote_models)
        if pair is not None and not settings.allow_remote_models:
            check_weights(target, model_names(pair.drafters) if drafts else [], model_map)
    except IntakeError as e:
        problems.append(("metadata.specbatch_model_map", e.errors[0].reason))
    except InputError as e:
        problems.append((str(e.field), e.reason))
    if problems:
        raise input_error(_in_order(problems, list(metadata)), "metadata")
    assert pair is not None      # (resolved: no problem with its keys)
    return JobOptions(pair, defaults, model_map)


def check_weights(target: str | None, drafts: list[str], model_map: dict[str, Any] | None) -> None:
    """InputError naming the key, for the first known model the metadata names (``target``, the
    draft models of ``specbatch_draft``, the routes of the model map) whose weights package is not
    installed here. ``submit`` only warns (its user reads the warning; the workers may run where the
    weights are); an API client sees no warning, and its batch would stay in_progress until it
    expires: the API holds a known name to its rule for every name (a model on this machine) and
    refuses it. ``serve --allow-remote-models`` takes it. The default pair is the operator's, not
    the client's: ``serve`` warns about it once at start-up."""
    routes = [m for t, ds in (model_map or {}).values() for m in (t, *ds)]
    for key, names in (("specbatch_target", [target] if target else []), ("specbatch_draft", drafts),
                       ("specbatch_model_map", routes)):
        for hint in filter(None, map(missing_weights, names)):
            raise InputError(f"{hint} (on the server's machine; serve --allow-remote-models takes a model "
                             "only the workers hold)", field=f"metadata.{key}")
