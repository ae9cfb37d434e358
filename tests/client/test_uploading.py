"""ShardUploader against a real embedded store: shards go out in the background, each once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from ckptstore.client.saving.hashing import digest_of
from ckptstore.client.saving.upload import ShardUploader
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.store import Store


class HeldStore(Store):
    """A Store whose put_shard signals when it starts and then waits to be let go."""

    started: threading.Event
    release: threading.Event

    def put_shard(
        self,
        header: bytes,
        pieces: Sequence[memoryview],
        on_bytes: Callable[[int], object] | None = None,
        *,
        save_key: str | None = None,
    ) -> ShardReceipt:
        self.started.set()
        assert self.release.wait(timeout=60), "the test never released the upload"
        return super().put_shard(header, pieces, on_bytes, save_key=save_key)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HeldStore]:
    held = HeldStore.open_home(tmp_path / "home")
    assert isinstance(held, HeldStore)
    held.started, held.release = threading.Event(), threading.Event()
    try:
        yield held
    finally:
        held.release.set()
        held.close()


def tensors(count: int) -> list[tuple[str, str, torch.Tensor]]:
    made = [torch.full((256,), float(i)) for i in range(count)]
    return [(digest_of(t, f"t{i}"), f"t{i}", t) for i, t in enumerate(made)]


def test_flush_starts_the_last_shard_without_waiting_for_it(store: HeldStore) -> None:
    items = tensors(3)
    with ShardUploader(store, shard_bytes=1 << 20) as uploader:
        for digest, key, tensor in items:
            uploader.add(digest, key, tensor, tensor.nbytes)
        assert not store.started.is_set()  # still filling the shard
        uploader.flush()
        assert store.started.wait(timeout=60)  # sent in the background while flush() has returned
        assert store.missing([d for d, _, _ in items]) == [d for d, _, _ in items]
        store.release.set()
        stored, shards = uploader.finish()
    assert shards == 1 and stored > 3 * 256 * 4
    assert store.missing([d for d, _, _ in items]) == []


def test_finish_after_flush_sends_nothing_twice(store: HeldStore) -> None:
    store.release.set()
    items = tensors(2)
    with ShardUploader(store, shard_bytes=1 << 20) as uploader:
        for digest, key, tensor in items:
            uploader.add(digest, key, tensor, tensor.nbytes)
        uploader.flush()
        uploader.flush()  # nothing left to send
        _, shards = uploader.finish()
    assert shards == 1
    assert len(list(store.blobs.list_ids())) == 1
