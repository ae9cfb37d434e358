"""ShardUploader against a real embedded store: shards go out in the background, each once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from client.saving.hashing import digest_of
from client.saving.upload import ShardUploader
from service.records import ShardReceipt
from service.shard_writer import UnhashedTensor
from service.store import Store


class HeldStore(Store):
    """A Store whose put_shard signals when it starts and then waits to be let go."""

    started: threading.Event
    release: threading.Event

    def put_shard(
        self, header: bytes, pieces: Sequence[memoryview], on_bytes: Callable[[int], object] | None = None
    ) -> ShardReceipt:
        self.started.set()
        assert self.release.wait(timeout=60), "the test never released the upload"
        return super().put_shard(header, pieces, on_bytes)


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


class SideBySideStore(Store):
    """A Store whose upload of a shard of small unhashed tensors waits until a large one has started."""

    large_started: threading.Event
    small_saw_large: list[bool]

    def put_tensors(
        self, tensors: Sequence[UnhashedTensor], on_bytes: Callable[[int], object] | None = None
    ) -> tuple[ShardReceipt, list[str]]:
        if all(t.data.nbytes <= 1024 for t in tensors):
            self.small_saw_large.append(self.large_started.wait(timeout=30))
        else:
            self.large_started.set()
        return super().put_tensors(tensors, on_bytes)


def test_the_small_tensors_shard_takes_no_slot_from_the_large_shards(tmp_path: Path) -> None:
    """Small tensors sent together (first, as a save sends them) go out beside the large shards:
    in a slot of their own they held up a large shard, or, sent last, went out alone at the end."""
    store = SideBySideStore.open_home(tmp_path / "home")
    assert isinstance(store, SideBySideStore)
    store.large_started, store.small_saw_large = threading.Event(), []
    large = [torch.full((4096,), float(i)) for i in range(4)]
    small = [torch.full((8,), float(i)) for i in range(3)]
    try:
        with ShardUploader(store, shard_bytes=16 << 10, in_flight=1) as uploader:
            for index, tensor in enumerate(small, start=len(large)):
                uploader.add_unhashed(index, f"small{index}", tensor, tensor.nbytes, together=True)
            uploader.flush_together()
            for index, tensor in enumerate(large):
                uploader.add_unhashed(index, f"large{index}", tensor, tensor.nbytes)
            stored, shards = uploader.finish()
        assert store.small_saw_large == [True]
        assert shards == 1 + len(large)  # a large tensor fills a shard of 16 KiB
        assert sorted(uploader.digests) == list(range(len(large) + len(small)))
        assert stored >= sum(t.nbytes for t in large + small)  # and the shards' headers
    finally:
        store.close()
