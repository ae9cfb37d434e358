"""Every byte read back is verified: a flipped byte in a stored shard never becomes a tensor."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import client
from ckptstore.service.blobs import BlobStore
from tests.client.conftest import Backend
from tests.client.models import TinyNet


def trainable_shard(blobs: BlobStore) -> str:
    """The shard of a small model's trainable tensors: the largest, where its buffers (saved with
    trainable False, packed apart) make a second one."""
    shards = sorted(blobs.list_ids(), key=lambda shard_id: -(blobs.size(shard_id) or 0))
    assert 1 <= len(shards) <= 2, shards
    return shards[0]


def rewrite(blobs: BlobStore, shard_id: str, scratch: Path, change: Callable[[bytearray], bytes]) -> None:
    """Replace a stored shard's bytes behind the store's back."""
    size = blobs.size(shard_id)
    assert size is not None
    data = bytearray(size)
    blobs.read_into(shard_id, 0, memoryview(data))
    blobs.delete(shard_id)
    scratch.write_bytes(change(data))
    blobs.put_file(shard_id, scratch)


@pytest.mark.parametrize("seed", range(3))
def test_flipped_byte_raises_integrity_error_naming_tensor_and_shard(
    backend: Backend, tmp_path: Path, seed: int
) -> None:
    backend.client.save("run", TinyNet())
    shard_id = trainable_shard(backend.blobs)
    rng = random.Random(seed)

    def flip(data: bytearray) -> bytes:
        header_end = 8 + int.from_bytes(data[:8], "little")
        data[rng.randrange(header_end, len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)

    rewrite(backend.blobs, shard_id, tmp_path / "corrupt", flip)
    with pytest.raises(client.IntegrityError) as caught:
        backend.client.load("run", model=TinyNet(seed=1))
    message = str(caught.value)
    assert shard_id in message and "model/" in message


def test_truncated_shard_is_an_integrity_error(backend: Backend, tmp_path: Path) -> None:
    backend.client.save("run", TinyNet())
    rewrite(backend.blobs, trainable_shard(backend.blobs), tmp_path / "short", lambda data: bytes(data[:-3]))
    with pytest.raises(client.IntegrityError):
        backend.client.load("run")


def test_missing_shard_is_not_found(backend: Backend) -> None:
    backend.client.save("run", TinyNet())
    backend.blobs.delete(trainable_shard(backend.blobs))
    with pytest.raises(client.NotFoundError):
        backend.client.load("run")
