"""The order a job's requests are chunked in: requests whose prompts share a prefix, adjacent.

A worker computes a shared prompt prefix once per decode (specbatch/engine/prefix.py), so the
requests sharing it should land in the same chunk and decode together rather than scatter over
chunks and workers that each compute it again. Tokens are the worker's business (the chat
template, the tokenizer); here the prompt's text stands for them: sorted, a request's neighbours
are the prompts it shares the most with. Requests whose prompts start with the same
``MIN_SHARED_CHARS`` characters form a group, placed where its first request was: requests that
share nothing keep their order, so a job without shared prefixes is chunked exactly as before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.db.models import Request

MIN_SHARED_CHARS = 64      # ~16 tokens: the shortest prefix a worker computes apart
KEY_CHARS = 20_000         # what is compared of a prompt (a prefix longer than that is one group)


def prompt_text(prompt: str | None, messages: list[dict[str, Any]] | None, prompt_ids: list[int] | None) -> str:
    """The prompt as the worker sees its front: the messages in order (role, then content), the
    text, or the token ids."""
    if messages is not None:
        return "".join(f"\x00{m.get('role')}\x00{m.get('content') if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}"
                       for m in messages if isinstance(m, dict))[:KEY_CHARS]
    if prompt_ids is not None:
        return " ".join(str(i) for i in prompt_ids)[:KEY_CHARS]
    return (prompt or "")[:KEY_CHARS]


def _shared(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def group_by_prefix(ids: Sequence[int], texts: Sequence[str], min_chars: int = MIN_SHARED_CHARS) -> list[int]:
    """``ids`` reordered: ids whose texts start with the same ``min_chars`` characters (a run of
    the sorted texts where neighbours share that much) form a group, placed where its first id
    was, its ids ascending; ids that share less with every other stay where they were."""
    order = sorted(range(len(ids)), key=lambda i: texts[i])
    group = list(range(len(ids)))             # index -> the index its group is known by
    for a, b in zip(order, order[1:]):
        if _shared(texts[a], texts[b]) >= min_chars:
            group[b] = group[a]
    members: dict[int, list[int]] = {}
    for i in range(len(ids)):
        members.setdefault(group[i], []).append(i)
    placed: dict[int, list[int]] = {}         # first index of a group -> its ids
    for m in members.values():
        placed[min(m)] = [ids[i] for i in sorted(m)]
    return [rid for first in sorted(placed) for rid in placed[first]]


def prefix_ordered(s: Session, request_ids: Sequence[int]) -> list[int]:
    """``request_ids`` (ascending) in chunking order: see the module docstring."""
    ids = sorted(int(i) for i in request_ids)
    if len(ids) < 2:
        return ids
    texts: dict[int, str] = {}
    for start in range(0, len(ids), 10_000):       # (bounded IN lists)
        rows = s.execute(select(Request.id, Request.prompt, Request.messages, Request.prompt_ids)
                         .where(Request.id.in_(ids[start:start + 10_000])))
        texts.update((rid, prompt_text(p, m, pi)) for rid, p, m, pi in rows)
    return group_by_prefix(ids, [texts.get(i, "") for i in ids])
