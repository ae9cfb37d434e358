"""The read planner on plain integers: bounded reads that cover every stored byte exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.client.loading.plan import Piece, Stored, plan_reads


def test_back_to_back_items_share_reads_and_big_ones_span_several() -> None:
    items = [Stored("a", 10, 3), Stored("a", 13, 10), Stored("a", 23, 2), Stored("a", 30, 4), Stored("b", 34, 1)]
    units = plan_reads(items, 8)
    assert [(u.shard_id, u.offset, u.nbytes) for u in units] == [
        ("a", 10, 8),
        ("a", 18, 7),
        ("a", 30, 4),  # a gap starts a new read
        ("b", 34, 1),  # so does another shard
    ]
    assert units[0].pieces == [Piece(0, 0, 3, True), Piece(1, 0, 5, False)]
    assert units[1].pieces == [Piece(1, 5, 5, True), Piece(2, 0, 2, True)]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_reads([Stored("a", 0, 1)], 0)
    with pytest.raises(ValueError):
        plan_reads([Stored("a", 0, 0)], 8)


@given(
    sizes=st.lists(st.integers(1, 50), max_size=20),
    gaps=st.lists(st.booleans(), min_size=20, max_size=20),
    unit=st.integers(1, 64),
)
def test_every_byte_is_read_once_in_order_within_the_budget(sizes: list[int], gaps: list[bool], unit: int) -> None:
    items, offset = [], 8
    for size, gap in zip(sizes, gaps, strict=False):
        offset += 5 if gap else 0
        items.append(Stored("s", offset, size))
        offset += size
    units = plan_reads(items, unit)
    covered: list[tuple[int, int]] = []
    for read in units:
        assert 0 < read.nbytes <= unit
        position = read.offset
        for piece in read.pieces:
            item = items[piece.item]
            assert item.offset + piece.start == position
            position += piece.length
            assert piece.last == (piece.start + piece.length == item.nbytes)
            covered.append((piece.item, piece.start))
        assert position == read.offset + read.nbytes
    expected_order = sorted(covered)
    assert covered == expected_order
    for index, item in enumerate(items):
        pieces = [p for read in units for p in read.pieces if p.item == index]
        assert sum(p.length for p in pieces) == item.nbytes and pieces[-1].last
