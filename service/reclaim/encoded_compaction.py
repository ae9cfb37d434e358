"""Compaction of encoded shards: their live payloads copied, byte for byte, into a new shard.

:mod:`service.reclaim.compression` stores the payloads of each version it visits in shards of their own.
Once versions are deleted, such a shard can hold payloads nothing loads or decodes from any more
beside live ones: a first version's frozen base weights, say, next to keyframes whose deltas have
all gone. :mod:`service.reclaim.compaction` picks it as it picks a raw shard (live bytes below a share of
its size, outside the grace period) and hands its live payloads here. Each is checked first (read,
decoded with whatever it decodes from, and hashed against its digest: a damaged one stops the
collection, as a damaged raw tensor does), then they are written as a new v2 shard, and in one
transaction under the exclusive collection lock each row still in the old shard with the same
encoding moves to it and the old shard is stamped, to be swept once the grace period has passed.
Payloads keep their encoding, base and length, so what deltas need (``tensor_needs``) is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptstore.service.blobs import BlobStore
from ckptstore.service.catalog import lookup
from ckptstore.service.db import Database
from ckptstore.service.errors import NotFoundError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.encoded_reads import check_digest, decode_into, fetch_chain
from ckptstore.service.reclaim.compression import Encoded, write_encoded_shard


@dataclass(frozen=True)
class LivePayload:
    """A referenced encoded tensor of the shard being compacted, as its row records it."""

    digest: str
    offset: int
    nbytes: int
    stored_nbytes: int
    encoding: str
    base: str | None


def repack(db: Database, blobs: BlobStore, staging: Path, shard_id: str, live: Sequence[LivePayload]) -> int | None:
    """Copy ``live`` (payloads of ``shard_id``) into a new shard and move their rows onto it; the
    new shard's size, or None if the shard went meanwhile or a row moved elsewhere first.

    Raises:
        IntegrityError: a live payload no longer decodes to its digest.
    """
    if not live:
        return None
    try:
        locations = lookup.locate(db=db, digests=[payload.digest for payload in live])
        batch = []
        for payload in live:
            # Decoded and hashed before it is copied (compaction must not carry damage along), from
            # the payload bytes read once: the same bytes are then copied.
            chain = fetch_chain(blobs.read_into, locations, payload.digest)
            decoded = bytearray(payload.nbytes)
            decode_into(blobs.read_into, chain, memoryview(decoded))
            location = locations[payload.digest]
            check_digest(location, tensor_digest(location.dtype, location.shape, decoded))
            batch.append(
                Encoded(
                    digest=payload.digest, old_shard=shard_id, nbytes=payload.nbytes, encoding=payload.encoding,
                    parts=(bytes(chain.links[0][1]),), base=payload.base, needs=(),
                )
            )  # fmt: skip
    except NotFoundError:
        return None  # swept by another collection since the pick
    moved, size = write_encoded_shard(db, blobs, staging, batch, repack=True)
    return size if moved == len(batch) else None


__all__ = ["LivePayload", "repack"]
