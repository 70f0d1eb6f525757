"""The exact results cache: a deterministic request is generated once per target, then copied.

specbatch is lossless, so a greedy result depends only on the target's weights (and the numerics
they run with), the prompt's token ids after the chat template, and the parameters that change
the output. Not on the drafts, gamma or the batch size. ``cache_key`` hashes exactly those, and
a hit is exact.

The cache is the results table itself: every generated result of a cacheable request carries
its key (``results.cache_key``, indexed) and the target's fingerprint (``cache_target``). A hit is
a normal result row marked ``cached`` that refers to the generated row (``cached_from``), with
zero generation statistics. So it works in ``specbatch run`` and in a cluster, survives restarts
and needs no other service. In a worker (specbatch.worker.chunk) the lookup happens right after a
request is claimed, before any model work:

    cache = ResultCache.for_engine(engine, settings.cache_dir)   # files' digest once per engine
    hits, todo = cache.serve(session_factory, claimed, worker)  # hits are written already
    ...generate todo, store each with cache.columns(request_id, began_compiled)...
    copies = cache.resolve(session_factory, request_id, worker)  # duplicates of it in the chunk

The target's fingerprint holds whether it decodes compiled (engine/fingerprint.py), which a
worker's background compile or a compiler failure changes while it runs: each lookup and each
stored key reads it then (``ResultCache``), and a result whose decode straddled a change gets
no key.

Identical requests claimed together (one chunk) are generated once: the first is generated, the
others wait for it in the chunk and are written as hits. Two workers that claim the same key at
the same moment both miss and both generate: two identical rows, each request still has exactly
one result (``results.request_id`` is unique).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from specbatch.db.models import Job, Request, Result
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats
from specbatch.errors import SpecBatchError
from specbatch.jobs import store

logger = logging.getLogger(__name__)

KEY_VERSION = 1   # bump when the key's contents change: old entries then simply miss


def cacheable(params: GenerationParams) -> bool:
    """Whether a request's result may be served from (and stored in) the cache: greedy only.

    A seeded sample is the target alone's sample with that seed, whatever the drafts, gamma or
    batch (the position-keyed race, engine/sampling.py; tests/engine/test_coupled_sampling.py),
    so it is a function of (target, prompt, parameters) as a greedy result is. ``cache_key``
    already covers the warp, the seed and the processors; caching it would take a new
    ``KEY_VERSION`` only if sampled entries had been stored before (seeded outputs changed with the
    race), then ``params.greedy or params.seed is not None`` here. Not done yet.

    A request with ``n`` > 1 samples is not cached: a hit copies one results row.
    """
    return params.greedy and params.n == 1


def cache_key(target: str, prompt_ids: Sequence[int], params: GenerationParams) -> str:
    """sha256 over everything a cacheable result depends on. ``target``: the target's fingerprint."""
    fields: dict[str, Any] = {
        "v": KEY_VERSION, "target": target, "prompt": [int(i) for i in prompt_ids],
        "max_new_tokens": params.max_new_tokens,
        "stop": sorted(set(params.stop)),   # any stop string ends the text; order and repeats do not matter
    }
    if params.structured is not None:   # (absent otherwise: keys of free-text requests are unchanged)
        fields["structured"] = params.structured.to_dict()
    if not params.greedy:  # greedy decoding never reads these (sampling.Warp is built for sampling only)
        fields.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      seed=params.seed, **({"min_p": params.min_p} if params.min_p else {}))
    # the logit processors change greedy text too; named only when set, so the keys of requests
    # without them are those of KEY_VERSION 1 (their entries stay valid)
    processors = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                  "repetition_penalty": params.repetition_penalty,
                  "logit_bias": [[int(i), float(b)] for i, b in sorted((int(i), b) for i, b in params.logit_bias)]}
    defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": []}
    fields.update({k: v for k, v in processors.items() if v != defaults[k]})
    if params.logprobs is not None:     # a hit copies the source's logprobs: the same count of them
        fields["logprobs"] = params.logprobs
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def output_of(row: Result) -> GenerationOutput:
    """A hit as the engine would return it: the stored text and tokens, nothing generated."""
    return GenerationOutput(text=row.text, token_ids=list(row.token_ids), finish_reason=row.finish_reason,
                            stats=GenerationStats(prompt_tokens=row.prompt_tokens, new_tokens=0))


def _find_sources(s: Session, keys: set[str]) -> dict[str, Result]:
    """key -> the row to copy: the first generated row, else (its job deleted) the first copy."""
    found: dict[str, Result] = {}
    if not keys:
        return found
    for row in s.scalars(select(Result).where(Result.cache_key.in_(sorted(keys)), Result.cached.is_(False))
                         .order_by(Result.id)):
        found.setdefault(row.cache_key or "", row)
    missing = keys - found.keys()
    if missing:
        for row in s.scalars(select(Result).where(Result.cache_key.in_(sorted(missing))).order_by(Result.id)):
            found.setdefault(row.cache_key or "", row)
    return found


_parts: weakref.WeakKeyDictionary[Any, dict[str, Any] | None] = weakref.WeakKeyDictionary()


def _target_parts(engine: Any, cache_dir: str | None) -> dict[str, Any] | None:
    """``fingerprint.fingerprint_parts`` of the engine's target (its files' digest: seconds on a
    cold memo), computed once per engine; None: no cache for this engine."""
    try:
        return _parts[engine]
    except (KeyError, TypeError):
        pass
    target = getattr(engine, "target", None)
    parts = None
    # a --fallback-draft engine (lossy) answers in the target's place: never cache what it says
    if target is not None and hasattr(target, "info") and not getattr(engine, "lossy", False):
        from specbatch.engine.fingerprint import fingerprint_parts

        try:
            parts = fingerprint_parts(target, cache_dir)
        except OSError as e:  # unreadable files: generate as usual, just without the cache
            logger.warning("results cache off: cannot fingerprint %s: %s", getattr(target, "name", "?"), e)
    try:
        _parts[engine] = parts
    except TypeError:
        pass
    return parts


def target_identity(engine: Any, cache_dir: str | None) -> str | None:
    """The engine's target fingerprint (content of its files + numerics) as it decodes now: the
    files' digest is taken once per engine, the compiled state is read at each call
    (``fingerprint.decodes_compiled``: a background compile adopts a compiled forward or static
    graphs while the worker runs, a compiler failure leaves eager for good). None disables the
    cache (an engine without a local target, e.g. a test fake)."""
    parts = _target_parts(engine, cache_dir)
    if parts is None:
        return None
    from specbatch.engine.fingerprint import decodes_compiled, fingerprint_of

    return fingerprint_of(parts, decodes_compiled(engine))


@dataclass
class ResultCache:
    """The cache as one worker's chunk sees it (see the module docstring).

    Keys follow how a result is decoded, which can change while a worker runs (a background
    compile adopted between batches, a compiler failure mid-batch): a claim is looked up under
    the target's fingerprint as the engine decodes at that moment (``serve``), a generated result
    is stored under the fingerprint it was decoded with (``columns``), and one whose decode
    straddled a change is stored with no key, so it is served to no one."""

    engine: Any
    # the target's fingerprint at the last lookup (``serve``); None: off for this engine
    target: str | None
    keys: dict[int, str] = field(default_factory=dict)  # request id -> key it was looked up under
    waiting: dict[int, list[Any]] = field(default_factory=dict)  # generated id -> its duplicates
    # key -> the request of this chunk generating it, until its result is in (a batch claims more
    # of its job as it runs: a duplicate claimed later waits for it too, not generated twice)
    leading: dict[str, int] = field(default_factory=dict)
    cache_dir: str | None = None
    # request id -> what its key hashes besides the target (prompt ids, parameters): the key
    # again when it is stored, under the fingerprint it was decoded with
    inputs: dict[int, tuple[list[int], GenerationParams]] = field(default_factory=dict)

    @classmethod
    def for_engine(cls, engine: Any, cache_dir: str | None) -> ResultCache:
        return cls(engine, target_identity(engine, cache_dir), cache_dir=cache_dir)

    def _target_now(self) -> str | None:
        """The fingerprint as the engine decodes now; a cache made without an engine (a test's)
        keeps the one it was given."""
        if self.target is None or self.engine is None:
            return self.target
        return target_identity(self.engine, self.cache_dir)

    def waiting_ids(self) -> list[int]:
        """Claimed duplicates waiting for a request of this chunk (their leases need renewing)."""
        return [c.id for cs in self.waiting.values() for c in cs]

    def columns(self, request_id: int, began_compiled: bool | None = None) -> dict[str, Any]:
        """``record_result`` keywords for a generated request: its key and the target fingerprint
        it was decoded with. ``began_compiled``: ``fingerprint.decodes_compiled`` when its decode
        began (None: not known, taken as now); where that differs from now the decode straddled a
        change (``fingerprint.decode_ran``: PARTLY) and it is stored with no key."""
        from specbatch.engine.fingerprint import PARTLY, decode_ran, decodes_compiled

        inputs = self.inputs.get(request_id)
        if inputs is None or decode_ran(began_compiled, decodes_compiled(self.engine)) == PARTLY:
            return {}
        target = self._target_now()
        return {"cache_key": cache_key(target, *inputs), "cache_target": target} if target else {}

    def _inputs(self, claimed: Any) -> tuple[list[int], GenerationParams] | None:
        """What a cacheable request's key hashes besides the target; None: not cacheable."""
        if not cacheable(claimed.params):
            return None
        try:
            input_ids = getattr(claimed, "input_ids", None)   # a token-id prompt is its own key
            ids = list(input_ids) if input_ids else self.engine.encode(claimed.prompt, claimed.messages)
        except SpecBatchError:   # the request's own fault: generating it reports the error
            return None
        return ids, claimed.params

    def serve(self, sf: Any, claimed: Sequence[Any], worker: str) -> tuple[list[tuple[Any, GenerationOutput]],
                                                                          list[Any]]:
        """Serve ``claimed`` (ClaimedRequests) from the cache: returns (hits written, now completed,
        with their outputs; the requests left to generate). Idempotent, so safe to retry whole.
        Called again for requests claimed later in the same chunk, it adds to what waits."""
        if not claimed:
            return [], []
        target = self.target = self._target_now()   # looked up as the engine decodes now
        if target is None:
            return [], list(claimed)
        for c in claimed:
            if c.id not in self.keys and (inputs := self._inputs(c)) is not None:
                self.inputs[c.id] = inputs
                self.keys[c.id] = cache_key(target, *inputs)
        hits: list[tuple[Any, GenerationOutput]] = []
        todo: list[Any] = []
        waiting: dict[int, list[Any]] = {}
        with sf.begin() as s:
            use = dict(s.execute(select(Job.id, Job.cache).where(Job.id.in_({c.job_id for c in claimed}))).all())
            keyed = {c.id for c in claimed if c.id in self.keys and use.get(c.job_id, False)}
            sources = _find_sources(s, {self.keys[i] for i in keyed})
            first = dict(self.leading)
            for c in claimed:
                key = self.keys[c.id] if c.id in keyed else None
                if key is None:
                    todo.append(c)
                elif key in sources:
                    store.record_cached_result(s, c.id, sources[key], worker)
                    hits.append((c, output_of(sources[key])))
                elif key in first:             # a duplicate of a request generated in this chunk
                    waiting.setdefault(first[key], []).append(c)
                else:
                    first[key] = c.id
                    todo.append(c)
            for job_id in sorted({c.job_id for c, _ in hits}):
                store.refresh_job(s, job_id)
        self.leading = first
        for leader, dups in waiting.items():     # each request waits once (a set: thousands of
            have = self.waiting.setdefault(leader, [])     # duplicates of one prompt were quadratic)
            seen = {h.id for h in have}
            for d in dups:
                if d.id not in seen:
                    seen.add(d.id)
                    have.append(d)
        return hits, todo

    def resolve(self, sf: Any, request_id: int, worker: str, error: str | None = None,
                **failure: Any) -> list[tuple[Any, GenerationOutput | None]]:
        """The duplicates waiting for ``request_id``, now that it is stored (copied as hits) or
        failed with ``error`` (they fail alike: the same input fails the same way; ``failure``:
        record_failure's keywords). Returns (request, output or None when failed)."""
        key = self.keys.get(request_id)
        if key is not None and self.leading.get(key) == request_id:
            del self.leading[key]    # a duplicate claimed from now on finds the result, or leads
        waiting = self.waiting.get(request_id, [])
        if not waiting:
            return []
        out: list[tuple[Any, GenerationOutput | None]] = []
        with sf.begin() as s:
            source = s.scalar(select(Result).where(Result.request_id == request_id))
            for c in waiting:
                if error is None and source is not None:
                    store.record_cached_result(s, c.id, source, worker)
                    out.append((c, output_of(source)))
                else:
                    store.record_failure(s, c.id, error or "the result it duplicates was not stored", worker,
                                         **failure)
                    out.append((c, None))
            for job_id in sorted({c.job_id for c in waiting}):
                store.refresh_job(s, job_id)
        del self.waiting[request_id]
        return out


# ---------------------------------------------------------------- `specbatch cache`


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


def _names_and_fingerprints(s: Session) -> list[tuple[str, str]]:
    """(target name, fingerprint) pairs of the stored keys: the request's routed target, else its job's."""
    name = func.coalesce(Request.target, Job.target)
    return [(n, fp) for n, fp in s.execute(
        select(name, Result.cache_target).join(Request, Request.id == Result.request_id)
        .join(Job, Job.id == Result.job_id).where(Result.cache_target.is_not(None)).distinct()) if fp is not None]


def _fingerprints_of(s: Session, target: str) -> set[str]:
    """The fingerprints that results of ``target`` were stored under (all its aliases share them)."""
    return {fp for name, fp in _names_and_fingerprints(s) if _same_model(name, target)}


def stats(s: Session) -> dict[str, Any]:
    """What the cache holds: entries (keys that can be served), hits served, tokens not generated,
    per target fingerprint with the model names jobs used for it."""
    per: dict[str | None, dict[str, Any]] = {}

    def bucket(fp: str | None) -> dict[str, Any]:
        return per.setdefault(fp, {"target": fp, "names": set(), "entries": 0, "hits": 0, "tokens_saved": 0})

    for fp, n in s.execute(select(Result.cache_target, func.count(func.distinct(Result.cache_key)))
                           .where(Result.cache_key.is_not(None)).group_by(Result.cache_target)):
        bucket(fp)["entries"] = int(n)
    for fp, n, tokens in s.execute(select(Result.cache_target, func.count(), func.sum(Result.completion_tokens))
                                   .where(Result.cached.is_(True)).group_by(Result.cache_target)):
        bucket(fp).update(hits=int(n), tokens_saved=int(tokens or 0))
    for name, fp in _names_and_fingerprints(s):
        bucket(fp)["names"].add(name)
    targets = [{**b, "names": sorted(b["names"])} for b in per.values()]
    targets.sort(key=lambda b: (-b["entries"], b["target"] or ""))
    return {"entries": sum(b["entries"] for b in targets), "hits": sum(b["hits"] for b in targets),
            "tokens_saved": sum(b["tokens_saved"] for b in targets), "targets": targets}


def clear(s: Session, target: str | None = None) -> int:
    """Forget cache entries (all, or those of ``target`` and its aliases); returns the entries
    dropped. Results stay: only their keys go, so no later request is served from them."""
    where = [Result.cache_key.is_not(None)]
    if target is not None:
        fps = _fingerprints_of(s, target)
        if not fps:
            return 0
        where.append(Result.cache_target.in_(sorted(fps)))
    n = s.scalar(select(func.count(func.distinct(Result.cache_key))).where(*where)) or 0
    s.execute(update(Result).where(*where).values(cache_key=None))
    return int(n)
