"""Queue names derived from a model pair: a job's tasks only reach workers holding its models."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

PREFIX = "specbatch"


def _canonical(name: str) -> str:
    """A model name as given; a local path is made absolute so ``./m`` and ``/abs/m`` agree."""
    name = name.strip().rstrip("/") or name
    if os.path.exists(name):
        return os.path.realpath(name)
    return name


def _slug(name: str) -> str:
    base = os.path.basename(name.rstrip("/")) or name
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base)[:40]


def queue_name(target: str, drafts: Sequence[str] = (), ngram: bool = False) -> str:
    """``specbatch.<target>+<draft>[+ngram].<hash>``; equal for equal pairs, readable in Flower.

    The hash covers the canonical names (absolute paths for local directories, in draft order),
    so two different directories that happen to share a basename never share a queue.
    """
    parts = [_canonical(target), *(_canonical(d) for d in drafts)]
    if ngram:
        parts.append("ngram")
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
    readable = "+".join([_slug(target), *(_slug(d) for d in drafts), *(["ngram"] if ngram else [])])
    return f"{PREFIX}.{readable}.{digest}"
