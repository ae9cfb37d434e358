"""Build shards and manifest bodies by hand, without torch, for the engine's tests.

A tensor here is raw little-endian bytes plus a safetensors dtype name and a shape; its digest
is computed with the format's own :func:`tensor_digest`, and a shard is the encoded header
followed by the tensors' bytes in the order the header lists them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from ckptstore.service.db.models import Shard, utcnow
from ckptstore.service.format.digest import shard_id, tensor_digest
from ckptstore.service.format.dtypes import byte_length, dtype_class
from ckptstore.service.format.manifest import Chunk, ManifestBody, TensorEntry
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.safetensors_header import encode_header
from ckptstore.service.store import Store


@dataclass(frozen=True)
class RawTensor:
    """One tensor as the service sees it: dtype name, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != byte_length(self.dtype, list(self.shape)):
            raise ValueError(f"{self.dtype}{list(self.shape)} needs {byte_length(self.dtype, list(self.shape))} bytes")

    @property
    def digest(self) -> str:
        """The tensor's content digest."""
        return tensor_digest(self.dtype, self.shape, self.data)

    @property
    def nbytes(self) -> int:
        """Length of the tensor's bytes."""
        return len(self.data)


def raw(dtype: str, shape: Sequence[int], seed: int) -> RawTensor:
    """A tensor of ``dtype`` and ``shape`` filled with bytes drawn from ``seed`` (distinct seeds differ)."""
    size = byte_length(dtype, list(shape))
    return RawTensor(dtype, tuple(shape), random.Random(seed).randbytes(size))


@dataclass(frozen=True)
class BuiltShard:
    """The bytes of a shard, its id and where each tensor's bytes start in the file."""

    data: bytes
    shard_id: str
    header_length: int
    offsets: dict[str, int]

    def write(self, path: Path) -> Path:
        """Write the shard to ``path`` and return it."""
        Path(path).write_bytes(self.data)
        return Path(path)


def build_shard(tensors: Sequence[RawTensor]) -> BuiltShard:
    """A valid shard holding ``tensors`` in the order given."""
    header, entries = encode_header([(t.digest, t.dtype, t.shape) for t in tensors])
    data = header + b"".join(t.data for t in tensors)
    offsets = {entry.digest: len(header) + entry.begin for entry in entries}
    return BuiltShard(data=data, shard_id=shard_id(header), header_length=len(header), offsets=offsets)


#: The ``ingest`` fixture: build a shard of the tensors given, stage it and ingest it.
Ingest = Callable[..., tuple[BuiltShard, ShardReceipt]]


def entry(key: str, tensor: RawTensor, *, trainable: bool | None = None) -> TensorEntry:
    """A manifest entry for ``tensor`` under ``key``; model tensors default to trainable."""
    if key.startswith("model/") and trainable is None:
        trainable = True
    return TensorEntry(
        key=key,
        dtype=tensor.dtype,
        shape=list(tensor.shape),
        dtype_class=dtype_class(tensor.dtype),
        digest=tensor.digest,
        placement="target",
        device_type="cpu",
        trainable=trainable,
    )


def chunked_entry(
    key: str, dtype: str, shape: Sequence[int], pieces: Sequence[tuple[list[int], RawTensor]]
) -> TensorEntry:
    """A manifest entry stored as ``pieces`` of (offsets, chunk tensor) tiling ``shape``."""
    return TensorEntry(
        key=key,
        dtype=dtype,
        shape=list(shape),
        dtype_class=dtype_class(dtype),
        chunks=[Chunk(offsets=offsets, shape=list(t.shape), digest=t.digest) for offsets, t in pieces],
        placement="target",
        device_type="cpu",
        trainable=True if key.startswith("model/") else None,
    )


def body(*entries: TensorEntry, step: int | None = None, **fields: object) -> ManifestBody:
    """A manifest body listing ``entries`` (extra fields such as state or metrics pass through)."""
    return ManifestBody(tensors=list(entries), step=step, **fields)  # type: ignore[arg-type]


# -- a store's state, for the engine's garbage-collection and compaction tests --

HOUR = 3600


def soon() -> datetime:
    """A moment just ahead of every timestamp the test wrote so far (grace 0 then spares nothing)."""
    return utcnow() + timedelta(seconds=1)


def age(store: Store, shard_ids: Iterable[str], seconds: float) -> None:
    """Pretend these shards were recorded ``seconds`` earlier than they were."""
    with store.db.transaction() as session:
        for row in session.scalars(select(Shard).where(Shard.id.in_(list(shard_ids)))):
            row.created_at = row.created_at - timedelta(seconds=seconds)


def reads_back(store: Store, tensors: Iterable[RawTensor]) -> bool:
    """Whether every tensor's bytes come back exactly from where the store says they are."""
    tensors = list(tensors)
    where = store.locate([t.digest for t in tensors])
    for tensor in tensors:
        spot = where[tensor.digest]
        buffer = bytearray(spot.nbytes)
        store.read_into(spot.shard_id, spot.offset, memoryview(buffer))
        if bytes(buffer) != tensor.data:
            return False
    return True


def shard_rows(store: Store) -> set[str]:
    with store.db.transaction() as session:
        return set(session.scalars(select(Shard.id)))
