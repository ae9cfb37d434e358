"""Scatter reads through the engine: one call fills several buffers from a shard's bytes."""

from __future__ import annotations

import pytest
from shardkit import Ingest, raw

from ckptstore.service.errors import IntegrityError, InvalidInputError
from ckptstore.service.store import Store


def test_read_scatter_fills_back_to_back_tensors(store: Store, ingest: Ingest) -> None:
    tensors = [raw("F32", (3, 5), 1), raw("I64", (7,), 2), raw("U8", (1,), 3)]
    ingest(*tensors)
    where = store.locate([t.digest for t in tensors])
    ordered = sorted(tensors, key=lambda t: where[t.digest].offset)
    first = where[ordered[0].digest]
    buffers = [bytearray(t.nbytes) for t in ordered]
    store.read_scatter(first.shard_id, first.offset, [memoryview(buffer) for buffer in buffers])
    assert [bytes(buffer) for buffer in buffers] == [t.data for t in ordered]


def test_read_scatter_refuses_a_bad_shard_id(store: Store) -> None:
    with pytest.raises(InvalidInputError):
        store.read_scatter("../metadata.db", 0, [memoryview(bytearray(1))])


def test_read_scatter_past_the_end_of_a_shard(store: Store, ingest: Ingest) -> None:
    shard, _ = ingest(raw("F32", (2,), 1))
    with pytest.raises(IntegrityError):
        store.read_scatter(shard.shard_id, len(shard.data) - 1, [memoryview(bytearray(1)), memoryview(bytearray(1))])
