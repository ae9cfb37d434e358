"""Every byte read back is verified: a flipped byte in a stored shard never becomes a tensor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import client
from tests.client.models import TinyNet


def shard_files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "blobs").glob("??/*") if p.is_file())


@pytest.mark.parametrize("seed", range(5))
def test_flipped_byte_raises_integrity_error_naming_tensor_and_shard(
    ckpt: client.Client, store_home: Path, seed: int
) -> None:
    ckpt.save("run", TinyNet())
    (shard,) = shard_files(store_home)
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    position = random.Random(seed).randrange(header_end, len(data))
    data[position] ^= 1 << random.Random(seed).randrange(8)
    shard.write_bytes(bytes(data))
    with pytest.raises(client.IntegrityError) as caught:
        ckpt.load("run", model=TinyNet(seed=1))
    message = str(caught.value)
    assert shard.name in message and "model/" in message


def test_truncated_shard_is_an_integrity_error(ckpt: client.Client, store_home: Path) -> None:
    ckpt.save("run", TinyNet())
    (shard,) = shard_files(store_home)
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(client.IntegrityError):
        ckpt.load("run")


def test_missing_shard_is_not_found(ckpt: client.Client, store_home: Path) -> None:
    ckpt.save("run", TinyNet())
    shard_files(store_home)[0].unlink()
    with pytest.raises(client.NotFoundError):
        ckpt.load("run")
