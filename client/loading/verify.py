"""Re-reading and re-hashing every stored byte a set of versions references.

Every version's stored metadata is checked against the digests covering it first (each
manifest part's body, the whole manifest text, the listed columns: the store's
``check_metadata``), then every tensor's bytes are hashed against its digest, and every shard's
header against the shard's id. Works through the transport only (``locate`` + ``read_scatter`` + a digest check), so
it checks an embedded store and a server alike. Each digest is read once however many versions
and keys share it; a problem names the first key that references it and the shard holding it.

Tensors stored encoded (``gc --compress``) are decoded, with the bases their deltas read, and the
result hashed the same way. The rest are read in shard-and-offset order in bounded reads
(:func:`client.loading.plan.plan_reads`) into two buffers that take turns: a background thread
reads the next unit while the calling thread hashes the current one, so memory stays near two
reads whatever the tensor sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptstore.client.loading.plan import ReadUnit, Stored, plan_reads
from ckptstore.client.loading.readahead import read_ahead
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import CheckpointError, IntegrityError, NotFoundError
from ckptstore.service.format.digest import TensorHasher, tensor_digest
from ckptstore.service.format.digest import shard_id as shard_id_of
from ckptstore.service.format.encoded_reads import read_tensor
from ckptstore.service.format.manifest import Manifest
from ckptstore.service.format.records import MetadataProblem, TensorLocation
from ckptstore.service.format.safetensors_header import MAX_HEADER_BYTES

#: Largest single read, and the size of each of the two buffers reads take turns in (the
#: same size as a load's reads: over HTTP every request costs a round trip).
UNIT_BYTES = 64 << 20


@dataclass
class Problem:
    """One thing wrong with the stored bytes of a tensor, or with a version's stored metadata
    (``key`` then names the piece: ``manifest``, ``part 12``, a listed column such as ``step``)."""

    run_id: str
    version: int | None
    key: str
    digest: str | None
    shard_id: str | None
    problem: str
    references: int = 1


@dataclass
class VerifyReport:
    """What :func:`verify` checked and found."""

    versions: int = 0
    tensors: int = 0
    digests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        return {"ok": self.ok, **asdict(self)}


@dataclass
class _Reference:
    run_id: str
    version: int
    key: str
    dtype: str
    shape: list[int]
    count: int = 1


def every_version(transport: Transport) -> Iterable[tuple[str, int]]:
    """``(run_id, version)`` of every committed version in the store."""
    for run in transport.runs():
        for info in transport.versions(run.run_id):
            yield run.run_id, info.version


def verify(
    transport: Transport,
    versions: Iterable[tuple[str, int | str]],
    *,
    on_bytes: Callable[[int], object] | None = None,
    on_total: Callable[[int], object] | None = None,
    strict_refs: bool = True,
) -> VerifyReport:
    """Check every stored piece the given versions reference.

    Args:
        transport: the store.
        versions: ``(run_id, ref)`` pairs.
        on_bytes: called with the size of each tensor once its bytes are checked.
        on_total: called once with the total bytes to read, before reading.
        strict_refs: raise if a version cannot be fetched; else skip versions deleted meanwhile
            and report unreadable manifests as problems.
    """
    started = time.perf_counter()
    report = VerifyReport()
    references: dict[str, _Reference] = {}
    for run_id, ref in versions:
        try:
            metadata = transport.check_metadata(run_id, ref)
            manifest = _manifest(transport, run_id, ref, metadata)
        except NotFoundError:
            if strict_refs:
                raise
            continue  # deleted since the versions were listed
        except CheckpointError as exc:
            if strict_refs:
                raise
            number = ref if isinstance(ref, int) else None
            report.problems.append(Problem(run_id, number, "", None, None, f"manifest unreadable: {exc}"))
            continue
        report.versions += 1
        report.problems.extend(_metadata_problem(problem) for problem in metadata)
        if isinstance(manifest, Problem):
            report.problems.append(manifest)
            continue
        if manifest is None:
            continue
        report.tensors += len(manifest.tensors)
        _collect(manifest, references, report)
    stored = sorted(d for d, ref in references.items() if 0 not in ref.shape)
    located = _locate(transport, stored, references, report)  # with the bases deltas decode from
    referenced = [located[d] for d in stored if d in located]
    if on_total is not None:
        on_total(sum(location.nbytes for location in referenced))
    order = sorted(referenced, key=lambda loc: (loc.shard_id, loc.offset))
    firsts: dict[str, TensorLocation] = {}
    for location in order:
        firsts.setdefault(location.shard_id, location)
    for shard_id, first in firsts.items():
        _check_header(transport, shard_id, references[first.digest], report)
    _check_tensors(transport, [loc for loc in order if not loc.encoded], references, report, on_bytes)
    _check_encoded(transport, [loc for loc in order if loc.encoded], located, references, report, on_bytes)
    report.seconds = time.perf_counter() - started
    return report


def _metadata_problem(problem: MetadataProblem) -> Problem:
    return Problem(problem.run_id, problem.version, problem.where, None, None, f"stored metadata: {problem.problem}")


def _manifest(
    transport: Transport, run_id: str, ref: int | str, metadata: list[MetadataProblem]
) -> Manifest | Problem | None:
    """The version's manifest; else the Problem its refusal is, or None when the metadata check named it already."""
    try:
        return transport.manifest(run_id, ref)
    except IntegrityError as exc:
        if any(problem.where in {"manifest", "parts"} or problem.where.startswith("part ") for problem in metadata):
            return None
        number = metadata[0].version if metadata else ref if isinstance(ref, int) else None
        return Problem(run_id, number, "manifest", None, None, f"stored metadata: {exc}")


def _collect(manifest: Manifest, references: dict[str, _Reference], report: VerifyReport) -> None:
    for entry in manifest.tensors:
        pieces = (
            [(entry.digest, list(entry.shape))]
            if entry.digest is not None
            else [(c.digest, list(c.shape)) for c in entry.chunks or ()]
        )
        for digest, shape in pieces:
            if digest in references:
                references[digest].count += 1
                continue
            reference = _Reference(manifest.run_id, manifest.version, entry.key, entry.dtype, shape)
            references[digest] = reference
            report.digests += 1
            # Empty tensors live only in the manifest: their digest must be that of no bytes.
            if 0 in shape and tensor_digest(entry.dtype, shape, b"") != digest:
                report.problems.append(_problem(reference, digest, None, "empty tensor with the digest of other bytes"))


def _problem(reference: _Reference, digest: str | None, shard_id: str | None, what: str) -> Problem:
    return Problem(reference.run_id, reference.version, reference.key, digest, shard_id, what, reference.count)


def _locate(
    transport: Transport, digests: list[str], references: dict[str, _Reference], report: VerifyReport
) -> dict[str, TensorLocation]:
    """Locate ``digests``; on a NotFoundError split the batch to name each absent digest."""
    if not digests:
        return {}
    try:
        return transport.locate(digests)
    except NotFoundError:
        if len(digests) == 1:
            reference = references[digests[0]]
            report.problems.append(_problem(reference, digests[0], None, "not in the store: no shard holds it"))
            return {}
    middle = len(digests) // 2
    found = _locate(transport, digests[:middle], references, report)
    found.update(_locate(transport, digests[middle:], references, report))
    return found


def _check_header(transport: Transport, shard_id: str, reference: _Reference, report: VerifyReport) -> None:
    """Re-hash the shard's length prefix and header, which its id is the digest of.

    Loads never read the header (the metadata database says where each tensor is), so a
    changed header would otherwise go unnoticed until the whole shard is copied somewhere.
    """
    prefix = bytearray(8)
    try:
        transport.read_into(shard_id, 0, memoryview(prefix))
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES:
            raise IntegrityError(f"its header length prefix reads {length} bytes, over the {MAX_HEADER_BYTES} limit")
        header = bytearray(8 + length)
        header[:8] = prefix
        transport.read_into(shard_id, 8, memoryview(header)[8:])
    except NotFoundError:
        return  # the shard is gone: its tensors' reads name each one
    except CheckpointError as exc:
        report.problems.append(_problem(reference, None, shard_id, f"shard header unreadable: {exc}"))
        return
    actual = shard_id_of(bytes(header))
    if actual != shard_id:
        report.problems.append(
            _problem(reference, None, shard_id, f"shard header hashes to {actual[:16]}…, not the shard's id")
        )


def _check_tensors(
    transport: Transport,
    order: list[TensorLocation],
    references: dict[str, _Reference],
    report: VerifyReport,
    on_bytes: Callable[[int], object] | None,
) -> None:
    """Hash each tensor (``order`` is sorted by shard and offset) as its pieces arrive, and check it.

    A tensor whose bytes cannot be read is reported once and not checked further.
    """
    units = plan_reads([Stored(loc.shard_id, loc.offset, loc.nbytes) for loc in order], UNIT_BYTES)
    hashers: dict[int, TensorHasher] = {}
    unreadable: set[int] = set()
    with closing(_fetched(transport, units)) as fetched:
        for unit, views, error in fetched:
            if error is not None:
                for index, exc in _unreadable(transport, unit, views, error, order, unreadable).items():
                    location = order[index]
                    unreadable.add(index)
                    hashers.pop(index, None)
                    report.problems.append(
                        _problem(references[location.digest], location.digest, location.shard_id, str(exc))
                    )
            for piece, view in zip(unit.pieces, views, strict=True):
                if piece.item in unreadable:
                    continue
                location = order[piece.item]
                reference = references[location.digest]
                if piece.start == 0:
                    hashers[piece.item] = TensorHasher(reference.dtype, reference.shape)
                hashers[piece.item].update(view)
                if piece.last:
                    _check(location, hashers.pop(piece.item).hexdigest(), reference, report)
                    if on_bytes is not None:
                        on_bytes(location.nbytes)


def _check_encoded(
    transport: Transport,
    order: list[TensorLocation],
    located: dict[str, TensorLocation],
    references: dict[str, _Reference],
    report: VerifyReport,
    on_bytes: Callable[[int], object] | None,
) -> None:
    """Decode each tensor stored encoded (``gc --compress``), with the bases its deltas read, and check it."""
    for location in order:
        reference = references[location.digest]
        try:
            read_tensor(transport.read_into, located, location.digest)
        except IntegrityError as exc:
            report.problems.append(_problem(reference, location.digest, location.shard_id, str(exc)))
        except CheckpointError as exc:
            report.problems.append(_problem(reference, location.digest, location.shard_id, f"unreadable: {exc}"))
        report.bytes += location.nbytes
        if on_bytes is not None:
            on_bytes(location.nbytes)


def _fetched(
    transport: Transport, units: list[ReadUnit]
) -> Generator[tuple[ReadUnit, list[memoryview], CheckpointError | None], None, None]:
    """Yield each unit with its pieces' bytes, or the error reading them, the next read running meanwhile.

    Two buffers take turns, so a unit's bytes stay valid only until the next unit is asked
    for. However the consumer stops, the queued read is cancelled and the running one waited
    for, so no thread outlives the generator.
    """
    size = max((unit.nbytes for unit in units), default=0)
    buffers = [memoryview(bytearray(size)) for _ in range(min(2, len(units)))]
    # The unit read into a buffer two turns ago has been handed out and dealt with.
    reads = read_ahead(
        transport.read_scatter,
        units,
        lambda number, unit: _views(unit, buffers[number % 2]),
        ahead=1,
        threads=1,
        name="ckptstore-verify",
    )
    with closing(reads):
        for unit, views, future in reads:
            yield _arrived(unit, views, future)


def _views(unit: ReadUnit, buffer: memoryview) -> list[memoryview]:
    """The stretch of ``buffer`` each of the unit's pieces is read into, in order."""
    views = []
    start = 0
    for piece in unit.pieces:
        views.append(buffer[start : start + piece.length])
        start += piece.length
    return views


def _arrived(
    unit: ReadUnit, views: list[memoryview], future: Future[None]
) -> tuple[ReadUnit, list[memoryview], CheckpointError | None]:
    try:
        future.result()
    except CheckpointError as exc:
        return unit, views, exc
    return unit, views, None


def _unreadable(
    transport: Transport,
    unit: ReadUnit,
    views: list[memoryview],
    error: CheckpointError,
    order: list[TensorLocation],
    skip: set[int],
) -> dict[int, CheckpointError]:
    """The tensors whose bytes in ``unit`` cannot be read, with why, after the unit's read failed with ``error``.

    Each tensor's piece is read again on its own, into its view, so the readable ones can still
    be hashed. Tensors in ``skip`` (already reported) are left out.
    """
    if len(unit.pieces) == 1:
        (piece,) = unit.pieces
        return {} if piece.item in skip else {piece.item: error}
    errors: dict[int, CheckpointError] = {}
    for piece, view in zip(unit.pieces, views, strict=True):
        if piece.item in skip:
            continue
        location = order[piece.item]
        try:
            transport.read_into(location.shard_id, location.offset + piece.start, view)
        except CheckpointError as exc:
            errors[piece.item] = exc
    return errors


def _check(location: TensorLocation, actual: str, reference: _Reference, report: VerifyReport) -> None:
    report.bytes += location.nbytes
    if actual != location.digest:
        report.problems.append(
            _problem(
                reference,
                location.digest,
                location.shard_id,
                f"bytes at offset {location.offset} hash to {actual[:16]}…, not {location.digest[:16]}…",
            )
        )
