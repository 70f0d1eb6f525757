"""The first thing every request meets: a URL with a control character in it is a 400, the key is
checked before a body byte is read, and the body is counted as it streams in, chunked or not, and
refused with a 413 past its route's limit.

FastAPI reads a route's JSON body before it solves the route's dependencies, so ``require_key``
alone would let anyone make the server buffer and parse a body of any size; a ``Content-Length``
check alone misses chunked bodies. This is a plain ASGI middleware (no ``BaseHTTPMiddleware``):
it wraps ``receive`` and never buffers anything itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import parse_qsl

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specbatch.api.errors import ApiError, as_response

TOO_LARGE = "request_too_large"


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` at the first byte over the limit. An HTTPException because FastAPI
    re-raises those from its body reading (any other error there becomes a 400 "error parsing the
    body"); the app's handler answers it in OpenAI's shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request bodies here are at most {limit} bytes")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def url_refusal(scope: Scope) -> ApiError | None:
    """A 400 for a control character (NUL above all: PostgreSQL text cannot hold it) in the path or
    a query parameter, which no id, cursor or filter of ours contains; nothing echoed."""
    if _control(scope["path"]):
        return ApiError(400, "the URL path holds a control character (such as NUL); no id contains one",
                        param="id", code="invalid_url")
    query = scope.get("query_string", b"").decode("latin-1")
    if "%" not in query and not _control(query):
        # decoding can make a control character only out of a %-escape: nothing to parse (the
        # parse was ~10 us of every list request's CPU)
        return None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if _control(name) or _control(value):
            param = None if _control(name) else name
            return ApiError(400, f"query parameter {param or '(unnamed)'} holds a control character (such as "
                                 "NUL)", param=param, code="invalid_url")
    return None


def has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("", "0")


class Guard:
    """``limit(scope)``: the most body bytes the route takes; ``check_key(headers)``: an ApiError
    (401) for a request without a valid key, None to let it in (a keyless server lets all in)."""

    def __init__(self, app: ASGIApp, limit: Callable[[Scope], int],
                 check_key: Callable[[Headers], ApiError | None]) -> None:
        self.app, self.limit, self.check_key = app, limit, check_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.limit(scope)
        refusal = url_refusal(scope)
        if refusal is None and has_body(headers):
            # a body is read only for a key holder; routes without a body check the key as a
            # dependency (so a public route such as /healthz stays public)
            refusal = self.check_key(headers)
            length = headers.get("content-length", "")
            if refusal is None and length.strip().isdigit() and int(length) > limit:
                refusal = ApiError(413, BodyTooLarge(limit).detail, code=TOO_LARGE)
        if refusal is not None:
            await as_response(refusal)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, bounded, send)
