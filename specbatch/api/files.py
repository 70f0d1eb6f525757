"""OpenAI Files: upload (``purpose=batch``), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from pydantic import ValidationError

from specbatch.api import upload
from specbatch.api.auth import Keyed
from specbatch.api.deps import AppState
from specbatch.api.errors import NO_RETRY, ApiError
from specbatch.api.models import ExpiresAfter, FileDeleted, FileList, FileObject
from specbatch.api.responses import answer
from specbatch.api.schema import UPLOAD_BODY
from specbatch.jobs import batches, files

router = APIRouter(prefix="/v1", tags=["files"])


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page (the client follows ``after=last id`` while ``has_more``)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


EXPIRES = ("expires_after[anchor]", "expires_after[seconds]")     # as openai-python sends a nested field


def form_fields(fields: dict[str, str]) -> None:
    """An upload's form fields other than ``purpose``: an unknown one is a 400 naming it (as
    ``POST /v1/batches``'s unknown fields: a misspelt option is not dropped); ``expires_after``
    must be within OpenAI's bounds (the file is kept until deleted whatever it says)."""
    for name in fields:
        if name != "purpose" and name not in EXPIRES:
            raise ApiError(400, f"unrecognized form field {name!r}: an upload takes purpose, file, "
                                "expires_after[anchor] and expires_after[seconds]", param=name)
    if any(k in fields for k in EXPIRES):
        try:
            ExpiresAfter.model_validate({k[len("expires_after["):-1]: fields[k] for k in EXPIRES if k in fields})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ApiError(400, f"expires_after.{where}: {first['msg']} (anchor 'created_at', seconds "
                                "3600 to 2592000)", param="expires_after") from None


def _save(sb: AppState, tmp: Any, form: upload.Upload, owner: str | None) -> dict[str, Any]:
    file_id = files.new_file_id()
    final = files.place(sb.settings, tmp, file_id)
    try:
        with sb.factory.begin() as s:
            return files.file_object(files.add_file(s, file_id=file_id, purpose="batch",
                                                    filename=form.filename or "upload.jsonl", tally=form.tally,
                                                    owner=owner))
    except BaseException:
        final.unlink(missing_ok=True)
        raise


@router.post("/files", response_model=FileObject, openapi_extra=UPLOAD_BODY)   # parsed by api.upload
async def create_file(request: Request, caller: Keyed) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    with files.incoming(sb.settings) as tmp:
        form = await upload.receive(request, tmp, sb.settings)
        purpose = form.fields.get("purpose")
        if purpose is None:     # (OpenAI: "Missing required parameter: 'purpose'.")
            raise ApiError(400, "missing required parameter 'purpose': give 'batch'", param="purpose")
        if purpose != "batch":
            raise ApiError(400, f"purpose must be 'batch' (got {purpose!r}): this server runs batches only",
                           param="purpose")
        form_fields(form.fields)
        if form.filename is None:
            raise ApiError(400, "the 'file' part is missing", param="file")
        if form.tally.lines == 0:
            raise ApiError(400, "the file is empty; one JSON request per line is expected", param="file")
        return answer(await run_in_threadpool(_save, sb, tmp, form, owner))


@router.get("/files", response_model=FileList)
def list_files(caller: Keyed, limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
               order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    rows, more = sb.read(lambda c: files.list_files(c, limit=limit, after=after, purpose=purpose, order=order,
                                                    owner=owner))
    return answer(page([files.file_object(f) for f in rows], more))


@router.get("/files/{file_id}", response_model=FileObject)
def retrieve_file(caller: Keyed, file_id: str) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    return answer(files.file_object(sb.read(lambda c: files.read_file(c, file_id, owner))))


@router.get("/files/{file_id}/content")
def file_content(caller: Keyed, file_id: str) -> FileResponse:
    sb, owner = caller.sb, caller.owner
    filename = sb.read(lambda c: files.read_file(c, file_id, owner)).filename
    path = files.file_path(sb.settings, file_id)
    if not path.exists():
        raise ApiError(404, f"No such File object: {file_id} (its bytes are gone from {sb.settings.files_dir})",
                       param="id")
    return FileResponse(path, media_type="application/octet-stream", filename=filename)


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(caller: Keyed, file_id: str) -> JSONResponse:
    sb, owner = caller.sb, caller.owner
    with sb.factory.begin() as s:
        files.get_file(s, file_id, owner)           # another tenant's file: 404 before anything else
        if live := batches.live_batches_of_file(s, file_id):
            raise ApiError(409, f"file {file_id} is the input of {', '.join(live)}, which has not ended; "
                                "cancel it or wait for it to end first", param="id", code="file_in_use",
                           headers=NO_RETRY)
        files.delete_file(s, file_id, owner)
    files.file_path(sb.settings, file_id).unlink(missing_ok=True)
    return answer({"id": file_id, "object": "file", "deleted": True})
