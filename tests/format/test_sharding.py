"""Shard planning on plain integers: no torch, no bytes, just sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.service.format.sharding import DEFAULT_SHARD_BYTES, MAX_TENSORS_PER_SHARD, plan_shards


def test_defaults() -> None:
    assert DEFAULT_SHARD_BYTES == 256 << 20
    assert MAX_TENSORS_PER_SHARD == 50_000
    assert plan_shards([("a", DEFAULT_SHARD_BYTES), ("b", 1)]) == [["a"], ["b"]]


def test_empty_plan() -> None:
    assert plan_shards([], 10) == []
    assert plan_shards([("a", 0), ("b", 0)], 10) == []


def test_order_is_preserved_and_target_respected() -> None:
    items = [("a", 4), ("b", 4), ("c", 2), ("d", 5), ("e", 5), ("f", 1)]
    assert plan_shards(items, 10) == [["a", "b", "c"], ["d", "e"], ["f"]]


def test_a_shard_may_fill_the_target_exactly() -> None:
    assert plan_shards([("a", 5), ("b", 5), ("c", 1)], 10) == [["a", "b"], ["c"]]


def test_oversized_item_gets_a_shard_of_its_own() -> None:
    items = [("a", 3), ("big", 25), ("b", 3), ("c", 3), ("huge", 10**12), ("d", 1)]
    assert plan_shards(items, 10) == [["a"], ["big"], ["b", "c"], ["huge"], ["d"]]


def test_oversized_first_item() -> None:
    assert plan_shards([("big", 11), ("a", 1)], 10) == [["big"], ["a"]]


def test_zero_size_items_are_not_placed() -> None:
    items = [("empty", 0), ("a", 6), ("empty2", 0), ("b", 6), ("negative", -5)]
    assert plan_shards(items, 10) == [["a"], ["b"]]


def test_max_tensors_respected() -> None:
    items = [(i, 1) for i in range(7)]
    assert plan_shards(items, 100, max_tensors=3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan_shards(items, 100, max_tensors=1) == [[i] for i in range(7)]


def test_items_can_be_any_objects() -> None:
    first, second = object(), ("model/w", 3)
    assert plan_shards([(first, 1), (second, 1)], 10) == [[first, second]]


@pytest.mark.parametrize(("target", "max_tensors"), [(0, 10), (-1, 10), (10, 0), (10, -3)])
def test_invalid_limits_raise_value_error(target: int, max_tensors: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_shards([("a", 1)], target, max_tensors)


@given(
    st.lists(st.integers(-3, 60), max_size=60),
    st.integers(1, 50),
    st.integers(1, 8),
)
def test_every_item_placed_once_in_order_and_shards_stay_in_bounds(
    sizes: list[int], target: int, max_tensors: int
) -> None:
    items = list(enumerate(sizes))
    plan = plan_shards(items, target, max_tensors)

    placed = [index for shard in plan for index in shard]
    assert placed == [index for index, size in items if size > 0]
    for shard in plan:
        assert shard
        assert len(shard) <= max_tensors
        if len(shard) > 1:
            assert sum(sizes[i] for i in shard) <= target
    # greedy: a shard closes only when the next item would not fit
    for shard, following in zip(plan, plan[1:], strict=False):
        full = sum(sizes[i] for i in shard) + sizes[following[0]] > target
        assert full or len(shard) == max_tensors
