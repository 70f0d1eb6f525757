"""Bearer keys (``SPECBATCH_API_KEYS``, comma-separated). No keys: every request is let in, which
``specbatch serve`` allows only on a loopback address."""

from __future__ import annotations

import hmac

from fastapi import Request

from specbatch.api.errors import ApiError

CHALLENGE = {"WWW-Authenticate": "Bearer"}


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    # compare against every key (no early exit) in constant time per key
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


def require_key(request: Request) -> None:
    """FastAPI dependency: 401 in OpenAI's shape unless the request carries one of the keys."""
    keys: tuple[str, ...] = request.app.state.sb.settings.api_key_list
    if not keys:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                            "(one of SPECBATCH_API_KEYS).", code="missing_api_key", headers=CHALLENGE)
    if not key_matches(given.strip(), keys):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE)
