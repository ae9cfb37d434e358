"""Routes for tensor bytes: which digests are missing, shard upload, locations, download."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ckptstore.service.api.deps import CanRead, CanWrite, MetricsDep, SettingsDep, StoreDep, StreamerDep
from ckptstore.service.api.http import range_batch, ranges, sendfile
from ckptstore.service.api.http.sendfile import FileAnswer, FileSpans
from ckptstore.service.api.http.shard_upload import receive_shard, receive_unhashed
from ckptstore.service.api.http.socket_body import offered
from ckptstore.service.api.http.streaming import PIECE_BYTES
from ckptstore.service.api.http.strict_json import StrictJSONRoute
from ckptstore.service.api.metrics import Metrics
from ckptstore.service.api.schemas import (
    DigestList,
    MissingResponse,
    RangeBatch,
    ReadUrls,
    ShardList,
    SizeList,
    SizesHeld,
)
from ckptstore.service.format.digest import DIGEST_PATTERN
from ckptstore.service.format.names import validate_commit_key
from ckptstore.service.format.records import ShardReceipt, TensorLocation, TensorsReceipt
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

router = APIRouter(prefix="/v1", route_class=StrictJSONRoute, tags=["data"])
#: The OpenAPI description of a request body of raw bytes.
BINARY_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {}}}}
ShardId = Annotated[str, Path(pattern=DIGEST_PATTERN, description="A shard id (64 lowercase hex characters).")]
SaveKey = Annotated[
    str | None,
    Header(
        alias="Save-Key",
        max_length=64,
        description="The commit key of the save this call is part of (its Idempotency-Key): what the store "
        "reports present or stores is held for that save until it commits, whatever garbage collection's grace.",
    ),
]


@router.post("/tensors/missing", dependencies=[CanWrite])
async def missing_tensors(body: DigestList, store: StoreDep, save_key: SaveKey = None) -> MissingResponse:
    """Which of these tensor digests the store does not hold yet; those it holds are kept for the
    save ``Save-Key`` names until it commits."""
    missing = await run_in_threadpool(lambda: store.missing(body.digests, save_key=save_key))
    return MissingResponse(missing=missing)


@router.post("/tensors/sizes", dependencies=[CanWrite])
async def sizes_held(body: SizeList, store: StoreDep, settings: SettingsDep) -> SizesHeld:
    """Which of these byte lengths some stored tensor has: a tensor of another length cannot be
    stored yet, so a save sends it unhashed (``POST /v1/shards``) without asking, unless shard
    bytes go to the blob store directly (``direct_uploads``)."""
    held = await run_in_threadpool(store.sizes_held, body.sizes)
    direct = settings.upload_url_seconds > 0 and store.blobs.staging() is not None
    return SizesHeld(held=sorted(held), direct_uploads=direct)


@router.post("/tensors/locate", dependencies=[CanRead])
async def locate_tensors(body: DigestList, store: StoreDep) -> dict[str, TensorLocation]:
    """Where each digest's bytes live: ``shard_id``, byte ``offset``, ``nbytes``, ``dtype`` and ``shape``."""
    return await run_in_threadpool(store.locate, body.digests)


@router.put(
    "/shards/{shard_id}",
    dependencies=[CanWrite],
    status_code=201,
    openapi_extra=BINARY_BODY,
)
async def upload_shard(
    shard_id: ShardId,
    request: Request,
    response: Response,
    store: StoreDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    content_length: Annotated[str | None, Header()] = None,
    save_key: SaveKey = None,
) -> ShardReceipt:
    """Upload a shard (a safetensors file named by digests); idempotent, verified before it is
    stored, its tensors held for the save ``Save-Key`` names until it commits."""
    limit, key = settings.max_shard_bytes, checked_key(save_key)
    stream, socket_body = request.stream(), offered(request.scope)
    receipt = await receive_shard(store, shard_id, stream, content_length, limit, socket_body, save_key=key)
    return _counted(receipt, response, metrics)


@router.post(
    "/shards",
    dependencies=[CanWrite],
    status_code=201,
    openapi_extra=BINARY_BODY,
)
async def upload_unhashed(
    request: Request,
    response: Response,
    store: StoreDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    content_length: Annotated[str | None, Header()] = None,
    save_key: SaveKey = None,
) -> TensorsReceipt:
    """Upload tensors not hashed yet as one shard: an 8-byte little-endian layout length, the layout
    (JSON ``[[dtype, shape], ...]``), then the tensors' bytes back to back. The server hashes each
    tensor as it writes it and answers the shard's receipt and the digests in order; the tensors
    must differ from one another. Idempotent; held for the save ``Save-Key`` names, as a shard is."""
    limit, key = settings.max_shard_bytes, checked_key(save_key)
    stream, socket_body = request.stream(), offered(request.scope)
    answer = await receive_unhashed(store, stream, content_length, limit, socket_body, save_key=key)
    _counted(answer.shard, response, metrics)
    return answer


def checked_key(save_key: str | None) -> str | None:
    """``save_key`` once it is seen to be a commit key (InvalidNameError before any byte is read)."""
    return None if save_key is None else validate_commit_key(save_key)


def _counted(receipt: ShardReceipt, response: Response, metrics: Metrics) -> ShardReceipt:
    """``receipt``, its bytes counted in; the answer is 200 rather than 201 for a shard already stored."""
    metrics.add_bytes("in", receipt.size)
    if not receipt.created:
        response.status_code = 200
    return receipt


@router.post("/shards/urls", dependencies=[CanRead])
async def shard_read_urls(body: ShardList, store: StoreDep, settings: SettingsDep) -> ReadUrls:
    """Signed URLs to GET these shards' bytes from the blob store directly (S3), so the bytes of a
    load never pass through this server; ``urls`` is empty where there are none (local blobs,
    ``read_url_seconds`` 0). Every byte read is checked against its digest by the client."""
    seconds = settings.read_url_seconds
    urls = await run_in_threadpool(store.read_urls, body.shards, seconds)
    return ReadUrls(urls=urls, expires_in=seconds if urls else 0)


RangeHeader = Annotated[str | None, Header(alias="range", description="bytes=start-end, bytes=start- or bytes=-length")]
IfNoneMatch = Annotated[str | None, Header(description="the shard's ETag (its quoted id): 304 if it matches")]
SHARD_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"content": {"application/octet-stream": {}}},
    206: {"description": "A byte range"},
    304: {"description": "Not modified: If-None-Match named the shard's ETag"},
    416: {"description": "The range starts past the end; Content-Range: bytes */size"},
}


@router.get("/shards/{shard_id}", dependencies=[CanRead], response_class=StreamingResponse, responses=SHARD_RESPONSES)
async def download_shard(
    shard_id: ShardId,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    streamer: StreamerDep,
    metrics: MetricsDep,
    range_: RangeHeader = None,
    if_none_match: IfNoneMatch = None,
) -> Response:
    """Download a shard, or one byte range of it with ``Range`` (a suffix ``bytes=-N`` is the last N bytes)."""
    size = await run_in_threadpool(store.shard_size, shard_id)
    plan = ranges.answer(shard_id, size, range_, if_none_match)
    if plan.status == 304:
        return Response(status_code=304, headers=plan.headers)
    spans = await _local_files(request, store, settings, [(shard_id, plan.start, plan.length)])
    if spans is not None:
        answer: Response = FileAnswer(spans, plan.status, plan.headers)
    else:
        chunks = store.iter_shard(shard_id, plan.start, plan.length, PIECE_BYTES)
        answer = await streamer.open(chunks, plan.status, plan.headers)  # reads the first piece: errors come first
    metrics.add_bytes("out", plan.length)
    return answer


async def _local_files(
    request: Request, store: Store, settings: Settings, spans: list[tuple[str, int, int]]
) -> FileSpans | None:
    """The spans as files the kernel can send, their first opened already (so a shard gone since
    it was checked is a 404), where blobs are local files, the settings allow it and the connection
    offers it; else None."""
    if not spans or not settings.sendfile or not sendfile.offered(request.scope):
        return None
    first = spans[0][0]
    fd = await run_in_threadpool(store.blobs.open_file, first)  # a shard's blob id is its id
    return None if fd is None else FileSpans(store.blobs.open_file, spans, opened=(first, fd))


@router.post(
    "/shards/ranges",
    dependencies=[CanRead],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download_ranges(
    body: RangeBatch,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    streamer: StreamerDep,
    metrics: MetricsDep,
) -> Response:
    """Byte ranges of many shards in one answer: their bytes back to back, in the order asked.

    At most ``MAX_RANGES`` ranges and ``MAX_BATCH_BYTES`` in all; each range must lie inside
    its shard (416 otherwise, 404 for a shard not stored), checked before any byte is sent.
    """
    wanted = [range_batch.ByteRange(r.shard_id, r.offset, r.length) for r in body.ranges]
    total = await run_in_threadpool(range_batch.check_batch, store, wanted)
    headers = {"Content-Length": str(total), "Cache-Control": "no-store"}
    spans = await _local_files(request, store, settings, [(r.shard_id, r.offset, r.length) for r in wanted])
    if spans is not None:
        answer: Response = FileAnswer(spans, 200, headers)
    else:
        chunks = range_batch.stream_batch(store, wanted, PIECE_BYTES)
        answer = await streamer.open(chunks, headers=headers)
    metrics.add_bytes("out", total)
    return answer


@router.head("/shards/{shard_id}", dependencies=[CanRead], responses=SHARD_RESPONSES)
async def shard_head(
    shard_id: ShardId, store: StoreDep, range_: RangeHeader = None, if_none_match: IfNoneMatch = None
) -> Response:
    """The headers a GET of the shard would answer (size, ETag, ranges), without its bytes."""
    size = await run_in_threadpool(store.shard_size, shard_id)
    plan = ranges.answer(shard_id, size, range_, if_none_match)
    media = {} if plan.status == 304 else {"Content-Type": "application/octet-stream"}
    return Response(status_code=plan.status, headers={**plan.headers, **media})
