"""An in-memory BlobStore for tests and throwaway stores."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptstore.service.blobs.base import BlobStore, check_blob_id, flat_bytes
from ckptstore.service.errors import IntegrityError, NotFoundError


class MemoryBlobStore(BlobStore):
    """Keeps blobs in a dict; thread-safe; lost when the process ends."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put_file(self, blob_id: str, path: Path) -> None:
        """Read the file into memory under ``blob_id`` unless already present."""
        check_blob_id(blob_id)
        data = Path(path).read_bytes()
        with self._lock:
            self._blobs.setdefault(blob_id, data)

    def size(self, blob_id: str) -> int | None:
        """Size of the blob, or None."""
        blob = self._blobs.get(check_blob_id(blob_id))
        return None if blob is None else len(blob)

    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        """Copy the requested range into ``buffer``."""
        self.read_scatter(blob_id, offset, [buffer])

    def read_scatter(self, blob_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Copy the consecutive bytes from ``offset`` into ``buffers`` in turn."""
        blob = self._blobs.get(check_blob_id(blob_id))
        if offset < 0:  # a negative slice start would silently read from the end of the blob
            raise ValueError(f"offset {offset} is negative")
        if blob is None:
            raise NotFoundError(f"blob {blob_id} is not in the store")
        wanted = sum(buffer.nbytes for buffer in buffers)
        if offset + wanted > len(blob) and wanted:
            raise IntegrityError(f"blob {blob_id} is {len(blob)} bytes; cannot read {wanted} from {offset}")
        view = memoryview(blob)
        for buffer in buffers:
            flat = flat_bytes(buffer)
            flat[:] = view[offset : offset + flat.nbytes]
            offset += flat.nbytes

    def delete(self, blob_id: str) -> None:
        """Forget the blob."""
        with self._lock:
            self._blobs.pop(check_blob_id(blob_id), None)

    def list_ids(self) -> Iterator[str]:
        """Every stored id."""
        yield from list(self._blobs)

    def corrupt(self, blob_id: str, offset: int) -> None:
        """Flip every bit of one byte (for tests that prove corruption is caught)."""
        with self._lock:
            data = bytearray(self._blobs[blob_id])
            data[offset] ^= 0xFF
            self._blobs[blob_id] = bytes(data)
