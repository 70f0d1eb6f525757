"""Token limits at intake: a prompt whose tokens plus its max_new_tokens exceed its pair's context
is refused on its line, before a job exists, instead of failing on a worker after the models load.

Only what is on this machine is read: the pair's configs (context lengths) and, for a line that
might not fit, the target's tokenizer (``model_files``). A line whose UTF-8 size alone shows it
fits is never tokenized, so an ordinary file costs no tokenizer load (nor the torch import under
it). A model with no files here (weights not installed, a path only the workers hold) is not
checked: its worker refuses such a request as before, with the same message.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specbatch.config import Settings
from specbatch.engine.chat import encode
from specbatch.engine.drafter_specs import model_names, parse_drafters
from specbatch.engine.model_files import (
    ModelFiles,
    context_length,
    context_problem,
    load_tokenizer,
    local_files,
)
from specbatch.errors import RequestError

logger = logging.getLogger(__name__)

# A token covers at least one byte of text in byte-level BPE and SentencePiece vocabularies alike,
# so a prompt's UTF-8 size bounds its tokens, give or take the special tokens added around it. A
# chat template's own text is not counted: its headers take these many tokens per message, plus
# the template's fixed text at most TEMPLATE_TOKENS (a line over the bound is tokenized exactly).
SPECIAL_TOKENS = 16
TOKENS_PER_MESSAGE = 32
TEMPLATE_TOKENS = 256

_NOT_HERE = object()


class ContextCheck:
    """``problem(fields)``: why one parsed line cannot fit its pair (the job's ``target`` and
    ``drafts``, or the pair --model-map routed it to), or None.

    One per intake; each model's context and the targets' tokenizers are read once, when first needed.
    """

    def __init__(self, settings: Settings, target: str, drafts: Sequence[str],
                 default_budget: str = "max_new_tokens") -> None:
        """``drafts``: the pool's drafter specs (only its draft models have a context);
        ``default_budget``: where the job's max_new_tokens came from (``--max-new-tokens``,
        ``metadata.specbatch_max_tokens``), named for a line that gives none."""
        self.cache_dir, self.default_budget = settings.cache_dir, default_budget
        self.target, self.drafts = target, model_names(parse_drafters(drafts))
        self._contexts: dict[str, int | None] = {}
        self._by_files: dict[ModelFiles, int | None] = {}
        self._tokenizers: dict[str, Any] = {}

    def _context(self, name: str) -> int | None:
        if name not in self._contexts:
            files = local_files(name, self.cache_dir)
            if files is None:
                self._contexts[name] = None
            elif files in self._by_files:       # e.g. the default pair: one GGUF file, read once
                self._contexts[name] = self._by_files[files]
            else:
                try:
                    self._contexts[name] = context_length(files)
                except Exception as e:  # noqa: BLE001 - an unreadable config: the worker's check remains
                    logger.info("cannot read the context length of %s (%s); not checked at intake", name, e)
                    self._contexts[name] = None
                self._by_files[files] = self._contexts[name]
        return self._contexts[name]

    def _tokenizer(self, name: str) -> Any:
        if name not in self._tokenizers:
            files = local_files(name, self.cache_dir)
            try:
                self._tokenizers[name] = load_tokenizer(files) if files is not None else _NOT_HERE
            except Exception as e:  # noqa: BLE001 - as above: the worker tokenizes it again
                logger.info("cannot load the tokenizer of %s (%s); not checked at intake", name, e)
                self._tokenizers[name] = _NOT_HERE
        return self._tokenizers[name]

    def problem(self, fields: dict[str, Any], budget: str | None = None) -> ContextProblem | None:
        """``fields``: intake's parsed line (prompt, messages, prompt_ids, params, target, drafts);
        ``budget``: the line's own max tokens field (``body.max_tokens``), None: the job's default."""
        target, drafts = ((fields["target"], fields.get("drafts") or []) if fields.get("target")
                          else (self.target, self.drafts))
        max_new = int(fields["params"]["max_new_tokens"])
        limits = [(n, c) for n in (target, *drafts) if (c := self._context(n)) is not None]
        if not limits:
            return None
        model, context = min(limits, key=lambda x: x[1])   # the shortest context bounds the pair
        budget = budget or self.default_budget
        # a number no prompt can fit beside (max_tokens=100000000) is that field's fault, not the prompt's
        field = budget if max_new >= context else None
        if fields.get("prompt_ids") is not None:
            why = context_problem(len(fields["prompt_ids"]), max_new, model, context, budget.rpartition(".")[2])
            return ContextProblem(why, field) if why else None
        if _upper_bound(fields) + max_new <= context:
            return None
        tok = self._tokenizer(target)
        if tok is _NOT_HERE:
            return None if field is None else ContextProblem(
                f"{budget.rpartition('.')[2]} ({max_new}) is over the context of {model!r} ({context} tokens)",
                field)
        try:
            ids = encode(tok, target, fields.get("prompt"), fields.get("messages"))
        except RequestError as e:
            return ContextProblem(e.reason, None)
        why = context_problem(len(ids), max_new, model, context, budget.rpartition(".")[2])
        return ContextProblem(why, field) if why else None


@dataclass(frozen=True)
class ContextProblem:
    message: str
    field: str | None       # None: the prompt's (intake names prompt / messages)


def _upper_bound(fields: dict[str, Any]) -> int:
    """At least the line's prompt tokens (see SPECIAL_TOKENS above)."""
    if fields.get("prompt") is not None:
        return len(fields["prompt"].encode("utf-8")) + SPECIAL_TOKENS
    messages = fields.get("messages") or []
    text = sum(len(str(v).encode("utf-8")) for m in messages for v in m.values())
    return text + TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS + SPECIAL_TOKENS
