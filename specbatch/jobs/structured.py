"""A request's output constraint from its line: OpenAI's ``response_format`` and the extension
``structured_outputs`` (vLLM's shape), checked with the grammar library (docs/FORMATS.md,
"Structured outputs"; docs/STRUCTURED.md).

    "response_format": {"type": "json_object"}
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}, "strict": true}}
    "structured_outputs": {"json": {...}} | {"regex": "..."} | {"choice": ["a", "b"]}
                        | {"grammar": "..."} | {"json_object": true}
    "guided_json": {...} | "guided_regex": "..." | "guided_choice": [...] | "guided_grammar": "..."
                        (vLLM's older top-level names for the same four kinds)

``parse`` returns the constraint as stored in a request's params (``GrammarSpec.to_dict()``) or
None, and the problems as (field, message) pairs: a schema, regex or grammar the library cannot
compile is refused with the library's own message, per line, before anything is written; a
schema no JSON value matches, in words a dataset builder wrote (``_unsatisfiable``).
"""

from __future__ import annotations

import json
import re
import sys
from functools import lru_cache
from typing import Any

from specbatch.engine.grammar_spec import GrammarSpec, spec_problem
from specbatch.jobs.openai_fields import json_type

# Python's JSON reader raises RecursionError past about 1000 levels (its C scanner shares the
# interpreter's recursion limit): an upload's line, or a schema given as JSON text, says this
TOO_DEEP = "nested too deeply (Python's JSON reader stops near 1000 levels)"


def unreadable(e: BaseException) -> str:
    """Why Python's JSON reader refused a text, in a user's words: a line of a file, a body, a
    schema given as JSON text (no advice to call ``sys.set_int_max_str_digits``)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} (column {e.colno})"
    if isinstance(e, RecursionError):
        return TOO_DEEP
    if isinstance(e, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start})"
    if isinstance(e, ValueError) and "integer string conversion" in str(e):
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return _one_line(str(e))


QUOTE_KEEP, MESSAGE_KEEP = 80, 300     # characters of a library message kept (_one_line)

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)   # every field that may carry a constraint

Problems = list[tuple[str, str]]


def parse(fields: dict[str, Any], prefix: str) -> tuple[dict[str, Any] | None, Problems]:
    """The constraint of a line (``fields``: the body of an OpenAI line, or a plain line)."""
    given = [k for k in FIELDS if fields.get(k) is not None]
    rf = fields.get("response_format")
    if len(given) > 1 and isinstance(rf, dict) and rf.get("type") == "text":   # OpenAI's default: no constraint
        _, problems = _response_format(rf, prefix + "response_format")
        if problems:
            return None, problems
        given.remove("response_format")
    if len(given) > 1:
        return None, [(prefix + k, f"give one of {', '.join(given)}, not several") for k in given[1:]]
    if not given:
        return None, []
    name = given[0]
    if name == "response_format":
        spec, problems = _response_format(fields[name], prefix + name)
    elif name == "structured_outputs":
        spec, problems = _structured_outputs(fields[name], prefix + name)
    else:
        spec, problems = _kind_spec(GUIDED[name], fields[name], prefix + name)
    return (spec.to_dict() if spec is not None and not problems else None), problems


def _compiles(spec: GrammarSpec, field: str) -> Problems:
    problem = spec_problem(spec)
    if problem is None:
        return []
    if spec.kind == "json" and problem.startswith(UNSATISFIABLE):
        return _unsatisfiable(spec, _why(problem), field)
    return [(field, f"the grammar library refuses it: {_one_line(problem)}")]


# llguidance's words for a schema no JSON value matches ("Unsatisfiable schema: anyOf is empty" of
# {"enum": []}: a dataset builder never wrote that anyOf). Lists that match nothing when empty, and
# what each lists; llguidance's "incompatible types", said as what a schema does to get it
UNSATISFIABLE = "Unsatisfiable schema:"
EMPTIED = ("anyOf is empty", "oneOf is empty")
EMPTY_LISTS = {"enum": "value", "type": "type", "anyOf": "schema", "oneOf": "schema"}
VALUES = ("const", "default", "enum", "examples")      # keywords whose contents are data, not schemas
INCOMPATIBLE = 'its "type" contradicts a "const", "enum" or "allOf" part of it'
# llguidance's "Regex is empty: (And (SearchRegex /.../) (Regex /.../))": the regexes it made of a
# string schema's keywords leave no string together
NO_STRING = "no string meets its pattern, format, minLength and maxLength together"
# empty lists tried, a compile each (~20 ms, up to 2n + 1 of them), to find those that matter;
# past this many the first is named
MAX_TRIED = 8

Path = tuple[str | int, ...]


def _why(problem: str) -> str:
    return _one_line(problem[len(UNSATISFIABLE):].strip())


def _unsatisfiable(spec: GrammarSpec, why: str, field: str) -> Problems:
    """A schema no JSON value matches, in words: where llguidance says "anyOf is empty" (or oneOf),
    each empty list of ``EMPTY_LISTS`` that leaves no value is named where it is."""
    # (no deeper than llguidance reads a schema: it refuses one nested past 128 levels itself)
    if why in EMPTIED and (empty := _emptying(spec.source, spec.strict)):
        return [(field + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path),
                 f"is an empty list, so no JSON value matches the schema; list at least one "
                 f"{EMPTY_LISTS[str(path[-1])]}") for path in empty]
    words = INCOMPATIBLE if why == "incompatible types" else NO_STRING if why.startswith("Regex is empty") else why
    return [(field, f"no JSON value matches this schema: {words}")]


@lru_cache(maxsize=64)      # a job's lines often share one schema: it is tried once, not per line
def _emptying(source: str, strict: bool) -> tuple[Path, ...]:
    """The empty lists that leave the schema no value, in the schema's order. The library is asked,
    not second-guessed: an unused ``$defs`` entry's or an optional property's ``"enum": []`` matches
    nothing yet empties nothing. Named: each list whose dropping alone lets the schema compile (both
    branches of an ``anyOf`` of two empty ones); where none does (``"enum": []`` beside
    ``"oneOf": []``), those that must all be dropped: all dropped, then each put back in turn that
    the schema compiles with."""
    found = _empty_lists(json.loads(source), ())
    if len(found) > MAX_TRIED:
        return tuple(found[:1])

    def empties(dropped: list[Path]) -> bool:
        schema = json.loads(source)
        for path in dropped:
            node = schema
            for k in path[:-1]:
                node = node[k]
            del node[path[-1]]            # no constraint left: any value passes this keyword
        problem = GrammarSpec.json_schema(schema, strict).problem()   # not remembered: tried once
        return problem is not None and problem.startswith(UNSATISFIABLE) and _why(problem) in EMPTIED

    alone = tuple(path for path in found if not empties([path]))
    if alone or empties(found):
        return alone or tuple(found[:1])
    dropped = list(found)
    for path in found:
        if not empties([p for p in dropped if p != path]):
            dropped.remove(path)
    return tuple(dropped)


def _empty_lists(node: Any, where: Path) -> list[Path]:
    """The path of every ``EMPTY_LISTS`` keyword whose list is empty, in the schema's order."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    found: list[Path] = []
    for k, v in items:
        if isinstance(node, dict) and k in EMPTY_LISTS and v == []:
            found.append((*where, k))
        elif k not in VALUES:
            found += _empty_lists(v, (*where, k))
    return found


def _one_line(message: str) -> str:
    """The library's message without its source echo and caret lines: one problem, one line.
    A quoted span past ``QUOTE_KEEP`` characters (llguidance quotes the whole regex) is cut to its
    ends, so a 100 kB regex does not make a 100 kB error line; then the line to ``MESSAGE_KEEP``."""
    kept = [line.strip() for line in message.splitlines()
            if line.strip() and not line.startswith(" ") and line.strip() != "^"]
    text = " ".join(kept) or message.strip()
    text = re.sub(rf'"([^"]{{{QUOTE_KEEP + 1},}})"', lambda m: f'"{m[1][:QUOTE_KEEP - 20]}...{m[1][-20:]}"', text)
    return text if len(text) <= MESSAGE_KEEP else text[:MESSAGE_KEEP - 3] + "..."


def _response_format(v: Any, field: str) -> tuple[GrammarSpec | None, Problems]:
    if not isinstance(v, dict):
        return None, [(field, f"must be an object, got {json_type(v)}")]
    kind = v.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        return None, [(field + ".type", f"must be one of {', '.join(map(json.dumps, RESPONSE_FORMAT_TYPES))} "
                                        f"(got {json.dumps(kind) if isinstance(kind, str) else json_type(kind)})")]
    allowed = ("type", "json_schema") if kind == "json_schema" else ("type",)
    problems = [(f"{field}.{k}", f"unknown field for type {json.dumps(kind)}") for k in v if k not in allowed]
    if kind == "text":
        return None, problems
    if kind == "json_object":
        spec = GrammarSpec.json_schema({"type": "object"})
        return spec, problems
    js = v.get("json_schema")
    where = field + ".json_schema"
    if not isinstance(js, dict):
        return None, problems + [(where, "is required" if js is None else f"must be an object, got {json_type(js)}")]
    problems += [(f"{where}.{k}", f"unknown field; expected {', '.join(JSON_SCHEMA_KEYS)}")
                 for k in js if k not in JSON_SCHEMA_KEYS]
    for k in ("name", "description"):
        if js.get(k) is not None and not isinstance(js[k], str):
            problems.append((f"{where}.{k}", f"must be a string, got {json_type(js[k])}"))
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        problems.append((where + ".strict", f"must be a boolean, got {json_type(strict)}"))
    schema = js.get("schema")
    if not isinstance(schema, dict):
        return None, problems + [(where + ".schema", "is required" if schema is None
                                  else f"must be a JSON schema object, got {json_type(schema)}")]
    spec = GrammarSpec.json_schema(schema, strict=strict is not False)
    return spec, problems + _compiles(spec, where + ".schema")


def _structured_outputs(v: Any, field: str) -> tuple[GrammarSpec | None, Problems]:
    if not isinstance(v, dict):
        return None, [(field, f"must be an object, got {json_type(v)}")]
    problems: Problems = [(f"{field}.{k}", f"not supported; give one of {', '.join(STRUCTURED_KINDS)}")
                          for k in v if k not in STRUCTURED_KINDS]
    given = [k for k in STRUCTURED_KINDS if v.get(k) is not None]
    if len(given) != 1:
        why = "needs one of" if not given else f"gives {' and '.join(given)}; give one of"
        return None, problems + [(field, f"{why} {', '.join(STRUCTURED_KINDS)}")]
    spec, more = _kind_spec(given[0], v[given[0]], f"{field}.{given[0]}")
    return spec, problems + more


def _kind_spec(kind: str, value: Any, where: str) -> tuple[GrammarSpec | None, Problems]:
    """One constraint of a kind in STRUCTURED_KINDS, its value found at ``where``."""
    if kind == "json_object":
        if value is not True:
            return None, [(where, f"must be true, got {json_type(value)}")]
        return GrammarSpec.json_schema({"type": "object"}), []
    if kind == "json":
        if isinstance(value, str):        # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                return None, [(where, f"is a string but not JSON: {unreadable(e)}")]
        if not isinstance(value, dict):
            return None, [(where, f"must be a JSON schema object, got {json_type(value)}")]
        spec = GrammarSpec.json_schema(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value:
            return None, [(where, "must be a non-empty list of strings"
                                      if isinstance(value, list) else f"must be a list of strings, got {json_type(value)}")]
        if any(not isinstance(c, str) or not c for c in value):
            return None, [(where, "every choice must be a non-empty string")]
        spec = GrammarSpec.choice(value)
    else:                                   # regex, grammar
        if not isinstance(value, str) or not value:
            return None, [(where, f"must be a non-empty string, got {json_type(value)}"
                                      if not isinstance(value, str) else "must not be empty")]
        spec = GrammarSpec(kind, value)
    return spec, _compiles(spec, where)
