"""Locating digests: every one asked and every base its deltas decode from, or a NotFoundError
naming what the store lacks, whatever the chains and whichever rows are missing."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.catalog.lookup import locate
from ckptstore.service.db.models import Shard, Tensor
from ckptstore.service.db.session import insert_missing
from ckptstore.service.errors import NotFoundError
from ckptstore.service.store import Store

_examples = itertools.count(1)


def _digester() -> Callable[[int], str]:
    """Digests of one example's tensors, unlike any other example's in the same store."""
    example = next(_examples)
    return lambda number: f"{example:032x}{number + 1:032x}"


@st.composite
def stores(draw: st.DrawFn) -> tuple[dict[int, int | None], set[int], list[int]]:
    """Tensors 0..n-1, each raw or a delta of an earlier one (chains of any depth within 16); the
    tensors whose rows are missing; the tensors asked for."""
    count = draw(st.integers(1, 12))
    base_of: dict[int, int | None] = {}
    depth: dict[int, int] = {}
    for number in range(count):
        base = draw(st.one_of(st.none(), st.integers(0, number - 1))) if number else None
        if base is not None and depth[base] >= 14:
            base = None
        base_of[number] = base
        depth[number] = 0 if base is None else depth[base] + 1
    missing = set(draw(st.lists(st.integers(0, count - 1), max_size=3)))
    asked = draw(st.lists(st.integers(0, count + 1), min_size=1, max_size=count + 2))
    return base_of, missing, asked


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=stores())
def test_locate_finds_every_digest_and_base_or_names_what_is_missing(
    store: Store, layout: tuple[dict[int, int | None], set[int], list[int]]
) -> None:
    base_of, missing, asked = layout
    _digest = _digester()
    rows = [
        {
            "digest": _digest(number),
            "shard_id": "s" * 64,
            "dtype": "U8",
            "shape": [4],
            "offset": 4 * number,
            "nbytes": 4,
            "encoding": None if base is None else "xor-zstd",
            "stored_nbytes": None if base is None else 3,
            "base": None if base is None else _digest(base),
        }
        for number, base in base_of.items()
        if number not in missing
    ]
    with store.db.transaction() as session:
        insert_missing(session, Shard, [{"id": "s" * 64, "size": 1000}])
        if rows:
            insert_missing(session, Tensor, rows)
    needed: set[int] = set()  # every tensor asked for and the chain under each
    for number in asked:
        while number is not None and number not in needed:
            needed.add(number)
            number = base_of.get(number)
    absent_asked = [n for n in dict.fromkeys(asked) if n not in base_of or n in missing]
    wanted = [_digest(n) for n in asked]
    if absent_asked:
        with pytest.raises(NotFoundError, match=rf"^{len(absent_asked)} tensors are not in the store"):
            locate(db=store.db, digests=wanted)
    elif needed & missing:
        with pytest.raises(NotFoundError, match="that stored deltas decode from are not in the store"):
            locate(db=store.db, digests=wanted)
    else:
        found = locate(db=store.db, digests=wanted)
        assert set(found) == {_digest(n) for n in needed}
        for number in needed:
            where = found[_digest(number)]
            base = base_of[number]
            assert (where.offset, where.base) == (4 * number, None if base is None else _digest(base))
