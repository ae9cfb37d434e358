"""An in-memory BlobStore for tests and throwaway stores."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from service.blobs.base import BlobStore, check_blob_id
from service.errors import IntegrityError, NotFoundError


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
        blob = self._blobs.get(check_blob_id(blob_id))
        if offset < 0:  # a negative slice start would silently read from the end of the blob
            raise ValueError(f"offset {offset} is negative")
        if blob is None:
            raise NotFoundError(f"blob {blob_id} is not in the store")
        piece = blob[offset : offset + len(buffer)]
        if len(piece) != len(buffer):
            raise IntegrityError(f"blob {blob_id} is {len(blob)} bytes; cannot read {len(buffer)} from {offset}")
        buffer[:] = piece

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
