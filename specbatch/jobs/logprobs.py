"""Log-probabilities at rest: one packed binary value per result (``results.logprobs``), not
JSON per token, and the OpenAI shapes they are exported in (docs/FORMATS.md, "Log-probabilities").

Layout (little-endian): b"LP1", k (uint8: top alternatives per token), then per token the
chosen token and its k alternatives, each as ``id int32, logprob float32, n uint16, n bytes``.
A 100-token answer with 5 alternatives is ~7 KB.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from specbatch.engine.types import TokenLogprob

MAGIC = b"LP1"
_ENTRY = struct.Struct("<ifH")


def pack(logprobs: Sequence[TokenLogprob]) -> bytes:
    k = max((len(t.top) for t in logprobs), default=0)
    out = bytearray(MAGIC + bytes([k]))
    for t in logprobs:
        entries = [(t.token, t.logprob, t.raw), *zip((i for i, _ in t.top), (v for _, v in t.top),
                                                        t.top_raw or [b""] * len(t.top))]
        entries += [(0, float("-inf"), b"")] * (k + 1 - len(entries))     # (never: k is per request)
        for tid, lp, raw in entries:
            out += _ENTRY.pack(tid, lp, len(raw)) + raw
    return bytes(out)


def unpack(blob: bytes) -> list[TokenLogprob]:
    if blob[:3] != MAGIC:
        raise ValueError("not a packed logprobs value")
    k, pos, out = blob[3], 4, []
    while pos < len(blob):
        entries = []
        for _ in range(k + 1):
            tid, lp, n = _ENTRY.unpack_from(blob, pos)
            pos += _ENTRY.size
            entries.append((tid, lp, bytes(blob[pos:pos + n])))
            pos += n
        (tid, lp, raw), top = entries[0], entries[1:]
        out.append(TokenLogprob(tid, lp, tuple((i, v) for i, v, _ in top), raw, tuple(b for _, _, b in top)))
    return out


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat.completion (openai.types.chat.ChoiceLogprobs)."""
    return {"content": [
        {"token": _text(t.raw), "logprob": t.logprob, "bytes": list(t.raw),
         "top_logprobs": [{"token": _text(b), "logprob": v, "bytes": list(b)}
                          for (_, v), b in zip(t.top, t.top_raw)]}
        for t in logprobs], "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a text_completion (openai.types.completion_choice.Logprobs):
    ``text_offset`` counts characters of the completion text, as OpenAI does without echo."""
    tokens = [_text(t.raw) for t in logprobs]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    top = []
    for t in logprobs:
        alts: dict[str, float] = {}
        for (_, v), b in zip(t.top, t.top_raw):
            alts.setdefault(_text(b), v)        # two ids may print alike: the likelier one stays
        top.append(alts)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs], "top_logprobs": top,
            "text_offset": offsets}
