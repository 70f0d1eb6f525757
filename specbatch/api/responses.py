"""The JSON answer of a route, rendered once.

A route that returns a dict has FastAPI validate it against the return type and then encode it;
for a plain ``def`` route that validation is a second trip through the thread pool (FastAPI runs
it there), about a fifth of a list/retrieve's CPU under load. Our objects are built from columns
as JSON-ready dicts, so routes return them as a ``JSONResponse`` (the same bytes) and declare
``response_model=Object`` for the schema that ``/openapi.json`` shows.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

Object = dict[str, Any]
"""The schema of every JSON object a route answers (OpenAI's objects, as dicts)."""


def answer(obj: Object) -> JSONResponse:
    return JSONResponse(obj)
