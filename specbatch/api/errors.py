"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

The official client turns the status into its exception class (401 AuthenticationError, 404
NotFoundError, 400 BadRequestError, ...) and reads the message from this body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException

from specbatch.errors import BrokerUnavailable, InputError, InputErrors, JobNotFound, SpecBatchError
from specbatch.jobs.batches import BatchEnded, BatchNotFound
from specbatch.jobs.files import FileNotFound
from specbatch.jobs.structured import unreadable

logger = logging.getLogger(__name__)


BROKER_DOWN = "the job queue's broker cannot be reached; nothing was queued, try again later"
# on a 409 whose answer cannot change: openai-python retries every 409 ("lock timeouts") twice with
# backoff unless the server says not to (its _should_retry obeys this header first)
NO_RETRY = {"x-should-retry": "false"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def as_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def from_domain(e: SpecBatchError) -> ApiError:
    """Our exceptions as API errors; the message is the one a CLI user would read."""
    if isinstance(e, (FileNotFound, BatchNotFound, JobNotFound)):
        return ApiError(404, str(e), param="id")
    if isinstance(e, BatchEnded):    # OpenAI's answer, word for word (its clients match on it)
        return ApiError(409, str(e), headers=NO_RETRY)
    if isinstance(e, InputError):    # the field in the message too: clients show only the message
        named = e.field and not isinstance(e, InputErrors)     # (InputErrors names each field itself)
        return ApiError(400, f"{e.field}: {e.reason}" if named else e.reason, param=e.field)
    if isinstance(e, BrokerUnavailable):     # its text names the broker URL, which may hold a password
        return ApiError(503, BROKER_DOWN, type="server_error", code="broker_unavailable")
    return ApiError(400, str(e))


# FastAPI's answer for a JSON body its reader raised on other than a JSONDecodeError (the reader's
# error is the exception's __cause__): it names nothing a client can fix
UNPARSED = "There was an error parsing the body"



def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return as_response(e)

    @app.exception_handler(SpecBatchError)
    async def domain_error(_: Request, e: SpecBatchError) -> JSONResponse:
        return as_response(from_domain(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":     # loc is ("body", offset): not a parameter
            where = first.get("loc", ("body", "?"))[-1]
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            return as_response(ApiError(400, f"the request body is not valid JSON ({reason} at character {where})",
                                        code="invalid_json"))
        if tuple(first.get("loc", ())) == ("body",):   # the whole body: none, or not an object
            # (a form or text/plain post reaches the model as a string: pydantic's words for that,
            # "a valid dictionary or object to extract fields from", tell a client nothing)
            what = "is empty" if first.get("type") == "missing" else "is not a JSON object"
            return as_response(ApiError(400, f"the request body {what}: send a JSON object with "
                                             "Content-Type: application/json", code="invalid_json"))
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return as_response(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 400 and e.detail == UNPARSED and e.__cause__ is not None:
            return as_response(ApiError(400, f"the request body is not valid JSON: {unreadable(e.__cause__)}",
                                        code="invalid_json"))
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        return as_response(ApiError(e.status_code, str(e.detail), code=code,
                                  headers=dict(e.headers) if e.headers else None))

    @app.exception_handler(DataError)
    async def unstorable(request: Request, e: DataError) -> JSONResponse:
        # a value the database cannot hold (PostgreSQL text and NUL): the request's fault, one line
        reason = str(e.orig or e).splitlines()[0]
        logger.warning("%s %r: the database refused a value of the request: %s", request.method,
                       request.url.path, reason)
        return as_response(ApiError(400, "a value in the request cannot be stored (text may not contain NUL, "
                                         "\\u0000, characters)", code="invalid_value"))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        logger.exception("%s %r failed", request.method, request.url.path)
        return as_response(ApiError(500, "The server had an error while processing your request.",
                                  type="server_error"))
