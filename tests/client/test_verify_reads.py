"""``verify`` reads stored tensors in bounded units, hashes them piece by piece, and names unreadable ones."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore.client.loading.verify as verifying
from ckptstore import client
from ckptstore.client.loading.plan import Stored, plan_reads
from ckptstore.client.loading.verify import Problem, VerifyReport, verify
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StorageError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.records import TensorLocation
from tests.client.conftest import Backend
from tests.client.test_integrity import rewrite, trainable_shard

UNIT = 1000


class Reads:
    """A transport that records every read (shard offset, length) and refuses bytes in chosen ranges."""

    def __init__(self, transport: Transport, *, fail: Callable[[int, int], Exception | None] | None = None) -> None:
        self._transport = transport
        self._fail = fail
        self.scatters: list[tuple[int, int]] = []
        self.intos: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def read_scatter(self, shard_id: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.scatters.append((offset, sum(buffer.nbytes for buffer in buffers)))
        self._refuse(offset, sum(buffer.nbytes for buffer in buffers))
        self._transport.read_scatter(shard_id, offset, buffers)

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        self.intos.append((offset, buffer.nbytes))
        self._refuse(offset, buffer.nbytes)
        self._transport.read_into(shard_id, offset, buffer)

    def _refuse(self, offset: int, length: int) -> None:
        error = self._fail(offset, length) if self._fail is not None else None
        if error is not None:
            raise error


def refusal(offset: int, length: int) -> str:
    return f"cannot read bytes {offset}-{offset + length} of the shard: input/output error"


def unreadable(start: int, end: int) -> Callable[[int, int], Exception | None]:
    """Reads touching bytes ``start`` to ``end`` fail, as over a bad disk sector."""

    def fail(offset: int, length: int) -> Exception | None:
        return StorageError(refusal(offset, length)) if offset < end and start < offset + length else None

    return fail


@pytest.fixture
def small_units(monkeypatch: pytest.MonkeyPatch) -> int:
    """Reads of 1000 bytes: a 4099-float tensor spans 17 of them, and a read covers several small tensors."""
    monkeypatch.setattr(verifying, "UNIT_BYTES", UNIT)
    return UNIT


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors on both sides of one far bigger than a read unit, with odd sizes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, generator=generator),
        "big": torch.randn(4099, generator=generator),
        "c": torch.arange(7, dtype=torch.int64) + seed,
        "d": torch.randn(33, generator=generator).to(torch.float16),
        "e": torch.randn(300, generator=generator),
    }


def locations(transport: Transport, run_id: str = "run") -> dict[str, TensorLocation]:
    """Where each key's bytes are stored."""
    manifest = transport.manifest(run_id)
    digests = {entry.key: entry.digest for entry in manifest.tensors if entry.digest is not None}
    found = transport.locate(digests.values())
    return {key: found[digest] for key, digest in digests.items()}


def data_reads(reads: list[tuple[int, int]], where: dict[str, TensorLocation]) -> list[tuple[int, int]]:
    """The reads of tensor bytes (header checks read before the first tensor)."""
    first = min(location.offset for location in where.values())
    return [read for read in reads if read[0] >= first]


def verify_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("ckptstore-verify")]


def run(transport: Transport) -> tuple[VerifyReport, list[int]]:
    """Verify the latest version of ``run``; also return the sizes ``on_bytes`` was given."""
    sizes: list[int] = []
    report = verify(transport, [("run", "latest")], on_bytes=sizes.append)
    assert verify_threads() == []
    return report, sizes


def test_a_tensor_longer_than_a_read_unit_is_read_in_bounded_pieces(tmp_path: Path, small_units: int) -> None:
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save_state_dict("run", tensors())
        where = locations(ckpt.transport)
        reads = Reads(ckpt.transport)
        report, sizes = run(reads)
    assert report.ok and report.digests == len(where)
    assert where["model/big"].nbytes > 16 * small_units
    assert all(length <= small_units for _, length in data_reads(reads.scatters, where))
    assert data_reads(reads.intos, where) == []  # nothing is read a second time
    total = sum(location.nbytes for location in where.values())
    assert sum(length for _, length in reads.scatters) == report.bytes == total
    assert sorted(sizes) == sorted(location.nbytes for location in where.values())


def test_back_to_back_small_tensors_are_read_together(tmp_path: Path) -> None:
    many = {f"t{i:03}": torch.full((i % 5 + 1,), float(i)) for i in range(200)}
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save_state_dict("run", many)
        where = locations(ckpt.transport)
        reads = Reads(ckpt.transport)
        report, sizes = run(reads)
    assert report.ok and report.digests == len(where) == 200 and len(sizes) == 200
    shards = len({location.shard_id for location in where.values()})
    assert len(reads.scatters) <= shards
    assert len(reads.intos) == 2 * shards  # each shard header's length prefix, then the header


def test_a_corrupt_byte_in_the_second_unit_of_a_big_tensor_is_reported_once(
    backend: Backend, tmp_path: Path, small_units: int
) -> None:
    backend.client.save_state_dict("run", tensors())
    where = locations(backend.client.transport)
    big = where["model/big"]
    order = sorted(where.values(), key=lambda location: location.offset)
    units = plan_reads([Stored(loc.shard_id, loc.offset, loc.nbytes) for loc in order], small_units)
    index = order.index(big)
    first, second = [unit for unit in units if any(piece.item == index for piece in unit.pieces)][:2]
    assert first.offset <= big.offset < second.offset < big.offset + big.nbytes
    position = second.offset + 5
    corrupt = bytearray()

    def flip(data: bytearray) -> bytes:
        data[position] ^= 0x10
        corrupt.extend(data[big.offset : big.offset + big.nbytes])
        return bytes(data)

    rewrite(backend.blobs, trainable_shard(backend.blobs), tmp_path / "corrupt", flip)
    report, sizes = run(Reads(backend.client.transport))
    actual = tensor_digest("F32", [4099], corrupt)
    assert report.problems == [
        Problem(
            "run",
            1,
            "model/big",
            big.digest,
            big.shard_id,
            f"bytes at offset {big.offset} hash to {actual[:16]}…, not {big.digest[:16]}…",
        )
    ]
    assert report.bytes == sum(location.nbytes for location in where.values()) and len(sizes) == len(where)


def test_an_unreadable_small_tensor_is_named_and_its_neighbours_checked(tmp_path: Path, small_units: int) -> None:
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save_state_dict("run", tensors())
        where = locations(ckpt.transport)
        bad = where["model/d"]
        reads = Reads(ckpt.transport, fail=unreadable(bad.offset + 3, bad.offset + 4))
        report, sizes = run(reads)
    (problem,) = report.problems
    assert (problem.key, problem.digest, problem.shard_id) == ("model/d", bad.digest, bad.shard_id)
    # The piece re-read on its own is the whole of the tensor: the error names exactly its bytes.
    assert problem.problem == refusal(bad.offset, bad.nbytes)
    assert report.bytes == sum(location.nbytes for location in where.values()) - bad.nbytes
    assert sorted(sizes) == sorted(location.nbytes for key, location in where.items() if key != "model/d")


def test_an_unreadable_unit_inside_a_big_tensor_reports_it_once(tmp_path: Path, small_units: int) -> None:
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save_state_dict("run", tensors())
        where = locations(ckpt.transport)
        big = where["model/big"]
        middle = big.offset + big.nbytes // 2
        reads = Reads(ckpt.transport, fail=unreadable(middle, middle + 1))
        report, sizes = run(reads)
        # The last unit of a big tensor also holds the start of the next tensor: both are unreadable.
        end = big.offset + big.nbytes
        both = run(Reads(ckpt.transport, fail=unreadable(end - 1, end + 1)))[0]
    (problem,) = report.problems
    assert (problem.key, problem.digest, problem.shard_id) == ("model/big", big.digest, big.shard_id)
    assert problem.problem.startswith("cannot read bytes") and problem.references == 1
    assert report.bytes == sum(location.nbytes for location in where.values()) - big.nbytes
    assert big.nbytes not in sizes and len(sizes) == len(where) - 1
    after = next(key for key, location in where.items() if location.offset == end)
    assert sorted(p.key for p in both.problems) == sorted(["model/big", after])


def test_an_unexpected_error_stops_the_reading_thread(tmp_path: Path, small_units: int) -> None:
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save_state_dict("run", tensors())
        where = locations(ckpt.transport)
        middle = where["model/big"].offset + where["model/big"].nbytes // 2
        broken = Reads(ckpt.transport, fail=lambda offset, length: RuntimeError("boom") if offset > middle else None)
        with pytest.raises(RuntimeError, match="boom"):
            verify(broken, [("run", "latest")])
        assert verify_threads() == []

        def stop(nbytes: int) -> None:
            raise RuntimeError("stopped")

        with pytest.raises(RuntimeError, match="stopped"):
            verify(ckpt.transport, [("run", "latest")], on_bytes=stop)
        assert verify_threads() == []
