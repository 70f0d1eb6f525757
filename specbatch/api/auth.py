"""Bearer keys (``SPECBATCH_API_KEYS``, comma-separated). No keys: every request is let in, which
``specbatch serve`` allows only on a loopback address."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from fastapi import Request

from specbatch.api.errors import ApiError

CHALLENGE = {"WWW-Authenticate": "Bearer"}


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    # compare against every key (no early exit) in constant time per key
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


def check_key(headers: Mapping[str, str], keys: tuple[str, ...]) -> ApiError | None:
    """The 401 (OpenAI's shape) for a request that does not carry one of ``keys``; None: let it in."""
    if not keys:
        return None
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                             "(one of SPECBATCH_API_KEYS).", code="missing_api_key", headers=CHALLENGE)
    if not key_matches(given.strip(), keys):
        return ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE)
    return None


def require_key(request: Request) -> None:
    """FastAPI dependency for routes without a body (``guard.Guard`` checks the others first)."""
    refusal = check_key(request.headers, request.app.state.sb.settings.api_key_list)
    if refusal is not None:
        raise refusal
