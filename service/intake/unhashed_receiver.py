"""Taking in an upload of tensors whose digests the sender does not know: hash them as they arrive.

A client that knows its tensors changed since it last saved them need not hash them before
sending (the embedded store's :meth:`Store.put_tensors`, over HTTP). The body of such an upload
(``POST /v1/shards``) is:

    8 bytes   N, little-endian: the length of the layout
    N bytes   the layout, JSON: [[dtype, shape], ...], one entry per tensor
    ...       the tensors' raw bytes, back to back in the layout's order

The layout is checked as soon as its last byte arrives (known dtypes, whole shapes, no empty
tensor, at most ``max_tensors`` entries, ``max_bytes`` in all, and a body exactly as long as it
says), before any data is read. Each tensor is then hashed from the same memory it is written
from, as :mod:`service.intake.shard_writer` does for an embedded save, and the shard's header, which
names tensors by digest, is written last into room left at the start of the file. The store
computes every digest itself, so nothing the sender claims is trusted. Tensors must differ: a
shard names each digest once, so an upload holding two equal tensors is refused (the sender
sends each once), and nothing is stored.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ckptstore.service.blobs.held_file import HeldFile, hold_new
from ckptstore.service.errors import InvalidInputError, PayloadTooLargeError
from ckptstore.service.format.digest import TensorHasher
from ckptstore.service.format.dtypes import DTYPES, byte_length
from ckptstore.service.format.safetensors_header import (
    PREFIX_BYTES,
    ShardHeader,
    header_bytes,
    header_size,
    laid_out_entries,
)
from ckptstore.service.format.sharding import MAX_DIMENSIONS, MAX_TENSORS_PER_SHARD, SHARD_METADATA
from ckptstore.service.intake.direct_file import ALIGNMENT, DirectFileWriter
from ckptstore.service.intake.receiver import UPLOAD_IN_FLIGHT, ReceiveSpace, advance, staging_error, take_prefixed
from ckptstore.service.intake.shard_writer import WrittenShard


class UnhashedReceiver:
    """Writes one unhashed upload to ``path`` as a shard, from bytes given in order to :meth:`write`.

    Args:
        path: the staging file to create (removed by :meth:`discard` unless the store took it).
        length: the body's length, from its Content-Length (the layout must agree).
        max_bytes: refuse uploads whose tensors hold more bytes than this (PayloadTooLargeError).
        max_layout_bytes: refuse layouts longer than this.
        direct_writes: write around the page cache where the file system allows it.
    """

    def __init__(
        self, path: Path, *, length: int, max_bytes: int, max_layout_bytes: int, direct_writes: bool = True
    ) -> None:
        self.path = Path(path)
        self.length = length
        self.max_bytes = max_bytes
        self.max_layout_bytes = max_layout_bytes
        self.direct_writes = direct_writes
        self.received = 0
        self._head = bytearray()
        self._layout: list[tuple[str, tuple[int, ...], int]] | None = None  # dtype, shape, nbytes
        self._writer: DirectFileWriter | None = None
        self._held: HeldFile | None = None  # the staging file's lock, from its creation to discard()
        self._room = 0
        self._index = 0  # the tensor the next data byte belongs to
        self._left = 0  # its bytes still to come
        self._hasher: TensorHasher | None = None
        self._digests: list[str] = []
        self._first: dict[str, int] = {}  # digest -> index of the tensor that has it
        self._landing = ReceiveSpace()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the body."""
        view = memoryview(data).cast("B")
        self.received += view.nbytes
        if self.received > self.length:
            raise InvalidInputError(f"the upload is longer than the {self.length} bytes its Content-Length says")
        if self._layout is None:
            view = self._take_layout(view)
        while view.nbytes:
            view = self._take_data(view)

    def space(self) -> memoryview:
        """Memory for the body's next bytes, to be received in place and then given to
        :meth:`landed`: the staging file's write buffer once the layout is in (the tensors are
        hashed and written from there, not copied), else memory of the receiver's own."""
        in_data = self._writer is not None and self.received < self.length
        return self._landing.space(self._writer if in_data else None, self.length - self.received)

    def landed(self, nbytes: int) -> None:
        """Take the ``nbytes`` received into the memory :meth:`space` gave last."""
        view, in_place = self._landing.take(nbytes)
        if not in_place:
            self.write(view)
            return
        assert self._writer is not None
        self.received += nbytes
        while view.nbytes:
            view = self._hash_data(view)
        advance(self._writer, nbytes)

    def _take_layout(self, view: memoryview) -> memoryview:
        """Collect the prefix and layout; once complete, check it and open the staging file."""
        view, complete = take_prefixed(self._head, view, self._layout_end)
        if not complete:
            return view
        need = len(self._head)
        self._layout = self._parse(bytes(self._head[PREFIX_BYTES:]))
        total = sum(nbytes for _, _, nbytes in self._layout)
        if total > self.max_bytes:
            raise PayloadTooLargeError(f"an upload of {total} bytes of tensors exceeds the limit of {self.max_bytes}")
        if need + total != self.length:
            raise InvalidInputError(
                f"the layout lists {total} bytes of tensors after {need} bytes of layout, but the body is "
                f"{self.length} bytes long"
            )
        self._room = header_size([(dtype, shape) for dtype, shape, _ in self._layout], SHARD_METADATA, align=ALIGNMENT)
        try:
            self._held = hold_new(self.path)  # held, so a sweep of the staging folder leaves it be
            self.path = self._held.path
            self._writer = DirectFileWriter(
                self.path, direct=self.direct_writes, in_flight=UPLOAD_IN_FLIGHT, start=self._room, exists=True
            )
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        self._left = self._layout[0][2]
        return view

    def _layout_end(self) -> int:
        """Where the layout ends, from the length prefix (refusing a length out of bounds)."""
        length = int(struct.unpack("<Q", bytes(self._head[:PREFIX_BYTES]))[0])
        if length < 2 or length > self.max_layout_bytes:
            raise InvalidInputError(f"the upload's layout is {length} bytes; it must be 2 to {self.max_layout_bytes}")
        return PREFIX_BYTES + length

    @staticmethod
    def _parse(text: bytes) -> list[tuple[str, tuple[int, ...], int]]:
        """The layout's entries (dtype, shape, byte length), each checked."""
        try:
            document = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InvalidInputError("the upload's layout is not valid JSON") from exc
        if not isinstance(document, list) or not document:
            raise InvalidInputError("the upload's layout must be a non-empty list of [dtype, shape]")
        if len(document) > MAX_TENSORS_PER_SHARD:
            raise InvalidInputError(f"the upload lists {len(document)} tensors; at most {MAX_TENSORS_PER_SHARD}")
        layout = []
        for number, entry in enumerate(document):
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in DTYPES and isinstance(entry[1], list)):
                raise InvalidInputError(f"layout entry {number} is not [dtype, shape] with a known dtype")
            dtype, shape = entry
            if len(shape) > MAX_DIMENSIONS or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape):
                raise InvalidInputError(f"layout entry {number} has an invalid shape {str(shape)[:80]}")
            nbytes = byte_length(dtype, shape)
            if nbytes <= 0:
                raise InvalidInputError(f"layout entry {number} is empty; an empty tensor needs no storage")
            layout.append((dtype, tuple(shape), nbytes))
        return layout

    def _take_data(self, view: memoryview) -> memoryview:
        """Write and hash the bytes of the current tensor that ``view`` starts with; the rest of ``view``."""
        assert self._writer is not None
        piece = view[: self._left]
        try:
            self._writer.write(piece, self._hash_data)
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        return view[piece.nbytes :]

    def _hash_data(self, view: memoryview) -> memoryview:
        """Hash the bytes of the current tensor that ``view`` starts with; the rest of ``view``."""
        assert self._layout is not None
        if self._hasher is None:
            dtype, shape, _ = self._layout[self._index]
            self._hasher = TensorHasher(dtype, shape, parallel=False)
        piece = view[: self._left]
        self._hasher.update(piece)
        self._left -= piece.nbytes
        if not self._left:
            self._end_tensor(self._hasher.hexdigest())
        return view[piece.nbytes :]

    def _end_tensor(self, digest: str) -> None:
        assert self._layout is not None
        earlier = self._first.setdefault(digest, self._index)
        if earlier != self._index:
            raise InvalidInputError(
                f"tensors {earlier} and {self._index} of the upload are equal; a shard holds each tensor once: "
                "send it once"
            )
        self._digests.append(digest)
        self._hasher = None
        self._index += 1
        if self._index < len(self._layout):
            self._left = self._layout[self._index][2]

    def finish(self) -> WrittenShard:
        """Check the upload is complete, write the header and close the file; the shard written.

        Raises:
            InvalidInputError: the body ended early.
        """
        if self._layout is None or self._writer is None or self._index < len(self._layout):
            raise InvalidInputError(f"the upload was cut off after {self.received} bytes; retry it")
        named = [(digest, dtype, shape) for digest, (dtype, shape, _) in zip(self._digests, self._layout, strict=True)]
        header = header_bytes(named, SHARD_METADATA, align=ALIGNMENT, at_least=self._room)
        try:
            self._writer.write_head(header)
            self._writer.close()
        except OSError as exc:
            raise staging_error(exc, self.path) from exc
        self._writer = None
        return WrittenShard(list(self._digests), ShardHeader(header, laid_out_entries(named), dict(SHARD_METADATA)))

    def discard(self) -> None:
        """Remove the staging file, if any (after :meth:`finish`, once the store took it or failed to)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self.path.unlink(missing_ok=True)
        if self._held is not None:
            self._held.release()
