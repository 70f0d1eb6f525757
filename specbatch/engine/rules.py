"""The one table of generation-parameter rules: type, range and message per field.

Intake (``specbatch.jobs.intake``) checks each field of a request line with it, naming the line
and the field; ``GenerationParams.validate`` checks the resolved parameters with the same rules,
as the engine's backstop. So a range is stated once and the two never disagree.

    value, problem = check("min_p", 1.5)       # -> (1.5, "must be in [0, 1], got 1.5")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**63 - 1
LOGIT_BIAS_LIMIT = 100.0      # OpenAI's range for a logit_bias value: [-100, 100]
MAX_TOP_LOGPROBS = 20         # chat's top_logprobs: 0..20 (completions' logprobs: 0..5)
MAX_COMPLETION_LOGPROBS = 5
MAX_N = 128                   # samples per request line (each one a row of the batch)


def json_type(v: Any) -> str:
    """How an error message names a JSON value's type."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {shown(v)}"    # "an integer ..., got a number" hid that 16.0 is not one
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, (list, tuple)) else "an object"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v: float) -> bool:
    """A JSON number is finite: an int always (math.isfinite raises OverflowError past a float's
    range, as for a 400-digit integer in a prompt file)."""
    return not isinstance(v, float) or math.isfinite(v)


def shown(v: float) -> str:
    """A number as a message echoes it: an integer of more than 20 digits by its start and length."""
    text = str(v)
    digits = text.lstrip("-")
    return text if not is_int(v) or len(digits) <= 20 else f"{text[:len(text) - len(digits) + 10]}... ({len(digits)} digits)"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Rule:
    """A numeric parameter: an integer or any finite number, within [lo, hi] (either end open
    or absent). ``nullable``: None means "not given". ``hint`` follows the type in messages."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    nullable: bool = False
    hint: str = ""
    shown: str | None = None          # the range as messages state it, when not the plain one
    typed_range: bool = True          # the type message states the range too

    @property
    def range_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{_fmt(self.lo)}, "
                    f"{_fmt(self.hi)}{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        return ""

    @property
    def expected(self) -> str:
        kind = "an integer" if self.integer else "a number"
        return f"{kind} {self.range_text}".rstrip() if self.typed_range else kind

    def within(self, v: float) -> bool:
        if not finite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def check(self, v: Any) -> tuple[Any, str | None]:
        """(normalised value, problem or None); numbers become floats unless ``integer``."""
        if v is None and self.nullable:
            return None, None
        if self.integer and isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53:
            # a whole number written as a float: pandas writes an integer column that has nulls so
            # (`"seed": 1.0`); up to 2**53 a float holds every integer exactly
            v = int(v)
        if not (is_int(v) if self.integer else is_number(v)):
            return v, f"must be {self.expected}{self.hint}, got {json_type(v)}"
        if not self.within(v):
            return v, f"must be {self.range_text}, got {shown(v)}"
        return (v if self.integer else float(v)), None


# Every numeric GenerationParams field. Ranges follow OpenAI where it has the field (penalties,
# top_p) and vLLM otherwise (min_p, repetition_penalty, top_k).
RULES: dict[str, Rule] = {
    "max_new_tokens": Rule(integer=True, lo=1),
    "temperature": Rule(integer=False, lo=0, hi=2, shown="in [0, 2] (OpenAI's range)"),
    "top_p": Rule(integer=False, lo=0, hi=1, lo_open=True),
    "top_k": Rule(integer=True, lo=0, hint=" (0: no top-k)"),
    "min_p": Rule(integer=False, lo=0, hi=1),
    "presence_penalty": Rule(integer=False, lo=-2, hi=2),
    "frequency_penalty": Rule(integer=False, lo=-2, hi=2),
    "repetition_penalty": Rule(integer=False, lo=0, lo_open=True),
    "seed": Rule(integer=True, lo=0, hi=MAX_SEED, nullable=True, shown="in [0, 2**63 - 1]",
                 typed_range=False),
    "gamma": Rule(integer=True, lo=0, hi=64, nullable=True),
    "logprobs": Rule(integer=True, lo=0, hi=MAX_TOP_LOGPROBS, nullable=True),
    "n": Rule(integer=True, lo=1, hi=MAX_N),
}


# completions' ``logprobs``: 0..5 alternatives (chat's ``top_logprobs`` is RULES["logprobs"])
COMPLETION_LOGPROBS = Rule(integer=True, lo=0, hi=MAX_COMPLETION_LOGPROBS)


def check(name: str, v: Any) -> tuple[Any, str | None]:
    """One numeric parameter against its rule (KeyError for a name without one)."""
    return RULES[name].check(v)


def check_stop(v: Any) -> tuple[list[str], str | None]:
    """A stop string or a list of them -> (the list, problem or None); None is no stop."""
    if v is None:
        return [], None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)):
        return v, f"must be a string or a list of strings, got {json_type(v)}"
    if (bad := next((i for i, s in enumerate(stops) if not isinstance(s, str)), None)) is not None:
        return v, f"must be a string or a list of strings; item {bad} is {json_type(stops[bad])}"
    if any(s == "" for s in stops):
        return v, "stop strings must not be empty"
    return list(stops), None


def token_id(key: Any) -> int | None:
    """A logit_bias key as a token id: an integer, or its decimal string (JSON keys are strings)."""
    if is_int(key):
        return int(key)
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


def check_logit_bias(v: Any, vocab_size: int | None = None
                     ) -> tuple[dict[int, float], list[tuple[str, str]]]:
    """OpenAI's ``logit_bias``: {token id: bias in [-100, 100]} -> ({id: bias}, [(subfield,
    problem)]). Token ids are checked against ``vocab_size`` (the target's logits) when it is
    known; None is an empty map."""
    if v is None:
        return {}, []
    if isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in v):
        v = dict(v)          # GenerationParams keeps it as (id, bias) pairs; a JSON array is no such tuple
    if not isinstance(v, dict):
        return {}, [("", f"must be an object of token id -> bias, got {json_type(v)}")]
    out: dict[int, float] = {}
    problems: list[tuple[str, str]] = []
    keys: dict[int, Any] = {}      # token id -> the key that named it first
    for key, bias in v.items():
        tid = token_id(key)
        where = f".{key}"
        if tid is None:
            problems.append((where, f"{key!r} is not a token id (a non-negative integer)"))
        elif tid in keys:
            # "21285" and "021285" (or 21285) are one token: which bias would hold is no one's guess
            problems.append((where, f"token id {tid} is given twice ({keys[tid]!r} and {key!r})"))
            tid = None
        else:
            keys[tid] = key
        if tid is not None and vocab_size is not None and tid >= vocab_size:
            problems.append((where, f"token id {tid} is outside the target's vocabulary [0, {vocab_size})"))
        if not is_number(bias):
            problems.append((where, f"must be a number in [-100, 100], got {json_type(bias)}"))
        elif not (finite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            problems.append((where, f"must be in [-100, 100], got {shown(bias)}"))
        elif tid is not None:
            out[tid] = float(bias)
    return out, problems
