"""What ``/openapi.json`` (and so ``/docs``' "Try it out") says of the requests and errors.

FastAPI lists a 422 ``HTTPValidationError`` under every route that takes parameters; this API
answers a bad request 400 with OpenAI's error object (``api.errors.install``), so the schema says
that instead. And ``POST /v1/files`` parses its multipart body itself (``api.upload``: streamed to
disk within the limits), so FastAPI sees no body parameter: ``UPLOAD_BODY`` declares it, or Swagger
UI shows "No parameters" and no file picker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ERROR = "OpenAIError"

UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSON Lines, UTF-8: one batch request per line "
                                "(SPECBATCH_MAX_UPLOAD_BYTES and SPECBATCH_MAX_REQUESTS bound it)"},
        "purpose": {"type": "string", "enum": ["batch"]},
        # (openai-python sends the nested object as these two fields; the file is kept until deleted)
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    }}}}}}

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"], "title": ERROR,
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}


def with_400s(openapi: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` whose schema has each 422 entry replaced by the 400 the API really answers."""
    def schema() -> dict[str, Any]:
        out = openapi()             # FastAPI builds it once and keeps it: fixing it again is a no-op
        components = out.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components[ERROR] = _ERROR_SCHEMA
        for ops in out.get("paths", {}).values():
            for op in ops.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None or "requestBody" in op:
                    responses["400"] = {"description": "Invalid request (OpenAI's error object; "
                                                       "`param` names the field)",
                                        "content": {"application/json": {
                                            "schema": {"$ref": f"#/components/schemas/{ERROR}"}}}}
        return out
    return schema
