"""Storing tensors whose digests the caller does not know: one pass over their bytes, the header
written last, a plain safetensors file that the store and the reference library read back."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit import RawTensor

from ckptstore.service.errors import InvalidInputError, StorageError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.safetensors_header import read_header
from ckptstore.service.format.sharding import SHARD_METADATA, UnhashedTensor
from ckptstore.service.intake.direct_file import ALIGNMENT
from ckptstore.service.intake.shard_writer import write_shard
from ckptstore.service.store import Store
from tests.faults.faulty import fail_staging_writes


def unhashed(tensor: RawTensor) -> UnhashedTensor:
    return UnhashedTensor(tensor.dtype, tensor.shape, memoryview(tensor.data))


def raw(dtype: str, shape: tuple[int, ...], seed: int) -> RawTensor:
    width = {"F64": 8, "F32": 4, "BF16": 2, "I64": 8, "U8": 1}[dtype]
    count = int(np.prod(shape))
    return RawTensor(dtype, shape, np.random.default_rng(seed).bytes(count * width))


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


@pytest.mark.parametrize("direct", [True, False])
def test_a_written_shard_is_a_safetensors_file_with_its_data_on_a_block_edge(tmp_path: Path, direct: bool) -> None:
    tensors = [raw("F32", (300, 7), 1), raw("F32", (5,), 2), raw("U8", (4097,), 3)]
    path = tmp_path / "shard"

    written = write_shard(path, [unhashed(t) for t in tensors], SHARD_METADATA, direct_writes=direct)

    assert written.digests == [t.digest for t in tensors]
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + length) % ALIGNMENT == 0  # the data was written before the header, around the page cache
    with open(path, "rb") as handle:
        header = read_header(handle, path.stat().st_size)
    assert header == written.header and header.metadata == SHARD_METADATA
    loaded = safetensors.numpy.load_file(path)
    assert set(loaded) == {t.digest for t in tensors}
    for tensor in tensors:
        assert loaded[tensor.digest].tobytes() == tensor.data


def test_equal_tensors_are_written_once_and_each_gets_its_digest(tmp_path: Path) -> None:
    same = raw("F32", (64, 64), 7)
    other = raw("F32", (64, 64), 8)
    path = tmp_path / "shard"

    written = write_shard(path, [unhashed(same), unhashed(other), unhashed(same)], SHARD_METADATA)

    assert written.digests == [same.digest, other.digest, same.digest]
    assert [e.digest for e in written.header.entries] == [same.digest, other.digest]
    assert path.stat().st_size == written.header.file_size == written.header.data_start + 2 * len(same.data)


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_staging_writes(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    path = tmp_path / "shard"
    with pytest.raises(StorageError, match="No space left on device"):
        write_shard(path, [unhashed(raw("F32", (1 << 21,), 1))], SHARD_METADATA)
    assert not path.exists()


def test_put_tensors_stores_them_and_returns_digests_in_the_order_given(store: Store) -> None:
    # Narrow dtypes first: the store lays the shard out widest first, the digests keep the caller's order.
    tensors = [raw("U8", (10,), 1), raw("BF16", (3, 3), 2), raw("F64", (2, 5), 3), raw("I64", (4,), 4)]
    assert store.missing([t.digest for t in tensors]) == [t.digest for t in tensors]
    seen: list[int] = []

    receipt, digests = store.put_tensors([unhashed(t) for t in tensors], seen.append)

    assert digests == [t.digest for t in tensors]
    assert sorted(seen) == sorted(len(t.data) for t in tensors)
    assert receipt.created and receipt.tensors == 4
    assert store.missing(digests) == []
    locations = store.locate(digests)
    for tensor in tensors:
        where = locations[tensor.digest]
        assert where.shard_id == receipt.shard_id and (where.dtype, tuple(where.shape)) == (tensor.dtype, tensor.shape)
        back = bytearray(where.nbytes)
        store.read_into(where.shard_id, where.offset, memoryview(back))
        assert bytes(back) == tensor.data
    assert [o.offset for o in sorted(locations.values(), key=lambda o: o.offset)] == [
        locations[t.digest].offset for t in (tensors[2], tensors[3], tensors[1], tensors[0])
    ]
    assert files_under(store.staging_dir) == []


def test_a_tensor_already_stored_keeps_its_first_location(store: Store) -> None:
    first = raw("F32", (16, 16), 1)
    (receipt, _) = store.put_tensors([unhashed(first)])
    again, digests = store.put_tensors([unhashed(first), unhashed(raw("F32", (16, 16), 2))])
    assert digests[0] == first.digest and again.shard_id != receipt.shard_id
    assert store.locate([first.digest])[first.digest].shard_id == receipt.shard_id


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], "no tensors"),
        ([UnhashedTensor("F32", (3,), memoryview(bytes(8)))], "8 bytes are not a tensor of F32\\[3\\]"),
        ([UnhashedTensor("Q7", (3,), memoryview(bytes(3)))], "not a tensor of Q7"),
        ([UnhashedTensor("F32", (0, 3), memoryview(b""))], "empty tensor"),
    ],
)
def test_put_tensors_refuses_what_is_not_a_tensor(store: Store, tensors: list[UnhashedTensor], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        store.put_tensors(tensors)
    assert list(store.blobs.list_ids()) == [] and files_under(store.staging_dir) == []


def test_the_digest_is_of_the_bytes_as_written(store: Store) -> None:
    # The digest comes from the memory the bytes are copied from, so the stored tensor and its
    # name always agree, whatever the caller believed about them.
    data = bytearray(np.arange(1000, dtype=np.float32).tobytes())
    _, (digest,) = store.put_tensors([UnhashedTensor("F32", (1000,), memoryview(data))])
    assert digest == tensor_digest("F32", (1000,), bytes(data))


def _near_copy(tensor: RawTensor, at: int) -> RawTensor:
    """``tensor`` with one byte changed at ``at``: a fingerprint that samples elsewhere matches."""
    data = bytearray(tensor.data)
    data[at] ^= 0xFF
    return RawTensor(tensor.dtype, tensor.shape, bytes(data))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["same", "near", "new"])), min_size=1, max_size=8),
    direct=st.booleans(),
)
def test_equal_tensors_are_written_once_and_near_copies_are_kept_whatever_the_order(
    tmp_path: Path, picks: list[tuple[int, str]], direct: bool
) -> None:
    # Sizes around the writer's buffer and the sampled spots: a near copy differs from its
    # original in one byte its fingerprint does not sample, so only its digest tells them apart.
    shapes = [(3,), (100, 3), (1 << 19,), (1 << 20, 2)]
    originals = [raw("F32", shape, seed) for seed, shape in enumerate(shapes)]
    tensors = []
    for index, kind in picks:
        base = originals[index]
        if kind == "near":
            tensors.append(_near_copy(base, len(base.data) // 4) if len(base.data) > 192 else base)
        elif kind == "new":
            tensors.append(raw("F32", base.shape, 100 + len(tensors)))
        else:
            tensors.append(base)
    path = tmp_path / f"shard-{os.urandom(4).hex()}"

    written = write_shard(path, [unhashed(t) for t in tensors], SHARD_METADATA, direct_writes=direct)

    assert written.digests == [tensor_digest(t.dtype, t.shape, t.data) for t in tensors]
    distinct = list(dict.fromkeys(written.digests))
    assert [e.digest for e in written.header.entries] == distinct
    with open(path, "rb") as handle:  # the header the writer made for itself is the file's, as parsed
        assert read_header(handle, path.stat().st_size) == written.header
    loaded = safetensors.numpy.load_file(path)
    by_digest = {digest: t for digest, t in zip(written.digests, tensors, strict=True)}
    assert {d: loaded[d].tobytes() for d in distinct} == {d: by_digest[d].data for d in distinct}
    path.unlink()


def test_a_tensor_changed_while_it_is_written_gets_the_digest_of_the_bytes_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A caller's memory that changes mid-write (a tensor updated in place) cannot leave a shard
    # whose bytes disagree with the digest naming them: the digest is taken from the writer's copy.
    from ckptstore.service.format import digest as digest_module

    source = bytearray(raw("F32", (1 << 21,), 5).data)  # 8 MiB: several of the writer's buffers
    updates: list[int] = []
    real_update = digest_module.TensorHasher.update

    def update_then_change(self: digest_module.TensorHasher, data: memoryview) -> None:
        real_update(self, data)
        updates.append(len(data))
        source[:16] = bytes(16)  # changed after its first piece was copied
        source[-16:] = bytes(16)

    monkeypatch.setattr(digest_module.TensorHasher, "update", update_then_change)
    path = tmp_path / "shard"
    written = write_shard(path, [UnhashedTensor("F32", (1 << 21,), memoryview(source))], SHARD_METADATA)
    assert len(updates) > 1
    stored = safetensors.numpy.load_file(path)[written.digests[0]].tobytes()
    assert written.digests[0] == tensor_digest("F32", (1 << 21,), stored)
    assert stored != bytes(source)  # its first bytes were written before the change
