"""Every number taken from a path, query or body is bounded to what the store can hold.

Against a real server on SQLite and on PostgreSQL alike (whose INTEGER columns hold 32 bits):
hypothesis draws numbers around 2**31, 2**63, zero and the negatives for every route that takes
one, and each answer must be the same on both databases: the success a number in range earns, a
404 for a version that cannot exist, or a 4xx naming the number; never a 5xx.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sqlalchemy import BigInteger, Integer, update
from sqlalchemy.exc import DBAPIError

from ckptstore.service.catalog.retention_rules import MAX_KEEP
from ckptstore.service.db.models import Base, Run
from ckptstore.service.format.bounds import INT32_MAX, INT64_MAX, MAX_VERSION
from ckptstore.service.format.manifest import MAX_TENSORS
from ckptstore.service.reclaim.gc import MAX_GRACE_SECONDS
from tests.api.kit import is_json_error
from tests.api.served import SEEDED_BODY, SEEDED_RUN, ServedStore, served_store
from tests.backends import PostgresDatabases

#: The bound the store checks before each integer column is written or compared with input.
#: A new integer column fails test_every_integer_column_has_a_bound until it is listed here.
COLUMN_BOUNDS = {
    "runs.version_counter": MAX_VERSION,
    "versions.version": MAX_VERSION,
    "versions.parent": MAX_VERSION,
    "manifest_parts.id": INT64_MAX,  # handed out by the database
    "manifest_parts.versions": INT64_MAX,  # versions listing a part, at most every version of every run
    "part_bodies.part_id": INT64_MAX,
    "part_bodies.entries": MAX_TENSORS,  # entries of one part, at most a manifest's
    "part_refs.part_id": INT64_MAX,
    "tags.version": MAX_VERSION,
    "versions.tensors_total": MAX_TENSORS,  # one per manifest entry
    "versions.tensors_new": MAX_TENSORS,
    "versions.step": INT64_MAX,  # the manifest's step field
    "versions.bytes_total": INT64_MAX,  # checked when a commit sums its entries
    "versions.bytes_new": INT64_MAX,
    "versions.bytes_trainable": INT64_MAX,
    "shards.size": INT64_MAX,  # a file the server received, capped by CKPTSTORE_MAX_SHARD_BYTES
    "tensors.offset": INT64_MAX,  # within that file
    "tensors.nbytes": INT64_MAX,
    "tensors.stored_nbytes": INT64_MAX,  # a payload the store wrote itself, within a shard's size
    "retention_policies.keep_last": MAX_KEEP,
    "retention_policies.keep_best": MAX_KEEP,
}

NUMBERS = st.one_of(
    st.integers(MAX_VERSION - 2, MAX_VERSION + 2),
    st.integers(INT64_MAX - 2, INT64_MAX + 2),
    st.integers(-INT64_MAX - 3, -INT64_MAX + 1),
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.sampled_from([MAX_KEEP, MAX_KEEP + 1, MAX_GRACE_SECONDS, MAX_GRACE_SECONDS + 1, 10**30, -(10**30)]),
)
TAG = "moving"


def test_every_integer_column_has_a_bound() -> None:
    """Each integer column's bound is declared, and fits the column on PostgreSQL."""
    found = {}
    for table in Base.metadata.sorted_tables:
        for column in table.columns:
            if isinstance(column.type, Integer):
                found[f"{table.name}.{column.name}"] = INT64_MAX if isinstance(column.type, BigInteger) else INT32_MAX
    assert set(found) == set(COLUMN_BOUNDS)
    too_large = {name: bound for name, bound in COLUMN_BOUNDS.items() if bound > found[name]}
    assert too_large == {}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, postgres_databases: PostgresDatabases
) -> Iterator[ServedStore]:
    """A seeded store behind a real server, on each database."""
    with served_store(request.param, tmp_path_factory.mktemp(request.param), postgres_databases) as running:
        yield running


# -- what each route must answer ---------------------------------------------------------------


def as_version(n: int) -> int:
    """The status a version number earns: only version 1 of the seeded run exists."""
    if n == 1:
        return 200
    return 404 if n >= 1 else 400  # beyond MAX_VERSION too: no run can have it


def in_range(low: int, high: int, ok: int = 200) -> Callable[[int], int]:
    """The status of a JSON number with declared bounds: ``ok`` inside, 422 outside."""
    return lambda n: ok if low <= n <= high else 422


def version_in_body(n: int) -> int:
    return 200 if n == 1 else 404 if 1 <= n <= MAX_VERSION else 422


@dataclass(frozen=True)
class Case:
    """A request carrying the number ``n``, the status it must get, and whether a refusal is JSON."""

    name: str
    send: Callable[[ServedStore, int], httpx.Response]
    expected: Callable[[int], int]
    api: bool = True
    names_the_number: bool = True


def _call(served: ServedStore, scope: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    with served.client(scope) as http:
        return http.request(method, path, **kwargs)


def _step_commit(served: ServedStore, n: int) -> httpx.Response:
    body = {"manifest": {**SEEDED_BODY["manifest"], "step": n}, "tags": []}
    return _call(served, "write", "POST", "/v1/runs/steps/versions", json=body)


CASES = [
    Case("manifest", lambda s, n: _call(s, "read", "GET", f"/v1/runs/{SEEDED_RUN}/versions/{n}"), as_version),
    Case("ref", lambda s, n: _call(s, "read", "GET", f"/v1/runs/{SEEDED_RUN}/refs/{n}"), as_version),
    Case(
        "delete",
        lambda s, n: _call(s, "admin", "DELETE", f"/v1/runs/{SEEDED_RUN}/versions/{n}"),
        lambda n: as_version(n) if n != 1 else 200,
    ),
    Case(
        "tag-int",
        lambda s, n: _call(s, "write", "PUT", f"/v1/runs/{SEEDED_RUN}/tags/{TAG}", json={"version": n}),
        version_in_body,
    ),
    Case(
        "tag-text",
        lambda s, n: _call(s, "write", "PUT", f"/v1/runs/{SEEDED_RUN}/tags/{TAG}", json={"version": str(n)}),
        as_version,
    ),
    Case(
        "keep-last",
        lambda s, n: _call(s, "admin", "PUT", f"/v1/runs/{SEEDED_RUN}/retention", json={"keep_last": n}),
        in_range(1, MAX_KEEP),
    ),
    Case(
        "keep-best",
        lambda s, n: _call(
            s, "admin", "PUT", f"/v1/runs/{SEEDED_RUN}/retention", json={"keep_best": n, "metric": "loss"}
        ),
        in_range(1, MAX_KEEP),
    ),
    Case(
        "gc-grace",
        lambda s, n: _call(s, "admin", "POST", "/v1/gc", json={"grace_seconds": n, "dry_run": True}),
        in_range(0, MAX_GRACE_SECONDS),
    ),
    Case("commit-step", _step_commit, in_range(0, INT64_MAX, ok=201)),
    Case(
        "version-page",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}/versions/{n}"),
        as_version,
        api=False,
    ),
    Case(
        "manifest-json",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}/versions/{n}/manifest.json"),
        as_version,
        api=False,
    ),
    Case(
        "tensor-download",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}/versions/{n}/tensor", params={"name": "model/w"}),
        as_version,
        api=False,
    ),
    Case(
        "diff",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}/diff", params={"a": "1", "b": str(n)}),
        as_version,
        api=False,
    ),
    Case(
        "run-page",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}", params={"page": str(n)}),
        lambda n: 200 if n == 1 else 404 if 1 <= n <= 10**9 else 422,  # the run's versions fill one page
        api=False,
        names_the_number=False,
    ),
    Case(
        "run-page-size",
        lambda s, n: _call(s, "read", "GET", f"/runs/{SEEDED_RUN}", params={"per_page": str(n)}),
        lambda n: 200 if 1 <= n <= 500 else 422,
        api=False,
        names_the_number=False,
    ),
]


@pytest.mark.slow  # 30 drawn numbers for each of ~20 bounded inputs, on SQLite and PostgreSQL
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=NUMBERS)
def test_a_number_out_of_range_is_a_4xx_naming_it_never_a_5xx(served: ServedStore, case: Case, n: int) -> None:
    assume(case.name != "delete" or n != 1)  # the seeded version stays for the other examples
    response = case.send(served, n)
    assert response.status_code == case.expected(n), (case.name, n, response.status_code, response.text[:300])
    if response.status_code < 400:
        return
    if case.api:
        assert is_json_error(response), response.text[:300]
        text = response.json()["message"]
    else:
        text = response.text
    if case.names_the_number:
        assert str(n) in text, (case.name, n, text[:300])
    if n > MAX_VERSION and case.expected is as_version:
        assert f"version numbers run from 1 to {MAX_VERSION}" in text


def test_a_run_holds_versions_up_to_the_bound_and_no_further(served: ServedStore) -> None:
    """Version MAX_VERSION is stored and read back on both databases; the next commit is refused."""
    with served.client("write") as http:
        assert http.post("/v1/runs/edge/versions", json=SEEDED_BODY).status_code == 201
        with served.store.db.transaction() as session:  # as if 2**31 - 3 more commits had been made
            session.execute(update(Run).where(Run.id == "edge").values(version_counter=MAX_VERSION - 1))
        last = http.post("/v1/runs/edge/versions", json={**SEEDED_BODY, "tags": ["last"]})
        assert last.status_code == 201 and last.json()["version"] == MAX_VERSION, last.text
        assert http.get(f"/v1/runs/edge/refs/{MAX_VERSION}").json()["version"] == MAX_VERSION
        assert http.get("/v1/runs/edge/refs/last").json()["version"] == MAX_VERSION
        assert http.get(f"/v1/runs/edge/versions/{MAX_VERSION}").json()["version"] == MAX_VERSION
        assert http.put("/v1/runs/edge/tags/top", json={"version": MAX_VERSION}).status_code == 200
        refused = http.post("/v1/runs/edge/versions", json=SEEDED_BODY)
        assert refused.status_code == 409 and is_json_error(refused), refused.text
        assert str(MAX_VERSION) in refused.json()["message"] and "new run" in refused.json()["message"]
        beyond = http.get(f"/v1/runs/edge/versions/{MAX_VERSION + 1}")
        assert beyond.status_code == 404 and str(MAX_VERSION + 1) in beyond.json()["message"]
        assert [v["version"] for v in http.get("/v1/runs/edge/versions").json()] == [1, MAX_VERSION]


@pytest.mark.parametrize("served", ["postgresql"], indirect=True)
def test_the_bound_is_what_postgresql_holds(served: ServedStore) -> None:
    """The constant is the column's real limit: one more than INT32_MAX does not fit an INTEGER."""
    with served.store.db.engine.begin() as connection:
        connection.execute(update(Run).where(Run.id == SEEDED_RUN).values(version_counter=INT32_MAX))
    with pytest.raises(DBAPIError, match="out of range"), served.store.db.engine.begin() as connection:
        connection.execute(update(Run).where(Run.id == SEEDED_RUN).values(version_counter=INT32_MAX + 1))
    with served.store.db.engine.begin() as connection:
        connection.execute(update(Run).where(Run.id == SEEDED_RUN).values(version_counter=1))
