"""Routes for shard uploads sent to the blob store directly (S3): signed URLs, then verify and store.

The server chooses the staging key and signs the URLs; the bytes go from the client to S3; the
server then verifies them before anything can reference them (:mod:`service.intake.direct_uploads`). A
server whose blobs are not in S3 answers 409 ``conflict``: the client sends the shard with
``PUT /v1/shards/<id>`` instead. The answers carry signed URLs: they are sent ``no-store`` and
never logged (the access log records request lines, never bodies).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ckptstore.service.api.deps import CanWrite, SettingsDep, StoreDep
from ckptstore.service.api.http.strict_json import StrictJSONRoute
from ckptstore.service.api.routes.data import SaveKey, checked_key
from ckptstore.service.blobs.base import STAGING_TOKEN_PATTERN
from ckptstore.service.format.bounds import INT64_MAX
from ckptstore.service.format.digest import DIGEST_PATTERN
from ckptstore.service.format.records import ShardReceipt

router = APIRouter(prefix="/v1", route_class=StrictJSONRoute, tags=["data"])
ShardId = Annotated[str, Path(pattern=DIGEST_PATTERN, description="A shard id (64 lowercase hex characters).")]
Token = Annotated[str, Path(pattern=STAGING_TOKEN_PATTERN, description="The upload's token, from its grant.")]
UNAVAILABLE: dict[int | str, dict[str, object]] = {
    409: {"description": "Direct uploads are not available here: PUT /v1/shards/{shard_id} instead"}
}


class UploadRequest(BaseModel):
    """A shard's size in bytes: of a shard to upload, or of the one uploaded."""

    model_config = ConfigDict(extra="forbid", strict=True)

    size: Annotated[int, Field(ge=1, le=INT64_MAX)]


class UploadGrant(BaseModel):
    """Where to send a shard's bytes: ``PUT`` bytes ``[i * part_bytes, (i + 1) * part_bytes)``
    to ``urls[i]`` within ``expires_in`` seconds, then ``POST`` ``/v1/shards/{shard_id}/uploads/{upload}``."""

    upload: str
    shard_id: str
    size: int
    part_bytes: int
    expires_in: int
    urls: list[str]


@router.post("/shards/{shard_id}/uploads", dependencies=[CanWrite], status_code=201, responses=UNAVAILABLE)
async def start_upload(
    shard_id: ShardId, body: UploadRequest, response: Response, store: StoreDep, settings: SettingsDep
) -> UploadGrant:
    """Signed URLs to upload a shard of ``size`` bytes to S3 directly (one, or one per part)."""
    plan = await run_in_threadpool(
        store.uploads.start,
        shard_id,
        body.size,
        max_bytes=settings.max_shard_bytes,
        expires_seconds=settings.upload_url_seconds,
    )
    response.headers["Cache-Control"] = "no-store"
    return UploadGrant(
        upload=plan.token,
        shard_id=shard_id,
        size=plan.size,
        part_bytes=plan.part_bytes,
        expires_in=plan.expires_in,
        urls=list(plan.urls),
    )


@router.post("/shards/{shard_id}/uploads/{upload}", dependencies=[CanWrite], status_code=201, responses=UNAVAILABLE)
async def complete_upload(
    shard_id: ShardId,
    upload: Token,
    body: UploadRequest,
    response: Response,
    store: StoreDep,
    settings: SettingsDep,
    save_key: SaveKey = None,
) -> ShardReceipt:
    """Verify the uploaded shard (header, id, every tensor's digest) and store it, held for the save
    ``Save-Key`` names until it commits; idempotent.

    201 when stored now, 200 when it already was; 400 naming the problem (the upload is then
    deleted), 404 when nothing was uploaded under ``upload``.
    """
    receipt = await run_in_threadpool(
        lambda: store.uploads.complete(
            shard_id, upload, body.size, max_bytes=settings.max_shard_bytes, save_key=checked_key(save_key)
        )
    )
    if not receipt.created:
        response.status_code = 200
    return receipt


@router.delete("/shards/{shard_id}/uploads/{upload}", dependencies=[CanWrite], status_code=204, responses=UNAVAILABLE)
async def abort_upload(shard_id: ShardId, upload: Token, store: StoreDep) -> Response:
    """Delete what was uploaded under ``upload`` (a client giving up on it); idempotent."""
    await run_in_threadpool(store.uploads.abort, shard_id, upload)
    return Response(status_code=204)
