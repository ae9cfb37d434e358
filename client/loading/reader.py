"""Reading a version's tensors: fetch only the byte ranges needed, verify, then hand out.

Every byte is checked against its digest before its tensor is handed out; a mismatch raises
IntegrityError naming the tensor key and the shard. Reads go in shard-and-offset order so a
local store reads each shard front to back. Bytes land straight in their final tensors (the
caller's own, or fresh ``torch.empty`` ones): a background thread reads a few bounded units
ahead while the calling thread hashes what has arrived.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import torch

from ckptstore.client.loading.decoding import decode_threads, decoded
from ckptstore.client.loading.plan import ReadUnit, batch_units, plan_reads
from ckptstore.client.loading.readahead import run_ahead
from ckptstore.client.store_protocol import Transport
from ckptstore.client.tensors import NAME_TO_TORCH, byte_view
from ckptstore.service.errors import IntegrityError, InvalidInputError
from ckptstore.service.format.digest import TensorHasher, tensor_digest
from ckptstore.service.format.encoded_reads import decode_into, fetch_chain
from ckptstore.service.format.manifest import DTypeName, Manifest, TensorEntry
from ckptstore.service.format.records import TensorLocation

#: Largest single read. Over HTTP every request costs a round trip and restarts the
#: server's disk read-ahead, so reads are large; 64 MiB still leaves a 1 GiB load sixteen
#: reads to overlap with hashing (measured: 16 MiB reads load 1 GiB over loopback HTTP in
#: 0.55-0.6 s, 64 MiB ones in 0.4-0.45 s; embedded loads take the same time with either).
UNIT_BYTES = 64 << 20
#: Reads in flight ahead of the hashing: enough to keep the reading thread busy, few enough
#: that an error stops the work soon.
READ_AHEAD = 2
#: Most bytes and ranges one batched request asks of a server (see ``Transport.read_ranges``):
#: small enough that hashing one batch overlaps reading the next, large enough that a
#: version spread over a thousand shards of small tensors takes a handful of requests.
BATCH_BYTES = 16 << 20
BATCH_UNITS = 1024


#: Makes the host tensor a piece is read into: ``host_empty(shape, dtype)``, as :func:`plain_empty`.
HostEmpty = Callable[[list[int], torch.dtype], torch.Tensor]


def plain_empty(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised, pageable host memory for a tensor of ``shape`` and ``dtype``."""
    return torch.empty(shape, dtype=dtype)


@dataclass(frozen=True)
class PieceSpec:
    """What one stored piece holds: a whole tensor (its entry's dtype and shape) or one chunk of it."""

    dtype: DTypeName
    shape: list[int]
    digest: str


class _Job:
    """One stored tensor on its way: the keys it serves, where it is, its destination, its hash."""

    __slots__ = ("keys", "dtype", "shape", "location", "tensor", "allocate", "_hasher", "_bytes")

    def __init__(
        self,
        keys: list[str],
        dtype: DTypeName,
        shape: list[int],
        location: TensorLocation,
        tensor: torch.Tensor | None,
        allocate: HostEmpty,
    ) -> None:
        self.keys = keys
        self.dtype = dtype
        self.shape = shape
        self.location = location
        self.tensor = tensor
        self.allocate = allocate
        self._hasher: TensorHasher | None = None
        self._bytes: memoryview | None = None

    def bytes(self) -> memoryview:
        """The destination's raw bytes, allocating it (uninitialised) on first use."""
        if self._bytes is None:
            if self.tensor is None:
                self.tensor = self.allocate(self.shape, NAME_TO_TORCH[self.dtype])
            self._bytes = byte_view(self.tensor.detach())
        return self._bytes

    def digest(self, view: memoryview, *, last: bool) -> str | None:
        """Hash the next piece of the tensor's bytes; the digest once ``last``, else None."""
        if self._hasher is None:
            self._hasher = TensorHasher(self.dtype, self.shape)
        self._hasher.update(view)
        return self._hasher.hexdigest() if last else None

    def release(self) -> torch.Tensor:
        """The destination, no longer referenced here (the reader must not keep every tensor alive)."""
        tensor, self.tensor, self._bytes = self.tensor, None, None
        assert tensor is not None
        return tensor


class TensorReader:
    """Reads the tensors of one manifest from a transport."""

    def __init__(
        self,
        transport: Transport,
        manifest: Manifest,
        *,
        on_bytes: Callable[[int], object] | None = None,
        read_threads: int = 1,
        digests: Iterable[str] | None = None,
    ) -> None:
        """``digests``: locate only these (the pieces a caller will read); default every one."""
        self.transport = transport
        self.read_threads = read_threads
        self.manifest = manifest
        self.entries = {entry.key: entry for entry in manifest.tensors}
        if digests is None:
            stored = [d for entry in manifest.tensors for d in _stored_digests(entry)]
        else:
            stored = sorted(set(digests))
        self.locations: dict[str, TensorLocation] = transport.locate(stored) if stored else {}
        self.bytes_read = 0
        self._on_bytes = on_bytes

    def read_many(
        self,
        keys: Iterable[str],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        host_empty: HostEmpty = plain_empty,
        checked: bool = False,
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield ``(key, tensor)`` for ``keys`` in storage order, each verified before it is yielded.

        ``into`` names, per key, the tensor to read into (a contiguous CPU tensor of exactly
        the stored dtype and shape, such as a model's own parameter); that very tensor is
        yielded. Other keys get a fresh tensor from ``host_empty(shape, dtype)`` (pinned memory,
        for tensors bound for a GPU: :class:`client.loading.device_copy.DeviceCopier`).
        Tensors stored back to back are fetched together in reads of up to ``UNIT_BYTES``; a
        digest shared by several keys (tied weights, equal optimizer scalars) is read and
        verified once, then copied, so no two keys ever share memory unless their destinations
        already did.

        On IntegrityError a destination may hold some bytes of the corrupt tensor. Close the
        iterator (``contextlib.closing``) when abandoning it early: that stops the read-ahead.
        ``checked``: the caller has already held every destination to these rules (as
        :func:`client.loading.restore.load_into_model` does), so they are not checked again.

        Raises:
            InvalidInputError: a destination is not a contiguous CPU tensor of the stored dtype and shape.
            IntegrityError: bytes read do not hash to their digest.
        """
        for batch in self.read_batches(keys, into=into, host_empty=host_empty, checked=checked):
            yield from batch

    def read_batches(
        self,
        keys: Iterable[str],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        host_empty: HostEmpty = plain_empty,
        checked: bool = False,
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """:meth:`read_many`'s ``(key, tensor)`` pairs in lists, one list per read as it completes.

        For callers that handle many small tensors: a list per read instead of a generator
        step per tensor (a load of 32,768 tensors passes each through several generators).
        """
        into = dict(into or {})
        entries = self.entries
        if not checked:
            for key, destination in into.items():
                _check_destination(entries[key], destination)
        groups: dict[str, list[str]] = {}
        for key in keys:
            entry = entries[key]
            if entry.digest is None or 0 in entry.shape:
                yield [(key, _deliver(self.read(key), into.get(key)))]
            else:
                groups.setdefault(entry.digest, []).append(key)
        yield from self._stream(self._jobs(groups, into, entries, host_empty), into)

    def read_pieces(
        self, pieces: Mapping[str, PieceSpec], *, into: Mapping[str, torch.Tensor] | None = None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield ``(label, tensor)`` for stored pieces (whole tensors or chunks) named by a label
        of the caller's choosing, in storage order, each verified before it is yielded.

        Works as :meth:`read_many` does (``into`` by label; equal digests read once, copied),
        for pieces the caller picked itself, such as the chunks one rank of a sharded load needs.
        Every piece's digest must have been located (the ``digests`` given to the reader).
        """
        into = dict(into or {})
        for label, destination in into.items():
            _check_piece_destination(label, pieces[label], destination)
        groups: dict[str, list[str]] = {}
        for label, spec in pieces.items():
            if 0 in spec.shape:
                yield label, _deliver(torch.empty(spec.shape, dtype=NAME_TO_TORCH[spec.dtype]), into.get(label))
            else:
                groups.setdefault(spec.digest, []).append(label)
        for batch in self._stream(self._jobs(groups, into, pieces, plain_empty), into):
            yield from batch

    def _jobs(
        self,
        groups: dict[str, list[str]],
        into: dict[str, torch.Tensor],
        specs: Mapping[str, TensorEntry] | Mapping[str, PieceSpec],
        host_empty: HostEmpty,
    ) -> list[_Job]:
        """One job per digest, in storage order, each read straight into a destination if it may.

        A destination is read into only if no earlier job uses its memory and no other
        destination partly overlaps it: bytes for it may arrive while an earlier tensor there
        is still being hashed. Such keys are read into a fresh tensor and copied in order.
        """
        spans = {}
        for key, tensor in into.items():
            if nbytes := tensor.nbytes:
                start = tensor.data_ptr()
                spans[key] = (start, start + nbytes)
        locations = self.locations
        located = sorted((locations[digest] for digest in groups), key=_STORAGE_ORDER)
        if _apart(list(spans.values())):
            # Every destination its own memory (a model's tensors, but for tied ones): each
            # job reads into its first key's destination, if that key has one.
            return [self._job(groups[where.digest], specs, where, into, host_empty) for where in located]
        tangled = _partly_overlapping(list(spans.values()))
        claimed: set[tuple[int, int]] = set()
        jobs = []
        for where in located:
            keys = groups[where.digest]
            owner = None
            for key in keys:
                span = spans.get(key)
                if span is None:
                    continue
                if owner is None and span not in claimed and span not in tangled:
                    owner = key
                claimed.add(span)
            if owner is not None and owner != keys[0]:
                keys = [owner, *(k for k in keys if k != owner)]
            spec, destination = specs[keys[0]], into[owner] if owner is not None else None
            jobs.append(_Job(keys, spec.dtype, spec.shape, where, destination, host_empty))
        return jobs

    @staticmethod
    def _job(
        keys: list[str],
        specs: Mapping[str, TensorEntry] | Mapping[str, PieceSpec],
        where: TensorLocation,
        into: dict[str, torch.Tensor],
        host_empty: HostEmpty,
    ) -> _Job:
        """The job of ``keys`` (one digest), reading into the first of them that has a destination."""
        destination = into.get(keys[0])
        if destination is None and len(keys) > 1:
            owner = next((key for key in keys if key in into), None)
            if owner is not None:
                keys, destination = [owner, *(k for k in keys if k != owner)], into[owner]
        spec = specs[keys[0]]
        return _Job(keys, spec.dtype, spec.shape, where, destination, host_empty)

    def _stream(
        self, jobs: list[_Job], into: dict[str, torch.Tensor]
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """Hash each arriving piece into its tensor's digest; yield every tensor whose last piece
        came, in a list per read.

        Tensors stored encoded are decoded after the others (:mod:`client.loading.decoding`).
        """
        encoded = [job for job in jobs if job.location.encoded]
        if encoded:
            jobs = [job for job in jobs if not job.location.encoded]
        yield from self._stream_raw(jobs, into)
        if encoded:
            yield from self._stream_decoded(encoded, into)

    def _stream_decoded(
        self, jobs: list[_Job], into: dict[str, torch.Tensor]
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """Decode, verify and yield each tensor stored encoded, on :func:`decode_threads` threads."""
        read, hint = self.transport.read_into, self.transport.will_read
        with closing(decoded(read, self.locations, jobs, threads=decode_threads(), will_read=hint)) as done:
            for job, digest in done:
                assert isinstance(job, _Job)
                handed: list[tuple[str, torch.Tensor]] = []
                self._hand_out(job, digest, into, handed)
                yield handed
                self._count(job.location.nbytes)

    def _hand_out(
        self, job: _Job, digest: str, into: dict[str, torch.Tensor], handed: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Check a whole tensor's digest, then append it to ``handed`` under each of its keys."""
        first = job.keys[0]
        self._check(first, job.location, digest)
        tensor = job.release()
        handed.append((first, _deliver(tensor, into.get(first))))
        for key in job.keys[1:]:
            # Every key gets its own memory: optimizer state updated in place
            # (Adam's step, equal moments) must never alias another parameter's.
            handed.append((key, _deliver(tensor, into.get(key), copy=True)))

    def _stream_raw(
        self, jobs: list[_Job], into: dict[str, torch.Tensor]
    ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        """The tensors stored raw: read in bounded units, hashed as their pieces arrive."""
        units = plan_reads([job.location for job in jobs], UNIT_BYTES)
        with closing(self._fetched(jobs, units)) as fetched:
            for unit, views in fetched:
                handed: list[tuple[str, torch.Tensor]] = []
                nbytes = 0
                for (item, start, _length, last), view in zip(unit.pieces, views, strict=True):
                    job = jobs[item]
                    if start == 0 and last:  # read in one piece: hashed in one call
                        digest = tensor_digest(job.dtype, job.shape, view)
                    else:
                        whole = job.digest(view, last=last)
                        if whole is None:
                            continue
                        digest = whole
                    nbytes += job.location.nbytes
                    if len(job.keys) == 1 and digest == job.location.digest:  # most tensors
                        tensor = job.release()
                        destination = into.get(job.keys[0])
                        if destination is not tensor:
                            tensor = _deliver(tensor, destination)
                        handed.append((job.keys[0], tensor))
                        continue
                    self._hand_out(job, digest, into, handed)
                yield handed
                self._count(nbytes)

    def _fetched(
        self, jobs: list[_Job], units: list[ReadUnit]
    ) -> Generator[tuple[ReadUnit, list[memoryview]], None, None]:
        """Yield each unit with its pieces' byte views once read, ``READ_AHEAD`` reads ahead on ``read_threads``.

        A store that answers many ranges in one request (a server: ``read_ranges``) gets the
        units in batches of up to ``BATCH_BYTES``, so a version spread over many shards costs
        a few requests, not one per shard. However the consumer stops (an error, an abandoned
        iterator), queued reads are cancelled and the running one is waited for, so no thread
        outlives the generator.
        """

        def views_for(_number: int, batch: list[ReadUnit]) -> list[list[memoryview]]:
            return [[jobs[p.item].bytes()[p.start : p.start + p.length] for p in unit.pieces] for unit in batch]

        read_ranges = getattr(self.transport, "read_ranges", None)
        batches = batch_units(units, BATCH_BYTES, BATCH_UNITS) if read_ranges else [[unit] for unit in units]

        def read(batch: list[ReadUnit], views: list[list[memoryview]]) -> None:
            if len(batch) == 1:
                self.transport.read_scatter(batch[0].shard_id, batch[0].offset, views[0])
            else:
                assert read_ranges is not None
                read_ranges([(u.shard_id, u.offset, v) for u, v in zip(batch, views, strict=True)])

        ahead = max(READ_AHEAD, 2 * self.read_threads)  # every reader has its next read queued
        reads = run_ahead(read, batches, views_for, ahead=ahead, threads=self.read_threads, name="ckptstore-read")
        with closing(reads):
            for batch, views, future in reads:
                future.result()
                yield from zip(batch, views, strict=True)

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

    def _read_piece(self, entry: TensorEntry, digest: str, shape: list[int]) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=NAME_TO_TORCH[entry.dtype])
        if 0 in shape:
            return tensor
        location = self.locations[digest]
        data = byte_view(tensor)
        if location.encoded:
            read = self.transport.read_into
            try:
                decode_into(read, fetch_chain(read, self.locations, digest), data)
            except IntegrityError as exc:
                raise IntegrityError(f"{entry.key}: {exc}") from exc
        else:
            self.transport.read_into(location.shard_id, location.offset, data)
        hasher = TensorHasher(entry.dtype, shape)
        hasher.update(data)
        self._check(entry.key, location, hasher.hexdigest())
        self._count(location.nbytes)
        return tensor

    def _check(self, key: str, location: TensorLocation, actual: str) -> None:
        if actual != location.digest:
            raise IntegrityError(
                f"{key}: bytes read from shard {location.shard_id} at offset {location.offset} hash to "
                f"{actual[:16]}…, not {location.digest[:16]}…; the stored shard is corrupt (run `ckptstore verify`)"
            )

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self._on_bytes is not None:
            self._on_bytes(nbytes)


#: Shard, then offset: the order a job list reads in.
_STORAGE_ORDER = operator.attrgetter("shard_id", "offset")


def _apart(spans: list[tuple[int, int]]) -> bool:
    """Whether no two of ``spans`` share a byte (equal spans do: one tensor under two names)."""
    if len(spans) < 2:
        return True
    starts = np.fromiter((start for start, _ in spans), dtype=np.uint64, count=len(spans))
    ends = np.fromiter((end for _, end in spans), dtype=np.uint64, count=len(spans))
    order = np.argsort(starts)
    # Sorted by start, apart when each span starts at or after the end of the one before it.
    return bool((starts[order][1:] >= ends[order][:-1]).all())


def _partly_overlapping(spans: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The spans that overlap a different span (equal spans, one tensor under two names, do not count)."""
    tangled: set[tuple[int, int]] = set()
    reach: tuple[int, int] | None = None  # of the spans seen so far, the one ending last
    for span in sorted(set(spans)):
        if reach is not None and span[0] < reach[1]:
            tangled.update((span, reach))
        if reach is None or span[1] > reach[1]:
            reach = span
    return tangled


def _check_destination(entry: TensorEntry, tensor: torch.Tensor) -> None:
    _check_shaped_destination(entry.key, entry.dtype, entry.shape, tensor)


def _check_piece_destination(label: str, spec: PieceSpec, tensor: torch.Tensor) -> None:
    _check_shaped_destination(label, spec.dtype, spec.shape, tensor)


def _check_shaped_destination(label: str, dtype: DTypeName, shape: list[int], tensor: torch.Tensor) -> None:
    want = NAME_TO_TORCH[dtype]
    if not tensor.is_cpu or tensor.dtype != want or list(tensor.shape) != list(shape):
        raise InvalidInputError(
            f"{label}: cannot read into a {tensor.dtype} tensor of shape {list(tensor.shape)} on "
            f"{tensor.device}; it needs a CPU tensor of {want} and shape {list(shape)}"
        )
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        raise InvalidInputError(f"{label}: cannot read into a tensor that is not contiguous")


def _deliver(source: torch.Tensor, destination: torch.Tensor | None, *, copy: bool = False) -> torch.Tensor:
    """``source``'s values in ``destination`` if given (returned), else in ``source`` or a copy of it."""
    if destination is None:
        return source.detach().clone() if copy else source
    if destination is source:
        return destination
    if destination.data_ptr() != source.data_ptr() and source.numel():
        byte_view(destination.detach())[:] = byte_view(source.detach())
    return destination


def _stored_digests(entry: TensorEntry) -> list[str]:
    if entry.digest is not None:
        return [] if 0 in entry.shape else [entry.digest]
    return [c.digest for c in entry.chunks or () if 0 not in c.shape]
