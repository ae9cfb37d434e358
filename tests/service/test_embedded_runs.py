"""The runs and versions of an embedded store read with ``sqlite3`` alone (``ckptstore ls``,
``ckptstore ls RUN``) are exactly what the engine's :meth:`Store.runs` and :meth:`Store.versions`
return, whatever the history; where the reader does not know the file, it answers None and the
engine is used."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardkit import body, entry, raw

from ckptstore.service.catalog.embedded_runs import read_runs, read_versions
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.settings import METADATA_FILE
from ckptstore.service.store import Store

RUNS = ["alpha", "beta", "gamma-2"]
#: A history: commits to a run (a step, sometimes metrics), deletions of a run's oldest remaining
#: version, and tags on its newest.
actions = st.lists(
    st.tuples(st.sampled_from(["commit", "commit", "delete", "tag"]), st.sampled_from(RUNS), st.integers(0, 10**12)),
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=actions)
def test_the_runs_read_directly_are_the_engines_whatever_the_history(
    tmp_path_factory: pytest.TempPathFactory, history: list[tuple[str, str, int]]
) -> None:
    home = tmp_path_factory.mktemp("home")
    store = Store.open_home(home)
    try:
        small, large = raw("F32", (8,), 1), raw("F32", (300,), 2)
        store.put_tensors([UnhashedTensor(t.dtype, t.shape, memoryview(t.data)) for t in (small, large)])
        for action, run_id, step in history:
            if action == "commit":
                tensors = [entry("model/w", small)] + ([entry("model/big", large)] if step % 2 else [])
                metrics = {"loss": step / 7, "acc": 1 / (step + 3)} if step % 3 else {}
                store.commit(run_id, body(*tensors, step=step if step % 5 else None, metrics=metrics))
                continue
            versions = store.versions(run_id) if run_id in {r.run_id for r in store.runs()} else []
            if versions and action == "delete":
                store.delete_version(run_id, versions[0].version)
            elif versions:
                store.tag(run_id, versions[-1].version, f"t{step % 4}")
        assert read_runs(home / METADATA_FILE) == store.runs()
        for run_id in RUNS:
            if run_id in {r.run_id for r in store.runs()}:
                assert read_versions(home / METADATA_FILE, run_id) == store.versions(run_id)
            else:
                assert read_versions(home / METADATA_FILE, run_id) is None  # the engine names the missing run
    finally:
        store.close()


def test_an_empty_store_has_no_runs_and_a_missing_one_is_left_to_the_engine(tmp_path: Path) -> None:
    assert read_runs(tmp_path / "nowhere" / METADATA_FILE) is None
    Store.open_home(tmp_path / "empty").close()
    assert read_runs(tmp_path / "empty" / METADATA_FILE) == []
    assert read_versions(tmp_path / "empty" / METADATA_FILE, "nope") is None


def test_a_store_at_another_schema_revision_is_left_to_the_engine(tmp_path: Path) -> None:
    Store.open_home(tmp_path).close()
    with sqlite3.connect(tmp_path / METADATA_FILE) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0003'")
    assert read_runs(tmp_path / METADATA_FILE) is None  # the engine migrates it, or refuses it, as it does
    assert read_versions(tmp_path / METADATA_FILE, "any") is None


@pytest.mark.parametrize("content", [b"", b"not a database at all" * 100])
def test_a_file_that_is_not_a_store_is_left_to_the_engine(tmp_path: Path, content: bytes) -> None:
    (tmp_path / METADATA_FILE).write_bytes(content)
    assert read_runs(tmp_path / METADATA_FILE) is None


def test_a_version_with_several_tags_and_metrics_reads_as_the_engine_has_it(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path)
    try:
        tensor = raw("F32", (4,), 1)
        store.put_tensors([UnhashedTensor(tensor.dtype, tensor.shape, memoryview(tensor.data))])
        store.commit("run", body(entry("model/w", tensor), step=3, metrics={"loss": 0.25, "acc": 0.5}))
        store.commit("run", body(entry("model/w", tensor)))
        for name in ("zeta", "best", "mid"):  # added out of order
            store.tag("run", 1, name)
        (first, second) = read_versions(tmp_path / METADATA_FILE, "run") or []
        assert first.tags == ["best", "mid", "zeta"] and first.metrics == {"loss": 0.25, "acc": 0.5}
        assert second.tags == [] and second.metrics == {} and second.step is None
        assert [first, second] == store.versions("run")
    finally:
        store.close()
