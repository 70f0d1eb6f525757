"""A request's output constraint as data (docs/STRUCTURED.md); its masks are in grammar.py.

No torch here: intake checks specs without loading the engine's heavy imports.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

KINDS = ("json", "regex", "choice", "grammar")

# JSON is written as json.dumps writes it, ", " and ": " and no other whitespace: the spelling
# models have read most, and no free whitespace a weak model could loop in until max_tokens
# (with fixed separators more of the output is forced, too: drafted by the grammar)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint. ``source``: the schema as JSON text (kind "json"), the regex,
    the choices as a JSON array, or the grammar text (Lark, or GBNF as llama.cpp writes it).
    ``strict`` (JSON only): an unsupported schema keyword is an error; else it is ignored."""

    kind: str
    source: str
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = True) -> GrammarSpec:
        # key order kept: the output lists properties in the schema's order
        return cls("json", json.dumps(schema), strict)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "strict": self.strict}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GrammarSpec:
        return cls(d["kind"], d["source"], bool(d.get("strict", True)))

    def llguidance(self) -> str:
        """The grammar in llguidance's own format. Raises ValueError for a kind it does not know
        or a GBNF grammar it cannot convert (``problem()`` says so as data)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(
                self.source, overrides={**JSON_OPTIONS, "lenient": not self.strict})  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return grammar_from("choice", self.source)
        if self.kind == "grammar":
            return grammar_from("grammar", self.source)   # Lark as is; GBNF converted to Lark
        raise ValueError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")

    def problem(self) -> str | None:
        """Why the grammar cannot be used (the library's message), or None. No tokenizer needed."""
        from llguidance import LLMatcher

        if self.kind == "choice":
            options = json.loads(self.source)
            if not options:
                return "must list at least one string"
            if any(not isinstance(o, str) or not o for o in options):
                return "every choice must be a non-empty string"
        try:
            grammar = self.llguidance()
        except ValueError as e:
            return str(e)
        message = LLMatcher.validate_grammar(grammar)
        return message.strip() or None


@lru_cache(maxsize=256)
def spec_problem(spec: GrammarSpec) -> str | None:
    """``spec.problem()``, remembered: a job's lines often share one schema."""
    return spec.problem()
