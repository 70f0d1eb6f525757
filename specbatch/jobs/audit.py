"""The lossless audit: re-decode a sample of a finished job's results with the target alone and
say, per request, whether the stored output is the target's (``specbatch audit JOB``).

  - greedy requests: decoded again by the target alone (no drafts, same parameters); the tokens
    must be identical;
  - seeded sampled requests likewise: a seeded sample is a function of the target, the prompt,
    the parameters and the seed (sample i of ``n``: ``sample_seed(seed, i)``), whatever the
    drafts or the batch, so the target alone re-decodes it and the tokens must be identical;
  - unseeded sampled requests: the stored tokens are scored by the target alone in one forward. With
    stored logprobs, each must equal the target's raw log-probability of its token (within
    ``LOGPROB_TOL``: they are stored as float32); without, each token must be one the processed,
    warped target could draw under the request's grammar, if any (a weaker check, reported as such).

A lossy result (``--fallback-draft``: the draft alone) never passes. The engine work is in
``Engine``; this module picks the rows and compares.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specbatch.db.models import Request, RequestStatus, Result
from specbatch.engine.sampling import sample_seed
from specbatch.errors import InputError
from specbatch.jobs import logprobs
from specbatch.jobs.intake import params_from_dict
from specbatch.jobs.openai_output import produced_by
from specbatch.jobs.store import get_job
from specbatch.plural import plural

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine

LOGPROB_TOL = 1e-3


@dataclass(frozen=True)
class Item:
    """One completed request to audit, read out of the session."""

    request_id: int
    custom_id: str
    target: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int] | None
    params: dict[str, Any]
    token_ids: list[int]
    logprobs: bytes | None
    lossy: bool
    sample_index: int = 0     # which sample of the request (parameter n); each is audited
    numerics: dict[str, Any] | None = None   # how it was decoded (results.numerics; None: not recorded)


@dataclass(frozen=True)
class Verdict:
    custom_id: str
    request_id: int
    check: str          # "identical" (greedy, seeded) | "logprobs" | "support" (unseeded) | "lossy"
    ok: bool
    detail: str
    sample_index: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_sample(text: str | None) -> int | float | None:
    """``--sample``: N requests, or PCT% of them; None for all."""
    if text is None:
        return None
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if 0 < pct <= 100:
                return pct / 100
        elif int(text) >= 1:
            return int(text)
    except ValueError:
        pass
    raise InputError(f"{text!r}: give a count >= 1 or a percentage in (0, 100]%", field="--sample")


def items(s: Session, job_id: str, sample: int | float | None = None, seed: int = 0) -> list[Item]:
    """The job's completed results (a seeded random sample of them), in input order: one item
    per sample of a request with ``n`` > 1."""
    job = get_job(s, job_id)
    rows = s.execute(select(Request, Result).join(Result, Result.request_id == Request.id)
                     .where(Request.job_id == job.id, Request.status == RequestStatus.completed)
                     .order_by(Request.line_no, Result.sample_index)).all()
    if sample is not None:
        n = sample if isinstance(sample, int) else max(1, round(sample * len(rows)))
        keep = set(random.Random(seed).sample(range(len(rows)), min(n, len(rows))))
        rows = [r for i, r in enumerate(rows) if i in keep]
    return [Item(req.id, req.custom_id, produced_by(job, req, res)[0], req.prompt, req.messages, req.prompt_ids,
                 dict(req.params or {}), list(res.token_ids), res.logprobs, bool(res.lossy), res.sample_index,
                 res.numerics)
            for req, res in rows]


def decoded_on(items_: Sequence[Item]) -> tuple[str | None, str | None]:
    """The device type and dtype the audited results were decoded with, each where every result
    that recorded it agrees (None: none recorded, or they differ): what the audit decodes with
    unless told otherwise, so that it re-decodes each result the way it was made."""
    def one(key: str) -> str | None:
        seen = {str(i.numerics[key]) for i in items_ if i.numerics and i.numerics.get(key)}
        return seen.pop() if len(seen) == 1 else None
    return one("device"), one("dtype")


# what a result's numbers depend on besides the target's files and the request (fingerprint.decoded_with;
# compiled: True, False or "partly", a decode that straddled a compiler failure)
_NUMERICS = ("device", "dtype", "int8", "compiled", "linears", "processor", "torch", "transformers")


def numerics_differ(recorded: dict[str, Any] | None, here: dict[str, Any]) -> str:
    """How the audit decodes unlike the result was decoded, in words ("dtype bfloat16, here
    float32; ..."); "" where alike or nothing was recorded (a result older than the record)."""
    if not recorded:
        return ""
    return "; ".join(f"{k} {recorded.get(k)}, here {here.get(k)}" for k in _NUMERICS
                     if recorded.get(k) != here.get(k))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def audit_item(engine: Engine, item: Item) -> Verdict:
    """One request against ``engine`` (the target alone)."""
    def verdict(check: str, ok: bool, detail: str) -> Verdict:
        return Verdict(item.custom_id, item.request_id, check, ok, detail, item.sample_index)

    if item.lossy:
        return verdict("lossy", False, "generated by the draft alone (--fallback-draft), not the target")
    # every sample of a greedy request is the target's greedy text: one decode checks each;
    # sample i of a seeded request is the target alone's n = 1 sample with seed sample_seed(seed, i)
    params = replace(params_from_dict(item.params), n=1)
    n = len(item.token_ids)
    seed = None if params.greedy else params.seed
    seeded = seed is not None
    if seed is not None:
        alone = f"the target alone's sample with seed {seed}" + (
            f" (sample {item.sample_index})" if item.sample_index else "")
        params = replace(params, seed=sample_seed(seed, item.sample_index))
    if params.greedy or seeded:
        out = engine.generate(prompt=item.prompt, messages=item.messages, input_ids=item.prompt_ids,
                              params=params)
        at = first_difference(item.token_ids, out.token_ids)
        if at is None:
            return verdict("identical", True,
                           f"{plural(n, 'token')} identical to {alone if seeded else 'the target alone'}")
        got = out.token_ids[at] if at < len(out.token_ids) else "end"
        want = item.token_ids[at] if at < n else "end"
        return verdict("identical", False, f"token {at} differs: stored {want}, target alone {got}")
    scored = engine.score(item.token_ids, prompt=item.prompt, messages=item.messages, input_ids=item.prompt_ids,
                          params=params)
    if item.logprobs is not None:
        stored = [t.logprob for t in logprobs.unpack(item.logprobs)]
        for j, (a, b) in enumerate(zip(stored, scored.logprobs)):
            if not abs(a - b) <= LOGPROB_TOL:
                return verdict("logprobs", False, f"token {j}: stored logprob {a:.6f}, target alone {b:.6f}")
        if len(stored) != n:
            return verdict("logprobs", False, f"{len(stored)} logprobs stored for {n} tokens")
        return verdict("logprobs", True, f"{plural(n, 'logprob')} equal{'s' if n == 1 else ''} the target "
                                         f"alone's (within {LOGPROB_TOL})")
    bad = next((j for j, p in enumerate(scored.probs) if p <= 0), None)
    if bad is not None:
        return verdict("support", False, f"token {bad} ({item.token_ids[bad]}) has probability 0 under the "
                                         "target's sampling parameters")
    return verdict("support", True, f"{plural(n, 'token')}{'' if n == 1 else ' each'} possible under the target "
                                    "(no logprobs stored to compare)")


def audit(items_: Sequence[Item], engine_for: Callable[[str], Engine],
          on_verdict: Callable[[Verdict], None] | None = None) -> list[Verdict]:
    """Audit every item with ``engine_for(target)`` (the target alone, loaded once per target).
    A mismatch on a result decoded with other numerics than the audit's says which: across a
    device, dtype, kernel or library version a near-tie can round either way with no draft
    involved, so such a mismatch does not show speculation lossy (docs/CONTRACTS.md)."""
    from specbatch.engine.fingerprint import decoded_by

    out = []
    for item in items_:
        engine = engine_for(item.target)
        v = audit_item(engine, item)
        if not v.ok and not item.lossy:
            if differ := numerics_differ(item.numerics, decoded_by(engine)):
                v = replace(v, detail=f"{v.detail} (decoded with other numerics than this audit's: {differ}; "
                                      "a near-tie can round either way across them with no draft involved: "
                                      "audit where it was decoded)")
        if on_verdict is not None:
            on_verdict(v)
        out.append(v)
    return out
