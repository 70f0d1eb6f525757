"""The order a job's requests are chunked in: requests whose prompts share a prefix, adjacent.

A worker computes a shared prompt prefix once per decode (specbatch/engine/prefix.py), so the
requests sharing it should land in the same chunk and decode together rather than scatter over
chunks and workers that each compute it again. Tokens are the worker's business (the chat
template, the tokenizer); here the prompt's text stands for them: sorted, a request's neighbours
are the prompts it shares the most with. Requests whose prompts start with the same
``MIN_SHARED_CHARS`` characters form a group, placed where its first request was: requests that
share nothing keep their order, so a job without shared prefixes is chunked exactly as before.
A worker topping its batch up beyond its chunk (worker/chunk.py, claiming ahead) takes the pending
requests that share its chunk's prefix first (``ahead_ordered``).
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
AHEAD_SCAN = 2_000         # pending requests read for their prompt when a worker claims ahead


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


def _texts(s: Session, ids: Sequence[int]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for start in range(0, len(ids), 10_000):       # (bounded IN lists)
        rows = s.execute(select(Request.id, Request.prompt, Request.messages, Request.prompt_ids)
                         .where(Request.id.in_(list(ids[start:start + 10_000]))))
        texts.update((rid, prompt_text(p, m, pi)) for rid, p, m, pi in rows)
    return texts


def prefix_ordered(s: Session, request_ids: Sequence[int]) -> list[int]:
    """``request_ids`` (ascending) in chunking order: see the module docstring."""
    ids = sorted(int(i) for i in request_ids)
    if len(ids) < 2:
        return ids
    texts = _texts(s, ids)
    return group_by_prefix(ids, [texts.get(i, "") for i in ids])


def mates_first(claimed: Sequence[str], ids: Sequence[int], texts: Sequence[str],
                min_chars: int = MIN_SHARED_CHARS) -> list[int]:
    """``ids`` in the order a worker claims them ahead of its batch: those whose text starts with
    the same ``min_chars`` characters as one of the ``claimed`` texts first, then the others
    grouped by prefix (``group_by_prefix``), so that a batch topped up from them shares what it
    can."""
    keys = {t[:min_chars] for t in claimed if len(t) >= min_chars}
    mates = [i for i, t in zip(ids, texts) if len(t) >= min_chars and t[:min_chars] in keys]
    if len(mates) == len(ids):
        return list(ids)
    taken = set(mates)
    rest = [(i, t) for i, t in zip(ids, texts) if i not in taken]
    return mates + group_by_prefix([i for i, _ in rest], [t for _, t in rest], min_chars)


def ahead_ordered(s: Session, claimed_ids: Sequence[int], pending_ids: Sequence[int],
                  scan: int = AHEAD_SCAN) -> list[int]:
    """``pending_ids`` (ascending) in the order to claim them ahead of a batch of ``claimed_ids``
    (``mates_first``). Chunks are cut in prefix order, but the pending requests a worker tops
    its batch up with come in id order, where a job's prefixes interleave. Only the first
    ``scan`` are read (a claim reads no whole job); the rest follow in id order."""
    head = list(pending_ids[:scan])
    texts = _texts(s, [*claimed_ids, *head])
    return mates_first([texts.get(i, "") for i in claimed_ids], head, [texts.get(i, "") for i in head]) \
        + list(pending_ids[scan:])
