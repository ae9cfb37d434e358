"""A compressing collection's memory: buffers handed back are handed out again (never twice at
once, never past the pool's bound), and the last version's tensors return to the pool when the
version after next begins."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.service.format.encoded_reads import read_raw
from ckptstore.service.format.records import TensorLocation
from ckptstore.service.reclaim.compression_buffers import BufferPool, RecentTensors


def test_a_buffer_given_back_is_taken_again_for_the_same_length_only() -> None:
    pool = BufferPool(limit=1 << 20)
    first = pool.take(4096)
    assert len(first) == 4096
    pool.give(first)
    assert pool.take(4000) is not first  # another length gets a buffer of its own
    assert pool.take(4096) is first
    assert pool.take(4096) is not first  # handed out once, not twice


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from([16, 64, 100, 256])), max_size=60))
def test_the_pool_never_holds_more_than_its_bound_nor_hands_a_buffer_out_twice(
    steps: list[tuple[bool, int]],
) -> None:
    pool = BufferPool(limit=300)
    out: list[bytearray] = []
    for give, nbytes in steps:
        if give and out:
            pool.give(out.pop(0))
        else:
            buffer = pool.take(nbytes)
            assert len(buffer) == nbytes and all(buffer is not held for held in out)
            out.append(buffer)
        assert pool.held <= 300


def test_threads_taking_and_giving_at_once_never_share_a_buffer() -> None:
    pool, start, shared = BufferPool(limit=1 << 20), threading.Barrier(4), []

    def churn(mark: int) -> None:
        start.wait()
        for _ in range(2000):
            buffer = pool.take(64)
            buffer[:] = bytes([mark]) * 64
            if buffer != bytes([mark]) * 64:
                shared.append(mark)
            pool.give(buffer)

    threads = [threading.Thread(target=churn, args=(mark,)) for mark in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert shared == []


def test_the_last_versions_tensors_go_back_to_the_pool_when_the_next_one_starts() -> None:
    pool = BufferPool()
    recent = RecentTensors(pool, dry_run=False)
    recent.turn()  # version 1
    one = pool.take(128)
    assert recent.keep("a" * 64, one)
    recent.turn()  # version 2 reads version 1's tensors as delta bases
    assert recent.previous == {"a" * 64: one} and pool.take(128) is not one
    recent.turn()  # version 3: nothing reads version 1's any more
    assert recent.previous == {} and pool.take(128) is one


def test_the_cache_keeps_what_fits_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptstore.service.reclaim.compression_buffers.CACHE_BYTES", 200)
    recent = RecentTensors(BufferPool(), dry_run=False)
    assert recent.keep("a" * 64, bytearray(150))
    assert not recent.keep("b" * 64, bytearray(100))  # the caller gives it back
    assert list(recent.current) == ["a" * 64]


def test_reading_into_a_buffer_of_another_length_is_refused() -> None:
    location = TensorLocation(digest="c" * 64, shard_id="d" * 64, dtype="BF16", shape=[8], offset=0, nbytes=16)

    def never(shard: str, offset: int, out: memoryview) -> None:
        raise AssertionError("nothing is read into a buffer that cannot hold the tensor")

    with pytest.raises(ValueError, match="cannot hold"):
        read_raw(never, {location.digest: location}, location.digest, into=bytearray(15))
