"""Reading a version's tensors: fetch only the byte ranges needed, verify, then build.

Every byte is checked against its digest before it becomes a tensor; a mismatch raises
IntegrityError naming the tensor key and the shard. Reads go in shard-and-offset order so a
local store reads each shard front to back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from client.tensors import NAME_TO_TORCH, tensor_from_buffer
from client.transport import Transport
from service.errors import IntegrityError
from service.format.digest import tensor_digest
from service.format.manifest import Manifest, TensorEntry
from service.records import TensorLocation

#: Largest single read when fetching back-to-back tensors together.
SPAN_BYTES = 64 << 20


class TensorReader:
    """Reads the tensors of one manifest from a transport."""

    def __init__(
        self, transport: Transport, manifest: Manifest, *, on_bytes: Callable[[int], object] | None = None
    ) -> None:
        self.transport = transport
        self.manifest = manifest
        self.entries = {entry.key: entry for entry in manifest.tensors}
        stored = [d for entry in manifest.tensors for d in _stored_digests(entry)]
        self.locations: dict[str, TensorLocation] = transport.locate(stored) if stored else {}
        self.bytes_read = 0
        self._scratch = bytearray()
        self._on_bytes = on_bytes

    def read_many(self, keys: Iterable[str], *, reuse_buffer: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(key, tensor)`` for ``keys`` in storage order, verified.

        Tensors stored back to back in one shard are fetched with a single read of up to
        ``SPAN_BYTES``, which matters over HTTP; a digest shared by several keys (tied
        weights, equal optimizer scalars) is read and verified once, then copied.

        With ``reuse_buffer`` every span is read into one scratch buffer, so a yielded tensor
        is valid only until the next one is requested: for callers that copy it out at once
        (loading into a model), which then never touch freshly allocated memory.
        """
        by_digest: dict[str, list[str]] = {}
        for key in keys:
            entry = self.entries[key]
            if entry.digest is None or 0 in entry.shape:
                yield key, self.read(key)
            else:
                by_digest.setdefault(entry.digest, []).append(key)
        located = sorted(by_digest, key=lambda d: (self.locations[d].shard_id, self.locations[d].offset))
        for span in _spans([self.locations[d] for d in located]):
            start = span[0].offset
            length = span[-1].offset + span[-1].nbytes - start
            buffer = self._scratch_buffer(length) if reuse_buffer else bytearray(length)
            self.transport.read_into(span[0].shard_id, start, memoryview(buffer)[:length])
            for location in span:
                piece = memoryview(buffer)[location.offset - start : location.offset - start + location.nbytes]
                first, *others = by_digest[location.digest]
                tensor = self._verified(self.entries[first], location, piece)
                yield first, tensor
                for key in others:
                    # Every key gets its own tensor: optimizer state updated in place (Adam's
                    # step, equal moments) must never alias another parameter's.
                    yield key, tensor.clone()

    def _scratch_buffer(self, length: int) -> bytearray:
        if len(self._scratch) < length:
            self._scratch = bytearray(length)
        return self._scratch

    def read(self, key: str) -> torch.Tensor:
        """The verified tensor stored under ``key``, as a new CPU tensor."""
        entry = self.entries[key]
        if entry.digest is not None:
            return self._read_piece(entry, entry.digest, list(entry.shape))
        result = torch.empty(entry.shape, dtype=NAME_TO_TORCH[entry.dtype])
        for chunk in entry.chunks or ():
            piece = self._read_piece(entry, chunk.digest, list(chunk.shape))
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape, strict=True))
            result[index] = piece
        return result

    def _piece(self, entry: TensorEntry, data: bytes | bytearray, shape: list[int]) -> torch.Tensor:
        return tensor_from_buffer(memoryview(data), entry.dtype, shape)

    def _read_piece(self, entry: TensorEntry, digest: str, shape: list[int]) -> torch.Tensor:
        if 0 in shape:
            return self._piece(entry, b"", shape)
        location = self.locations[digest]
        buffer = bytearray(location.nbytes)
        self.transport.read_into(location.shard_id, location.offset, memoryview(buffer))
        return self._verified(entry, location, memoryview(buffer), shape)

    def _verified(
        self, entry: TensorEntry, location: TensorLocation, data: memoryview, shape: list[int] | None = None
    ) -> torch.Tensor:
        shape = list(entry.shape) if shape is None else shape
        actual = tensor_digest(entry.dtype, shape, data)
        if actual != location.digest:
            raise IntegrityError(
                f"{entry.key}: bytes read from shard {location.shard_id} at offset {location.offset} hash to "
                f"{actual[:16]}…, not {location.digest[:16]}…; the stored shard is corrupt (run `ckptstore verify`)"
            )
        self.bytes_read += len(data)
        if self._on_bytes is not None:
            self._on_bytes(len(data))
        return tensor_from_buffer(data, entry.dtype, shape)


def _spans(locations: list[TensorLocation]) -> Iterator[list[TensorLocation]]:
    """Group locations (sorted by shard and offset) into back-to-back runs of bounded size."""
    span: list[TensorLocation] = []
    for location in locations:
        if span and (
            location.shard_id != span[0].shard_id
            or location.offset != span[-1].offset + span[-1].nbytes
            or location.offset + location.nbytes - span[0].offset > SPAN_BYTES
        ):
            yield span
            span = []
        span.append(location)
    if span:
        yield span


def _stored_digests(entry: TensorEntry) -> list[str]:
    if entry.digest is not None:
        return [] if 0 in entry.shape else [entry.digest]
    return [c.digest for c in entry.chunks or () if 0 not in c.shape]
