"""Where a request stops: max_new_tokens, any EOS id, or a stop string (possibly straddling steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StopCheck:
    """Feed each step's new tokens; tells how many to keep and whether to finish.

    Stop strings are searched in the decoded text of the new tokens, from a little before the
    previous end, so a stop string split across draft or step boundaries is still found. The
    kept tokens end with the token that completed the stop string (as transformers does); the
    text ends exactly before the stop string.
    """

    tokenizer: Any
    eos_ids: frozenset[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    text_end: int | None = None         # set when a stop string cut the text
    _searched: int = 0                  # text already searched (minus overlap)

    def step(self, generated: list[int], n_new: int) -> tuple[int, str | None]:
        """generated: all new tokens so far, the last n_new from this step.

        Returns (tokens to keep, finish_reason or None).
        """
        start = len(generated) - n_new
        keep, reason = len(generated), None
        for i in range(start, len(generated)):
            if generated[i] in self.eos_ids:
                keep, reason = i + 1, "stop"
                break
        if keep >= self.max_new_tokens and (reason is None or keep > self.max_new_tokens):
            keep, reason = self.max_new_tokens, "length"
        if self.stop:
            cut = self._find_stop(generated[:keep], start)
            if cut is not None:
                keep, reason = cut, "stop"
        return keep, reason

    def _find_stop(self, generated: list[int], start: int) -> int | None:
        text = self.decode(generated)
        longest = max(len(s) for s in self.stop)
        frm = max(0, self._searched - longest)
        hits = [(i, s) for s in self.stop if (i := text.find(s, frm)) >= 0]
        self._searched = len(text)
        if not hits:
            return None
        at, s = min(hits)
        self.text_end = at
        # the fewest tokens whose text already contains the stop string
        for m in range(max(start, 1), len(generated) + 1):
            if len(self.decode(generated[:m])) >= at + len(s) and s in self.decode(generated[:m]):
                return m
        return len(generated)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self, generated: list[int]) -> str:
        text = self.decode(generated)
        return text[: self.text_end] if self.text_end is not None else text
