"""Reading a version's tensors: fetch only the byte ranges needed, verify, then build.

Every byte is checked against its digest before it becomes a tensor; a mismatch raises
IntegrityError naming the tensor key and the shard. Reads go in shard-and-offset order so a
local store reads each shard front to back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from client.tensors import NAME_TO_TORCH, tensor_from_buffer
from client.transport import Transport
from service.errors import IntegrityError
from service.format.digest import tensor_digest
from service.format.manifest import Manifest, TensorEntry
from service.records import TensorLocation


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
        self._on_bytes = on_bytes

    def ordered(self, keys: Iterable[str]) -> list[str]:
        """``keys`` sorted by where their (first) bytes live, for sequential reads."""

        def position(key: str) -> tuple[str, int]:
            digests = _stored_digests(self.entries[key])
            if not digests:
                return ("", 0)
            location = self.locations[digests[0]]
            return (location.shard_id, location.offset)

        return sorted(keys, key=position)

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
        actual = tensor_digest(entry.dtype, shape, buffer)
        if actual != digest:
            raise IntegrityError(
                f"{entry.key}: bytes read from shard {location.shard_id} at offset {location.offset} hash to "
                f"{actual[:16]}…, not {digest[:16]}…; the stored shard is corrupt (run `ckptstore verify`)"
            )
        self.bytes_read += len(buffer)
        if self._on_bytes is not None:
            self._on_bytes(len(buffer))
        return self._piece(entry, buffer, shape)


def _stored_digests(entry: TensorEntry) -> list[str]:
    if entry.digest is not None:
        return [] if 0 in entry.shape else [entry.digest]
    return [c.digest for c in entry.chunks or () if 0 not in c.shape]
