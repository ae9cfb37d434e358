"""Taking in a shard's bytes as they arrive: validate the header first, hash every tensor on the way.

Both ways a shard reaches the store use it: an embedded client hands over the header and the
tensors' memory, the HTTP route feeds the request body chunk by chunk. Each byte is written
to the staging file and hashed from the same memory in one pass, so the store never reads
the file back to verify it. The header is checked as soon as its last byte arrives (and the
shard id against the one the upload names), so a wrong upload is refused before its data is
read; an upload that is cut short, too long or whose bytes do not match their digest names
leaves nothing behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ckptstore.service.blobs.held_file import HeldFile, hold_new
from ckptstore.service.errors import (
    IntegrityError,
    InvalidInputError,
    InvalidShardError,
    PayloadTooLargeError,
    StorageError,
    StorageFullError,
    is_disk_full,
)
from ckptstore.service.format.digest import TensorHasher, tensor_digest
from ckptstore.service.format.safetensors_header import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    HeaderEntry,
    ShardHeader,
    header_length,
    parse_header,
)
from ckptstore.service.intake.direct_file import DirectFileWriter

#: Buffers an upload's staging file keeps on their way to the device with ``write_behind``: a
#: server takes many uploads at once, each holding this many + 1 buffers of 4 MiB.
UPLOAD_IN_FLIGHT = 2
#: Bytes of an upload received at a time into a receiver's own memory (its header, say) rather
#: than into its staging file's buffer (see :meth:`ShardReceiver.space`).
SCRATCH_BYTES = 64 << 10


class ShardReceiver:
    """Writes one shard to ``path`` from bytes given in order to :meth:`write`, verifying as it goes.

    Args:
        path: the staging file to create (removed by :meth:`discard` unless the store took it).
        expected_id: the shard id the upload claims; checked once the header is complete.
        max_bytes: refuse shards larger than this (PayloadTooLargeError).
        max_header_bytes: refuse headers larger than this.
        direct_writes: write the staging file around the page cache where the file system
            allows it (see :mod:`service.intake.direct_file`).
        write_behind: write the staging file on a background thread while the next bytes are
            hashed (for uploads, whose bytes arrive while earlier ones are written).
    """

    def __init__(
        self,
        path: Path,
        *,
        expected_id: str | None = None,
        max_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        direct_writes: bool = True,
        write_behind: bool = False,
    ) -> None:
        self.path = Path(path)
        self.expected_id = expected_id
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.direct_writes = direct_writes
        self.write_behind = write_behind
        self.received = 0
        self.header: ShardHeader | None = None
        self._head = bytearray()
        self._handle: _Sink | None = None
        self._held: HeldFile | None = None  # the staging file's lock, from its creation to discard()
        self._entry = 0  # index of the tensor the next data byte belongs to
        self._hasher: TensorHasher | None = None  # None until the tensor's first bytes arrive
        self._landing = ReceiveSpace()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the shard."""
        view = memoryview(data).cast("B")
        self.received += view.nbytes
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise PayloadTooLargeError(f"shard upload exceeds the limit of {self.max_bytes} bytes")
        if self.header is None:
            view = self._take_header(view)
            if self.header is None:
                return
        if view.nbytes:
            self._take_data(view)

    def space(self) -> memoryview:
        """Memory for the shard's next bytes, to be received in place and then given to :meth:`landed`.

        Tensor data lands in the staging file's write buffer, where it is hashed and written from
        without a copy; the header, and anything past the shard's end, lands in memory of the
        receiver's own and goes through :meth:`write`.
        """
        header = self.header
        left = 0 if header is None else header.file_size - self.received
        return self._landing.space(self._handle if left > 0 else None, left)

    def landed(self, nbytes: int) -> None:
        """Take the ``nbytes`` received into the memory :meth:`space` gave last."""
        view, in_place = self._landing.take(nbytes)
        if not in_place:
            self.write(view)
            return
        assert self.header is not None and self._handle is not None
        self.received += nbytes
        self._hash_pieces(view, self.received - nbytes - self.header.data_start)
        del view
        advance(self._handle, nbytes)

    def write_tensors(self, pieces: Sequence[memoryview], on_bytes: Callable[[int], object] | None = None) -> None:
        """Take the shard's next tensors, each whole and in header order, as :meth:`write` would
        one by one; ``on_bytes`` is called with each one's size once it is written.

        What an embedded save hands over: a shard of 32,768 small tensors took 0.9 s through
        :meth:`write`, whose every call works out where its bytes fall.
        """
        header = self.header
        if header is None or self._hasher is not None:
            self._write_each(pieces, on_bytes)
            return
        entries = header.entries
        for number, piece in enumerate(pieces):
            index = self._entry
            view = piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece
            if index >= len(entries) or view.nbytes != entries[index].end - entries[index].begin:
                self._write_each(pieces[number:], on_bytes)  # not one whole tensor: write() tells why
                return
            self._write_whole(entries[index], view)
            self.received += view.nbytes
            if on_bytes is not None:
                on_bytes(view.nbytes)

    def _write_each(self, pieces: Sequence[memoryview], on_bytes: Callable[[int], object] | None) -> None:
        for piece in pieces:
            self.write(piece)
            if on_bytes is not None:
                on_bytes(piece.nbytes)

    def _take_header(self, view: memoryview) -> memoryview:
        """Collect header bytes; once complete, validate the header and open the staging file.

        Returns what is left of ``view`` after the header.
        """
        view, complete = take_prefixed(self._head, view, self._header_end)
        if not complete:
            return view
        header = parse_header(bytes(self._head), max_header_bytes=self.max_header_bytes)
        if self.expected_id is not None and header.shard_id != self.expected_id:
            raise IntegrityError(
                f"the uploaded shard's id is {header.shard_id}, not {self.expected_id} as the URL says; nothing "
                "was stored: upload it under the id its header hashes to"
            )
        if self.max_bytes is not None and header.file_size > self.max_bytes:
            raise PayloadTooLargeError(f"shard of {header.file_size} bytes exceeds the limit of {self.max_bytes}")
        self.header = header
        handle = self._open()
        try:
            handle.write(self._head)
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        return view

    def _header_end(self) -> int:
        """Where the header ends, from the length prefix (refusing oversized headers)."""
        return PREFIX_BYTES + header_length(self._head, max_header_bytes=self.max_header_bytes)

    def _open(self) -> _Sink:
        try:
            # Its buffer also turns the many small tensors of an adapter's shard into few writes.
            in_flight = UPLOAD_IN_FLIGHT if self.write_behind else 0
            self._held = hold_new(self.path)  # held, so a sweep of the staging folder leaves it be
            self.path = self._held.path
            self._handle = DirectFileWriter(self.path, direct=self.direct_writes, in_flight=in_flight, exists=True)
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        return self._handle

    def _take_data(self, view: memoryview) -> None:
        """Hash ``view`` tensor by tensor and append it to the staging file."""
        header = self.header
        assert header is not None and self._handle is not None
        position = self.received - view.nbytes - header.data_start  # data offset of view[0]
        if position + view.nbytes > header.data_length:
            raise InvalidShardError(
                f"shard upload has trailing bytes after the {header.data_length} bytes of tensor data its header lists"
            )
        entry = header.entries[self._entry]
        if position == entry.begin and position + view.nbytes == entry.end:
            self._write_whole(entry, view)
        else:
            self._hash_pieces(view, position)
            self._append(view)

    def _write_whole(self, entry: HeaderEntry, view: memoryview) -> None:
        """Check one whole tensor's bytes against its digest and append them: an embedded save
        hands over whole tensors, each one hash call with no slicing or hasher state."""
        self._check(entry.digest, tensor_digest(entry.dtype, entry.shape, view, parallel=False))
        self._append(view)
        self._entry += 1

    def _append(self, view: memoryview) -> None:
        assert self._handle is not None
        try:
            self._handle.write(view)
        except OSError as exc:
            raise staging_error(exc, self.path) from exc

    def _hash_pieces(self, view: memoryview, position: int) -> None:
        """Feed ``view``, starting at data offset ``position``, to the hashers of the tensors it spans."""
        assert self.header is not None
        done = 0
        while done < view.nbytes:
            entry = self.header.entries[self._entry]
            piece = view[done : done + entry.end - (position + done)]
            if self._hasher is None:
                self._hasher = TensorHasher(entry.dtype, entry.shape, parallel=False)
            self._hasher.update(piece)
            done += piece.nbytes
            if position + done == entry.end:
                self._check(entry.digest, self._hasher.hexdigest())
                self._entry += 1
                self._hasher = None

    @staticmethod
    def _check(expected: str, actual: str) -> None:
        if actual != expected:
            raise IntegrityError(
                f"shard tensor {expected[:16]}… hashes to {actual[:16]}…: its bytes were changed or cut in transit; "
                "retry the save (stored tensors are not sent again)"
            )

    def finish(self) -> ShardHeader:
        """Check the shard is complete and close the staging file; returns its verified header.

        Raises:
            InvalidInputError: nothing was received.
            InvalidShardError: the shard ended inside its header or before its last tensor.
        """
        if self.received == 0:
            raise InvalidInputError("the shard upload is empty")
        header = self.header
        if header is None:
            if len(self._head) < PREFIX_BYTES:
                raise InvalidShardError(f"shard is {len(self._head)} bytes; a safetensors file has at least 8")
            raise InvalidShardError(f"the shard ended inside its header, after {len(self._head)} bytes")
        if self.received != header.file_size:
            raise InvalidShardError(
                f"shard file has {header.file_size - self.received} bytes too few for the tensors its header lists"
            )
        assert self._handle is not None
        try:
            self._handle.close()
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        return header

    def discard(self) -> None:
        """Close and remove the staging file (a no-op once the store has moved it away)."""
        if self._handle is not None:
            try:
                self._handle.abort()
            except OSError:
                pass
        self.path.unlink(missing_ok=True)
        if self._held is not None:
            self._held.release()


class _Sink(Protocol):
    """Where a receiver's bytes go once checked: its staging file (:class:`DirectFileWriter`)."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def space(self) -> memoryview: ...

    def advance(self, nbytes: int) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class ReceiveSpace:
    """Where a receiver's next bytes are received in place: its staging file's buffer, or scratch
    memory of its own for bytes that :meth:`ShardReceiver.write` must see (headers, layouts)."""

    def __init__(self) -> None:
        self._scratch: bytearray | None = None
        self._view: memoryview | None = None
        self._in_place = False

    def space(self, sink: _Sink | None, limit: int) -> memoryview:
        """Up to ``limit`` bytes of ``sink``'s buffer, or (no sink) the scratch memory."""
        if sink is not None:
            self._view, self._in_place = sink.space()[:limit], True
        else:
            if self._scratch is None:
                self._scratch = bytearray(SCRATCH_BYTES)
            self._view, self._in_place = memoryview(self._scratch), False
        return self._view

    def take(self, nbytes: int) -> tuple[memoryview, bool]:
        """The first ``nbytes`` of the last space, and whether it is in the sink's buffer."""
        view, self._view = self._view, None
        if view is None or not 0 < nbytes <= view.nbytes:
            raise ValueError(f"{nbytes} bytes did not land in the space last given")
        return view[:nbytes], self._in_place


def advance(sink: _Sink, nbytes: int) -> None:
    """Append the ``nbytes`` put into ``sink``'s space (a disk error is a :class:`StorageError`)."""
    try:
        sink.advance(nbytes)
    except OSError as exc:
        raise staging_error(exc, getattr(sink, "path", None)) from exc


class _Nowhere:
    """A sink that keeps nothing: the bytes a :class:`ShardVerifier` checks are stored elsewhere."""

    def __init__(self) -> None:
        self._space = bytearray(SCRATCH_BYTES)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Drop ``data``."""

    def space(self) -> memoryview:
        """Memory reused for every piece received in place."""
        return memoryview(self._space)

    def advance(self, nbytes: int) -> None:
        """Drop what was put into the space."""

    def close(self) -> None:
        """Nothing to close."""

    def abort(self) -> None:
        """Nothing to give up."""


class ShardVerifier(ShardReceiver):
    """Checks a shard given in order to :meth:`write` exactly as :class:`ShardReceiver` does (the
    header, the shard id, the size, every tensor's digest), writing no file: for bytes already
    stored elsewhere, such as a shard a client uploaded to S3 itself (:mod:`service.intake.direct_uploads`).

    Not for :meth:`service.store.Store.ingest_received`, which stores a receiver's file. What
    it saves over a receiver writing a file is measured in :mod:`service.intake.direct_uploads`.
    """

    def __init__(
        self, *, expected_id: str | None = None, max_bytes: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES
    ) -> None:
        super().__init__(
            Path("/nonexistent/ckptstore-verify-only"),
            expected_id=expected_id,
            max_bytes=max_bytes,
            max_header_bytes=max_header_bytes,
        )

    def _open(self) -> _Sink:
        self._handle = _Nowhere()
        return self._handle

    def discard(self) -> None:
        """Nothing to remove: no file was written."""


def take_prefixed(head: bytearray, view: memoryview, end_of: Callable[[], int]) -> tuple[memoryview, bool]:
    """Move bytes from ``view`` to ``head`` until ``head`` holds an 8-byte length prefix and what it
    announces, ending at ``end_of()`` (called once the prefix is in; it refuses bad lengths).

    Returns what is left of ``view`` and whether ``head`` is complete.
    """
    need = PREFIX_BYTES if len(head) < PREFIX_BYTES else end_of()
    while True:
        take = min(view.nbytes, need - len(head))
        head += view[:take]
        view = view[take:]
        if len(head) < need:
            return view, False
        if need > PREFIX_BYTES:
            return view, True
        need = end_of()


def staging_error(exc: OSError, path: Path | None = None) -> StorageError:
    """The error for a shard the staging folder could not take at ``path`` (else the file the
    error names): the store's disk, not the upload, is at fault. A full disk (ENOSPC, EDQUOT) is
    a :class:`StorageFullError` naming the folder and what to run; any other (EIO) a StorageError."""
    if is_disk_full(exc):
        named = path if path is not None else (Path(os.fsdecode(exc.filename)) if exc.filename else None)
        folder = named.parent if named is not None else "the staging folder"
        return StorageFullError.of_folder(folder, exc.strerror or exc)
    return StorageError(
        f"could not write the shard to the staging folder: {exc.strerror or exc}; nothing was stored, "
        "retry once there is disk space"
    )
