"""Many byte ranges of many shards in one answer: checked first, then streamed back to back.

A load whose tensors were stored at different times reads a little from each of hundreds of
shards; one request per shard costs a round trip and a request's server overhead each. A
batch names up to ``MAX_RANGES`` ranges (``MAX_BATCH_BYTES`` in all); every range is checked
against its shard's size (its blob's, as for a single-shard GET) before the first byte goes
out, so a bad batch is a 4xx, never a cut-off 200. The body is the ranges' bytes in the order
asked, nothing between them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore.service.errors import NotFoundError, PayloadTooLargeError, RangeNotSatisfiableError
from ckptstore.service.store import Store

#: Most ranges in one batch: a load's batch covers at most this many pieces.
MAX_RANGES = 4096
#: Most bytes one batch answers: a client asks for far less (64 MiB) and sends several at once.
MAX_BATCH_BYTES = 256 << 20
#: Shard sizes looked up at once.
SIZE_LOOKUPS = 16
#: The body goes out in pieces of at most this size: small ranges are joined, large ones cut.
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ByteRange:
    """``length`` (> 0) bytes of shard ``shard_id`` from byte ``offset``."""

    shard_id: str
    offset: int
    length: int


def check_batch(store: Store, ranges: Sequence[ByteRange]) -> int:
    """The total bytes ``ranges`` ask for, once each lies inside a stored shard.

    Raises:
        PayloadTooLargeError: more than ``MAX_BATCH_BYTES`` in all.
        NotFoundError: a shard the store does not hold (the first few named).
        RangeNotSatisfiableError: a range that runs past its shard's end.
    """
    total = sum(r.length for r in ranges)
    if total > MAX_BATCH_BYTES:
        raise PayloadTooLargeError(
            f"the batch asks for {total} bytes; at most {MAX_BATCH_BYTES} per request: split it into several"
        )
    sizes = shard_sizes(store, {r.shard_id for r in ranges})
    absent = sorted({r.shard_id for r in ranges} - sizes.keys())
    if absent:
        raise NotFoundError(f"{len(absent)} shard(s) of the batch are not in the store: {', '.join(absent[:3])}")
    for index, r in enumerate(ranges):
        size = sizes[r.shard_id]
        if r.offset + r.length > size:
            raise RangeNotSatisfiableError(
                f"range {index} (bytes {r.offset} to {r.offset + r.length - 1}) runs past the end of shard "
                f"{r.shard_id}, which holds {size} bytes",
                size,
            )
    return total


def shard_sizes(store: Store, shard_ids: set[str]) -> dict[str, int]:
    """The size of each of ``shard_ids`` the blob store holds, asked of the blobs themselves (as a
    single-shard GET does: a file cut short behind the store's back is seen before any byte goes
    out), ``SIZE_LOOKUPS`` at a time (on S3 each is a request)."""
    ordered = sorted(shard_ids)
    with ThreadPoolExecutor(min(SIZE_LOOKUPS, len(ordered)) or 1, thread_name_prefix="ckptstore-sizes") as pool:
        sizes = list(pool.map(store.blobs.size, ordered))
    return {shard_id: size for shard_id, size in zip(ordered, sizes, strict=True) if size is not None}


def stream_batch(
    store: Store, ranges: Sequence[ByteRange], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes | memoryview]:
    """The ranges' bytes back to back, in pieces of at most ``chunk_bytes`` (small ranges joined).

    Between two pieces the generator holds no bytes: what is joined goes out before the next
    piece is read, and a piece is yielded as ``out.pop()``, its only reference. So the bytes a
    server holds for a batch are the pieces it was handed and has not sent, nothing hidden here.
    """
    pending: list[bytes | memoryview] = []
    pending_bytes = 0
    out: list[bytes | memoryview] = []
    for r in ranges:
        pieces = store.iter_shard(r.shard_id, r.offset, r.length, chunk_bytes)
        left = r.length
        while left:
            size = min(chunk_bytes, left)  # the size of the piece iter_shard yields next
            left -= size
            if pending and pending_bytes + size >= chunk_bytes:
                out.append(b"".join(pending))
                pending.clear()
                pending_bytes = 0
                yield out.pop()
            if size == chunk_bytes:
                out.append(next(pieces))
                yield out.pop()
            else:
                pending.append(next(pieces))
                pending_bytes += size
    if pending:
        out.append(b"".join(pending))
        pending.clear()
        yield out.pop()
