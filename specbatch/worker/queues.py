"""Queue names derived from a model pair: a job's tasks only reach workers holding its models."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

from specbatch.engine.drafter_specs import DrafterSpec, names, parse_drafters, without_models

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


def queue_name(target: str, drafters: Sequence[str | DrafterSpec] = ()) -> str:
    """``specbatch.<target>+<draft>[+ngram].<hash>``; equal for equal pairs, readable in Flower.

    The hash covers the canonical names (absolute paths for local directories, the pool in
    ``parse_drafters``' order), so two different directories that happen to share a basename
    never share a queue, and a pool hashes as it did when drafters were a list plus a flag.
    """
    specs = parse_drafters(drafters)
    parts = [_canonical(target), *(_canonical(s.arg) if s.loads_model else str(s) for s in specs)]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
    readable = "+".join([_slug(target), *(_slug(s.arg if s.loads_model else str(s)) for s in specs)])
    return f"{PREFIX}.{readable}.{digest}"


def route_drafters(route_drafts: Sequence[str], job_drafters: Sequence[str]) -> list[str]:
    """A --model-map route's pool: its own draft models plus the job's drafters that load none."""
    return [*route_drafts, *names(without_models(parse_drafters(job_drafters)))]


def route_queue(route: tuple[str, Sequence[str]] | None, job_queue: str, job_drafters: Sequence[str]) -> str:
    """The queue of a route (``store.request_routes``: (target, draft models); None: the job's own
    ``job_queue``)."""
    if route is None:
        return job_queue
    return queue_name(route[0], route_drafters(route[1], job_drafters))
