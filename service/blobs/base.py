"""The BlobStore interface every backend implements."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.digest import is_digest

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
        local folder's are temporary files (:mod:`service.reclaim.cleanup`), so this default finds none.
        """
        return StaleUploads()

    def read_urls(self, blob_ids: Sequence[str], expires_seconds: int) -> dict[str, str]:
        """A URL per blob that anyone holding it may GET the blob's bytes from (ranged reads
        included) for ``expires_seconds``; empty where the backend has no such URLs (local
        folders, memory).

        Clients read shards from such URLs directly, so a server's CPU and network carry no
        shard bytes; every byte read is verified against its digest by the client.
        """
        return {}

    def staging(self) -> StagingArea | None:
        """Where clients upload shards straight to the backend (presigned URLs), to be verified
        and published as blobs only then; None where the backend has no such URLs (local folders,
        memory): every upload then goes through the server."""
        return None

    def will_read(self, blob_id: str, spans: Sequence[tuple[int, int]]) -> None:
        """A hint that ``(offset, length)`` spans of the blob will be read soon: a backend may
        start reading them now (a local folder asks the kernel to). Never raises; this default
        does nothing."""
        return None

    def open_file(self, blob_id: str) -> int | None:
        """A read-only file descriptor of the blob where blobs are local files (the caller closes
        it), so its bytes can be sent by the kernel; None where they are not (this default).

        Raises:
            NotFoundError: the blob is absent (where blobs are local files).
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


#: A staged upload's token: 32 lowercase hex characters the server drew (128 random bits).
STAGING_TOKEN_PATTERN = r"^[0-9a-f]{32}$"
_STAGING_TOKEN_RE = re.compile(STAGING_TOKEN_PATTERN)


def check_staging_token(token: str) -> str:
    """``token``, once it is seen to be one the server could have drawn (InvalidInputError otherwise)."""
    if not (isinstance(token, str) and _STAGING_TOKEN_RE.match(token)):
        raise InvalidInputError(f"{str(token)[:40]!r} is not an upload token (32 lowercase hex characters)")
    return token


@dataclass(frozen=True)
class UploadPlan:
    """Where a client sends one shard's bytes itself: ``urls[i]`` takes bytes
    ``[i * part_bytes, min((i + 1) * part_bytes, size))`` with a ``PUT``, for ``expires_in``
    seconds; ``token`` names the staged upload when the client asks the server to finish it."""

    token: str
    size: int
    part_bytes: int
    urls: tuple[str, ...]
    expires_in: int


class StagingArea(ABC):
    """Shards clients upload to the blob store directly, kept apart from the blobs until verified.

    The server calls the methods in this order over an upload's life: :meth:`plan` (a staging key
    of its own choosing, never the blob's, and URLs the client ``PUT``s the bytes to); after the
    client says it is done, :meth:`finish` (completing a multipart upload), :meth:`seal` (a copy
    of the staged object that only the server writes: the client can still write the staged one),
    :meth:`read` of the sealed copy (the server verifies every byte), :meth:`publish` (the sealed
    copy becomes the blob), then :meth:`unseal` and :meth:`remove` whatever the outcome.
    :meth:`sweep` is garbage collection's, for uploads a killed client never finished. Tokens are
    checked with :func:`check_staging_token` and shard ids with :func:`check_blob_id`, so no request value reaches a
    key unchecked.
    """

    @abstractmethod
    def plan(self, shard_id: str, size: int, expires_seconds: int) -> UploadPlan:
        """Stage a new upload of ``size`` bytes for shard ``shard_id`` and sign its URLs.

        Raises:
            PayloadTooLargeError: ``size`` needs more parts than the backend allows.
            StorageError: the backend failed (starting a multipart upload is a request).
        """

    @abstractmethod
    def finish(self, shard_id: str, token: str, size: int) -> int:
        """Complete the staged upload (its multipart upload, if any, after checking it has every
        part of the plan for ``size`` bytes); returns the staged object's size.

        Raises:
            NotFoundError: nothing was staged under ``token`` (never sent, expired, or removed).
            InvalidInputError: a part is missing or of the wrong size.
        """

    @abstractmethod
    def seal(self, shard_id: str, token: str, size: int) -> str:
        """Copy the staged object (about ``size`` bytes), inside the backend, to a key no client can
        write and no other completion shares; returns the seal naming that copy.

        Raises:
            NotFoundError: nothing is staged under ``token``.
        """

    @abstractmethod
    def read(self, shard_id: str, token: str, seal: str, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
        """Yield the sealed copy's bytes in order, in pieces of at most ``chunk_bytes``."""

    @abstractmethod
    def publish(self, shard_id: str, token: str, seal: str, size: int) -> None:
        """Copy the sealed copy (verified, of ``size`` bytes) to the blob of ``shard_id``,
        inside the backend, unless that blob exists."""

    @abstractmethod
    def unseal(self, shard_id: str, token: str, seal: str) -> None:
        """Delete the sealed copy ``seal``, if it exists."""

    @abstractmethod
    def remove(self, shard_id: str, token: str) -> None:
        """Delete the staged object and abort its unfinished multipart upload, if either exists."""

    @abstractmethod
    def sweep(self, idle_since: datetime, *, dry_run: bool = False) -> StaleUploads:
        """Remove (unless ``dry_run``) staged objects and unfinished staged uploads with nothing
        added since ``idle_since`` (timezone-aware): uploads killed clients left."""


def flat_bytes(buffer: memoryview) -> memoryview:
    """``buffer`` as a one-dimensional view of unsigned bytes (no copy)."""
    return buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")


def check_blob_id(blob_id: str) -> str:
    """Guard against any non-digest reaching a backend (a programming error, not user input)."""
    if not is_digest(blob_id):
        raise ValueError(f"blob id {blob_id[:80]!r} is not a digest")
    return blob_id
