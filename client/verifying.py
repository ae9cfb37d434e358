"""Re-reading and re-hashing every stored byte a set of versions references.

Every tensor's bytes are hashed against its digest, and every shard's header against the
shard's id. Works through the transport only (``locate`` + ``read_into`` + a digest check), so
it checks an embedded store and a server alike. Each digest is read once however many versions
and keys share it; a problem names the first key that references it and the shard holding it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from client.transport import Transport
from service.errors import CheckpointError, IntegrityError, NotFoundError
from service.format.digest import shard_id as shard_id_of
from service.format.digest import tensor_digest
from service.format.manifest import Manifest
from service.format.safetensors_header import MAX_HEADER_BYTES
from service.records import TensorLocation

#: Largest single read when checking back-to-back tensors together.
SPAN_BYTES = 64 << 20


@dataclass
class Problem:
    """One thing wrong with the stored bytes of a tensor (or with a whole version)."""

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
        on_bytes: called with the size of each piece once it is read.
        on_total: called once with the total bytes to read, before reading.
        strict_refs: raise if a version cannot be fetched; else skip versions deleted meanwhile
            and report unreadable manifests as problems.
    """
    started = time.perf_counter()
    report = VerifyReport()
    references: dict[str, _Reference] = {}
    for run_id, ref in versions:
        try:
            manifest = transport.manifest(run_id, ref)
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
        report.tensors += len(manifest.tensors)
        _collect(manifest, references, report)
    stored = sorted(d for d, ref in references.items() if 0 not in ref.shape)
    located = _locate(transport, stored, references, report)
    if on_total is not None:
        on_total(sum(location.nbytes for location in located.values()))
    order = sorted(located.values(), key=lambda loc: (loc.shard_id, loc.offset))
    firsts: dict[str, TensorLocation] = {}
    for location in order:
        firsts.setdefault(location.shard_id, location)
    for shard_id, first in firsts.items():
        _check_header(transport, shard_id, references[first.digest], report)
    for span in _spans(order):
        pieces = _read_span(transport, span, references, report)
        for location, data in pieces:
            _check(location, data, references[location.digest], report)
            if on_bytes is not None:
                on_bytes(location.nbytes)
    report.seconds = time.perf_counter() - started
    return report


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


def _read_span(
    transport: Transport, span: list[TensorLocation], references: dict[str, _Reference], report: VerifyReport
) -> list[tuple[TensorLocation, memoryview]]:
    """Read back-to-back pieces with one read; if that fails, piece by piece to say which."""
    start = span[0].offset
    buffer = bytearray(span[-1].offset + span[-1].nbytes - start)
    try:
        transport.read_into(span[0].shard_id, start, memoryview(buffer))
    except CheckpointError as exc:
        if len(span) > 1:
            return [piece for location in span for piece in _read_span(transport, [location], references, report)]
        location = span[0]
        report.problems.append(_problem(references[location.digest], location.digest, location.shard_id, str(exc)))
        return []
    view = memoryview(buffer)
    return [(loc, view[loc.offset - start : loc.offset - start + loc.nbytes]) for loc in span]


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


def _check(location: TensorLocation, data: memoryview, reference: _Reference, report: VerifyReport) -> None:
    actual = tensor_digest(reference.dtype, reference.shape, data)
    report.bytes += len(data)
    if actual != location.digest:
        report.problems.append(
            _problem(
                reference,
                location.digest,
                location.shard_id,
                f"bytes at offset {location.offset} hash to {actual[:16]}…, not {location.digest[:16]}…",
            )
        )
