"""Routes for tensor bytes: which digests are missing, shard upload, locations, download."""

from __future__ import annotations

import itertools
import re
from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import CanRead, CanWrite, MetricsDep, SettingsDep, StoreDep
from service.api.schemas import DigestList, MissingResponse
from service.api.strict_json import StrictJSONRoute
from service.api.uploads import receive_shard
from service.errors import InvalidInputError
from service.format.digest import DIGEST_PATTERN
from service.records import ShardReceipt, TensorLocation

router = APIRouter(prefix="/v1", route_class=StrictJSONRoute, tags=["data"])
ShardId = Annotated[str, Path(pattern=DIGEST_PATTERN, description="A shard id (64 lowercase hex characters).")]
_RANGE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")


@router.post("/tensors/missing", dependencies=[CanWrite])
async def missing_tensors(body: DigestList, store: StoreDep) -> MissingResponse:
    """Which of these tensor digests the store does not hold yet."""
    return MissingResponse(missing=await run_in_threadpool(store.missing, body.digests))


@router.post("/tensors/locate", dependencies=[CanRead])
async def locate_tensors(body: DigestList, store: StoreDep) -> dict[str, TensorLocation]:
    """Where each digest's bytes live: shard id, byte offset, length, dtype and shape."""
    return await run_in_threadpool(store.locate, body.digests)


@router.put(
    "/shards/{shard_id}",
    dependencies=[CanWrite],
    status_code=201,
    openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {}}}},
)
async def upload_shard(
    shard_id: ShardId,
    request: Request,
    response: Response,
    store: StoreDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    content_length: Annotated[str | None, Header()] = None,
) -> ShardReceipt:
    """Upload a shard (a safetensors file named by digests); idempotent, verified before it is stored."""
    receipt = await receive_shard(store, shard_id, request.stream(), content_length, settings.max_shard_bytes)
    metrics.add_bytes("in", receipt.size)
    if not receipt.created:
        response.status_code = 200
    return receipt


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    if header is None:
        return None
    match = _RANGE.match(header.strip())
    if match is None:
        raise InvalidInputError(f"unsupported Range {header[:60]!r}: use a single 'bytes=start-end' range")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) else size - 1
    if start >= size or end < start:
        raise InvalidInputError(f"Range {header[:60]!r} is outside the shard's {size} bytes")
    return start, min(end, size - 1)


@router.get(
    "/shards/{shard_id}",
    dependencies=[CanRead],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 206: {"description": "A byte range"}},
)
async def download_shard(
    shard_id: ShardId,
    store: StoreDep,
    metrics: MetricsDep,
    range_: Annotated[str | None, Header(alias="range")] = None,
) -> StreamingResponse:
    """Download a shard, or one byte range of it with ``Range: bytes=start-end``."""
    size = await run_in_threadpool(store.shard_size, shard_id)
    span = _parse_range(range_, size)
    start, end = span if span is not None else (0, size - 1)
    length = end - start + 1
    headers = {"Content-Length": str(length), "Accept-Ranges": "bytes", "ETag": f'"{shard_id}"'}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    chunks = store.iter_shard(shard_id, start, length)
    # The first piece is read before the status line goes out, so a blob that cannot be read
    # (deleted meanwhile, storage down) is a proper error response, not a 200 cut off mid-body.
    first = await run_in_threadpool(next, chunks, b"")
    metrics.add_bytes("out", length)
    return StreamingResponse(
        itertools.chain((first,), chunks),
        status_code=206 if span is not None else 200,
        media_type="application/octet-stream",
        headers=headers,
    )
