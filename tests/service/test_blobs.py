"""The BlobStore contract, run against every backend (one base class, one subclass per backend)."""

from __future__ import annotations

import array
import errno
import os
import random
import sys
from pathlib import Path

import pytest

from ckptstore.service.blobs import BlobStore, LocalBlobStore, MemoryBlobStore
from ckptstore.service.blobs import local as local_module
from ckptstore.service.errors import IntegrityError, NotFoundError
from ckptstore.service.format.digest import shard_id

BAD_IDS = ["../etc", "../" + "a" * 61, "A" * 64, "a" * 63, "a" * 65, "", "g" * 64, "ab/" + "c" * 61]


def blob_id(seed: int) -> str:
    """A well-formed id (the content does not have to hash to it: ids are the store's business)."""
    return shard_id(seed.to_bytes(8, "little"))


def payload(seed: int, size: int = 1000) -> bytes:
    return random.Random(seed).randbytes(size)


class BlobStoreContract:
    """Tests every backend must pass; subclasses provide the ``blobs`` fixture."""

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> BlobStore:
        raise NotImplementedError

    @pytest.fixture
    def source(self, tmp_path: Path) -> Path:
        """A file to put, outside any store folder."""
        path = tmp_path / "outside" / "shard.incomplete"
        path.parent.mkdir()
        path.write_bytes(payload(1))
        return path

    def test_put_then_size_and_read_exact_bytes(self, blobs: BlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        assert blobs.size(blob_id(1)) == len(data)
        for offset, length in [(0, len(data)), (0, 1), (17, 100), (len(data) - 3, 3), (len(data), 0)]:
            buffer = bytearray(length)
            blobs.read_into(blob_id(1), offset, memoryview(buffer))
            assert bytes(buffer) == data[offset : offset + length]

    def test_read_past_end_raises_integrity_error(self, blobs: BlobStore, source: Path) -> None:
        size = len(source.read_bytes())
        blobs.put_file(blob_id(1), source)
        with pytest.raises(IntegrityError, match=blob_id(1)):
            blobs.read_into(blob_id(1), size - 4, memoryview(bytearray(5)))
        with pytest.raises(IntegrityError):
            blobs.read_into(blob_id(1), size + 10, memoryview(bytearray(1)))

    @pytest.mark.parametrize("offset", [-1, -8])
    def test_negative_offset_is_refused(self, blobs: BlobStore, source: Path, offset: int) -> None:
        blobs.put_file(blob_id(1), source)
        buffer = bytearray(b"untouched")
        with pytest.raises(ValueError):
            blobs.read_into(blob_id(1), offset, memoryview(buffer)[:4])
        assert buffer == b"untouched"

    def test_absent_blob(self, blobs: BlobStore) -> None:
        assert blobs.size(blob_id(2)) is None
        with pytest.raises(NotFoundError, match=blob_id(2)):
            blobs.read_into(blob_id(2), 0, memoryview(bytearray(1)))
        with pytest.raises(NotFoundError):
            list(blobs.iter_range(blob_id(2), 0, 1))

    def test_put_is_idempotent_and_keeps_the_first(self, blobs: BlobStore, source: Path, tmp_path: Path) -> None:
        first = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        second = tmp_path / "outside" / "again.incomplete"
        second.write_bytes(payload(99, 500))
        blobs.put_file(blob_id(1), second)
        assert blobs.size(blob_id(1)) == len(first)
        buffer = bytearray(len(first))
        blobs.read_into(blob_id(1), 0, memoryview(buffer))
        assert bytes(buffer) == first
        assert list(blobs.list_ids()) == [blob_id(1)]

    def test_delete(self, blobs: BlobStore, source: Path, tmp_path: Path) -> None:
        other = tmp_path / "outside" / "other.incomplete"
        other.write_bytes(payload(2))
        blobs.put_file(blob_id(1), source)
        blobs.put_file(blob_id(2), other)
        blobs.delete(blob_id(1))
        assert blobs.size(blob_id(1)) is None
        with pytest.raises(NotFoundError):
            blobs.read_into(blob_id(1), 0, memoryview(bytearray(1)))
        assert blobs.size(blob_id(2)) == len(payload(2))
        blobs.delete(blob_id(1))  # deleting an absent blob is not an error
        assert list(blobs.list_ids()) == [blob_id(2)]

    def test_list_ids(self, blobs: BlobStore, tmp_path: Path) -> None:
        assert list(blobs.list_ids()) == []
        ids = [blob_id(seed) for seed in range(6)]
        for seed, name in enumerate(ids):
            path = tmp_path / f"source-{seed}"
            path.write_bytes(payload(seed, 10 + seed))
            blobs.put_file(name, path)
        assert sorted(blobs.list_ids()) == sorted(ids)

    @pytest.mark.parametrize("bad", BAD_IDS)
    def test_invalid_id_is_rejected(self, blobs: BlobStore, source: Path, tmp_path: Path, bad: str) -> None:
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(ValueError):
            blobs.put_file(bad, source)
        with pytest.raises(ValueError):
            blobs.size(bad)
        with pytest.raises(ValueError):
            blobs.read_into(bad, 0, memoryview(bytearray(1)))
        with pytest.raises(ValueError):
            blobs.delete(bad)
        assert source.read_bytes() == payload(1)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
        assert list(blobs.list_ids()) == []

    def test_read_scatter_fills_the_buffers_in_turn(self, blobs: BlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        sizes = [0, 1, 300, 0, 7, 250]
        buffers = [bytearray(size) for size in sizes]
        blobs.read_scatter(blob_id(1), 11, [memoryview(buffer) for buffer in buffers])
        assert b"".join(buffers) == data[11 : 11 + sum(sizes)]
        blobs.read_scatter(blob_id(1), 0, [])
        whole = bytearray(len(data))
        blobs.read_scatter(blob_id(1), 0, [memoryview(whole)])
        assert whole == data

    def test_read_scatter_takes_typed_views(self, blobs: BlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        words = array.array("i", bytes(40))
        matrix = memoryview(bytearray(24)).cast("B", (4, 6))
        blobs.read_scatter(blob_id(1), 3, [memoryview(words), matrix])
        assert words.tobytes() + matrix.tobytes() == data[3:67]

    def test_read_scatter_past_end_raises_integrity_error(self, blobs: BlobStore, source: Path) -> None:
        size = len(source.read_bytes())
        blobs.put_file(blob_id(1), source)
        with pytest.raises(IntegrityError, match=blob_id(1)):
            blobs.read_scatter(blob_id(1), size - 10, [memoryview(bytearray(6)), memoryview(bytearray(5))])

    def test_read_scatter_refuses_what_read_into_refuses(self, blobs: BlobStore, source: Path) -> None:
        blobs.put_file(blob_id(1), source)
        buffer = bytearray(b"untouched")
        with pytest.raises(ValueError):
            blobs.read_scatter(blob_id(1), -1, [memoryview(buffer)[:4]])
        assert buffer == b"untouched"
        with pytest.raises(NotFoundError, match=blob_id(2)):
            blobs.read_scatter(blob_id(2), 0, [memoryview(bytearray(1))])
        with pytest.raises(ValueError):
            blobs.read_scatter("../" + "a" * 61, 0, [memoryview(bytearray(1))])

    @pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096])
    def test_iter_range(self, blobs: BlobStore, source: Path, chunk_bytes: int) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        pieces = list(blobs.iter_range(blob_id(1), 13, 300, chunk_bytes=chunk_bytes))
        assert b"".join(pieces) == data[13:313]
        assert all(len(piece) <= chunk_bytes for piece in pieces)
        assert len(pieces) == -(-300 // chunk_bytes)
        assert list(blobs.iter_range(blob_id(1), 0, 0)) == []

    def test_iter_range_keeps_no_piece_it_has_yielded(self, blobs: BlobStore, source: Path) -> None:
        # A server counts the pieces of a download it holds: once it lets one go, nothing may keep it.
        blobs.put_file(blob_id(1), source)
        pieces = blobs.iter_range(blob_id(1), 0, 300, chunk_bytes=64)
        for piece in pieces:
            assert sys.getrefcount(piece) == 2  # ``piece`` and getrefcount's argument

    def test_iter_range_past_end_raises(self, blobs: BlobStore, source: Path) -> None:
        size = len(source.read_bytes())
        blobs.put_file(blob_id(1), source)
        with pytest.raises(IntegrityError):
            list(blobs.iter_range(blob_id(1), size - 10, 11, chunk_bytes=4))


class TestMemoryBlobStore(BlobStoreContract):
    @pytest.fixture
    def blobs(self, tmp_path: Path) -> BlobStore:
        return MemoryBlobStore()

    def test_corrupt_changes_one_byte(self, blobs: MemoryBlobStore, source: Path) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        blobs.corrupt(blob_id(1), 5)
        buffer = bytearray(len(data))
        blobs.read_into(blob_id(1), 0, memoryview(buffer))
        assert buffer[5] == data[5] ^ 0xFF
        assert buffer[:5] + buffer[6:] == data[:5] + data[6:]


class TestLocalBlobStore(BlobStoreContract):
    @pytest.fixture
    def blobs(self, tmp_path: Path) -> BlobStore:
        return LocalBlobStore(tmp_path / "blobs")

    def test_fan_out_path(self, blobs: LocalBlobStore, source: Path) -> None:
        data = source.read_bytes()
        name = blob_id(1)
        blobs.put_file(name, source)
        path = blobs.root / name[:2] / name
        assert path.read_bytes() == data
        files = [p for p in blobs.root.rglob("*") if p.is_file()]
        assert files == [path]

    def test_no_temporary_files_remain(self, blobs: LocalBlobStore, tmp_path: Path) -> None:
        ids = [blob_id(seed) for seed in range(5)]
        for round_ in range(2):  # the second round takes the "already stored" path
            for seed, name in enumerate(ids):
                path = tmp_path / f"source-{round_}-{seed}"
                path.write_bytes(payload(seed))
                blobs.put_file(name, path)
        files = sorted(p.relative_to(blobs.root).as_posix() for p in blobs.root.rglob("*") if p.is_file())
        assert files == sorted(f"{name[:2]}/{name}" for name in ids)

    def test_put_from_another_directory_moves_the_file(self, blobs: LocalBlobStore, source: Path) -> None:
        assert blobs.root not in source.parents
        blobs.put_file(blob_id(1), source)
        assert (blobs.root / blob_id(1)[:2] / blob_id(1)).read_bytes() == payload(1)

    def test_put_across_file_systems_copies(
        self, blobs: LocalBlobStore, source: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real_replace = os.replace

        def replace(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
            # Only the move from the caller's folder crosses a "device"; the store's own rename does not.
            if Path(src) == source:
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            real_replace(src, dst)

        monkeypatch.setattr(local_module.os, "replace", replace)
        blobs.put_file(blob_id(1), source)
        assert (blobs.root / blob_id(1)[:2] / blob_id(1)).read_bytes() == payload(1)
        assert [p for p in blobs.root.rglob("*") if p.is_file()] == [blobs.root / blob_id(1)[:2] / blob_id(1)]

    def test_read_scatter_resumes_short_reads_inside_and_across_buffers(
        self, blobs: LocalBlobStore, source: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        data = source.read_bytes()
        blobs.put_file(blob_id(1), source)
        real_preadv = os.preadv
        calls: list[int] = []

        def short_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls.append(len(buffers))
            limit = 5  # a network file system may return any prefix of the request
            taken: list[memoryview] = []
            for buffer in buffers:
                taken.append(buffer[:limit])
                limit -= len(taken[-1])
                if not limit:
                    break
            return real_preadv(fd, taken, offset)

        monkeypatch.setattr(local_module.os, "preadv", short_preadv)
        buffers = [bytearray(size) for size in (3, 4, 1, 9, 0, 2)]
        blobs.read_scatter(blob_id(1), 100, [memoryview(buffer) for buffer in buffers])
        assert b"".join(buffers) == data[100:119]
        assert len(calls) == 4 and calls[0] == 5  # the empty buffer is never passed

    def test_blobs_survive_reopening(self, blobs: LocalBlobStore, source: Path) -> None:
        blobs.put_file(blob_id(1), source)
        reopened = LocalBlobStore(blobs.root)
        assert list(reopened.list_ids()) == [blob_id(1)]
        assert reopened.size(blob_id(1)) == len(payload(1))

    def test_list_ids_ignores_stray_files(self, blobs: LocalBlobStore, source: Path) -> None:
        blobs.put_file(blob_id(1), source)
        name = blob_id(2)
        (blobs.root / "zz").mkdir()
        (blobs.root / "zz" / name).write_bytes(b"misplaced")
        (blobs.root / blob_id(1)[:2] / "notes.txt").write_bytes(b"stray")
        assert list(blobs.list_ids()) == [blob_id(1)]
