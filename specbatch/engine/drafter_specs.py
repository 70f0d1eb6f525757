"""Drafters as values: a ``DrafterSpec`` parsed from one string, and the registry of kinds.

    DrafterSpec.parse("ngram")                   # the prompt-lookup drafter
    DrafterSpec.parse("model:DIR")               # a draft model; a bare name or path means the same
    parse_drafters(["DIR", "ngram"])             # a pool, normalized: what jobs, queues, the database hold

A job, its queue name, the ``jobs.drafts`` column, the worker's engine spec and the metrics'
``drafts`` label all carry ``str(spec)`` of each member, in ``parse_drafters``' order: the model
drafts as given, then the drafters that load no model. ``str`` of a model spec is its bare name,
so a pool stored, or hashed into a queue name, before specs existed reads back the same.

A new kind of drafter is one entry in ``KINDS`` (its name, its argument, how to build it for one
decode), its own module, and its tests; nothing else names it. SGLang's
``SpeculativeAlgorithm.from_string`` and vLLM's ``speculative_config.method`` are the model.
Importing this module imports no torch (``submit`` parses drafters without an engine).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specbatch.errors import ModelLoadError

if TYPE_CHECKING:
    from specbatch.engine.drafters import Drafter
    from specbatch.engine.loading import LoadedModel


@dataclass(frozen=True)
class Kind:
    """One kind of drafter. ``build(spec, draft, vocab_size)`` makes a fresh drafter for one decode
    (``draft``: the loaded model of a ``loads_model`` kind, else None); None: the name is taken,
    the drafter is not available here, and parsing it says ``missing``."""

    build: Callable[[DrafterSpec, LoadedModel | None, int], Drafter] | None
    argument: str = ""         # what follows "KIND:" ("": the kind takes none)
    loads_model: bool = False  # the argument is a draft model the engine loads beside the target
    missing: str = ""


def _model(spec: DrafterSpec, draft: LoadedModel | None, vocab_size: int) -> Drafter:
    from specbatch.engine.drafters import ModelDrafter

    assert draft is not None, spec
    return ModelDrafter(draft, vocab_size)


def _ngram(spec: DrafterSpec, draft: LoadedModel | None, vocab_size: int) -> Drafter:
    from specbatch.engine.drafters import NgramDrafter

    return NgramDrafter()


KINDS: dict[str, Kind] = {
    "model": Kind(_model, argument="a model name, directory, .gguf file or Hugging Face id", loads_model=True),
    "ngram": Kind(_ngram),
    "eagle": Kind(None, argument="a path to EAGLE heads",
                  missing="EAGLE heads need the target's hidden states per step; not available yet"),
    "suffix": Kind(None, missing="the suffix-tree drafter is not available yet"),
    "grammar": Kind(None, missing="structured outputs already draft the tokens their grammar forces; "
                                  "there is no grammar drafter to name"),
}
MODEL = "model"


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter as a value: its kind (a ``KINDS`` key) and its argument ("" for none)."""

    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """``KIND`` or ``KIND:ARG``; anything else is a model (``model:`` is implied). Raises
        ModelLoadError naming the spec when the kind is not available or its argument is wrong."""
        text = text.strip()
        head, sep, rest = text.partition(":")
        if sep and head in KINDS:
            spec = cls(head, rest.strip())
        elif text in KINDS:
            spec = cls(text)
        else:
            spec = cls(MODEL, text)
        kind = KINDS[spec.kind]
        if spec.kind == MODEL and "," in spec.arg and not os.path.exists(os.path.expanduser(spec.arg)):
            # `--draft ngram,foo` read as one model name: say how a pool is written
            first, _, rest = spec.arg.partition(",")
            raise ModelLoadError(f"drafter {text!r}: one drafter a spec; for a pool give each its own "
                                 f"(--draft {first.strip()} --draft {rest.strip()})")
        if kind.build is None:
            raise ModelLoadError(f"drafter {text!r}: {kind.missing}")
        if kind.argument and not spec.arg:
            raise ModelLoadError(f"drafter {text!r}: {spec.kind} takes {kind.argument} ({spec.kind}:ARG)")
        if spec.arg and not kind.argument:
            raise ModelLoadError(f"drafter {text!r}: {spec.kind} takes no argument (write {spec.kind!r})")
        return spec

    @property
    def loads_model(self) -> bool:
        return KINDS[self.kind].loads_model

    def build(self, draft: LoadedModel | None, vocab_size: int) -> Drafter:
        """A fresh drafter for one decode (``draft``: this spec's loaded model, if it loads one)."""
        build = KINDS[self.kind].build
        assert build is not None, self   # parse refuses kinds with no builder
        return build(self, draft, vocab_size)

    def __str__(self) -> str:
        """The string that parses back to this spec: a model's bare name where that is unambiguous
        (what ``--draft`` took and the database held before specs), else ``KIND:ARG``."""
        if self.kind == MODEL:
            head = self.arg.partition(":")[0]
            return f"{MODEL}:{self.arg}" if self.arg in KINDS or head in KINDS else self.arg
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


NGRAM = DrafterSpec("ngram")     # the prompt-lookup drafter: ``--ngram`` adds it to a pool


def parse_drafters(texts: Iterable[str | DrafterSpec]) -> tuple[DrafterSpec, ...]:
    """A pool as one normalized tuple: duplicates dropped, the drafters that load a model first in
    the order given (the pool's order), then the others in the order given. Equal pools give
    equal tuples, hence equal queue names."""
    specs: list[DrafterSpec] = []
    for t in texts:
        spec = t if isinstance(t, DrafterSpec) else DrafterSpec.parse(t)
        if spec not in specs:
            specs.append(spec)
    return tuple(sorted(specs, key=lambda s: not s.loads_model))   # stable: the order given within each


def names(specs: Iterable[DrafterSpec]) -> list[str]:
    """What the database, the queue name and the metrics store of a pool."""
    return [str(s) for s in specs]


def model_names(specs: Iterable[DrafterSpec]) -> list[str]:
    """The draft models of a pool (what the engine loads beside the target)."""
    return [s.arg for s in specs if s.loads_model]


def without_models(specs: Iterable[DrafterSpec]) -> tuple[DrafterSpec, ...]:
    """The members that load no model: a --model-map route runs on its own draft models plus these."""
    return tuple(s for s in specs if not s.loads_model)


def pool_fields(drafters: Iterable[str]) -> dict[str, Any]:
    """A stored pool as JSON outputs show it (``status --json``, exports, the API): ``drafters``,
    every member; ``drafts`` (the draft models) and ``ngram`` (the n-gram drafter is in it), the
    two fields those outputs had before drafters were values."""
    specs = parse_drafters(drafters)
    return {"drafts": model_names(specs), "ngram": NGRAM in specs, "drafters": names(specs)}
