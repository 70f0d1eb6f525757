"""The JSON answer of a route, rendered once.

A route that returns a dict has FastAPI validate it against the return type and then encode it;
for a plain ``def`` route that validation is a second trip through the thread pool (FastAPI runs
it there), about a fifth of a list/retrieve's CPU under load. Our objects are built from columns
as JSON-ready dicts, so routes return them as a ``JSONResponse`` (the same bytes), which FastAPI
passes through as it is, and declare ``response_model=`` one of ``api.models`` for the schema that
``/openapi.json`` shows.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def answer(obj: dict[str, Any]) -> JSONResponse:
    return JSONResponse(obj)
