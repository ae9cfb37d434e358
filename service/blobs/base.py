"""The BlobStore interface every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from service.format.digest import is_digest

READ_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class StaleUploads:
    """Unfinished uploads a killed writer left (S3 multipart uploads): how many were found idle
    past the cut-off, the bytes their parts hold, and how many of them were aborted."""

    found: int = 0
    bytes: int = 0
    aborted: int = 0


class BlobStore(ABC):
    """Write-once storage of shard files, keyed by shard id (a validated digest).

    The store calls the methods in this order over a blob's life: :meth:`put_file` once the
    shard has been validated; :meth:`size` to check presence; :meth:`read_into` (or
    :meth:`read_scatter`, :meth:`iter_range`) for every read; :meth:`delete` only from
    garbage collection.
    :meth:`list_ids` serves scrubbing and collection, and :meth:`abort_stale_uploads`
    collection. Keys are shard ids only, never names from a request, so no backend ever builds
    a path or URL from user input.
    """

    @property
    def location(self) -> str:
        """Where the blobs are, for people (``file:///…``, ``s3://bucket/prefix``)."""
        return repr(self)

    @abstractmethod
    def put_file(self, blob_id: str, path: Path) -> None:
        """Store the file at ``path`` under ``blob_id`` atomically; the file may be moved away.

        Idempotent: if the blob exists, the existing one is kept. Either the whole blob
        becomes visible or nothing does.
        """

    @abstractmethod
    def size(self, blob_id: str) -> int | None:
        """Size in bytes of the blob, or None if it is absent."""

    @abstractmethod
    def read_into(self, blob_id: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the blob's bytes starting at ``offset``.

        Raises:
            NotFoundError: the blob is absent.
            IntegrityError: the blob ends before the buffer is full.
            ValueError: ``offset`` is negative.
        """

    @abstractmethod
    def delete(self, blob_id: str) -> None:
        """Remove the blob if present."""

    @abstractmethod
    def list_ids(self) -> Iterator[str]:
        """Every stored blob id."""

    def abort_stale_uploads(self, idle_since: datetime, *, dry_run: bool = False) -> StaleUploads:
        """Find uploads a killed writer left unfinished with nothing added since ``idle_since``
        (timezone-aware), and abort them unless ``dry_run``.

        Only S3 has such leftovers (incomplete multipart uploads, billed until aborted); a
        local folder's are temporary files (:mod:`service.cleanup`), so this default finds none.
        """
        return StaleUploads()

    def read_url(self, blob_id: str, expires_seconds: int) -> str | None:
        """A URL anyone holding it may GET the blob's bytes from (ranged reads included) for
        ``expires_seconds``, or None where the backend has no such URLs (local folders, memory).

        Clients read shards from such URLs directly, so a server's CPU and network carry no
        shard bytes; every byte read is verified against its digest by the client.
        """
        return None

    def read_scatter(self, blob_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in turn with the blob's consecutive bytes starting at ``offset``.

        Backends override this to read the whole range at once; this default reads each
        buffer with :meth:`read_into`.

        Raises:
            NotFoundError: the blob is absent.
            IntegrityError: the blob ends before the last buffer is full.
            ValueError: ``offset`` is negative.
        """
        for buffer in buffers:
            self.read_into(blob_id, offset, buffer)
            offset += buffer.nbytes

    def iter_range(
        self, blob_id: str, offset: int, length: int, chunk_bytes: int = READ_CHUNK_BYTES
    ) -> Iterator[bytes | memoryview]:
        """Yield ``length`` bytes of the blob from ``offset`` in pieces of ``chunk_bytes``.

        Pieces are yielded as read, without a copy to ``bytes``. Each is a fresh buffer, never
        reused: an ASGI server may still hold one after asking for the next (uvloop keeps the
        unsent part of a write as a view of the caller's buffer). The generator keeps no reference
        to a piece it has yielded, so one a client has taken is freed while the next waits.
        """
        end = offset + length
        while offset < end:
            size = min(chunk_bytes, end - offset)
            yield self._read_new(blob_id, offset, size)
            offset += size

    def _read_new(self, blob_id: str, offset: int, size: int) -> memoryview:
        """``size`` bytes of the blob from ``offset`` in a buffer of their own."""
        piece = memoryview(bytearray(size))
        self.read_into(blob_id, offset, piece)
        return piece


def flat_bytes(buffer: memoryview) -> memoryview:
    """``buffer`` as a one-dimensional view of unsigned bytes (no copy)."""
    return buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")


def check_blob_id(blob_id: str) -> str:
    """Guard against any non-digest reaching a backend (a programming error, not user input)."""
    if not is_digest(blob_id):
        raise ValueError(f"blob id {blob_id[:80]!r} is not a digest")
    return blob_id
