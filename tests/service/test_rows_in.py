"""Rows of a statement with an IN list, run by SQLite's driver where it can: the same rows as
SQLAlchemy gives, whatever the list's length, with the statement's other parameters bound. And
rows inserted column by column, as a shard's tensors are: read back as given."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import bindparam, select

from ckptstore.service.db.models import Shard, Tensor, Version, table
from ckptstore.service.db.session import _sqlite_expanded, insert_columns, insert_missing, insert_new, rows_in
from ckptstore.service.store import Store

_TENSORS = table(Tensor)
# Another bound value before the list (nbytes >= ?), as in the commit's reference check.
_SOME = select(_TENSORS.c.digest, _TENSORS.c.nbytes).where(
    _TENSORS.c.nbytes >= bindparam("least", 3), _TENSORS.c.digest.in_(bindparam("digests", expanding=True))
)


def _fill(store: Store, count: int) -> list[str]:
    digests = [f"{number:064x}" for number in range(count)]
    rows = [
        {"digest": d, "shard_id": "s" * 64, "dtype": "U8", "shape": [n], "offset": 0, "nbytes": n}
        for n, d in enumerate(digests)
    ]
    with store.db.transaction() as session:
        insert_new(session, Shard, {"id": "s" * 64, "size": 1000})
        insert_missing(session, Tensor, rows)
    return digests


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 40), max_size=30), absent=st.integers(0, 3))
def test_the_rows_are_those_sqlalchemy_gives(store: Store, picks: list[int], absent: int) -> None:
    digests = _fill(store, 41)
    asked = [digests[i] for i in picks] + [f"{9999 + i:064x}" for i in range(absent)]
    if not asked:
        return
    with store.db.transaction() as session:
        connection = session.connection()
        got = sorted(tuple(row) for row in rows_in(connection, _SOME, "digests", asked))
        want = sorted(tuple(row) for row in connection.execute(_SOME, {"digests": asked}).all())
    assert got == want
    assert {digest for digest, _ in got} == {digests[i] for i in picks if i >= 3}


def test_a_statement_whose_parameters_need_processing_goes_through_sqlalchemy(store: Store) -> None:
    # A datetime is turned into text by SQLAlchemy in SQLite, not by the driver: that statement
    # is not run as driver SQL, and still gives its rows.
    versions = table(Version)
    since = select(versions.c.version).where(
        versions.c.created_at >= bindparam("since", datetime(2000, 1, 1, tzinfo=UTC)),
        versions.c.run_id.in_(bindparam("runs", expanding=True)),
    )
    assert _sqlite_expanded(since, "runs", 2) is None
    with store.db.transaction() as session:
        assert list(rows_in(session.connection(), since, "runs", ["a", "b"])) == []


def test_a_name_the_statement_does_not_expand_is_refused() -> None:
    with pytest.raises(ValueError, match="does not expand 'least'"):
        _sqlite_expanded(_SOME, "least", 2)


_NUMBERS = itertools.count(1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=st.lists(st.lists(st.integers(0, 2**40), max_size=4), min_size=1, max_size=60),
    as_tuples=st.booleans(),
)
def test_tensors_inserted_as_columns_read_back_as_given(store: Store, shapes: list[list[int]], as_tuples: bool) -> None:
    # Each example's own digests and shard (the store outlives the examples).
    shard = f"{next(_NUMBERS):064x}"
    digests = [f"{next(_NUMBERS):064x}" for _ in shapes]
    columns = {
        "digest": digests,
        "shard_id": [shard] * len(shapes),
        "dtype": ["U8"] * len(shapes),
        "shape": [tuple(shape) if as_tuples else list(shape) for shape in shapes],
        "offset": list(range(len(shapes))),
        "nbytes": [7] * len(shapes),
    }
    with store.db.transaction() as session:
        insert_new(session, Shard, {"id": shard, "size": 1000})
        insert_columns(session, Tensor, columns)
        # Inserted again with other shapes and offsets: the rows already there are kept.
        insert_columns(session, Tensor, {**columns, "shape": [(1, 2)] * len(shapes), "offset": [99] * len(shapes)})
    with store.db.transaction() as session:
        rows = session.connection().execute(
            select(_TENSORS.c.digest, _TENSORS.c.shape, _TENSORS.c.offset).where(_TENSORS.c.shard_id == shard)
        )
        found = {digest: (list(shape), offset) for digest, shape, offset in rows}
    assert found == {
        digest: (list(shape), index) for index, (digest, shape) in enumerate(zip(digests, shapes, strict=True))
    }
