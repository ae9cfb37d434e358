"""Receiving a shard upload: stream the body into a staging file, then verify and store it.

The body is never held in memory: chunks go to a staging file as they arrive (size-capped),
the shard id its header hashes to is checked against the URL, and the engine then validates
the header, hashes every tensor and moves the file into the blob store. A body that is cut
short, too long, sent under another id or wrong leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from service.errors import IntegrityError, InvalidInputError, PayloadTooLargeError, StorageError
from service.format.safetensors_header import read_header
from service.records import ShardReceipt
from service.store import Store

WRITE_BYTES = 4 << 20


async def receive_shard(
    store: Store, shard_id: str, body: AsyncIterator[bytes], declared_length: str | None, max_bytes: int
) -> ShardReceipt:
    """Store the streamed shard whose id must be ``shard_id``."""
    if declared_length is not None:
        if not declared_length.isdigit():
            raise InvalidInputError(f"Content-Length {declared_length[:40]!r} is not a byte count")
        if int(declared_length) > max_bytes:
            raise PayloadTooLargeError(f"shard of {declared_length} bytes exceeds the limit of {max_bytes}")
    path = store.staging_path()
    try:
        received = 0
        pending: list[bytes] = []
        pending_bytes = 0
        try:
            with open(path, "wb") as handle:
                try:
                    async for chunk in body:
                        received += len(chunk)
                        if received > max_bytes:
                            raise PayloadTooLargeError(f"shard upload exceeds the limit of {max_bytes} bytes")
                        pending.append(chunk)
                        pending_bytes += len(chunk)
                        if pending_bytes >= WRITE_BYTES:
                            await run_in_threadpool(handle.writelines, pending)
                            pending, pending_bytes = [], 0
                except ClientDisconnect as exc:
                    raise InvalidInputError(f"the upload was cut off after {received} bytes; retry it") from exc
                await run_in_threadpool(handle.writelines, pending)
        except OSError as exc:  # the server's disk, not the upload, is at fault (ENOSPC, EIO)
            raise StorageError(
                f"the server could not write shard {shard_id} to its staging folder: {exc.strerror or exc}; "
                "nothing was stored, retry once the server has disk space"
            ) from exc
        if declared_length is not None and received != int(declared_length):
            raise InvalidInputError(f"received {received} bytes but Content-Length said {declared_length}")
        if received == 0:
            raise InvalidInputError("the shard upload is empty")
        # The id is checked before the engine stores anything: a body sent under the wrong id
        # leaves no trace, like any other rejected upload.
        actual = await run_in_threadpool(_shard_id_of, path, received, store.max_header_bytes)
        if actual != shard_id:
            raise IntegrityError(
                f"the uploaded shard's id is {actual}, not {shard_id} as the URL says; nothing was stored: "
                "upload it under the id its header hashes to"
            )
        return await run_in_threadpool(store.ingest_file, path)
    finally:
        path.unlink(missing_ok=True)


def _shard_id_of(path: Path, size: int, max_header_bytes: int) -> str:
    """The id of the shard in ``path`` (InvalidShardError if its header or size is wrong)."""
    with open(path, "rb") as handle:
        return read_header(handle, size, max_header_bytes=max_header_bytes).shard_id
