"""Bearer keys and the tenants they stand for (``SPECBATCH_API_KEYS``, comma-separated).

An entry is ``KEY`` or ``PROJECT:KEY``. A key sees, lists, cancels and deletes only its tenant's
files and batches; another tenant's are answered 404, as if they did not exist. The tenant of
``PROJECT:KEY`` is the project (several keys may share one, so a key can be rotated); a bare key is
a tenant of its own (stored as a fingerprint, never the key). ``*:KEY`` is an admin key: it sees
every tenant's objects, and those made before tenants existed. No keys: every request is let in
and sees everything, which ``specbatch serve`` allows only on a loopback address.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Request

from specbatch.api.deps import Caller
from specbatch.api.errors import ApiError

CHALLENGE = {"WWW-Authenticate": "Bearer"}
ADMIN = "*"


def fingerprint(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=4)
def keyring(entries: tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """((key, tenant), ...) for ``settings.api_key_list``; tenant None: an admin key."""
    ring: list[tuple[str, str | None]] = []
    for entry in entries:
        project, colon, key = entry.partition(":")
        if not colon or not project.strip() or not key.strip():
            ring.append((entry, fingerprint(entry)))
        else:
            ring.append((key.strip(), None if project.strip() == ADMIN else project.strip()))
    return tuple(ring)


def tenant_of(given: str, entries: tuple[str, ...]) -> tuple[bool, str | None]:
    """(whether ``given`` is one of the keys, its tenant): every key compared (no early exit), each
    in constant time."""
    found, tenant = False, None
    for key, owner in keyring(entries):
        if hmac.compare_digest(given.encode(), key.encode()):
            found, tenant = True, owner
    return found, tenant


def check_key(headers: Mapping[str, str], entries: tuple[str, ...]) -> ApiError | None:
    """The 401 (OpenAI's shape) for a request that does not carry one of the keys; None: let it in."""
    return _authenticate(headers, entries)[0]


def _authenticate(headers: Mapping[str, str], entries: tuple[str, ...]) -> tuple[ApiError | None, str | None]:
    if not entries:
        return None, None
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                             "(one of SPECBATCH_API_KEYS).", code="missing_api_key", headers=CHALLENGE), None
    found, tenant = tenant_of(given.strip(), entries)
    if not found:
        return ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE), None
    return None, tenant


async def require_key(request: Request) -> Caller:
    """FastAPI dependency, the only one of a keyed route: the app's state and the request's tenant
    (None: sees every tenant), or a 401. One dependency, not the key, the state and the tenant as
    three: FastAPI solves each sub-dependency in full (its parameters, its cache key) on every
    request, even one whose value it has cached, and three were a fifth of a list/retrieve's CPU.
    Routes with a body meet ``guard.Guard``'s check first. ``async`` though it never waits: a sync
    dependency costs each request a hop through the thread pool."""
    sb = request.app.state.sb
    refusal, tenant = _authenticate(request.headers, sb.settings.api_key_list)
    if refusal is not None:
        raise refusal
    return Caller(sb, tenant)


async def require_docs_key(request: Request) -> None:
    """``require_key`` for /docs and /openapi.json. Their usual caller is a browser, which sends no
    bearer key, so the 401 also names the setting that opens them."""
    try:
        await require_key(request)
    except ApiError as e:
        e.message += (" A browser sends no key: SPECBATCH_API_PUBLIC_DOCS=1 on the server opens /docs "
                      "and /openapi.json to anyone who reaches the port.")
        raise


Keyed = Annotated[Caller, Depends(require_key)]
"""A keyed route's one dependency: ``def route(caller: Keyed)``, then ``caller.sb`` and ``caller.owner``."""
